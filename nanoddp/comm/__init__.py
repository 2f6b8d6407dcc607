"""Collectives built from scratch on point-to-point send/recv, with torch.distributed's API.

`all_reduce`, `reduce`, `broadcast`, `all_gather`, `all_gather_into_tensor`,
`reduce_scatter_tensor`, `scatter` and `gather` take the same arguments as their
`torch.distributed` namesakes (src/dst are *global* ranks, `group` may be a subgroup) and give
the same results, but every byte moves through `isend`/`irecv` (see `nanoddp.comm.ring`).

Algorithms. Every collective opens with one round of *frames* between all pairs: a header
(collective, numel, dtype, op, root) so mismatched calls raise the same ValueError on every
rank instead of hanging. Small messages ride inside that frame, so they cost exactly one round
(all_reduce: every rank reduces all contributions in rank order — bitwise identical
everywhere). Larger ones then run a pipelined ring (all_reduce = reduce-scatter + all-gather;
all_gather; reduce_scatter), a pipelined chain (broadcast, reduce) or direct sends (scatter,
gather).

The switch point (`ring.inline_limit`): on gloo, a payload rides in the frame while what one
rank sends in that round, (ws-1) x payload, stays within 3 MB — 3 MB at ws 2, 1 MB at ws 4.
Below it the single round wins because a round costs far more than its bytes on a loaded CPU
host (a 2-core host: ~0.3-1 ms per round trip, while the ring needs 2(ws-1) of them plus the
header round); above it the ring's smaller per-rank volume, 2(ws-1)/ws x payload, and its
pipelining win (measured side by side with `nanoddp bench collectives` and a one-round-only
variant: at ws 2 one round beat the ring 1.3-2x up to 1 MB and tied at 4 MB; at ws 4 it won up
to 1 MB and lost 2-3x at 4 MB). On nccl frames travel whole (exact sizes), so there the limit
stays at 64 KB (`INLINE_MAX_BYTES`).

Precision. fp16/bf16 sums are computed in fp32 one addition at a time and rounded after each
ring step, as gloo does; the one-round path accumulates in fp32 and rounds once. AVG is
allowed on floating-point tensors only (gloo rejects it for ints too).

Threading model. Each process group has one worker thread that runs that group's collectives
one at a time in submission (FIFO) order. Because every rank issues collectives in the same
order, FIFO execution keeps their messages matched. A blocking call runs inline on the calling
thread when nothing is queued for the group (no hand-off latency), else it queues behind the
pending work and waits. `async_op=True` queues the work and returns a `Work` at once; the ring
then makes progress in the background (torch ops and gloo waits release the GIL), so a DDP
engine can launch bucket all-reduces from autograd hooks and overlap them with backward.
Submitting is thread-safe. Do not touch a tensor until its `Work.wait()` returns.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from nanoddp.comm import ring
from nanoddp.comm.ring import INLINE_MAX_BYTES, INLINE_SEND_BYTES, Peers
from nanoddp.comm.runner import Work, runner_for

logger = logging.getLogger(__name__)

__all__ = [
    "INLINE_MAX_BYTES", "INLINE_SEND_BYTES", "ReduceOp", "Work", "all_gather", "all_gather_into_tensor", "all_reduce",
    "broadcast", "gather", "reduce", "reduce_scatter_tensor", "scatter",
]  # fmt: skip

_OP_NAMES = {
    ReduceOp.SUM: "SUM", ReduceOp.AVG: "AVG", ReduceOp.PRODUCT: "PRODUCT",
    ReduceOp.MIN: "MIN", ReduceOp.MAX: "MAX",
}  # fmt: skip
_KIND = {name: code for code, name in enumerate(ring.COLLECTIVES)}


# --- argument checks (these raise at once, on the calling rank) --------------------------------


def _op_name(op: ReduceOp, tensor: torch.Tensor) -> str:
    key = op if isinstance(op, ReduceOp.RedOpType) else getattr(op, "op", op)
    name = _OP_NAMES.get(key)
    if name is None:
        raise ValueError(f"op must be one of ReduceOp.{', ReduceOp.'.join(ring.OPS)}; got {op!r}")
    if name == "AVG" and not tensor.is_floating_point():
        raise ValueError(f"ReduceOp.AVG needs a floating-point tensor, got {tensor.dtype}; use SUM and divide")
    return name


def _check(tensor: torch.Tensor, what: str, like: torch.Tensor | None = None, numel: int | None = None,
           rule: str = "") -> None:  # fmt: skip
    """Type/dtype checks; with `like`, same dtype as `like` and `numel` elements (`rule` says why)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in ring.DTYPE_CODES:
        raise ValueError(f"{what} has unsupported dtype {tensor.dtype}; supported: {list(ring.DTYPES)}")
    if like is None:
        return
    numel = like.numel() if numel is None else numel
    if tensor.dtype != like.dtype or tensor.numel() != numel:
        raise ValueError(
            f"{what} must be {like.dtype} with {numel} elements{rule}, got {tensor.dtype} with {tensor.numel()}"
        )


