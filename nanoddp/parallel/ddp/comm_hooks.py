"""Communication hooks: what a DDP bucket does to get reduced, with torch's hook contract.

A hook is `hook(state, bucket) -> torch.futures.Future[Tensor]`: it starts reducing
`bucket.buffer()` (a flat (N,) gradient tensor, summed locally) and returns a future whose
value is the *averaged* bucket. `state` is the process group to reduce over (None: the
engine's group, or the default group).

The same functions work on `nanoddp.DistributedDataParallel` (they then reduce with the engine's
`comm_backend`) and on `torch.nn.parallel.DistributedDataParallel` (with torch.distributed).

- `allreduce_hook`: what the engine does by default.
- `reduce_scatter_hook` (with its state, `CrossReplicaShards`): a fault-tolerant step's first
  half. Each rank keeps only its averaged shard of each bucket, for the step to sum across
  replica groups; `CrossReplicaShards.finish` then all-gathers the shards back into `.grad`.
- `fp16_compress_hook` / `bf16_compress_hook`: send half the bytes. The bucket is cast to 16
  bits, divided by the world size (in 16 bits, as torch's hooks do, so the sum cannot
  overflow fp16), all-reduced and cast back. Gradients then carry 16-bit rounding error;
  worth it when the network, not the compute, is the bottleneck. (torch DDP refuses any hook
  *named* bf16_compress_hook unless NCCL is available; nanoddp's engine has no such restriction.)

A sparse bucket (an Embedding built with sparse=True: nanoddp.parallel.ddp.sparse) holds the
sparse gradient itself; these hooks average it as a sparse tensor.

The annotations are real objects (no `from __future__ import annotations`): torch DDP checks
that a hook's `bucket` annotation is `dist.GradBucket` and its return annotation exactly
`torch.futures.Future[torch.Tensor]`, and so does `check_comm_hook` for nanoddp's.
"""

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from nanoddp.comm.api.backend import Collectives
from nanoddp.parallel.ddp.buckets import GradBucket
from nanoddp.parallel.ddp.gradient_average import divide_for_average
from nanoddp.parallel.ddp.sparse import sparse_all_reduce

__all__ = ["CrossReplicaShards", "allreduce_hook", "bf16_compress_hook", "fp16_compress_hook", "reduce_scatter_hook"]


def check_comm_hook(hook: Any) -> None:
    """Refuse a hook as torch DDP's `_check_comm_hook` does, with its error types and messages:
    not callable, a `bucket` annotated other than GradBucket, or a return annotated other than
    `torch.futures.Future[torch.Tensor]`. (torch also refuses hooks *named* bf16_compress_hook
    without NCCL: nanoddp reduces bfloat16 on any backend, so it does not. torch fails with a
    KeyError on a hook whose second parameter is not named `bucket`; nanoddp then checks that
    parameter's annotation instead.)"""
    if not callable(hook):
        raise TypeError("Communication hook must be callable.")
    signature = inspect.signature(hook)
    bucket = signature.parameters.get("bucket")
    if bucket is None and len(signature.parameters) >= 2:
        bucket = list(signature.parameters.values())[1]
    if bucket is not None and bucket.annotation not in (inspect.Parameter.empty, dist.GradBucket, GradBucket):
        raise ValueError("Communication hook: bucket annotation should be dist.GradBucket.")
    returns = signature.return_annotation
    if returns is not inspect.Signature.empty and returns != torch.futures.Future[torch.Tensor]:
        raise ValueError("Communication hook: return annotation should be torch.futures.Future[torch.Tensor].")


def _collectives_and_group(state: Any, bucket) -> tuple[Collectives, Any]:
    """Reduce with the engine's backend and group when the bucket is one of ours; a torch
    GradBucket has neither, so fall back to torch.distributed and the default group."""
    collectives = getattr(bucket, "_collectives", dist)
    group = state if state is not None else getattr(bucket, "_group", None)
    return collectives, group


def _future_when_done(work, on_done: Callable[[], torch.Tensor]) -> torch.futures.Future:
    """A Future that resolves to `on_done()` once `work` finishes (errors propagate)."""

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()  # re-raises the collective's error, if any
        return on_done()

    return work.get_future().then(finish)


