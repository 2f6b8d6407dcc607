"""Prepared header rounds: the optional fast layer, one round made once per call signature.

Why a second way to run the same rounds: [Note: per-call cost] small collectives are what a
training loop repeats every step (a loss all_reduce, a metric all_gather, DDP's buffer broadcast),
and on a CPU host each step of a call costs far more than it does in a warm loop: the ranks'
processes and gloo's I/O threads share the cores and evict each other's caches between calls, so
every tensor op, slice and helper call on the way costs microseconds, and at 2 ranks a 4 KB call
is only a few such steps above a bare exchange. `header_round.one_round` serves every collective,
size and group through callbacks and builds its views, header rows and checks per call; a prepared
round makes them once for one signature (collective, numel, dtype, op, root and the payload sizes
each way), so a call writes the header, copies the payload in, sends and receives, compares the
header rows with the ones it expects and copies out what arrived.

Nothing here is a protocol of its own: the frames, tag, header slots, round counter, checks and
error decoding are `nanoddp.comm.protocol.wire`'s, and the star's verdict is sent by
`header_round.check_at_hub`, so a peer that took the general path, or made a mismatched or invalid
call, is checked exactly as there and every rank raises the same error. The layer is optional and
chosen in one place: a collective runs here only where `plan.plan` answers `Path.PAIR` or
`Path.STAR` (and a header-only round where `plan.header_round_path` answers `Path.PAIR`); with
those answers switched off every call takes the general round, with the same results
(tests/multiproc/test_comm_paths.py runs both). The functions at the end are what the public
collectives call: one per collective that has a prepared form. Prepared rounds live with the frames
they use (`FrameBuffers.rounds`), so they are dropped when the frames are re-made.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanoddp.comm.algorithms.reduce import reduce_in_rank_order
from nanoddp.comm.plan import plan
from nanoddp.comm.protocol import header_round, wire
from nanoddp.comm.protocol.header_round import check_at_hub
from nanoddp.comm.protocol.wire import COLLECTIVES, HEADER_BYTES, SLOT_NBYTES, TAG_FRAME, FrameBuffers
from nanoddp.comm.transport.transport import Peers, send_on

MAX_ROUNDS = 256  # prepared signatures kept per group (a training loop uses a handful)


class PairRound:
    """One prepared round: fill `outgoing`, call `run()`, read what it returns."""

    __slots__ = ("_expected", "_frame", "_group", "_in_row", "_in_slots", "_mine", "_other", "_out_slots", "_peers",
                 "incoming", "outgoing")  # fmt: skip

    def __init__(self, peers: Peers, bufs: FrameBuffers, header: tuple[int, ...], dtype: torch.dtype,
                 out_numel: int, in_numel: int) -> None:  # fmt: skip
        other = 1 - peers.rank
        out_bytes, in_bytes = out_numel * dtype.itemsize, in_numel * dtype.itemsize
        self._peers, self._group, self._other = peers, peers.group, other
        self._mine = wire.up_slots(header, out_bytes)  # this rank's header slots
        self._expected = wire.up_slots(header, in_bytes)  # the peer's, if it made the same call
        self._out_slots, self._in_slots = bufs.slot_arrays()
        out_row, self._in_row = bufs.out_rows[other], bufs.in_rows[other]
        self._frame = out_row[: HEADER_BYTES + out_bytes]
        self.outgoing = out_row[HEADER_BYTES : HEADER_BYTES + out_bytes].view(dtype)  # (out_numel,)
        self.incoming = self._in_row[HEADER_BYTES : HEADER_BYTES + in_bytes].view(dtype)  # (in_numel,)

    def run(self) -> torch.Tensor:
        """Send this rank's frame (header + `outgoing`), receive the peer's, check them; return
        `incoming`, the peer's payload (valid until the group's next collective)."""
        return wire.counted(self._peers, self._run)

    def _run(self) -> torch.Tensor:
        other = self._other
        self._out_slots[other] = self._mine
        received = self._group.recv([self._in_row], other, TAG_FRAME)  # first: gloo sends once it is announced
        sent = send_on(self._group, self._frame, other, TAG_FRAME)
        received.wait()
        sent.wait()
        theirs = self._in_slots[other].tolist()
        if theirs != self._expected:
            self._disagree(theirs)
        return self.incoming

    def _disagree(self, theirs: list[int]) -> None:
        """The peer's header row is not the expected one: raise what the general path raises."""
        table = [self._mine, theirs] if self._peers.rank == 0 else [theirs, self._mine]
        peer_payload = self._in_row[HEADER_BYTES : HEADER_BYTES + theirs[SLOT_NBYTES]]
        wire.check_table(table, lambda q: peer_payload if table[q] is theirs else None)
        collective = COLLECTIVES[self._mine[0]]
        wire.raise_payload_mismatch(collective, self._expected[SLOT_NBYTES], theirs[SLOT_NBYTES])


