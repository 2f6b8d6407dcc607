"""Point-to-point algorithms behind `nanoddp.comm`: the ring, the chain, reductions.

Everything here moves bytes with `torch.distributed.isend`/`irecv` only. Ranks are *group*
ranks (0..n-1 inside the group); `Peers` passes them to torch as `group_dst`/`group_src`, so
a subgroup needs no global-rank bookkeeping.

Every collective starts with the header round (`nanoddp.comm.frames`), which checks that the
ranks agree and, for small messages, already carries the data. Larger messages then take one
of two shapes of traffic:

* **Ring** (`ring`): reduce-scatter then all-gather around ranks 0→1→…→n-1→0. Each chunk is
  cut into pieces; a piece is forwarded the moment it has been received (and reduced), so
  sending, receiving and adding all overlap, and the last reduce-scatter step flows straight
  into the first all-gather step.
* **Chain** (`chain_broadcast`, `chain_reduce`): the same piece pipeline along a line from (or
  to) the root — bandwidth-optimal for one-to-all and all-to-one.
* **Direct** (`start_direct_broadcast`): the root sends the message to every rank itself — one
  hop, for mid-size broadcasts on 3+ ranks, where the chain's hops cost more than its bandwidth saves.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from nanoddp.env import group_ranks

TAG_DATA = 0x6E6402  # our own tags: user send/recv on the same group cannot steal our messages
# The bulk phase of call number k on a group uses tags TAG_CALLS + 2 (k mod CALL_TAG_CYCLE) + {0, 1}.
TAG_CALLS = 0x10000000
CALL_TAG_CYCLE = 1 << 24
# Early data (`early_bytes`): the first piece of call k, 2**e bytes, travels under tag
# TAG_EARLY + 32 (k mod EARLY_TAG_CYCLE) + e, so it can only land in a receive of the same size.
TAG_EARLY = 0x20000000
EARLY_TAG_CYCLE = 1 << 20
EARLY_MIN_BYTES = 64 * 1024
EARLY_MAX_BYTES = 4 * 1024 * 1024
# Largest payload that rides inside a frame (see nanoddp.comm for why): 64 KB on nccl, where
# frames travel whole; on gloo, where only the bytes used travel, as much as keeps what one rank
# sends in that round within INLINE_SEND_BYTES (3 MB at ws 2, 1.5 MB at ws 3, 1 MB at ws 4).
INLINE_MAX_BYTES = 64 * 1024
INLINE_SEND_BYTES = 3 * 1024 * 1024
# all_gather and broadcast leave the frames from 1 MB per rank: their bulk paths receive every
# piece in place and send straight from the tensor (at 2 ranks all of it early, with the header
# round), where the frames copy each share in and out (measured: docs/performance.md, "all_gather's
# switch" and "broadcast's switch"; at 4 ranks broadcast ties there, at 2 the bulk path wins).
IN_PLACE_BULK_KINDS = ("all_gather", "broadcast")
BULK_FROM_BYTES = 1024 * 1024
# Pipelining granularity: two pieces per chunk (as gloo's own ring), within these bounds. Each
# piece costs a gloo send and receive, and posting one while gloo's I/O thread holds the pair's
# lock to move another blocks, so small pieces cost more than the overlap they buy and large
# ones make the pipeline too coarse (measured: docs/performance.md, "Collectives: where the
# thresholds come from").
PIECE_MIN_BYTES = 1024 * 1024
PIECE_MAX_BYTES = 4 * 1024 * 1024
# all_reduce on 2 gloo ranks, above the one-round limit and up to this size, is one exchange of
# whole tensors (`start_exchange_reduce`) instead of the ring. Measured side by side (ws 2, shuffled,
# 40-80 iterations): 4 MB 0.79-1.03x torch vs 0.64-0.77x for the ring in four runs, 6 MB 0.84x
# vs 0.66x; 8 MB even (0.79/0.91x vs 0.82/0.94x), 16 and 64 MB behind the ring.
EXCHANGE_MAX_BYTES = 6 * 1024 * 1024
# broadcast on 3+ gloo ranks, past the frames and up to this size, goes straight from the root to
# every rank (`start_direct_broadcast`) instead of down the chain, whose n-1 hops each wait for a
# whole piece. Measured side by side (ws 4, 60-100 paired iterations): 1 MB 0.64x torch vs 0.59x for
# the chain, 4 MB 0.83-0.92x vs 0.69-0.73x, ws 3 1 MB 0.72x vs 0.63x; 16 MB even. Above it the
# chain stays: the root then sends each byte once, not n-1 times (what counts on a real network).
DIRECT_BROADCAST_MAX_BYTES = 8 * 1024 * 1024

DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
)  # fmt: skip
DTYPE_CODES = {dtype: code for code, dtype in enumerate(DTYPES)}
LOW_PRECISION = (torch.float16, torch.bfloat16)
COLLECTIVES = (
    "all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "scatter", "gather", "all_to_all", "barrier",
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
)  # fmt: skip
OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX")


class Peers:
    """One process group as seen from this rank: p2p by group rank, plus reusable scratch.

    Scratch buffers are kept per group and grow to the largest message seen; this is safe
    because `nanoddp.comm` runs at most one collective per group at a time.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.global_ranks = tuple(group_ranks(group))  # hashable: the watchdog keys groups by it
        self.world_size = dist.get_world_size()  # of the default group: src/dst are global ranks
        # gloo can receive a message into a larger buffer; nccl needs exact sizes and no tags
        self.gloo = dist.get_backend(group) == "gloo"
        self._scratch: dict[tuple[str, torch.device], torch.Tensor] = {}
        self.cache: dict[object, object] = {}  # per-group state of other modules (frames.buffers)
        self.calls = 0  # header rounds run on this group: the same count on every rank

    def call_tags(self) -> tuple[int, int]:
        """Two tags that belong to the current call alone.

        The bulk phase posts its receives before the header round's verdict; if the round
        raises, they stay posted, unmatched. With tags of their own no later message can ever
        land in them (and gloo forgets a receive whose handle was dropped)."""
        base = TAG_CALLS + 2 * (self.calls % CALL_TAG_CYCLE)
        return base, base + 1

    def early_tag(self, nbytes: int) -> int:
        """The tag of this call's early piece of `nbytes` bytes (a power of two, see `early_bytes`)."""
        return TAG_EARLY + 32 * (self.calls % EARLY_TAG_CYCLE) + nbytes.bit_length() - 1

    def send_early(self, piece: torch.Tensor, peer: int) -> dist.Work:
        """Send this call's early piece (`early_bytes`) now, under the tag naming its size.

        Posted on the calling thread, never by the background sender: a gloo send posted from
        another thread while this one posts the header round's frames on the same pair hung the
        round in 4 of 51 runs (2 of 6 under a CPU burner; tests/multiproc/test_comm.py,
        test_bulk_traffic_after_a_failed_header_round[3]), and in none of 55 from this thread."""
        return self.isend(piece, peer, self.early_tag(piece.numel() * piece.element_size()))

    # On gloo straight to the group's own send/recv (which take group ranks): `dist.isend`'s
    # wrapper re-checks the group and translates ranks on every call, ~10 us of CPU each on this
    # machine, paid twice per header round. nccl keeps the wrapper (its batching rules live there).
    def isend(self, tensor: torch.Tensor, peer: int, tag: int = TAG_DATA) -> dist.Work:
        if self.gloo:
            return self.group.send([tensor], peer, tag)
        return dist.isend(tensor, group=self.group, group_dst=peer)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = TAG_DATA) -> dist.Work:
        if self.gloo:
            return self.group.recv([tensor], peer, tag)
        return dist.irecv(tensor, group=self.group, group_src=peer)

    def post_send(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work | BackgroundSend:
        """A bulk-phase send. On gloo it is posted by a background thread: posting a large gloo
        send writes it into the socket on the posting thread, so posted here it would hold up
        receiving and reducing the next piece (docs/performance.md, "the bulk phase"). All of a
        bulk phase's sends go this way, so they reach gloo in the order they were made."""
        if not self.gloo:
            return self.isend(tensor, peer, tag)
        return _background_send(self.group, tensor, peer, tag)

    def exchange(
        self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]], tag: int = TAG_DATA
    ) -> list[dist.Work]:
        """Post (tensor, peer) sends and receives as one round: one nccl group, so a receive and a
        send to the same peer cannot deadlock; on gloo, receives first so sends can start."""
        if self.gloo:
            return [self.irecv(t, p, tag) for t, p in recvs] + [self.isend(t, p, tag) for t, p in sends]
        ops = [dist.P2POp(dist.irecv, t, group=self.group, group_peer=p) for t, p in recvs]
        ops += [dist.P2POp(dist.isend, t, group=self.group, group_peer=p) for t, p in sends]
        return dist.batch_isend_irecv(ops) if ops else []

    def scratch(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A reusable 1-D buffer of `numel` elements (contents undefined)."""
        nbytes = numel * dtype.itemsize
        buf = self._scratch.get((name, device))
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 64), dtype=torch.uint8, device=device)
            self._scratch[(name, device)] = buf
        return buf[:nbytes].view(dtype)


class BackgroundSend:
    """A send handed to the background sender: `wait()` returns once it was posted and is done."""

    __slots__ = ("_error", "_posted", "_work")

    def __init__(self) -> None:
        self._posted = threading.Event()
        self._work: dist.Work | None = None
        self._error: BaseException | None = None

    def wait(self) -> None:
        self._posted.wait()
        if self._error is not None:
            raise self._error
        self._work.wait()


_SENDS: queue.SimpleQueue | None = None  # one sender thread per process, for every group
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


def _send_loop(sends: queue.SimpleQueue) -> None:
    """Post queued sends in order (FIFO keeps each pair's messages in the order they were made)."""
    while True:
        handle, group, tensor, peer, tag = sends.get()
        try:
            handle._work = group.send([tensor], peer, tag)
        except BaseException as exc:  # a destroyed group, say: the waiter gets it, the thread lives on
            handle._error = exc
        finally:
            handle._posted.set()


def inline_limit(peers: Peers) -> int:
    """Largest per-peer payload (bytes) that rides in a frame on this group."""
    return inline_limit_for(peers.size, peers.gloo)


def inline_limit_for(world_size: int, gloo: bool) -> int:
    """`inline_limit` for a group of `world_size` ranks (gloo: what one rank sends in all stays
    under INLINE_SEND_BYTES; nccl: INLINE_MAX_BYTES, its rounds are cheap)."""
    if not gloo:
        return INLINE_MAX_BYTES
    return max(INLINE_MAX_BYTES, INLINE_SEND_BYTES // max(world_size - 1, 1))


def early_bytes(nbytes: int, gloo: bool) -> int:
    """How many leading bytes of an `nbytes` message go out *with* the header round, before its
    verdict: the largest power of two <= nbytes, at most EARLY_MAX_BYTES; 0 below EARLY_MIN_BYTES
    and on nccl (which matches messages by order, so nothing may overtake the header's frames).

    Sending data before the ranks know they agree is safe because of the size: gloo aborts the
    process when a message is larger than the receive it lands in, and this piece's tag names its
    size (`Peers.early_tag`), so it can only meet a receive of exactly its size. If the ranks
    disagree, the round raises on every rank and an unmatched early send or receive stays posted
    under a tag no later call uses (as `Peers.call_tags`)."""
    if not gloo or nbytes < EARLY_MIN_BYTES:
        return 0
    return min(1 << (nbytes.bit_length() - 1), EARLY_MAX_BYTES)


def wait_all(works: Sequence[dist.Work]) -> None:
    for work in works:
        work.wait()


# --- reductions -------------------------------------------------------------------------------


def reduce_into(op: str, acc: torch.Tensor, other: torch.Tensor) -> None:
    """acc = op(acc, other), in place (AVG sums here; `finish_avg` divides once at the end)."""
    if op in ("SUM", "AVG"):
        acc.add_(other)
    elif op == "PRODUCT":
        acc.mul_(other)
    elif op == "MIN":
        torch.minimum(acc, other, out=acc)
    else:
        torch.maximum(acc, other, out=acc)


def finish_avg(op: str, tensor: torch.Tensor, n: int) -> None:
    if op == "AVG":
        tensor.div_(n)  # comm.py only allows AVG on floating-point tensors, as torch does


def reduce_in_rank_order(op: str, parts: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """out = parts[0] op parts[1] op ... in rank order, accumulating fp16/bf16 in fp32.

    Every rank combines the same parts in the same order, so all ranks get bitwise the same
    result (DDP replicas must not drift apart by rounding).
    """
    later = {p.data_ptr() for p in parts[2:]}
    if out.dtype not in LOW_PRECISION and len(parts) > 1 and out.data_ptr() not in later:
        # Straight into `out` (it may be parts[0] or parts[1]: elementwise, each is read before it
        # is written): the accumulator's additions in the same order, without its two copies.
        _FIRST_PAIR[op](parts[0], parts[1], out=out)
        for part in parts[2:]:
            reduce_into(op, out, part)
        finish_avg(op, out, len(parts))
        return
    acc_dtype = torch.float32 if out.dtype in LOW_PRECISION else out.dtype
    acc = parts[0].to(acc_dtype, copy=True)
    for part in parts[1:]:
        reduce_into(op, acc, part)
    finish_avg(op, acc, len(parts))
    out.copy_(acc.view_as(out))


_FIRST_PAIR = {"SUM": torch.add, "AVG": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum, "MAX": torch.maximum}


# --- the ring ---------------------------------------------------------------------------------


def piece_numel(longest: int, itemsize: int) -> int:
    """Elements per piece for chunks of at most `longest` elements (the same on every rank)."""
    nbytes = min(max(-(-longest * itemsize // 2), PIECE_MIN_BYTES), PIECE_MAX_BYTES)
    return max(1, nbytes // itemsize)


def _pieces(length: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(a + step, length)) for a in range(0, length, step)]


def _pieces_after(length: int, first: int, step: int) -> list[tuple[int, int]]:
    """[0, first) as one piece (if first > 0), then the rest in pieces of `step`."""
    rest = [(first + a, first + b) for a, b in _pieces(length - first, step)]
    return [(0, first), *rest] if first else rest


def ring(
    peers: Peers,
    chunks: Sequence[torch.Tensor],
    op: str | None,
    reduce_steps: int,
    gather_steps: int,
    shift: int,
) -> None:
    """Run the ring now (see `start_ring`)."""
    start_ring(peers, chunks, op, reduce_steps, gather_steps, shift)()


def start_ring(
    peers: Peers,
    chunks: Sequence[torch.Tensor],
    op: str | None,
    reduce_steps: int,
    gather_steps: int,
    shift: int,
) -> Callable[[], None]:
    """Post the ring's first receives now; the returned function runs it: `reduce_steps`
    reduce-scatter steps then `gather_steps` all-gather steps, in place.

    `chunks` are n 1-D contiguous tensors (sizes may differ, even be 0). At step j this rank
    sends chunk (rank - j + shift) to its right neighbour and receives chunk (rank - j - 1 +
    shift) from its left; during reduce-scatter the received piece is reduced into the chunk,
    during all-gather it lands in the chunk directly. What is received at step j is exactly
    what is sent at step j+1, so each piece is forwarded as soon as it is ready. After n-1
    reduce steps this rank holds the finished chunk (rank + 1 + shift).

    Callers start the ring before the header round and run it after: a gloo send only starts
    once the receiver has announced the matching receive, and that announcement then travels
    during the header round instead of after it (see `Peers.call_tags` for why receives left
    unmatched by a round that raised are harmless).
    """
    if peers.size == 1:
        return lambda: None
    if peers.gloo:
        return _start_pipelined_ring(peers, chunks, op, reduce_steps, gather_steps, shift)
    return lambda: _lockstep_ring(peers, chunks, op, reduce_steps, gather_steps, shift)


def _start_pipelined_ring(
    peers: Peers, chunks: Sequence[torch.Tensor], op: str | None, reduce_steps: int, gather_steps: int, shift: int
) -> Callable[[], None]:
    """The ring on gloo: every receive posted before any data moves, pieces forwarded one by one.

    A gloo send only starts once the receiver has announced its receive, so receives are
    posted early: all-gather receives go straight into their chunks, all up front. That is
    safe although this rank may still be sending from the same chunk: the finished value of a
    piece cannot arrive before our own contribution to it has been received downstream, i.e.
    before our send has been read. Reduce-scatter receives use scratch slots (their own tag,
    so they match independently of the all-gather ones), posted a step ahead.
    """
    n, r = peers.size, peers.rank
    right, left = (r + 1) % n, (r - 1) % n
    steps = reduce_steps + gather_steps
    longest = max(c.numel() for c in chunks)
    itemsize = chunks[0].element_size()
    step = piece_numel(longest, itemsize)
    # Every chunk's first piece is early data (`early_bytes`, sized by the smallest chunk, which all
    # ranks agree on): step 0 sends it now, so it travels during the header round.
    early = early_bytes(min(c.numel() for c in chunks) * itemsize, peers.gloo) // itemsize  # elements
    pieces = [_pieces_after(c.numel(), early, step) for c in chunks]
    slots = min(reduce_steps, 2)
    scratch = peers.scratch("ring", slots * longest, chunks[0].dtype, chunks[0].device).view(slots, longest)
    chunk_at = [(r - j - 1 + shift) % n for j in range(steps)]  # chunk received at step j
    reduce_tag, gather_tag = peers.call_tags()
    tag_at = [reduce_tag if j < reduce_steps else gather_tag for j in range(steps)]
    early_tag = peers.early_tag(early * itemsize) if early else None

    def tag_of(j: int, i: int) -> int:  # piece i of step j
        return early_tag if early and j == 0 and i == 0 else tag_at[j]

    def post_recvs(j: int) -> list[dist.Work]:
        c = chunk_at[j]
        target = scratch[j % 2] if j < reduce_steps else chunks[c]
        return [peers.irecv(target[a:b], left, tag_of(j, i)) for i, (a, b) in enumerate(pieces[c])]

    recvs = {j: post_recvs(j) for j in range(reduce_steps, steps)}
    recvs.update({j: post_recvs(j) for j in range(min(reduce_steps, 2))})
    first = (r + shift) % n
    early_send = [peers.send_early(chunks[first][:early], right)] if early else []

    def run() -> None:
        sends = early_send + [
            peers.post_send(chunks[first][a:b], right, tag_at[0]) for a, b in pieces[first][len(early_send) :]
        ]
        for j in range(steps):
            if j > 0 and j + 1 < reduce_steps:  # slot (j+1) % 2 was freed by step j-1
                recvs[j + 1] = post_recvs(j + 1)
            c = chunk_at[j]
            for (a, b), work in zip(pieces[c], recvs.pop(j), strict=True):
                work.wait()
                piece = chunks[c][a:b]
                if j < reduce_steps:
                    reduce_into(op, piece, scratch[j % 2, a:b])
                    if j == reduce_steps - 1:
                        finish_avg(op, piece, n)
                if j + 1 < steps:
                    sends.append(peers.post_send(piece, right, tag_at[j + 1]))
        wait_all(sends)

    return run


def _lockstep_ring(
    peers: Peers, chunks: Sequence[torch.Tensor], op: str | None, reduce_steps: int, gather_steps: int, shift: int
) -> None:
    """The ring on nccl: one grouped send+receive per step (an ungrouped receive posted before
    the send to the same peer deadlocks nccl, and nccl matches by order, not by tag)."""
    n, r = peers.size, peers.rank
    right, left = (r + 1) % n, (r - 1) % n
    longest = max(c.numel() for c in chunks)
    incoming = peers.scratch("ring", longest, chunks[0].dtype, chunks[0].device)
    for j in range(reduce_steps + gather_steps):
        sent, c = chunks[(r - j + shift) % n], (r - j - 1 + shift) % n
        target = incoming[: chunks[c].numel()] if j < reduce_steps else chunks[c]
        wait_all(peers.exchange([(sent, right)], [(target, left)]))
        if j < reduce_steps:
            reduce_into(op, chunks[c], target)
            if j == reduce_steps - 1:
                finish_avg(op, chunks[c], n)


def balanced_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """n contiguous ranges covering [0, numel), sizes differing by at most one."""
    return [(numel * i // n, numel * (i + 1) // n) for i in range(n)]


def _message_pieces(peers: Peers, flat: torch.Tensor) -> tuple[int, list[tuple[int, int, int]]]:
    """How one whole message moves (the chain, the 2-rank exchange): (early elements, pieces as
    (start, end, tag)). Its early piece (`early_bytes`) comes first under the tag naming its size,
    the rest in pieces of `piece_numel` under this call's first tag."""
    itemsize = flat.element_size()
    early = early_bytes(flat.numel() * itemsize, peers.gloo) // itemsize  # elements
    tag = peers.call_tags()[0]
    pieces = [(a, b, tag) for a, b in _pieces_after(flat.numel(), early, piece_numel(flat.numel(), itemsize))]
    if early:
        pieces[0] = (0, early, peers.early_tag(early * itemsize))
    return early, pieces


# --- two ranks: all_reduce as one exchange ------------------------------------------------


def reduces_by_exchange(nbytes: int, size: int, gloo: bool) -> bool:
    """Whether an all_reduce of `nbytes` past the one-round limit runs `start_exchange_reduce`."""
    return size == 2 and gloo and nbytes <= EXCHANGE_MAX_BYTES


def start_exchange_reduce(peers: Peers, flat: torch.Tensor, op: str) -> Callable[[], None]:
    """all_reduce on 2 gloo ranks: each sends the other its whole tensor and reduces locally.

    The ring at 2 ranks moves the same bytes each way (half, then the reduced half back), but in
    two dependent exchanges with a reduction between them; here the link carries one exchange
    and each received piece is reduced as it lands. Two operands combine the same either way
    round (a + b == b + a in IEEE arithmetic, as min, max and product), so both ranks, and
    gloo's own ring, get bitwise the same result. Receives are posted now and the first piece
    leaves early (`early_bytes`), as in `start_ring`; the returned function runs the rest."""
    other = 1 - peers.rank
    early, pieces = _message_pieces(peers, flat)
    incoming = peers.scratch("exchange", flat.numel(), flat.dtype, flat.device)
    recvs = [peers.irecv(incoming[a:b], other, t) for a, b, t in pieces]
    first = [peers.send_early(flat[:early], other)] if early else []

    def run() -> None:
        sends = first + [peers.post_send(flat[a:b], other, t) for a, b, t in pieces[len(first) :]]
        for (a, b, _), received, sent in zip(pieces, recvs, sends, strict=True):
            received.wait()
            sent.wait()  # the piece is read out before its sum overwrites it
            reduce_into(op, flat[a:b], incoming[a:b])
        finish_avg(op, flat, 2)

    return run


# --- the chain: broadcast and reduce ------------------------------------------------------


def start_chain_broadcast(peers: Peers, flat: torch.Tensor, root: int) -> Callable[[], None]:
    """root → root+1 → … → root-1; every piece is forwarded as soon as it arrives. Receives are
    posted now, the returned function runs it (started before the header round, as `start_ring`)."""
    return _posted_now_on_gloo(peers, lambda: _start_chain_broadcast(peers, flat, root))


def broadcasts_directly(nbytes: int, size: int, gloo: bool) -> bool:
    """Whether a broadcast of `nbytes` past the frames runs `start_direct_broadcast` (else the chain)."""
    return gloo and size > 2 and nbytes <= DIRECT_BROADCAST_MAX_BYTES


def start_direct_broadcast(peers: Peers, flat: torch.Tensor, root: int) -> Callable[[], None]:
    """The root sends the whole message to every other rank itself: one hop instead of the chain's
    n-1. Receives are posted now, the returned function runs it (as `start_chain_broadcast`)."""
    return _posted_now_on_gloo(peers, lambda: _start_direct_broadcast(peers, flat, root))


def _start_direct_broadcast(peers: Peers, flat: torch.Tensor, root: int) -> Callable[[], None]:
    early, pieces = _message_pieces(peers, flat)
    if peers.rank != root:
        recvs = [peers.irecv(flat[a:b], root, t) for a, b, t in pieces]
        return lambda: wait_all(recvs)
    others = [p for p in range(peers.size) if p != root]
    first = [peers.send_early(flat[:early], p) for p in others] if early else []
    rest = pieces[len(first) and 1 :]
    return lambda: wait_all(first + [peers.post_send(flat[a:b], p, t) for a, b, t in rest for p in others])


def start_chain_reduce(peers: Peers, flat: torch.Tensor, op: str, root: int) -> Callable[[], None]:
    """root-1 → root-2 → … → root: each rank adds its part to the running result and passes it
    on. Only the root's `flat` is written; the others accumulate in scratch. Receives are posted
    now, the returned function runs it (started before the header round, as `start_ring`)."""
    return _posted_now_on_gloo(peers, lambda: _start_chain_reduce(peers, flat, op, root))


def _posted_now_on_gloo(peers: Peers, start: Callable[[], Callable[[], None]]) -> Callable[[], None]:
    """Post a chain's receives now on gloo; elsewhere (nccl matches by order, not by tag, so nothing
    may be posted ahead of the header round's frames) post them when it runs."""
    if peers.gloo:
        return start()
    return lambda: start()()


def _start_chain_broadcast(peers: Peers, flat: torch.Tensor, root: int) -> Callable[[], None]:
    """The chain's first piece is early data (`early_bytes`): the root sends it now, so it travels
    during the header round; the others follow the verdict."""
    n, r = peers.size, peers.rank
    position = (r - root) % n
    right, left = (r + 1) % n, (r - 1) % n
    early, pieces = _message_pieces(peers, flat)
    if position == 0:
        first = [peers.send_early(flat[:early], right)] if early else []
        return lambda: wait_all(first + [peers.post_send(flat[a:b], right, t) for a, b, t in pieces[len(first) :]])
    recvs = [peers.irecv(flat[a:b], left, t) for a, b, t in pieces]

    def run() -> None:
        sends = []
        for (a, b, t), work in zip(pieces, recvs, strict=True):
            work.wait()
            if position < n - 1:
                sends.append(peers.post_send(flat[a:b], right, t))
        wait_all(sends)

    return run


def _start_chain_reduce(peers: Peers, flat: torch.Tensor, op: str, root: int) -> Callable[[], None]:
    n, r = peers.size, peers.rank
    position = (r - root) % n
    toward_root, upstream = (r - 1) % n, (r + 1) % n
    pieces = _pieces(flat.numel(), piece_numel(flat.numel(), flat.element_size()))
    tag = peers.call_tags()[0]
    if position == n - 1:  # the far end of the chain starts with its own data
        return lambda: wait_all([peers.post_send(flat[a:b], toward_root, tag) for a, b in pieces])
    incoming = peers.scratch("chain", flat.numel(), flat.dtype, flat.device)
    recvs = [peers.irecv(incoming[a:b], upstream, tag) for a, b in pieces]

    def run() -> None:
        sends = []
        for (a, b), work in zip(pieces, recvs, strict=True):
            work.wait()
            if position == 0:
                reduce_into(op, flat[a:b], incoming[a:b])
            else:
                reduce_into(op, incoming[a:b], flat[a:b])
                sends.append(peers.post_send(incoming[a:b], toward_root, tag))
        wait_all(sends)
        if position == 0:
            finish_avg(op, flat, n)

    return run
