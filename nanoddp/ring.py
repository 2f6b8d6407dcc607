"""Point-to-point algorithms behind `nanoddp.comm`: frames, the ring, the chain, reductions.

Everything here moves bytes with `torch.distributed.isend`/`irecv` only. Ranks are *group*
ranks (0..n-1 inside the group); `Peers` passes them to torch as `group_dst`/`group_src`, so
a subgroup needs no global-rank bookkeeping.

The three shapes of traffic:

* **Frames** (`exchange_frames`): one round in which every rank sends every other rank a
  fixed-format frame: a small header (which collective, numel, dtype, op, root) and, for
  small messages, the payload itself. Every collective starts with it, so a rank that passes
  a tensor of another size or dtype is caught before any data moves, and every rank raises
  the same error. For small messages the payload rides in the frame, so the check is free:
  the header *is* the latency-optimal one-round algorithm.
* **Ring** (`ring`): reduce-scatter then all-gather around ranks 0→1→…→n-1→0. Each chunk is
  cut into pieces; a piece is forwarded the moment it has been received (and reduced), so
  sending, receiving and adding all overlap, and the last reduce-scatter step flows straight
  into the first all-gather step.
* **Chain** (`chain_broadcast`, `chain_reduce`): the same piece pipeline along a line from (or
  to) the root — bandwidth-optimal for one-to-all and all-to-one.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.distributed as dist

from nanoddp.dist import group_ranks

TAG_FRAME = 0x6E6401  # our own tags: user send/recv on the same group cannot steal our messages
TAG_DATA = 0x6E6402
HEADER_FIELDS = ("collective", "numel", "dtype", "op", "root")
HEADER_BYTES = 64  # 8 int64 slots: the fields above, the inline payload size, 2 spare
INLINE_MAX_BYTES = 64 * 1024  # largest payload that rides inside a frame (see comm.py for why)
# Pipelining granularity: about 4 pieces per chunk, within these bounds. Smaller pieces add
# per-message overhead (a Python call, a wake-up); larger ones serialise sending and receiving
# on gloo's per-pair lock (measured on a 2-core host: 4 x 512 KB beat 1 x 2 MB and 16 x 128 KB).
PIECE_MIN_BYTES = 256 * 1024
PIECE_MAX_BYTES = 2 * 1024 * 1024

DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
)  # fmt: skip
DTYPE_CODES = {dtype: code for code, dtype in enumerate(DTYPES)}
LOW_PRECISION = (torch.float16, torch.bfloat16)
COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "scatter", "gather")
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
        self.global_ranks = group_ranks(group)
        self.global_ranks_tuple = tuple(self.global_ranks)
        # gloo can receive a message into a larger buffer; nccl needs exact sizes and no tags
        self.gloo = dist.get_backend(group) == "gloo"
        self._scratch: dict[tuple[str, torch.device], torch.Tensor] = {}

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = TAG_DATA) -> dist.Work:
        return dist.isend(tensor, group=self.group, group_dst=peer, tag=tag if self.gloo else 0)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = TAG_DATA) -> dist.Work:
        return dist.irecv(tensor, group=self.group, group_src=peer, tag=tag if self.gloo else 0)

    def scratch(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A reusable 1-D buffer of `numel` elements (contents undefined)."""
        nbytes = numel * dtype.itemsize
        buf = self._scratch.get((name, device))
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 64), dtype=torch.uint8, device=device)
            self._scratch[(name, device)] = buf
        return buf[:nbytes].view(dtype)


def wait_all(works: Sequence[dist.Work]) -> None:
    for work in works:
        work.wait()


# --- frames: the header round, with small payloads inline ---------------------------------


