"""Collectives built from scratch on point-to-point send/recv, with torch.distributed's API.

`all_reduce`, `reduce`, `broadcast`, `all_gather`, `all_gather_into_tensor`,
`reduce_scatter_tensor`, `scatter` and `gather` take the same arguments as their
`torch.distributed` namesakes (src/dst are *global* ranks, `group` may be a subgroup) and give
the same results, but every byte moves through `isend`/`irecv` (see `nanoddp.comm.ring`).
So do `reduce_scatter` (list form, here), `all_to_all_single`, `all_to_all`, `barrier`,
`monitored_barrier`, `batch_isend_irecv` (`nanoddp.comm.alltoall`) and the object collectives
(`nanoddp.comm.objects`; pickles: trusted ranks only).

Algorithms. Every collective opens with one round of *frames* between all pairs: a header
(collective, numel, dtype, op, root) so mismatched calls raise the same ValueError on every
rank instead of hanging. A call that fails its own argument checks on one rank only (an int
tensor with AVG, a bad root, a wrong output size) takes part in that round too, carrying its
error message, so every rank raises that rank's error word for word (`nanoddp.comm.checks`);
with `async_op=True` it is raised by `wait()`. Small messages ride inside that frame, so they cost exactly one round
(all_reduce: every rank reduces all contributions in rank order — bitwise identical
everywhere). Larger ones then run a pipelined ring (all_reduce = reduce-scatter + all-gather;
all_gather; reduce_scatter), a pipelined chain (broadcast, reduce) or direct sends (scatter,
gather).

The switch point (`ring.inline_limit`): on gloo, a payload rides in the frame while what one
rank sends in that round, (ws-1) x payload, stays within `INLINE_SEND_BYTES`. Below it the
single round wins because on a CPU host a round trip costs far more than its bytes, and the ring
needs 2(ws-1) of them plus the header round; above it the ring's smaller per-rank volume,
2(ws-1)/ws x payload, and its pipelining win. The limit was chosen by measuring both side by side
(docs/performance.md, "Collectives: where the thresholds come from"). On nccl frames travel whole
(exact sizes), so there the limit stays at `INLINE_MAX_BYTES`.

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

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from nanoddp.comm import ring
from nanoddp.comm.checks import Prepared, check, check_list, flat, group_root, header, list_on_root, nbytes, op_name
from nanoddp.comm.checks import submit as _submit
from nanoddp.comm.checks import write_back as _write_back
from nanoddp.comm.ring import INLINE_MAX_BYTES, INLINE_SEND_BYTES, Peers
from nanoddp.comm.runner import Work, runner_for

logger = logging.getLogger(__name__)

__all__ = [
    "INLINE_MAX_BYTES", "INLINE_SEND_BYTES", "ReduceOp", "Work", "all_gather", "all_gather_into_tensor", "all_reduce",
    "broadcast", "gather", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
    "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv", "monitored_barrier",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
]  # fmt: skip

_flat, _nbytes, _header = flat, nbytes, header


# --- the collectives ----------------------------------------------------------------------------


def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOp = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce `tensor` over the group; every rank ends with the result, in place."""
    runner = runner_for(group)
    if runner is None:
        return None

    def prepare() -> Prepared:
        check(tensor, "tensor")
        name = op_name(op, tensor)
        return tensor.numel(), lambda: _all_reduce(runner.peers, tensor, name), [tensor]

    return _submit(runner, "all_reduce", "all_reduce", prepare, async_op)


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
    runner = runner_for(group)
    if runner is None:
        return None

    def prepare() -> Prepared:
        check(tensor, "tensor")
        name = op_name(op, tensor)
        root = group_root(runner.peers, dst, "dst")
        return tensor.numel(), lambda: _reduce(runner.peers, tensor, name, root), [tensor]

    return _submit(runner, "reduce", "reduce", prepare, async_op)


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
    runner = runner_for(group)
    if runner is None:
        return None

    def prepare() -> Prepared:
        check(tensor, "tensor")
        root = group_root(runner.peers, src, "src")
        return tensor.numel(), lambda: _broadcast(runner.peers, tensor, root), [tensor]

    return _submit(runner, "broadcast", "broadcast", prepare, async_op)


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
    runner = runner_for(group)
    if runner is None:
        return None

    def prepare() -> Prepared:
        check(tensor, "tensor")
        check_list(tensor_list, runner.peers.size, "tensor_list", tensor)
        outputs = list(tensor_list)

        def body() -> None:
            flats = [_flat(t) for t in outputs]
            _all_gather(runner.peers, flats, tensor)
            for out, f in zip(outputs, flats, strict=True):
                _write_back(out, f)

        return tensor.numel(), body, outputs

    return _submit(runner, "all_gather", "all_gather", prepare, async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Every rank's `input_tensor`, concatenated along dim 0 in group-rank order, into `output_tensor`."""
    runner = runner_for(group)
    if runner is None:
        return None

    def prepare() -> Prepared:
        check(input_tensor, "input_tensor")
        n, m = runner.peers.size, input_tensor.numel()
        check(output_tensor, "output_tensor", input_tensor, n * m, f" (group size {n} x input numel {m})")

        def body() -> None:
            out = _flat(output_tensor)
            _all_gather(runner.peers, [out[p * m : (p + 1) * m] for p in range(n)], input_tensor)
            _write_back(output_tensor, out)

        return m, body, [output_tensor]

    return _submit(runner, "all_gather", "all_gather_into_tensor", prepare, async_op)


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
    runner = runner_for(group)
    if runner is None:
        return None

    def prepare() -> Prepared:
        check(output, "output")
        name = op_name(op, output)
        n = runner.peers.size
        check(input, "input", output, n * output.numel(), f" (group size {n} x output numel {output.numel()})")
        return input.numel(), lambda: _reduce_scatter(runner.peers, output, input, name), [output]

    return _submit(runner, "reduce_scatter", "reduce_scatter_tensor", prepare, async_op)


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: ReduceOp = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce `input_list[i]` over the group into group rank i's `output` (the list form of
    `reduce_scatter_tensor`; the inputs are packed into one scratch buffer, never modified)."""
    runner = runner_for(group)
    if runner is None:
        return None

    def prepare() -> Prepared:
        check(output, "output")
        name = op_name(op, output)
        check_list(input_list, runner.peers.size, "input_list", output)
        inputs = list(input_list)

        def body() -> None:
            m = output.numel()
            packed = runner.peers.scratch("reduce_scatter_list", len(inputs) * m, output.dtype, output.device)
            for i, t in enumerate(inputs):  # (n * m,): input i at [i*m, (i+1)*m)
                packed[i * m : (i + 1) * m].view(t.shape).copy_(t)
            _reduce_scatter(runner.peers, output, packed, name)

        return output.numel() * runner.peers.size, body, [output]

    return _submit(runner, "reduce_scatter", "reduce_scatter", prepare, async_op)


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
    runner = runner_for(group)
    if runner is None:
        return None

    def prepare() -> Prepared:
        check(tensor, "tensor")
        root = group_root(runner.peers, src, "src")
        sources = list_on_root(runner.peers, root, scatter_list, "scatter_list", tensor)
        return tensor.numel(), lambda: _scatter(runner.peers, tensor, sources, root), [tensor]

    return _submit(runner, "scatter", "scatter", prepare, async_op)


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
    runner = runner_for(group)
    if runner is None:
        return None

    def prepare() -> Prepared:
        check(tensor, "tensor")
        root = group_root(runner.peers, dst, "dst")
        targets = list_on_root(runner.peers, root, gather_list, "gather_list", tensor)
        return tensor.numel(), lambda: _gather(runner.peers, tensor, targets, root), targets or []

    return _submit(runner, "gather", "gather", prepare, async_op)


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


# The rest of torch.distributed's surface, built on the above and on point-to-point (kept in
# their own modules; imported last because they use this module's collectives).
from nanoddp.comm.alltoall import (  # noqa: E402
    all_to_all,
    all_to_all_single,
    barrier,
    batch_isend_irecv,
    monitored_barrier,
)
from nanoddp.comm.objects import (  # noqa: E402
    all_gather_object,
    broadcast_object_list,
    gather_object,
    scatter_object_list,
)
