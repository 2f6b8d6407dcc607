"""Point-to-point transport for `nanoddp.comm`: `Peers` (one group by group rank), tags, background sends.

Why it exists: every algorithm (ring, chain, exchange, the header round) moves bytes the same
way, with `isend`/`irecv` addressed by *group* rank (passed to torch as `group_dst`/`group_src`,
so a subgroup needs no global-rank bookkeeping), under tags of our own so a user's send/recv on
the same group can never steal one of our messages. The tag rules live here, next to the sends
that use them: each call's bulk phase and early piece have tags no other call uses
(`Peers.call_tags`, `Peers.early_tag`), so no later call's message can meet one of a call whose
round raised. The counter they derive from, `Peers.calls`, is advanced by the header round
alone (`nanoddp.comm.protocol.wire.counted`), once per round on every rank.

What a call posts before its verdict is also noted (`Peers.unsettled`): gloo must never lose the
buffer of a message still on its way (it stops reading that connection for good), so a call whose
round raised settles those messages (`nanoddp.comm.protocol.settle`) before their handles are dropped.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from nanoddp.comm.transport.link import Backlog, LinkModel, LinkShaper, link_from_environ
from nanoddp.comm.transport.membership import membership

TAG_DATA = 0x6E6402  # our own tags: user send/recv on the same group cannot steal our messages
# The bulk phase of call number k on a group uses tags TAG_CALLS + 2 (k mod CALL_TAG_CYCLE) + {0, 1}.
TAG_CALLS = 0x10000000
CALL_TAG_CYCLE = 1 << 24
# Early data (`plan.early_bytes`): the first piece of call k, 2**e bytes, travels under tag
# TAG_EARLY + 32 (k mod EARLY_TAG_CYCLE) + e, so it can only land in a receive of the same size.
TAG_EARLY = 0x20000000
EARLY_TAG_CYCLE = 1 << 20


class Peers:
    """One process group as seen from this rank: p2p by group rank, plus reusable scratch.

    Scratch buffers are kept per group and grow to the largest message seen; this is safe
    because `nanoddp.comm` runs at most one collective per group at a time.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        member = membership(group)  # torch's registry, else the group itself (a torchft group's)
        self.rank, self.size = member.rank, member.size
        self.global_ranks = member.ranks  # what src/dst name: global ranks, or an unregistered group's own
        self.watch_key = member.watch_key  # the hang watchdog counts this group's calls under it
        # src/dst are global ranks, checked against the default group's size; an unregistered
        # group's src/dst are its own ranks
        self.world_size = dist.get_world_size() if member.registered else member.size
        # [Note: straight to the group] torch's p2p wrappers (`dist.isend`, `P2POp`) need the registry
        self.registered = member.registered
        # gloo can receive a message into a larger buffer; nccl needs exact sizes and no tags
        self.gloo = member.backend == "gloo"
        self._scratch: dict[tuple[str, torch.device], torch.Tensor] = {}
        # The protocol layer's frames per device (`wire.buffers` makes and types them): kept here,
        # with the group they belong to, but never read by this layer, which sits below the wire.
        self.cache: dict[torch.device, Any] = {}
        self.calls = 0  # header rounds run on this group: the same count on every rank
        # (peer, tag, bytes, is a send, handle) of what this call posted before its verdict
        self.unsettled: list[tuple[int, int, int, bool, Waitable]] = []
        use_link(link_from_environ())  # the environment as it is when the group is first used
        if _SHAPER is not None and not self.gloo:
            raise ValueError(
                "NANODDP_LINK_BANDWIDTH / NANODDP_LINK_LATENCY shape gloo's sends only, and this group is "
                f"{member.backend}: unset them, or run on gloo (--backend gloo)"
            )

    @property
    def backend(self) -> str:
        """The backend as `plan.plan` names it."""
        return "gloo" if self.gloo else "nccl"

    def call_tags(self) -> tuple[int, int]:
        """Two tags that belong to the current call alone.

        The bulk phase posts its receives before the header round's verdict; if the round
        raises, they are settled (`nanoddp.comm.protocol.settle`) under these tags, which no other call's
        messages carry, so nothing but the settling can meet them."""
        base = TAG_CALLS + 2 * (self.calls % CALL_TAG_CYCLE)
        return base, base + 1

    def early_tag(self, nbytes: int) -> int:
        """The tag of this call's early piece of `nbytes` bytes (a power of two, see `early_bytes`)."""
        return TAG_EARLY + 32 * (self.calls % EARLY_TAG_CYCLE) + nbytes.bit_length() - 1

    def send_early(self, piece: torch.Tensor, peer: int) -> Waitable:
        """Send this call's early piece (`early_bytes`) now, under the tag naming its size.

        [Note: the calling thread] Never by the background sender: a gloo send posted from another
        thread while this one posts the header round's frames on the same pair can hang the round
        (tests/multiproc/test_comm_mismatch.py, test_bulk_traffic_after_a_failed_header_round)."""
        return self.isend(piece, peer, self.early_tag(piece.numel() * piece.element_size()))

    # [Note: straight to the group] On gloo, the group's own send/recv (which take group ranks):
    # `dist.isend`'s wrapper re-checks the group and translates ranks on every call, CPU paid on
    # both ranks' critical path twice per header round. nccl keeps the wrapper (its batching
    # rules live there) on a group the registry knows; on one it does not, the wrapper cannot
    # look the group up, so nccl too uses the group's own send/recv (tag 0: nccl has no tags),
    # and batches a round itself (`exchange`).
    def isend(self, tensor: torch.Tensor, peer: int, tag: int = TAG_DATA) -> Waitable:
        if self.gloo:
            work = send_on(self.group, tensor, peer, tag)
            if tag >= TAG_CALLS and self._before_verdict(tag):
                self.unsettled.append((peer, tag, tensor.numel() * tensor.element_size(), True, work))
            return work
        count_sent(tensor)
        if not self.registered:
            return self.group.send([tensor], peer, 0)
        return posted(dist.isend(tensor, group=self.group, group_dst=peer))

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = TAG_DATA) -> dist.Work:
        if self.gloo:
            work = self.group.recv([tensor], peer, tag)
            if tag >= TAG_CALLS and self._before_verdict(tag):
                self.unsettled.append((peer, tag, tensor.numel() * tensor.element_size(), False, work))
            return work
        if not self.registered:
            return self.group.recv([tensor], peer, 0)
        return posted(dist.irecv(tensor, group=self.group, group_src=peer))

    def _before_verdict(self, tag: int) -> bool:
        """Is `tag` one of the current call's? Posted under it, a message was posted before the call's
        header round ended (the round advances `calls`; later posts carry the tags taken before)."""
        if tag >= TAG_EARLY:
            return (tag - TAG_EARLY) >> 5 == self.calls % EARLY_TAG_CYCLE
        return (tag - TAG_CALLS) >> 1 == self.calls % CALL_TAG_CYCLE

    def post_send(self, tensor: torch.Tensor, peer: int, tag: int) -> Waitable:
        """A bulk-phase send. On gloo it is posted by a background thread.

        [Note: background sends] Posting a large gloo send writes it into the socket on the
        posting thread (about 1 ms per MB here), so posted here it would hold up receiving and
        reducing the next piece. All of a bulk phase's sends go this way, so they reach gloo in
        the order they were made. On a shaped link the shaper's thread posts it (`send_on`)."""
        if not self.gloo or _SHAPER is not None:
            return self.isend(tensor, peer, tag)
        return _background_send(self.group, tensor, peer, tag)

    def exchange(
        self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]], tag: int = TAG_DATA
    ) -> list[Waitable]:
        """Post (tensor, peer) sends and receives as one round: one nccl group, so a receive and a
        send to the same peer cannot deadlock; on gloo, receives first so sends can start."""
        if self.gloo:
            works: list[Waitable] = [self.irecv(t, p, tag) for t, p in recvs]
            return works + [self.isend(t, p, tag) for t, p in sends]
        if not self.registered:
            return self._exchange_coalesced(sends, recvs)
        ops = [dist.P2POp(dist.irecv, t, group=self.group, group_peer=p) for t, p in recvs]
        ops += [dist.P2POp(dist.isend, t, group=self.group, group_peer=p) for t, p in sends]
        for t, _ in sends:
            count_sent(t)
        return [*dist.batch_isend_irecv(ops)] if ops else []

    def _exchange_coalesced(
        self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]
    ) -> list[Waitable]:
        """nccl on an unregistered group: what `dist.batch_isend_irecv` does, on the group object
        (its coalescing makes the round one nccl group, so a receive and a send to the same peer
        cannot deadlock); the one coalesced work stands for every op of the round."""
        tensors = [t for t, _ in recvs] + [t for t, _ in sends]
        if not tensors:
            return []
        device = tensors[0].device
        self.group._start_coalescing(device)
        try:
            works = [self.irecv(t, p) for t, p in recvs] + [self.isend(t, p) for t, p in sends]
        finally:
            coalesced = self.group._end_coalescing(device)
        return [coalesced] * len(works) if coalesced is not None else works

    def scratch(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A reusable 1-D buffer of `numel` elements (contents undefined)."""
        nbytes = numel * dtype.itemsize
        buf = self._scratch.get((name, device))
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 64), dtype=torch.uint8, device=device)
            self._scratch[(name, device)] = buf
        return buf[:nbytes].view(dtype)


# Bytes this process has handed to sends for nanoddp's collectives (headers included), for the
# trainer's `comm_bytes`: the main thread and the background sender both add to it, hence the lock.
_SENT_BYTES = 0
_SENT_LOCK = threading.Lock()


def count_sent(tensor: torch.Tensor) -> None:
    """Add `tensor`'s bytes to `sent_bytes()`."""
    global _SENT_BYTES
    with _SENT_LOCK:
        _SENT_BYTES += tensor.numel() * tensor.element_size()


def sent_bytes() -> int:
    """Bytes this process has sent through nanoddp's collectives so far (a running total: take the
    difference around a step for that step's bytes)."""
    return _SENT_BYTES


def send_on(group: dist.ProcessGroup, tensor: torch.Tensor, peer: int, tag: int) -> Waitable:
    """Every gloo send of nanoddp's collectives goes through here: `group.send`, counted; on a
    simulated slow link (`nanoddp.comm.transport.link`), posted by the shaper's thread when it is due."""
    count_sent(tensor)
    if _SHAPER is None:  # the fast path pays this one test
        return group.send([tensor], peer, tag)
    handle = BackgroundSend()
    nbytes = tensor.numel() * tensor.element_size()
    _SHAPER.submit(
        _link_to(group, peer), nbytes, functools.partial(_post, (handle, group, tensor, peer, tag), _send_now)
    )
    return handle


def _link_to(group: dist.ProcessGroup, peer: int) -> object:
    """The directed link a send to `peer` travels: the peer's process (global rank), whichever group
    they share; a group torch's registry does not know (made by hand, e.g. by a fault-tolerance
    manager) is its own set of links."""
    try:
        return dist.get_global_rank(group, peer)
    except (ValueError, RuntimeError):
        return (id(group), peer)


def _send_now(group: dist.ProcessGroup, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
    return group.send([tensor], peer, tag)


# [Note: a simulated slow link] `nanoddp.comm.transport.link` explains the model. One shaper per process,
# (re)read from the environment whenever a group is first used (`Peers`); None: no shaping.
_SHAPER: LinkShaper | None = None


def use_link(model: LinkModel | None) -> None:
    """Shape every later gloo send of nanoddp's collectives as `model` says (None: at full speed).

    Switching off waits until the shaper has posted what it holds, so that sends are never posted
    from two threads at once (the shaper's note)."""
    global _SHAPER
    if model is None:
        shaper, _SHAPER = _SHAPER, None
        while shaper is not None and shaper.pending():
            time.sleep(0.001)
    elif _SHAPER is None:
        _SHAPER = LinkShaper(model)
    else:
        _SHAPER.model = model  # one thread still posts everything, and queued messages keep their times


def link_model() -> LinkModel | None:
    """The simulated link in force, None when sends run at full speed."""
    return None if _SHAPER is None else _SHAPER.model


def link_backlog() -> Backlog | None:
    """What the simulated link holds back now; None when sends run at full speed."""
    return None if _SHAPER is None else _SHAPER.backlog()


def posted(work: dist.Work | None) -> dist.Work:
    """torch's isend/irecv give None only on a rank outside the group, and a `Peers` is made by a member."""
    assert work is not None, "isend/irecv posted nothing: this rank is not in the group"
    return work


class Waitable(Protocol):
    """What `wait_all` waits on: torch's Work, a `BackgroundSend`, nanoddp's own `Work`."""

    def wait(self) -> object: ...


class BackgroundSend:
    """A send handed to the background sender: `wait()` returns once it was posted and is done."""

    __slots__ = ("_error", "_posted", "_work")

    def __init__(self) -> None:
        self._posted = threading.Event()
        self._work: Waitable | None = None
        self._error: BaseException | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        """As torch's `Work.wait`, whose `timeout` callers pass (torchft's checkpoint transport
        does, healing a joiner): a zero or absent timeout waits as long as it takes."""
        seconds = timeout.total_seconds() if timeout else None
        if not self._posted.wait(seconds):
            raise RuntimeError(f"a shaped send was not posted within {timeout}")
        if self._error is not None:
            raise self._error
        assert self._work is not None  # posted without an error: the sender set it
        if timeout:
            work: Any = self._work  # torch's Work, which takes the timeout
            work.wait(timeout)
        else:
            self._work.wait()
        return True


_QueuedSend = tuple[BackgroundSend, dist.ProcessGroup, torch.Tensor, int, int]  # (handle, group, tensor, peer, tag)
_SENDS: queue.SimpleQueue[_QueuedSend] | None = None  # one sender thread per process, for every group
_SENDS_LOCK = threading.Lock()


def _background_send(group: dist.ProcessGroup, tensor: torch.Tensor, peer: int, tag: int) -> BackgroundSend:
    global _SENDS
    with _SENDS_LOCK:
        if _SENDS is None:
            _SENDS = queue.SimpleQueue()
            threading.Thread(target=_send_loop, args=(_SENDS,), name="nanoddp-sender", daemon=True).start()
    handle = BackgroundSend()
    _SENDS.put((handle, group, tensor, peer, tag))
    return handle


def _send_loop(sends: queue.SimpleQueue[_QueuedSend]) -> None:
    """Post queued sends in order (FIFO keeps each pair's messages in the order they were made)."""
    while True:
        _post(sends.get(), send_on)


def _post(queued: _QueuedSend, send: Callable[[dist.ProcessGroup, torch.Tensor, int, int], Waitable]) -> None:
    """Post one queued send by `send`. A function of its own so that nothing of it outlives the call:
    the loop waits for the next send holding no reference, where a loop variable would keep the last
    message's whole storage alive (a broadcast root's 14 MB flat copy of a model, say)."""
    handle, group, tensor, peer, tag = queued
    try:
        handle._work = send(group, tensor, peer, tag)
    except BaseException as exc:  # a destroyed group, say: the waiter gets it, the thread lives on
        handle._error = exc
    finally:
        handle._posted.set()


def wait_all(works: Sequence[Waitable]) -> None:
    for work in works:
        work.wait()