def exchange_frames(
    peers: Peers, header: Sequence[int], payloads: Sequence[torch.Tensor | None], device: torch.device
) -> list[torch.Tensor]:
    """Send every peer our header (+ `payloads[peer]`, <= INLINE_MAX_BYTES); check all headers.

    Returns the payload bytes received from each peer (uint8; empty for ourselves). Raises the
    same ValueError on every rank when the headers disagree, because every rank sees the same
    table of headers.
    """
    n, me = peers.size, peers.rank
    if n == 1:
        return [payloads[0]]
    frame_bytes = HEADER_BYTES + INLINE_MAX_BYTES
    inbox = peers.scratch("inbox", n * frame_bytes, torch.uint8, device).view(n, frame_bytes)
    outbox = peers.scratch("outbox", n * frame_bytes, torch.uint8, device).view(n, frame_bytes)
    works = [peers.irecv(inbox[p], p, TAG_FRAME) for p in range(n) if p != me]
    for p in range(n):
        if p == me:
            continue
        payload = payloads[p]
        nbytes = 0 if payload is None else payload.numel() * payload.element_size()
        assert nbytes <= INLINE_MAX_BYTES, f"inline payload of {nbytes} bytes is too large"
        frame = outbox[p]
        frame[:HEADER_BYTES].view(torch.int64)[: len(header) + 1] = torch.tensor([*header, nbytes])
        if nbytes:
            frame[HEADER_BYTES : HEADER_BYTES + nbytes].view(payload.dtype).copy_(payload.reshape(-1))
        sent = frame[: HEADER_BYTES + nbytes] if peers.gloo else frame
        works.append(peers.isend(sent, p, TAG_FRAME))
    wait_all(works)
    slots = inbox[:, :HEADER_BYTES].view(torch.int64)[:, : len(header) + 1].tolist()  # (n, fields+1)
    slots[me] = [*header, 0]
    check_headers([row[: len(header)] for row in slots])
    return [inbox[p, HEADER_BYTES : HEADER_BYTES + slots[p][-1]] for p in range(n)]


def check_headers(table: list[list[int]]) -> None:
    """Raise one ValueError, worded identically on every rank, if the ranks' headers differ."""
    for field, name in enumerate(HEADER_FIELDS):
        values = [row[field] for row in table]
        if len(set(values)) == 1:
            continue
        shown = ", ".join(f"rank {r}: {_describe(name, v)}" for r, v in enumerate(values))
        collective = COLLECTIVES[table[0][0]]
        raise ValueError(
            f"nanoddp.comm.{collective}: ranks disagree on {name} ({shown}; ranks are group ranks); "
            "every rank must call the same collectives in the same order, with tensors of the "
            "same numel and dtype and the same op/src/dst"
        )


def _describe(name: str, value: int) -> str:
    if name == "collective":
        return COLLECTIVES[value]
    if name == "dtype":
        return str(DTYPES[value]).removeprefix("torch.")
    if name == "op":
        return OPS[value] if value >= 0 else "none"
    return str(value)


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
    acc_dtype = torch.float32 if out.dtype in LOW_PRECISION else out.dtype
    acc = parts[0].to(acc_dtype, copy=True)
    for part in parts[1:]:
        reduce_into(op, acc, part)
    finish_avg(op, acc, len(parts))
    out.copy_(acc.view_as(out))


# --- the ring ---------------------------------------------------------------------------------


