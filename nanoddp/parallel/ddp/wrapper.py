"""nanoddp.DistributedDataParallel: a bucketed, overlapped, drop-in replacement for torch's DDP.

The life of one synchronised iteration, in the order things happen:

1. `forward` (`_prepare_for_forward`): rebuild buckets once if due, broadcast buffers from
   rank 0, and note whether the coming backward must synchronise (not under `no_sync`).
2. backward, per parameter (`_on_grad_ready`, a post-accumulate-grad hook): the gradient is
   copied into its bucket's flat buffer (or already lives there with gradient_as_bucket_view).
   When a bucket's last gradient lands, its all-reduce is launched asynchronously
   (`_launch_ready_buckets`) and backward goes on computing earlier layers meanwhile.
   Buckets are launched strictly in index order so every rank issues the same collectives.
3. end of backward (`_finalize_backward`, an autograd-engine callback queued by a hook on the
   forward output, so it runs when the outer backward ends, after any reentrant backward of
   activation checkpointing nested in it, and before `backward()` returns): parameters that
   got no gradient contribute zeros, the usage of every parameter is summed over ranks (to
   report or tolerate unused parameters), every bucket is waited on, and the averaged
   gradients are written into `param.grad`.

With world size 1 the wrapper is a plain pass-through: no hooks, no communication.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms import Join, Joinable

from nanoddp.comm.backend import DEFAULT_COMM_BACKEND, collectives_for
from nanoddp.parallel.ddp import buckets as bucketing
from nanoddp.parallel.ddp.api import CommHook, DDPUserAPI
from nanoddp.parallel.ddp.args import resolve_args
from nanoddp.parallel.ddp.autograd import grad_ready_trampoline, output_grad_trampoline
from nanoddp.parallel.ddp.buckets import Bucket, GradBucket, build_buckets, unused_parameters_error
from nanoddp.parallel.ddp.delayed_params import DelayedAllReduce
from nanoddp.parallel.ddp.join import JoinableDDP, common_rank, global_requires_sync
from nanoddp.parallel.ddp.mixed_precision import MixedPrecision
from nanoddp.parallel.replicas import broadcast_coalesced, check_same_structure, group_size_rank_src
from nanoddp.parallel.tensors import move_to, tensors_in

logger = logging.getLogger(__name__)


class DistributedDataParallel(DDPUserAPI, JoinableDDP, nn.Module, Joinable):
    """Data-parallel wrapper with torch DDP's constructor, attributes and gradients.

    `comm_backend="nanoddp"` reduces with `nanoddp.comm` (collectives over point-to-point);
    `"torch"` with torch.distributed's built-ins, for comparison. Everything else is the same code.

    The positional and keyword arguments are torch 2.13's, with torch's defaults
    (`bucket_cap_mb=None`: 25 MB; `broadcast_buffers=None`: True; `forward_sync_buffers`
    replaces it but buffers are then always synced at construction; `init_sync=False` skips
    the construction-time shape check and broadcast; `device_mesh`: a 1-D mesh's group).
    Accepted with no effect here, because they only matter on other hardware or are
    optimisations that do not change results:
    `output_device` and `dim` (multi-device scatter/gather: outputs stay where the module puts
    them, as torch DDP does for single-device modules), `batched_grad_copy` (fewer GPU kernel
    launches), `skip_all_reduce_unused_params` (torch then sends no bytes for parameters unused
    on every rank; nanoddp reduces their zeros, and their `.grad` is left alone either way),
    `check_reduction` (deprecated in torch). `delay_all_reduce_named_params` /
    `param_to_hook_all_reduce`: torch's semantics (nanoddp.parallel.ddp.delayed_params), except that
    the delayed all-reduce is waited for before backward() returns. `bucket_cap_mb_list`:
    torch's per-bucket limits and its initial layout (nanoddp.parallel.ddp.buckets).
    `mixed_precision`: torch's documented semantics on any device (torch's own path needs an
    accelerator: it fails on CPU), see nanoddp.parallel.ddp.mixed_precision.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Sequence[tuple[str, nn.Parameter]] | None = None,
        param_to_hook_all_reduce: nn.Parameter | None = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[int] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        comm_backend: str = DEFAULT_COMM_BACKEND,
    ):
        super().__init__()
        Joinable.__init__(self)
        args = resolve_args(
            module, device_ids, bucket_cap_mb, comm_backend, broadcast_buffers, forward_sync_buffers,
            process_group, device_mesh, check_reduction, delay_all_reduce_named_params,
            param_to_hook_all_reduce, mixed_precision, bucket_cap_mb_list, gradient_as_bucket_view,
        )  # fmt: skip
        process_group, bucket_cap_mb = args.process_group, args.bucket_cap_mb
        self.dim = dim
        self.device_mesh = device_mesh
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy = batched_grad_copy
        self.mixed_precision = mixed_precision
        self._mp = MixedPrecision(mixed_precision, module) if mixed_precision is not None else None
        self.forward_sync_buffers = args.forward_sync_buffers
        self.module = module
        self.device_ids = list(device_ids) if device_ids is not None else None
        self.output_device = output_device
        self.broadcast_buffers = args.forward_sync_buffers  # the attribute torch code reads
        self.process_group = process_group
        self.bucket_cap_mb = bucket_cap_mb
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.comm_backend = comm_backend
        self.require_backward_grad_sync = True
        self.record_timeline = False  # set True to fill `last_timeline` with (event, seconds, detail)
        self.last_timeline: list[tuple[str, float, Any]] = []
        self._device = torch.device(self.device_ids[0]) if self.device_ids else None
        self._collectives = collectives_for(comm_backend)
        self._comm_hook: CommHook | None = None
        self._comm_hook_state: Any = None
        delayed_names = {name for name, _ in args.delayed}  # reduced apart: see delayed_params.py
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in delayed_names]
        self._params = [p for _, p in named]
        self._param_names = [n for n, _ in named]
        self._bucket_limits, self._custom_bucket_caps = args.bucket_limits, args.custom_bucket_caps
        self._delayed: DelayedAllReduce | None = None
        self._buckets: list[Bucket] = []  # stays empty at world size 1: nothing to reduce
        self._slot_of: list[tuple[Bucket, int] | None] = [None] * len(self._params)
        self._sync_iterations = 0
        self._used_since_sync = [False] * len(self._params)
        self._last_use_counts = [0] * len(self._params)  # what a joined rank reports (join.py)
        self._ready_order: list[int] | None = []  # first synced iteration's arrival order
        self._rebuild_due = False
        # static_graph: hooks per parameter in the first synced backward (None until then), the
        # parameters with no hook on this rank, and those unused on every rank
        self._static_counts: list[int] | None = None
        self._locally_unused: list[int] = []
        self._global_unused: set[int] = set()
        self._divide_by_initial_world_size = True  # set by join(); see nanoddp.parallel.ddp.join
        self._reset_sync_state()
        if not dist.is_initialized():
            self._world_size, self._rank, self._src = 1, 0, 0
        else:
            self._world_size, self._rank, self._src = group_size_rank_src(process_group)
        self._divisor = self._world_size  # what bucket sums are divided by (see join())
        if self._world_size == 1:
            return  # the same object, as a pass-through: no hooks, no communication
        if args.delayed:
            self._delayed = DelayedAllReduce(
                args.delayed, param_to_hook_all_reduce, self._collectives, process_group, self._world_size, self._src
            )
            if not self._params:
                return  # every trainable parameter is delayed: nothing else to do (as torch)
        if init_sync:
            check_same_structure(module, self._collectives, process_group)
            states = list(module.parameters()) + (list(module.buffers()) if args.init_sync_buffers else [])
            broadcast_coalesced(states, self._collectives, process_group, self._src)
        self._build_buckets(bucketing.initial_groups(self._params, self._bucket_limits, self._custom_bucket_caps))
        engine_ref = weakref.ref(self)
        handles = [
            p.register_post_accumulate_grad_hook(functools.partial(grad_ready_trampoline, engine_ref, i))
            for i, p in enumerate(self._params)
        ]
        weakref.finalize(self, lambda: [h.remove() for h in handles])

    # ---- buckets ------------------------------------------------------------------------------

    def _build_buckets(self, groups: Sequence[Sequence[int]]) -> None:
        """(Re)create the buckets: `groups` of parameter indices, in launch order."""
        dtype = self._mp.reduce_dtype if self._mp is not None else None
        self._buckets, self._slot_of = build_buckets(self._params, groups, self.gradient_as_bucket_view, dtype)
        logger.debug("built %d buckets of sizes %s", len(self._buckets), [b.nbytes for b in self._buckets])

    def _rebuild_buckets(self) -> None:
        """Once, before the second synchronised forward: regroup by the observed arrival order.

        Reverse registration order is only a guess at when gradients become ready; the real order
        (e.g. a tied embedding arrives last) is recorded during the first backward. Rank 0's order
        is broadcast so that every rank builds identical buckets.
        """
        if len(self._ready_order) != len(self._params):  # a joined rank that never ran a backward
            self._ready_order = [i for bucket in self._buckets for i in bucket.param_indices]
        order = torch.tensor(self._ready_order, dtype=torch.int64)  # (P,)
        self._collectives.broadcast(order, src=self._src, group=self.process_group)
        groups = bucketing.group_in_order(self._params, order.tolist(), self._bucket_limits)
        if groups != [bucket.param_indices for bucket in self._buckets]:
            self._build_buckets(groups)
        self._rebuild_due, self._ready_order = False, None

    # ---- forward ------------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._device is not None:
            inputs, kwargs = move_to(inputs, self._device, True), move_to(kwargs, self._device, True)
        if self._mp is not None:
            inputs, kwargs = self._mp.before_forward(inputs, kwargs)
        output = self.module(*inputs, **kwargs) if self._world_size == 1 else self._ddp_forward(inputs, kwargs)
        if self._mp is not None:
            self._mp.after_forward(output)  # after the DDP hooks: finalize restores first
        return output

    def _ddp_forward(self, inputs: tuple, kwargs: dict) -> Any:
        if self._params or self._delayed is None:  # all delayed: no buffer sync, as torch
            self._prepare_for_forward()
        output = self.module(*inputs, **kwargs)
        if self._sync_this_backward:
            engine_ref = weakref.ref(self)
            for tensor in tensors_in(output):
                if tensor.grad_fn is not None:
                    tensor.register_hook(functools.partial(output_grad_trampoline, engine_ref))
        if self._delayed is not None:
            self._delayed.after_forward()
        return output

    def _prepare_for_forward(self, joined: bool = False) -> None:
        """Before the forward: rebuild buckets if due, sync buffers, arm (or not) the backward.

        Under a Join context, tell the joined ranks that this one still trains and whether its
        backward synchronises; `joined=True` is a joined rank shadowing these collectives.
        """
        if self.record_timeline:
            self.last_timeline = [("forward", time.perf_counter(), None)]
        if not joined:
            work = Join.notify_join_context(self)  # None outside a join context
            self._divisor = self._world_size
            if work is not None and not self._divide_by_initial_world_size:
                self._divisor = int(work.get_future().wait()[0].item())  # ranks that have not joined
        if self._rebuild_due:
            self._rebuild_buckets()
        if self.broadcast_buffers:
            buffers = list(self.module.buffers())
            if buffers:
                src = common_rank(self, not joined) if self._join_config.enable else self._src
                broadcast_coalesced(buffers, self._collectives, self.process_group, src)
        if joined:
            return
        self._reset_sync_state()
        self._sync_this_backward = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self._join_config.enable:
            global_requires_sync(self, self._sync_this_backward)

    def _reset_sync_state(self) -> None:
        self._ready = [False] * len(self._params)
        self._hook_counts = [0] * len(self._params)
        self._arrival: list[int] = []  # static_graph's first iteration: first-hook order
        self._next_bucket = 0
        self._last_hook_future = None
        self._backward_started = False
        self._finalize_queued = False
        self._sync_this_backward = False
        for bucket in self._buckets:
            bucket.reset()

    def _trace(self, event: str, detail: Any = None) -> None:
        if self.record_timeline:
            self.last_timeline.append((event, time.perf_counter(), detail))

    # ---- backward: per-gradient hook and bucket launch ----------------------------------------

    @property
    def _delay_all_reduce(self) -> bool:
        """static_graph's first synced backward: only count hooks, reduce everything at the end
        (a parameter may get several partial gradients, e.g. a block checkpointed twice)."""
        return self.static_graph and self._static_counts is None

    def _on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        """Runs inside backward each time `param.grad` has received (part of) its gradient."""
        self._used_since_sync[index] = True
        if not self._sync_this_backward:
            return  # no_sync: gradients simply accumulate in .grad
        if not self._backward_started:
            self._backward_started = True
            self._queue_finalize()  # normally done already, from the output's hook
            for unused in self._locally_unused:  # static graph: no need to wait for them
                self._mark_ready(unused)
        self._hook_counts[index] += 1
        if self._delay_all_reduce:
            if self._hook_counts[index] == 1:
                self._arrival.append(index)
            return
        expected = 1 if self._static_counts is None else self._static_counts[index]
        if self._hook_counts[index] > expected:
            raise RuntimeError(
                f"parameter '{self._param_names[index]}' received a gradient {self._hook_counts[index]} times "
                f"in one synchronised backward (expected {expected}); DistributedDataParallel supports one "
                "backward per forward (wrap extra backward passes in no_sync(), or run a new forward); a "
                "block run several times under reentrant checkpointing needs static_graph=True"
            )
        if self._hook_counts[index] == expected:
            self._trace("grad_ready", index)
            self._mark_ready(index)

    @torch.no_grad()
    def _mark_ready(self, index: int) -> None:
        """Put `index`'s gradient in its bucket; launch every bucket that is now complete."""
        self._ready[index] = True
        if self._ready_order is not None:
            self._ready_order.append(index)
        bucket, slot = self._slot_of[index]
        param, view = self._params[index], bucket.views[slot]
        grad = param.grad
        if grad is None:
            view.zero_()  # no gradient here: contribute zeros
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
            if self.gradient_as_bucket_view:
                param.grad = view
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        """Launch complete buckets in index order; a complete bucket behind an incomplete one
        waits, because every rank must issue its collectives in the same order."""
        while self._next_bucket < len(self._buckets) and self._buckets[self._next_bucket].pending == 0:
            self._launch(self._buckets[self._next_bucket])
            self._next_bucket += 1

    def _launch(self, bucket: Bucket) -> None:
        """Start reducing one bucket (the default averaging all-reduce, or the comm hook)."""
        self._trace("launch", bucket.index)
        if self._comm_hook is None:
            # average as we sum: (N,). torch's reducer multiplies by 1/n when it copies a gradient
            # into its bucket and divides a bucket-view gradient in place; the same ops here
            # give its rounding bit for bit when n is not a power of two.
            if self.gradient_as_bucket_view:
                bucket.buffer.div_(self._divisor)
            else:
                bucket.buffer.mul_(1.0 / self._divisor)
            bucket.handle = self._collectives.all_reduce(bucket.buffer, group=self.process_group, async_op=True)
        else:
            if self._serialize_hooks and self._last_hook_future is not None:
                self._last_hook_future.wait()  # see DDPUserAPI.register_comm_hook
            grad_bucket = GradBucket(bucket, len(self._buckets), self._collectives, self.process_group)
            bucket.handle = self._last_hook_future = self._comm_hook(self._comm_hook_state, grad_bucket)

    # ---- end of backward ------------------------------------------------------------------------

    def _queue_finalize(self) -> None:
        """Queue `_finalize_backward` on the graph task now running, once per backward.

        Called first from the hook on the forward output, which runs in the outer backward: a
        callback queued there runs when the OUTER backward ends, after any reentrant backward
        (activation checkpointing) nested inside it has delivered its gradients. Queued from a
        parameter's hook instead, it could land on an inner graph task and finalise too early.
        """
        if not self._finalize_queued:
            self._finalize_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)

    def _finalize_backward(self) -> None:
        """Autograd-engine callback, after every gradient hook and before backward() returns:
        handle parameters without gradients, wait for every bucket, write `.grad`."""
        self._finalize_queued = False
        if not self._backward_started:
            return  # e.g. torch.autograd.grad through the output: no .grad written, nothing to sync
        self._trace("finalize")
        for i in self._arrival:  # static_graph's first iteration: reduce in arrival order
            self._mark_ready(i)
        missing = [i for i, ready in enumerate(self._ready) if not ready]
        for i in missing:
            self._mark_ready(i)  # launches the remaining buckets, in order
        if self._comm_hook is not None:
            # a hook may issue more collectives from its futures' callbacks, on another thread
            # (PowerSGD does): let them all finish before this thread issues the next collective
            for bucket in self._buckets:
                bucket.handle.wait()
        if self._mp is not None:
            self._mp.restore()  # full-precision parameters, before .grad is written
        use_counts = self._global_use_counts()
        for bucket in self._buckets:
            self._wait_and_write_back(bucket, use_counts)
        self._trace("done")
        self._after_sync_iteration(use_counts)
        if use_counts is not None and not (self.find_unused_parameters or self.static_graph):
            self._raise_if_unused(use_counts)

    def _after_sync_iteration(self, use_counts: list[int] | None, shadowed: bool = False) -> None:
        """Bookkeeping after a synchronised iteration, run or (joined rank) shadowed."""
        if self._ready_order is not None:
            self._rebuild_due = True
        if self._delay_all_reduce:
            counts = [0] * len(self._params) if shadowed else list(self._hook_counts)
            self._static_counts = counts
            self._locally_unused = [i for i, n in enumerate(counts) if n == 0]
            per_param = (use_counts or counts)[: len(self._params)]
            self._global_unused = {i for i, n in enumerate(per_param) if n == 0}
        self._sync_iterations += 1
        self._used_since_sync = [False] * len(self._params)
        self._reset_sync_state()

    def _global_use_counts(self, active: bool = True) -> list[int] | None:
        """How many ranks produced a gradient for each parameter since the last sync, and (last
        entry) how many ranks took part: fewer than the world size under join().

        Costs one tiny all-reduce per synchronised iteration; with static_graph it is done in
        the first iteration only (the set of unused parameters cannot change).
        """
        if self.static_graph and self._static_counts is not None:
            return None
        flags = self._used_since_sync if active else self._last_use_counts
        used = torch.tensor([*flags, active], dtype=torch.int32)  # (P + 1,)
        self._collectives.all_reduce(used, group=self.process_group, async_op=True).wait()
        if self.find_unused_parameters:
            self._last_use_counts = used.tolist()[:-1]
        return used.tolist()

    @torch.no_grad()
    def _wait_and_write_back(self, bucket: Bucket, use_counts: list[int] | None) -> None:
        """Block until `bucket` is reduced, then make each parameter's `.grad` the average."""
        if self._comm_hook is None:
            bucket.handle.wait()
        else:
            result = bucket.handle.wait()
            if not isinstance(result, torch.Tensor) or result.numel() != bucket.buffer.numel():
                raise RuntimeError(
                    f"comm hook must return a Future holding a tensor of {bucket.buffer.numel()} elements "
                    f"(the bucket buffer), got {type(result).__name__}"
                )
            if result.data_ptr() != bucket.buffer.data_ptr():
                bucket.buffer.copy_(result)
        for index, param, view in zip(bucket.param_indices, bucket.params, bucket.views, strict=True):
            if index in self._global_unused or (use_counts is not None and use_counts[index] == 0):
                continue  # unused on every rank: leave .grad alone, like torch DDP
            if self.gradient_as_bucket_view:
                if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                    param.grad = view
            elif param.grad is None:
                param.grad = view.to(param.dtype, copy=True)  # clone, or cast up (mixed precision)
            else:
                param.grad.copy_(view)

    def _raise_if_unused(self, use_counts: list[int]) -> None:
        """Raised on every rank (all see the same counts), after all collectives completed."""
        error = unused_parameters_error(self._param_names, use_counts)
        if error is not None:
            raise error
