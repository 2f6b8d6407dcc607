"""Collectives built from scratch on point-to-point send/recv, with torch.distributed's API.

`all_reduce`, `reduce`, `broadcast`, `all_gather`, `all_gather_into_tensor`,
`reduce_scatter_tensor` (also under torch 2.13's names `all_gather_single`, `reduce_scatter_single`),
`scatter` and `gather` take the same arguments as their
`torch.distributed` namesakes (src/dst are *global* ranks, `group` may be a subgroup) and give
the same results, but every byte moves through `isend`/`irecv` (see `nanoddp.comm.ring`).
So do `reduce_scatter` (list form, here), `all_to_all_single`, `all_to_all`, `barrier`,
`monitored_barrier`, `batch_isend_irecv` (`nanoddp.comm.alltoall`) and the object collectives
(`nanoddp.comm.objects`; pickles: trusted ranks only).

Algorithms. Every collective opens with the header round (`nanoddp.comm.frames`): each rank's
header (collective, numel, dtype, op, root) reaches a place where all of them are checked — one
exchange between 2 ranks, a star through group rank 0 for more — so mismatched calls raise the
same ValueError on every rank instead of hanging. A call that fails its own argument checks on
one rank only (an int tensor with AVG, a bad root, a wrong output size) takes part in that round
too, carrying its error message, so every rank raises that rank's error word for word
(`nanoddp.comm.checks`); with `async_op=True` it is raised by `wait()`. Small messages ride inside
the round's frames, so they cost that one round and nothing more (all_reduce: the contributions
are reduced in rank order in one place — each rank at 2 ranks, rank 0 in the star — so every rank
gets bitwise the same result); the rounds a loop repeats (2 gloo ranks; broadcast on 3+) run from
views and header rows prepared once per call signature (`nanoddp.comm.prepared`), and a repeat of
such a call (same arguments but the tensors' values) goes from the public function straight to
its round, past the argument checks and path choice it passed before. Larger ones then
run a pipelined ring (all_reduce = reduce-scatter + all-gather; all_gather; reduce_scatter), a
pipelined chain (broadcast, reduce; broadcast on 3+ ranks up to 8 MB goes straight from the root)
or direct sends (scatter, gather).

The switch point (`frames.rides_in_frames`): on gloo, a payload rides in the frames while what
one rank sends in that round stays within `INLINE_SEND_BYTES`, and an all_gather's or a
broadcast's share stays under `BULK_FROM_BYTES` (their bulk paths receive in place, where frames
copy in and out). Below it the single round wins because on a CPU host a round trip costs far
more than its bytes, and the ring needs 2(ws-1) of them plus the header round; above it the
ring's smaller per-rank volume, 2(ws-1)/ws x payload, and its pipelining win. The limit was chosen
by measuring both side by side (docs/performance.md, "Collectives: where the thresholds come
from"). On nccl frames travel whole (exact sizes), so there the limit stays at `INLINE_MAX_BYTES`.

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

from nanoddp.comm import frames, prepared, ring
from nanoddp.comm.checks import Prepared, check, check_list, fits, flat, header, land, nbytes, op_name
from nanoddp.comm.checks import submit as _submit
from nanoddp.comm.checks import write_back as _write_back
from nanoddp.comm.frames import others_for, unpack
from nanoddp.comm.ring import INLINE_MAX_BYTES, INLINE_SEND_BYTES, Peers
from nanoddp.comm.runner import Work, runner_for

logger = logging.getLogger(__name__)

__all__ = [
    "INLINE_MAX_BYTES", "INLINE_SEND_BYTES", "ReduceOp", "Work", "all_gather", "all_gather_into_tensor", "all_reduce",
    "broadcast", "gather", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
    "all_gather_single", "reduce_scatter_single",
    "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv", "monitored_barrier",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
]  # fmt: skip

_flat, _nbytes, _header = flat, nbytes, header


# --- the collectives ----------------------------------------------------------------------------


def _nothing() -> None:
    """The bulk phase of an empty message."""


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
    key = prepared.call_key("all_reduce", op, tensor)
    if again := prepared.repeat_of(runner.peers, key):
        return runner.submit("all_reduce", tensor.numel(), lambda: again(_flat(tensor)), [tensor], async_op)

    def prepare() -> Prepared:
        check(tensor, "tensor")
        name = op_name(op, tensor)
        return tensor.numel(), lambda: _all_reduce(runner.peers, tensor, name, key), [tensor]

    return _submit(runner, "all_reduce", "all_reduce", prepare, async_op)


def _pair_all_reduce(pair: prepared.PairRound, op: str, rank: int):
    """all_reduce of a 1-D tensor at 2 ranks through `pair`: swap, then reduce in rank order (so
    both ranks compute bitwise the same result)."""

    def run(flat: torch.Tensor) -> None:
        pair.outgoing.copy_(flat)
        received = pair.run()
        ring.reduce_in_rank_order(op, [flat, received] if rank == 0 else [received, flat], flat)

    return run


def _all_reduce(peers: Peers, tensor: torch.Tensor, op: str, key: tuple | None) -> None:
    n = peers.size
    if n == 1:
        return
    flat, header = _flat(tensor), _header("all_reduce", tensor, op)
    if tensor.numel() == 0 or not fits(peers, "all_reduce", tensor):
        if not tensor.numel():
            run = _nothing
        elif ring.reduces_by_exchange(_nbytes(flat), n, peers.gloo):
            run = ring.start_exchange_reduce(peers, flat, op)
        else:
            chunks = [flat[a:b] for a, b in ring.balanced_bounds(flat.numel(), n)]
            run = ring.start_ring(peers, chunks, op, n - 1, n - 1, shift=0)
        prepared.header_round(peers, header, tensor.device)
        run()
        _write_back(tensor, flat)
        return

    if pair := prepared.pair_round(peers, header, flat.dtype, flat.device, flat.numel(), flat.numel()):
        run = _pair_all_reduce(pair, op, peers.rank)
        prepared.remember(peers, key, run)
        run(flat)
        _write_back(tensor, flat)
        return

    def combine(pick, p: int) -> torch.Tensor:  # every rank's data, reduced in rank order: bitwise the same everywhere
        ring.reduce_in_rank_order(op, [pick(q).view(tensor.dtype) for q in range(n)], flat)
        return flat

    result = frames.one_round(peers, header, tensor.device, lambda p: flat, combine=combine, same_for_all=True)
    land(flat, result)
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
            _all_gather(runner.peers, flats, tensor, None)
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
    key = prepared.call_key("all_gather_into_tensor", None, output_tensor, input_tensor)
    if again := prepared.repeat_of(runner.peers, key):
        m = input_tensor.numel()

        def repeat() -> None:
            out = _flat(output_tensor)  # (2m,): a view, the key holds contiguous tensors only
            again([out[:m], out[m:]], _flat(input_tensor))

        return runner.submit("all_gather_into_tensor", m, repeat, [output_tensor], async_op)

    def prepare() -> Prepared:
        check(input_tensor, "input_tensor")
        n, m = runner.peers.size, input_tensor.numel()
        check(output_tensor, "output_tensor", input_tensor, n * m, f" (group size {n} x input numel {m})")

        def body() -> None:
            out = _flat(output_tensor)
            _all_gather(runner.peers, [out[p * m : (p + 1) * m] for p in range(n)], input_tensor, key)
            _write_back(output_tensor, out)

        return m, body, [output_tensor]

    return _submit(runner, "all_gather", "all_gather_into_tensor", prepare, async_op)


def _pair_all_gather(pair: prepared.PairRound, rank: int):
    """all_gather at 2 ranks through `pair`: `outputs` (two 1-D views) get `flat` and the peer's."""

    def run(outputs: list[torch.Tensor], flat: torch.Tensor) -> None:
        outputs[rank].copy_(flat)
        pair.outgoing.copy_(flat)
        outputs[1 - rank].copy_(pair.run())

    return run


