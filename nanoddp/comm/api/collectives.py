"""The four everyday collectives: all_reduce, all_gather, all_gather_into_tensor, reduce_scatter_tensor.

Why it exists: these are what DDP, ZeRO and FSDP call every step, with torch.distributed's
signatures and results, built from point-to-point send/recv only. Each is the same three steps:

1. **check** the arguments (`nanoddp.comm.protocol.checks`). A call that fails on one rank only still
   takes part in the header round, carrying its error, so every rank raises that error word for
   word (with `async_op=True`, from `wait()`), and the group stays usable.
2. **plan** the path from the message size, group size and backend (`nanoddp.comm.plan.plan`): data in
   the header round's frames (one round; the check costs nothing extra), or the header round and
   then a bulk algorithm: the pipelined ring (`ring.py`), at 2 gloo ranks one exchange of whole
   tensors (`exchange.py`), or from 5 gloo ranks, where the α–β model (`cost_model.py`) says the
   ring's 2(n-1) steps cost more, recursive halving and doubling (`halving_doubling.py`).
3. **run** it. Every path starts with the header round (`nanoddp.comm.protocol.header_round`): each rank's
   header (collective, numel, dtype, op, root) reaches a place where all are checked, so
   mismatched calls raise the same ValueError on every rank instead of hanging. Where `plan`
   answers `Path.PAIR`, the round a training loop repeats most runs from views and header rows
   made once per call signature (`nanoddp.comm.protocol.cached_rounds`, an optional layer over the same
   wire); everything else runs the general round.

Precision. fp16/bf16 sums are computed in fp32 one addition at a time and rounded after each
ring step, as gloo does; the one-round path accumulates in fp32 and rounds once, in rank order in
one place (`nanoddp.comm.algorithms.reduce`), so every rank gets bitwise the same result. AVG is allowed on
floating-point tensors only (gloo rejects it for ints too).

Threading model. Each process group has one worker thread that runs that group's collectives
one at a time in submission (FIFO) order (`nanoddp.comm.transport.runner`). Because every rank issues
collectives in the same order, FIFO execution keeps their messages matched. A blocking call runs
inline on the calling thread when nothing is queued for the group, else it queues behind the
pending work and waits. `async_op=True` queues the work and returns a `Work` at once; the bulk
phase then makes progress in the background (torch ops and gloo waits release the GIL), so a DDP
engine can launch bucket all-reduces from autograd hooks and overlap them with backward.
Submitting is thread-safe. Do not touch a tensor until its `Work.wait()` returns.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from nanoddp.comm.algorithms import halving_doubling
from nanoddp.comm.algorithms.exchange import start_exchange_reduce
from nanoddp.comm.algorithms.message_pieces import balanced_bounds
from nanoddp.comm.algorithms.reduce import reduce_in_rank_order
from nanoddp.comm.algorithms.ring import start_reduce_scatter_ring, start_ring
from nanoddp.comm.plan.plan import Path, plan
from nanoddp.comm.protocol import cached_rounds, header_round, wire
from nanoddp.comm.protocol.cached_rounds import header_then
from nanoddp.comm.protocol.checks import (
    Op,
    Prepared,
    check,
    check_list,
    flat,
    header,
    land,
    nbytes,
    op_name,
    submit,
    write_back,
)
from nanoddp.comm.protocol.header_round import others_for, unpack
from nanoddp.comm.transport.collectives_only import or_torch_on_collectives_only
from nanoddp.comm.transport.runner import Work, runner_for
from nanoddp.comm.transport.transport import Peers

# --- all_reduce -----------------------------------------------------------------------------------


@or_torch_on_collectives_only("all_reduce")
def all_reduce(
    tensor: torch.Tensor,
    op: Op = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce `tensor` over the group; every rank ends with the result, in place."""
    runner = runner_for(group, "all_reduce")
    if runner is None:
        return None

    def prepare() -> Prepared:
        check(tensor, "tensor")
        name = op_name(op, tensor)
        return tensor.numel(), lambda: _all_reduce(runner.peers, tensor, name), [tensor]

    return submit(runner, "all_reduce", "all_reduce", prepare, async_op)