def piece_numel(longest: int, itemsize: int) -> int:
    """Elements per piece for chunks of at most `longest` elements (the same on every rank)."""
    nbytes = min(max(longest * itemsize // 4, PIECE_MIN_BYTES), PIECE_MAX_BYTES)
    return max(1, nbytes // itemsize)


def _pieces(length: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(a + step, length)) for a in range(0, length, step)]


def ring(
    peers: Peers,
    chunks: Sequence[torch.Tensor],
    op: str | None,
    reduce_steps: int,
    gather_steps: int,
    shift: int,
) -> None:
    """Run `reduce_steps` reduce-scatter steps then `gather_steps` all-gather steps in place.

    `chunks` are n 1-D contiguous tensors (sizes may differ, even be 0). At step j this rank
    sends chunk (rank - j + shift) to its right neighbour and receives chunk (rank - j - 1 +
    shift) from its left; during reduce-scatter the received piece is reduced into the chunk,
    during all-gather it is copied into it. What is received at step j is exactly what is
    sent at step j+1, so each piece is forwarded as soon as it is ready. After n-1 reduce
    steps this rank holds the finished chunk (rank + 1 + shift).

    Receives are posted one step ahead into a double buffer, so gloo can write every send at
    once (a receive posted late costs a round trip). After a reduce-scatter, all-gather pieces
    also land in the buffer and are copied in: their chunk may still be in flight from an
    earlier send, which we wait for per piece, never stalling the pipeline on a whole chunk.
    """
    n, r = peers.size, peers.rank
    if n == 1:
        return
    right, left = (r + 1) % n, (r - 1) % n
    steps = reduce_steps + gather_steps
    longest = max(c.numel() for c in chunks)
    step = piece_numel(longest, chunks[0].element_size())
    pieces = [_pieces(c.numel(), step) for c in chunks]
    scratch = peers.scratch("ring", 2 * longest, chunks[0].dtype, chunks[0].device).view(2, longest)
    sends: dict[tuple[int, int], list[dist.Work]] = defaultdict(list)  # (chunk, piece) -> sends reading it
    via_scratch = reduce_steps > 0  # a pure all-gather never overwrites a chunk it has sent

    def post_recvs(j: int) -> list[dist.Work]:
        c = (r - j - 1 + shift) % n
        target = scratch[j % 2] if via_scratch else chunks[c]
        return [peers.irecv(target[a:b], left) for a, b in pieces[c]]

    recvs = post_recvs(0)
    first = (r + shift) % n
    for k, (a, b) in enumerate(pieces[first]):
        sends[(first, k)].append(peers.isend(chunks[first][a:b], right))
    for j in range(steps):
        c = (r - j - 1 + shift) % n
        upcoming = post_recvs(j + 1) if j + 1 < steps else []
        for k, ((a, b), work) in enumerate(zip(pieces[c], recvs, strict=True)):
            work.wait()
            piece, incoming = chunks[c][a:b], scratch[j % 2, a:b]
            if j < reduce_steps:
                reduce_into(op, piece, incoming)
                if j == reduce_steps - 1:
                    finish_avg(op, piece, n)
            elif via_scratch:
                wait_all(sends.pop((c, k), []))
                piece.copy_(incoming)
            if j + 1 < steps:
                sends[(c, k)].append(peers.isend(piece, right))
        recvs = upcoming
    for works in sends.values():
        wait_all(works)


def balanced_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """n contiguous ranges covering [0, numel), sizes differing by at most one."""
    return [(numel * i // n, numel * (i + 1) // n) for i in range(n)]


# --- the chain: broadcast and reduce ------------------------------------------------------


def chain_broadcast(peers: Peers, flat: torch.Tensor, root: int) -> None:
    """root → root+1 → … → root-1; every piece is forwarded as soon as it arrives."""
    n, r = peers.size, peers.rank
    position = (r - root) % n
    right, left = (r + 1) % n, (r - 1) % n
    pieces = _pieces(flat.numel(), piece_numel(flat.numel(), flat.element_size()))
    if position == 0:
        wait_all([peers.isend(flat[a:b], right) for a, b in pieces])
        return
    recvs = [peers.irecv(flat[a:b], left) for a, b in pieces]
    sends = []
    for (a, b), work in zip(pieces, recvs, strict=True):
        work.wait()
        if position < n - 1:
            sends.append(peers.isend(flat[a:b], right))
    wait_all(sends)


def chain_reduce(peers: Peers, flat: torch.Tensor, op: str, root: int) -> None:
    """root-1 → root-2 → … → root: each rank adds its part to the running result and passes it
    on. Only the root's `flat` is written; the others accumulate in scratch."""
    n, r = peers.size, peers.rank
    position = (r - root) % n
    toward_root, upstream = (r - 1) % n, (r + 1) % n
    pieces = _pieces(flat.numel(), piece_numel(flat.numel(), flat.element_size()))
    if position == n - 1:  # the far end of the chain starts with its own data
        wait_all([peers.isend(flat[a:b], toward_root) for a, b in pieces])
        return
    incoming = peers.scratch("chain", flat.numel(), flat.dtype, flat.device)
    recvs = [peers.irecv(incoming[a:b], upstream) for a, b in pieces]
    sends = []
    for (a, b), work in zip(pieces, recvs, strict=True):
        work.wait()
        if position == 0:
            reduce_into(op, flat[a:b], incoming[a:b])
        else:
            reduce_into(op, incoming[a:b], flat[a:b])
            sends.append(peers.isend(incoming[a:b], toward_root))
    wait_all(sends)
    if position == 0:
        finish_avg(op, flat, n)