def _kept(bufs: FrameBuffers, key: tuple[int | str, ...], prepared: PairRound | StarBroadcast) -> None:
    if len(bufs.rounds) >= MAX_ROUNDS:
        bufs.rounds.clear()
    bufs.rounds[key] = prepared


def pair_round(peers: Peers, header: list[int], dtype: torch.dtype, device: torch.device, out_numel: int,
             in_numel: int) -> PairRound:  # fmt: skip
    """The prepared round for this signature (`plan.Path.PAIR`: 2 gloo ranks, frames on CPU)."""
    bufs = wire.buffers(peers, device)
    key = (*header, out_numel, in_numel)
    pair = bufs.rounds.get(key)  # only star_broadcast's keys end in "star": this one is a PairRound
    if pair is None:
        pair = PairRound(peers, bufs, tuple(header), dtype, out_numel, in_numel)
        _kept(bufs, key, pair)
    return pair


def header_then(peers: Peers, header: list[int], device: torch.device, run: Callable[[], None] | None = None) -> None:
    """The header round of a call whose data moves after it (bulk paths, barrier), then `run()`
    (already started: its receives are posted, its early piece sent): prepared where
    `plan.header_round_path` says so (2 gloo ranks), `header_round.one_round` elsewhere."""
    if plan.header_round_path(peers.size, peers.backend, cpu=device.type == "cpu") is plan.Path.PAIR:
        pair_round(peers, header, torch.uint8, device, 0, 0).run()
    else:
        header_round.one_round(peers, header, device)
    if run is not None:
        run()


class StarBroadcast:
    """broadcast on 3+ gloo ranks with the data in the frames: `header_round._star`'s round (up frames to
    group rank 0, the hub; a down frame back to each rank with the verdict and the data), its
    header rows, views and expected tables made once. `run(flat)` does the whole call."""

    def __init__(self, peers: Peers, bufs: FrameBuffers, header: tuple[int, ...], dtype: torch.dtype, numel: int,
                 root: int) -> None:  # fmt: skip
        n, me, nbytes = peers.size, peers.rank, numel * dtype.itemsize
        self._peers, self._group, self._bufs, self._root = peers, peers.group, bufs, root
        self._out_slots, self._in_slots = bufs.slot_arrays()
        self._mine = wire.up_slots(header, nbytes if me == root else 0)
        if me == 0:
            self._expected = [wire.up_slots(header, nbytes if p == root else 0) for p in range(1, n)]  # rows 1..n-1
            # One down frame for every rank but the root (group rank 0 never sends to itself, so its
            # outbox row 0 is free); the root, if not the hub, gets its verdict without data.
            self._down_slots, self._root_slots = wire.down_slots(0, nbytes), wire.down_slots(0, 0)
            self._down = bufs.out_rows[0][: HEADER_BYTES + nbytes]
            self._down_data = bufs.out_rows[0][HEADER_BYTES : HEADER_BYTES + nbytes]
            self._root_down = bufs.out_rows[root][:HEADER_BYTES]
            self._from_root = bufs.in_rows[root][HEADER_BYTES : HEADER_BYTES + nbytes]  # the root's up payload
        else:
            self._expected_verdict = wire.down_slots(0, 0 if me == root else nbytes)
            self._up = bufs.out_rows[0][: HEADER_BYTES + (nbytes if me == root else 0)]
            self._up_data = bufs.out_rows[0][HEADER_BYTES : HEADER_BYTES + nbytes]
            self._from_hub = bufs.in_rows[0][HEADER_BYTES : HEADER_BYTES + nbytes]  # the data in the down frame

    def run(self, flat: torch.Tensor) -> None:
        """The broadcast of `flat` (1-D, contiguous; the root's is read, the others' written)."""
        wire.counted(self._peers, self._hub if self._peers.rank == 0 else self._spoke, flat)

    def _spoke(self, flat: torch.Tensor) -> None:
        me, bufs = self._peers.rank, self._bufs
        if me == self._root:
            self._up_data.copy_(flat.view(torch.uint8))
        self._out_slots[0] = self._mine
        received = self._group.recv([bufs.in_rows[0]], 0, TAG_FRAME)
        sent = send_on(self._group, self._up, 0, TAG_FRAME)
        received.wait()
        sent.wait()
        verdict = self._in_slots[0].tolist()
        if verdict != self._expected_verdict:
            if not verdict[0]:  # passed, but with another payload size: the ranks' frame limits differ
                wire.raise_payload_mismatch("broadcast", self._expected_verdict[SLOT_NBYTES], verdict[SLOT_NBYTES])
            wire.raise_down_frame(verdict[0], bufs.in_rows[0][HEADER_BYTES : HEADER_BYTES + verdict[SLOT_NBYTES]])
        if me != self._root:
            flat.view(torch.uint8).copy_(self._from_hub)

    def _hub(self, flat: torch.Tensor) -> None:
        peers, bufs, root, n = self._peers, self._bufs, self._root, self._peers.size
        received = [self._group.recv([bufs.in_rows[p]], p, TAG_FRAME) for p in range(1, n)]
        for work in received:
            work.wait()
        rows = self._in_slots[1:].tolist()  # (n-1) x 8
        if rows != self._expected:
            table = [self._mine, *rows]
            payload_of = lambda q: bufs.in_rows[q][HEADER_BYTES : HEADER_BYTES + table[q][SLOT_NBYTES]]  # noqa: E731
            check_at_hub(peers, bufs, lambda: _check_star(table, payload_of, self._expected), flat.device)
        self._down_data.copy_(flat.view(torch.uint8) if root == 0 else self._from_root)
        self._out_slots[0] = self._down_slots
        if root != 0:
            self._out_slots[root] = self._root_slots
        sent = [send_on(self._group, self._root_down if p == root else self._down, p, TAG_FRAME) for p in range(1, n)]
        for sending in sent:
            sending.wait()
        if root != 0:
            flat.view(torch.uint8).copy_(self._from_root)