def _check_list(tensors: Sequence[torch.Tensor] | None, n: int, what: str, like: torch.Tensor) -> None:
    if tensors is None or len(tensors) != n:
        got = "None" if tensors is None else f"{len(tensors)} tensors"
        raise ValueError(f"{what} must hold one tensor per group rank ({n}), got {got}")
    for i, t in enumerate(tensors):
        _check(t, f"{what}[{i}]", like, rule=" (like the input tensor)")


def _list_on_root(peers: Peers, root: int, tensors: Sequence[torch.Tensor] | None, what: str,
                  like: torch.Tensor) -> list[torch.Tensor] | None:  # fmt: skip
    """scatter/gather: `tensors` matters on the root only; check it there, ignore it elsewhere."""
    if peers.rank != root:
        return None
    _check_list(tensors, peers.size, what, like)
    return list(tensors)


def _root(peers: Peers, rank: int, what: str) -> int:
    """Translate a global src/dst rank into a group rank, or raise."""
    world = dist.get_world_size()
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"{what} must be a global rank in [0, {world}), got {rank!r}")
    if rank not in peers.global_ranks:
        raise ValueError(
            f"{what}={rank} is not a member of the group (global ranks {list(peers.global_ranks)}); "
            "src/dst are global ranks, as in torch.distributed"
        )
    return peers.global_ranks.index(rank)


def _header(kind: str, tensor: torch.Tensor, op: str | None = None, root: int = -1) -> list[int]:
    op_code = ring.OPS.index(op) if op is not None else -1
    return [_KIND[kind], tensor.numel(), ring.DTYPE_CODES[tensor.dtype], op_code, root]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous tensor with `tensor`'s values: a view when possible, else a copy."""
    return tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)


def _write_back(tensor: torch.Tensor, flat: torch.Tensor) -> None:
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))


# --- the collectives ----------------------------------------------------------------------------


def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOp = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce `tensor` over the group; every rank ends with the result, in place."""
    _check(tensor, "tensor")
    op_name = _op_name(op, tensor)
    runner = runner_for(group)
    if runner is None:
        return None
    return runner.submit(
        "all_reduce", tensor.numel(), lambda: _all_reduce(runner.peers, tensor, op_name), [tensor], async_op
    )


def _all_reduce(peers: Peers, tensor: torch.Tensor, op: str) -> None:
    n = peers.size
    if n == 1:
        return
    flat = _flat(tensor)
    inline = _nbytes(tensor) <= ring.inline_limit(peers)
    received = ring.exchange_frames(
        peers, _header("all_reduce", tensor, op), [flat if inline else None] * n, tensor.device
    )
    if tensor.numel() == 0:
        return
    if inline:  # one round: everyone already has everyone's data
        parts = [flat if p == peers.rank else received[p].view(tensor.dtype) for p in range(n)]
        ring.reduce_in_rank_order(op, parts, flat)
    else:
        chunks = [flat[a:b] for a, b in ring.balanced_bounds(flat.numel(), n)]
        ring.ring(peers, chunks, op, reduce_steps=n - 1, gather_steps=n - 1, shift=0)
    _write_back(tensor, flat)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: ReduceOp = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce `tensor` over the group into global rank `dst`'s tensor (others are left as they were)."""
    _check(tensor, "tensor")
    op_name = _op_name(op, tensor)
    runner = runner_for(group)
    if runner is None:
        return None
    root = _root(runner.peers, dst, "dst")
    return runner.submit(
        "reduce", tensor.numel(), lambda: _reduce(runner.peers, tensor, op_name, root), [tensor], async_op
    )