def _all_reduce(peers: Peers, tensor: torch.Tensor, op: str) -> None:
    data, head, device = flat(tensor), header("all_reduce", tensor, op), tensor.device
    path = plan("all_reduce", nbytes(tensor), peers.size, peers.backend, cpu=tensor.is_cpu)
    if path is Path.LOCAL:
        return
    if path is Path.PAIR:
        cached_rounds.all_reduce(peers, head, data, op)
    elif path is Path.HEADER_ONLY:
        header_then(peers, head, device, None)
    elif path is Path.EXCHANGE:
        header_then(peers, head, device, start_exchange_reduce(peers, data, op))
    elif path is Path.RING:
        chunks = [data[a:b] for a, b in balanced_bounds(data.numel(), peers.size)]
        header_then(peers, head, device, start_ring(peers, chunks, op, peers.size - 1, peers.size - 1, shift=0))
    elif path is Path.HALVING_DOUBLING:
        bounds = balanced_bounds(data.numel(), peers.size)
        header_then(peers, head, device, halving_doubling.start_all_reduce(peers, data, bounds, op))
    else:  # IN_FRAMES: every rank's data reduced in rank order: bitwise the same everywhere

        def combine(pick, p: int) -> torch.Tensor:
            reduce_in_rank_order(op, [pick(q).view(tensor.dtype) for q in range(peers.size)], data)
            return data

        land(data, header_round.one_round(peers, head, device, lambda p: data, combine=combine, same_for_all=True))
    write_back(tensor, data)


# --- all_gather -----------------------------------------------------------------------------------


@or_torch_on_collectives_only("all_gather")
def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Every rank's `tensor`, in group-rank order, into every rank's `tensor_list`."""
    runner = runner_for(group, "all_gather")
    if runner is None:
        return None

    def prepare() -> Prepared:
        check(tensor, "tensor")
        check_list(tensor_list, runner.peers.size, "tensor_list", tensor)
        outputs = list(tensor_list)

        def body() -> None:
            flats = [flat(t) for t in outputs]
            _all_gather(runner.peers, flats, tensor, None)
            for out, f in zip(outputs, flats, strict=True):
                write_back(out, f)

        return tensor.numel(), body, outputs

    return submit(runner, "all_gather", "all_gather", prepare, async_op)


@or_torch_on_collectives_only("all_gather_single")
def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Every rank's `input_tensor`, concatenated along dim 0 in group-rank order, into `output_tensor`."""
    runner = runner_for(group, "all_gather_single")
    if runner is None:
        return None

    def prepare() -> Prepared:
        check(input_tensor, "input_tensor")
        n, m = runner.peers.size, input_tensor.numel()
        check(output_tensor, "output_tensor", input_tensor, n * m, f" (group size {n} x input numel {m})")

        def body() -> None:
            out = flat(output_tensor)
            _all_gather(runner.peers, [out[p * m : (p + 1) * m] for p in range(n)], input_tensor, out)
            write_back(output_tensor, out)

        return m, body, [output_tensor]

    return submit(runner, "all_gather", "all_gather_into_tensor", prepare, async_op)


def _all_gather(peers: Peers, outputs: list[torch.Tensor], tensor: torch.Tensor, whole: torch.Tensor | None) -> None:
    """outputs: one 1-D contiguous tensor per group rank; `whole`: the outputs as one 1-D tensor,
    where they are (None: they are separate tensors)."""
    n, me, device = peers.size, peers.rank, tensor.device
    data, head = flat(tensor), header("all_gather", tensor)
    path = plan("all_gather", nbytes(tensor), n, peers.backend, cpu=tensor.is_cpu)
    if path is Path.PAIR:
        cached_rounds.all_gather(peers, head, outputs, data)
        return
    outputs[me].copy_(data)
    if path is Path.HEADER_ONLY:
        header_then(peers, head, device, None)
    elif path is Path.RING:
        header_then(peers, head, device, start_ring(peers, outputs, None, 0, n - 1, shift=0))
    elif path is Path.IN_FRAMES:
        result = header_round.one_round(peers, head, device, lambda p: data, combine=others_for(n))
        unpack(result, [outputs[q] for q in range(n) if q != me])
    elif path is Path.HALVING_DOUBLING:  # doubling sends whole ranges of blocks: one buffer
        m = data.numel()
        buf = whole if whole is not None else peers.scratch("halving_gather", n * m, data.dtype, device)
        buf[me * m : (me + 1) * m].copy_(data)
        header_then(peers, head, device, halving_doubling.start_all_gather(peers, buf, m))
        if whole is None:
            for q in range(n):
                outputs[q].copy_(buf[q * m : (q + 1) * m])