def _all_gather(peers: Peers, outputs: list[torch.Tensor], tensor: torch.Tensor, key: tuple | None) -> None:
    """outputs: one 1-D contiguous tensor per group rank; `key`: the call to remember (None: none)."""
    n, me = peers.size, peers.rank
    flat, header = _flat(tensor), _header("all_gather", tensor)
    if tensor.numel() == 0 or n == 1 or not fits(peers, "all_gather", tensor):
        outputs[me].copy_(flat)
        run = ring.start_ring(peers, outputs, None, 0, n - 1, shift=0) if tensor.numel() else _nothing
        prepared.header_round(peers, header, tensor.device)
        run()
        return
    if pair := prepared.pair_round(peers, header, flat.dtype, flat.device, flat.numel(), flat.numel()):
        run = _pair_all_gather(pair, me)
        prepared.remember(peers, key, run)
        run(outputs, flat)
        return
    outputs[me].copy_(flat)
    result = frames.one_round(peers, header, tensor.device, lambda p: flat, combine=others_for(n))
    unpack(result, [outputs[q] for q in range(n) if q != me])


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
    in_flat, out_flat, header = _flat(input), _flat(output), _header("reduce_scatter", output, op)
    if m and (n == 1 or fits(peers, "reduce_scatter", output)):
        share = m * output.element_size()

        def combine(pick, p: int) -> torch.Tensor:  # chunk p of every rank's input, reduced in rank order
            out = out_flat if p == me else torch.empty_like(out_flat)  # the star's hub reduces for all
            ring.reduce_in_rank_order(op, [pick(q).view(output.dtype) for q in range(n)], out)
            return out

        result = frames.one_round(
            peers,
            header,
            output.device,
            lambda p: in_flat if p is None else in_flat[p * m : (p + 1) * m],
            select=lambda whole, p: frames.as_bytes(whole)[p * share : (p + 1) * share],
            combine=combine,
        )
        land(out_flat, result)
        _write_back(output, out_flat)
        return
    if m == 0:
        prepared.header_round(peers, header, output.device)
        return
    work = peers.scratch("reduce_scatter", n * m, output.dtype, output.device).view(n, m)
    work.copy_(in_flat.view(n, m))  # reduce in a scratch copy: the caller's input must survive
    run = ring.start_ring(peers, list(work), op, n - 1, 0, shift=-1)  # sends its first piece now
    prepared.header_round(peers, header, output.device)
    run()
    out_flat.copy_(work[me])
    _write_back(output, out_flat)


# torch 2.13's names for the same two calls (it deprecates the `*_tensor` ones in their favour).
all_gather_single = all_gather_into_tensor
reduce_scatter_single = reduce_scatter_tensor


# The rooted collectives and the rest of torch.distributed's surface, built the same way or on
# the above (kept in their own modules; imported last because some use this module's collectives).
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
from nanoddp.comm.rooted import broadcast, gather, reduce, scatter  # noqa: E402