def _reduce(peers: Peers, tensor: torch.Tensor, op: str, root: int) -> None:
    n, me = peers.size, peers.rank
    flat = _flat(tensor)
    inline = _nbytes(tensor) <= ring.inline_limit(peers)
    payloads = [flat if inline and p == root else None for p in range(n)]
    received = ring.exchange_frames(peers, _header("reduce", tensor, op, root), payloads, tensor.device)
    if tensor.numel() == 0 or n == 1:
        return
    if not inline:
        ring.chain_reduce(peers, flat, op, root)
    elif me == root:
        parts = [flat if p == me else received[p].view(tensor.dtype) for p in range(n)]
        ring.reduce_in_rank_order(op, parts, flat)
    if me == root:
        _write_back(tensor, flat)


def broadcast(
    tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Copy global rank `src`'s tensor into every other rank's `tensor`."""
    _check(tensor, "tensor")
    runner = runner_for(group)
    if runner is None:
        return None
    root = _root(runner.peers, src, "src")
    return runner.submit(
        "broadcast", tensor.numel(), lambda: _broadcast(runner.peers, tensor, root), [tensor], async_op
    )


def _broadcast(peers: Peers, tensor: torch.Tensor, root: int) -> None:
    n, me = peers.size, peers.rank
    flat = _flat(tensor)
    inline = _nbytes(tensor) <= ring.inline_limit(peers)
    payloads = [flat if inline and me == root else None] * n
    received = ring.exchange_frames(peers, _header("broadcast", tensor, root=root), payloads, tensor.device)
    if tensor.numel() == 0 or n == 1 or (inline and me == root):
        return
    if inline:
        flat.copy_(received[root].view(tensor.dtype))
    else:
        ring.chain_broadcast(peers, flat, root)
    if me != root:
        _write_back(tensor, flat)


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Every rank's `tensor`, in group-rank order, into every rank's `tensor_list`."""
    _check(tensor, "tensor")
    runner = runner_for(group)
    if runner is None:
        return None
    _check_list(tensor_list, runner.peers.size, "tensor_list", tensor)
    outputs = list(tensor_list)

    def body() -> None:
        flats = [_flat(t) for t in outputs]
        _all_gather(runner.peers, flats, tensor)
        for out, flat in zip(outputs, flats, strict=True):
            _write_back(out, flat)

    return runner.submit("all_gather", tensor.numel(), body, outputs, async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Every rank's `input_tensor`, concatenated along dim 0 in group-rank order, into `output_tensor`."""
    _check(input_tensor, "input_tensor")
    runner = runner_for(group)
    if runner is None:
        return None
    n, m = runner.peers.size, input_tensor.numel()
    _check(output_tensor, "output_tensor", input_tensor, n * m, f" (group size {n} x input numel {m})")

    def body() -> None:
        flat = _flat(output_tensor)
        _all_gather(runner.peers, [flat[p * m : (p + 1) * m] for p in range(n)], input_tensor)
        _write_back(output_tensor, flat)

    return runner.submit("all_gather_into_tensor", input_tensor.numel(), body, [output_tensor], async_op)


def _all_gather(peers: Peers, outputs: list[torch.Tensor], tensor: torch.Tensor) -> None:
    """outputs: one 1-D contiguous tensor per group rank."""
    n, me = peers.size, peers.rank
    flat = _flat(tensor)
    inline = _nbytes(tensor) <= ring.inline_limit(peers)
    received = ring.exchange_frames(peers, _header("all_gather", tensor), [flat if inline else None] * n, tensor.device)
    outputs[me].copy_(flat)
    if tensor.numel() == 0:
        return
    if inline:
        for p in range(n):
            if p != me:
                outputs[p].copy_(received[p].view(tensor.dtype))
    else:
        ring.ring(peers, outputs, None, reduce_steps=0, gather_steps=n - 1, shift=0)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOp = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce `input` (n equal chunks along dim 0) over the group; group rank i gets chunk i."""
    _check(output, "output")
    op_name = _op_name(op, output)
    runner = runner_for(group)
    if runner is None:
        return None
    n = runner.peers.size
    _check(input, "input", output, n * output.numel(), f" (group size {n} x output numel {output.numel()})")
    return runner.submit(
        "reduce_scatter_tensor",
        input.numel(),
        lambda: _reduce_scatter(runner.peers, output, input, op_name),
        [output],
        async_op,
    )


def _reduce_scatter(peers: Peers, output: torch.Tensor, input: torch.Tensor, op: str) -> None:
    n, me, m = peers.size, peers.rank, output.numel()
    in_flat = _flat(input)
    chunks = [in_flat[p * m : (p + 1) * m] for p in range(n)]
    inline = n == 1 or _nbytes(output) <= ring.inline_limit(peers)
    payloads = chunks if inline else [None] * n
    received = ring.exchange_frames(peers, _header("reduce_scatter", output, op), payloads, output.device)
    if m == 0:
        return
    out_flat = _flat(output)
    if inline:
        parts = [chunks[p] if p == me else received[p].view(output.dtype) for p in range(n)]
        ring.reduce_in_rank_order(op, parts, out_flat)
    else:  # reduce in a scratch copy: the caller's input must survive
        work = peers.scratch("reduce_scatter", n * m, output.dtype, output.device).view(n, m)
        work.copy_(in_flat.view(n, m))
        ring.ring(peers, list(work), op, reduce_steps=n - 1, gather_steps=0, shift=-1)
        out_flat.copy_(work[me])
    _write_back(output, out_flat)


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Global rank `src` sends `scatter_list[i]` to group rank i's `tensor` (the list is read on src only)."""
    _check(tensor, "tensor")
    runner = runner_for(group)
    if runner is None:
        return None
    root = _root(runner.peers, src, "src")
    sources = _list_on_root(runner.peers, root, scatter_list, "scatter_list", tensor)
    return runner.submit(
        "scatter", tensor.numel(), lambda: _scatter(runner.peers, tensor, sources, root), [tensor], async_op
    )


def _scatter(peers: Peers, tensor: torch.Tensor, sources: list[torch.Tensor] | None, root: int) -> None:
    n, me = peers.size, peers.rank
    flat = _flat(tensor)
    inline = _nbytes(tensor) <= ring.inline_limit(peers)
    flats = [_flat(t) for t in sources] if sources is not None else [None] * n
    payloads = flats if inline else [None] * n
    received = ring.exchange_frames(peers, _header("scatter", tensor, root=root), payloads, tensor.device)
    if tensor.numel() == 0:
        return
    if me == root:
        if not inline:
            ring.wait_all([peers.isend(flats[p], p) for p in range(n) if p != me])
        flat.copy_(flats[me])
    elif inline:
        flat.copy_(received[root].view(tensor.dtype))
    else:
        peers.irecv(flat, root).wait()
    _write_back(tensor, flat)


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Every rank's `tensor` into global rank `dst`'s `gather_list` (the list is used on dst only)."""
    _check(tensor, "tensor")
    runner = runner_for(group)
    if runner is None:
        return None
    root = _root(runner.peers, dst, "dst")
    targets = _list_on_root(runner.peers, root, gather_list, "gather_list", tensor)
    return runner.submit(
        "gather", tensor.numel(), lambda: _gather(runner.peers, tensor, targets, root), targets or [], async_op
    )


def _gather(peers: Peers, tensor: torch.Tensor, targets: list[torch.Tensor] | None, root: int) -> None:
    n, me = peers.size, peers.rank
    flat = _flat(tensor)
    inline = _nbytes(tensor) <= ring.inline_limit(peers)
    payloads = [flat if inline and p == root else None for p in range(n)]
    received = ring.exchange_frames(peers, _header("gather", tensor, root=root), payloads, tensor.device)
    if me != root:
        if tensor.numel() and not inline:
            peers.isend(flat, root).wait()
        return
    flats = [_flat(t) for t in targets]
    flats[me].copy_(flat)
    if tensor.numel() and inline:
        for p in range(n):
            if p != me:
                flats[p].copy_(received[p].view(tensor.dtype))
    elif tensor.numel():
        ring.wait_all([peers.irecv(flats[p], p) for p in range(n) if p != me])
    for out, f in zip(targets, flats, strict=True):
        _write_back(out, f)