def allreduce_hook(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over ranks: divide by the world size, then all-reduce (SUM) in place."""
    collectives, group = _collectives_and_group(process_group, bucket)
    tensor = bucket.buffer()  # (N,), or the sparse gradient of a sparse bucket
    divide_for_average(tensor, dist.get_world_size(group))
    if tensor.is_sparse:
        return sparse_all_reduce(tensor, collectives, group)
    work = collectives.all_reduce(tensor, group=group, async_op=True)
    return _future_when_done(work, lambda: tensor)


def _compress_hook(dtype: torch.dtype, process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future:
    collectives, group = _collectives_and_group(process_group, bucket)
    buffer = bucket.buffer()  # (N,) in the gradients' dtype
    compressed = divide_for_average(buffer.to(dtype), dist.get_world_size(group))  # (N,) 16-bit, on the wire
    if buffer.is_sparse:
        return sparse_all_reduce(compressed, collectives, group).then(lambda fut: fut.value().to(buffer.dtype))
    work = collectives.all_reduce(compressed, group=group, async_op=True)

    def decompress() -> torch.Tensor:
        buffer.copy_(compressed)
        return buffer

    return _future_when_done(work, decompress)


def fp16_compress_hook(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in float16: half the bytes on the wire, fp16 rounding in the result."""
    return _compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in bfloat16: fp32's range (no overflow risk), 8 bits of mantissa."""
    return _compress_hook(torch.bfloat16, process_group, bucket)


class CrossReplicaShards:
    """The state of `reduce_scatter_hook`: what a backward left for the cross-replica sum.

    Why split DDP's all-reduce: a fault-tolerant step averages over replica groups after the
    group's own average (`Engine.cross_replica_grads`). Summing only this rank's shard of each
    bucket across groups, then gathering within the group, moves the same bytes as one ring
    all-reduce over every rank, where summing whole buckets would send each group's full
    gradient across."""

    def __init__(self, group: Any = None) -> None:
        self.group = group  # the replica group's own (None: the default group)
        self.shards: dict[int, torch.Tensor] = {}  # bucket index -> this rank's averaged shard, (chunk,)
        self._gathers: dict[int, tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], Collectives]] = {}

    def clear(self) -> None:
        """Forget the last backward's shards. DDP rebuilds its buckets once, at its second forward:
        a layout's shards left from a step before (one that failed, say) would otherwise be summed
        and gathered with the new layout's, into gradients they no longer belong to."""
        self.shards.clear()
        self._gathers.clear()

    def finish(self) -> None:
        """All-gather every bucket's shard (summed across groups meanwhile) into its buffer, and
        the buffer into each parameter's `.grad` (a copy, unless the grad is the buffer's view)."""
        for index in sorted(self._gathers):
            buffer, params, views, collectives = self._gathers[index]
            shard = self.shards[index]
            whole = buffer.new_empty(shard.numel() * dist.get_world_size(self.group))
            collectives.all_gather_into_tensor(whole, shard, group=self.group)
            buffer.copy_(whole[: buffer.numel()])
            for param, view in zip(params, views, strict=True):
                if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
                    param.grad.copy_(view)


def reduce_scatter_hook(state: CrossReplicaShards, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the group into this rank's shard only (`state.shards`): divide by
    the world size, reduce-scatter (SUM) into equal chunks (the last padded with zeros). The
    bucket's buffer, and so `.grad`, keeps this rank's own divided gradient until
    `state.finish()`."""
    collectives, group = _collectives_and_group(state.group, bucket)
    buffer = bucket.buffer()  # (N,)
    if buffer.is_sparse:
        raise ValueError("the cross-replica step reduces dense buckets only: build the model without sparse=True")
    world_size = dist.get_world_size(group)
    divide_for_average(buffer, world_size)
    chunk = -(-buffer.numel() // world_size)
    padded = (
        buffer
        if chunk * world_size == buffer.numel()
        else torch.cat([buffer, buffer.new_zeros(chunk * world_size - buffer.numel())])
    )
    shard = buffer.new_empty(chunk)
    state.shards[bucket.index()] = shard
    state._gathers[bucket.index()] = (buffer, bucket.parameters(), bucket.gradients(), collectives)
    work = collectives.reduce_scatter_tensor(shard, padded, group=group, async_op=True)
    return _future_when_done(work, lambda: buffer)