# --- reduce_scatter -------------------------------------------------------------------------------


@or_torch_on_collectives_only("reduce_scatter_single")
def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Op = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce `input` (n equal chunks along dim 0) over the group; group rank i gets chunk i."""
    runner = runner_for(group, "reduce_scatter_single")
    if runner is None:
        return None

    def prepare() -> Prepared:
        check(output, "output")
        name = op_name(op, output)
        n = runner.peers.size
        check(input, "input", output, n * output.numel(), f" (group size {n} x output numel {output.numel()})")
        return input.numel(), lambda: _reduce_scatter(runner.peers, output, input, name), [output]

    return submit(runner, "reduce_scatter", "reduce_scatter_tensor", prepare, async_op)


@or_torch_on_collectives_only("reduce_scatter")
def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: Op = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce `input_list[i]` over the group into group rank i's `output` (the list form of
    `reduce_scatter_tensor`; the inputs are packed into one scratch buffer, never modified)."""
    runner = runner_for(group, "reduce_scatter")
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

    return submit(runner, "reduce_scatter", "reduce_scatter", prepare, async_op)


def _reduce_scatter(peers: Peers, output: torch.Tensor, input: torch.Tensor, op: str) -> None:
    n, me, m, device = peers.size, peers.rank, output.numel(), output.device
    in_flat, out_flat, head = flat(input), flat(output), header("reduce_scatter", output, op)
    path = plan("reduce_scatter", nbytes(output), n, peers.backend, cpu=output.is_cpu)
    if path is Path.HEADER_ONLY:
        header_then(peers, head, device, None)
        return
    if path is Path.LOCAL:
        reduce_in_rank_order(op, [in_flat], out_flat)
    elif path is Path.IN_FRAMES:
        share = nbytes(output)

        def combine(pick, p: int) -> torch.Tensor:  # chunk p of every rank's input, reduced in rank order
            out = out_flat if p == me else torch.empty_like(out_flat)  # the star's hub reduces for all
            reduce_in_rank_order(op, [pick(q).view(output.dtype) for q in range(n)], out)
            return out

        result = header_round.one_round(
            peers,
            head,
            device,
            lambda p: in_flat if p is None else in_flat[p * m : (p + 1) * m],
            select=lambda whole, p: wire.as_bytes(whole)[p * share : (p + 1) * share],
            combine=combine,
        )
        land(out_flat, result)
    elif path is Path.HALVING_DOUBLING:
        work = peers.scratch("reduce_scatter", n * m, output.dtype, device)
        work.copy_(in_flat)  # reduce in a scratch copy: the caller's input must survive
        header_then(peers, head, device, halving_doubling.start_reduce_scatter(peers, work, m, op))
        out_flat.copy_(work[me * m : (me + 1) * m])
    elif peers.gloo and not _overlap(in_flat, out_flat):  # RING, reading the input in place
        header_then(peers, head, device, start_reduce_scatter_ring(peers, list(in_flat.view(n, m)), op, out_flat))
    else:  # RING on nccl, or over an input the output overlaps: reduce in a copy
        work = peers.scratch("reduce_scatter", n * m, output.dtype, device).view(n, m)
        work.copy_(in_flat.view(n, m))  # reduce in a scratch copy: the caller's input must survive
        header_then(peers, head, device, start_ring(peers, list(work), op, n - 1, 0, shift=-1))
        out_flat.copy_(work[me])
    write_back(output, out_flat)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two 1-D contiguous tensors share any byte of memory."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


# torch 2.13's names for the same two calls (it deprecates the `*_tensor` ones in their favour).
all_gather_single = all_gather_into_tensor
reduce_scatter_single = reduce_scatter_tensor