def _check_star(table: list[list[int]], payload_of: Callable[[int], torch.Tensor], expected: list[list[int]]) -> None:
    """Raise what the general path raises for this table; if it passes (same calls, other payload
    sizes: the ranks' frame limits differ), raise that."""
    wire.check_table(table, payload_of)
    wire.raise_payload_mismatch(
        "broadcast", [row[SLOT_NBYTES] for row in expected], [row[SLOT_NBYTES] for row in table[1:]]
    )


def star_broadcast(peers: Peers, header: list[int], flat: torch.Tensor, root: int) -> StarBroadcast:
    """The prepared broadcast for this signature (`plan.Path.STAR`: 3+ gloo ranks, frames on CPU)."""
    bufs = wire.buffers(peers, flat.device)
    key: tuple[int | str, ...] = (*header, "star")
    star = bufs.rounds.get(key)
    if star is None:
        star = StarBroadcast(peers, bufs, tuple(header), flat.dtype, flat.numel(), root)
        _kept(bufs, key, star)
    return star


# --- the collectives' prepared forms (each runs where `plan.plan` chose Path.PAIR or Path.STAR) ---


def all_reduce(peers: Peers, header: list[int], data: torch.Tensor, op: str) -> None:
    """all_reduce of 1-D `data` at 2 ranks: swap, then reduce in rank order (so both ranks compute
    bitwise the same result)."""
    pair = pair_round(peers, header, data.dtype, data.device, data.numel(), data.numel())
    pair.outgoing.copy_(data)
    received = pair.run()
    reduce_in_rank_order(op, [data, received] if peers.rank == 0 else [received, data], data)


def all_gather(peers: Peers, header: list[int], outputs: list[torch.Tensor], data: torch.Tensor) -> None:
    """all_gather at 2 ranks: `outputs` (two 1-D tensors) get `data` and the peer's."""
    pair = pair_round(peers, header, data.dtype, data.device, data.numel(), data.numel())
    me = peers.rank
    outputs[me].copy_(data)
    pair.outgoing.copy_(data)
    outputs[1 - me].copy_(pair.run())


def broadcast(peers: Peers, header: list[int], data: torch.Tensor, root: int) -> None:
    """broadcast of 1-D `data` from group rank `root`: the star on 3+ ranks; at 2 ranks the root
    sends and the other receives."""
    if peers.size > 2:
        star_broadcast(peers, header, data, root).run(data)
        return
    is_root = peers.rank == root
    sizes = (data.numel(), 0) if is_root else (0, data.numel())
    pair = pair_round(peers, header, data.dtype, data.device, *sizes)
    if is_root:
        pair.outgoing.copy_(data)
        pair.run()
    else:
        data.copy_(pair.run())
