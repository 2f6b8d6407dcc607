"""nanoddp.DistributedDataParallel: a bucketed, overlapped, drop-in replacement for torch's DDP.

The life of one synchronised iteration, in the order things happen (the methods below come in
the same order; the bucket state they drive is the `Reducer`, nanoddp.parallel.ddp.reducer):

1. `forward` (`_prepare_for_forward`): rebuild buckets once if due, broadcast buffers from
   rank 0, and note whether the coming backward must synchronise (not under `no_sync`).
2. backward, per parameter (`_on_grad_ready`, a post-accumulate-grad hook): the gradient is
   copied into its bucket's flat buffer (or already lives there with gradient_as_bucket_view).
   When a bucket's last gradient lands, its all-reduce is launched asynchronously
   (`Reducer.grad_ready`) and backward goes on computing earlier layers meanwhile.
   Buckets are launched strictly in index order so every rank issues the same collectives.
3. end of backward (`_finalize_backward`, an autograd-engine callback queued by a hook on the
   forward output, so it runs when the outer backward ends, after any reentrant backward of
   activation checkpointing nested in it, and before `backward()` returns): parameters that
   got no gradient contribute zeros, the usage of every parameter is summed over ranks (to
   report or tolerate unused parameters), every bucket is waited on, and the averaged
   gradients are written into `param.grad`.

Between iterations: `no_sync`, `register_comm_hook` and `join` only set what the next
iteration reads. With world size 1 the wrapper is a plain pass-through: no hooks, no communication.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms import Join, Joinable, JoinHook

from nanoddp.comm.api.backend import DEFAULT_COMM_BACKEND, collectives_for
from nanoddp.parallel.ddp.args import resolve_args
from nanoddp.parallel.ddp.delayed_params import DelayedAllReduce
from nanoddp.parallel.ddp.ignored import (
    ignored_names,
    set_params_and_buffers_to_ignore,
    synced_buffers,
    synced_parameters,
)
from nanoddp.parallel.ddp.join import DDPJoinHook, broadcast_buffers_from_trainer, global_requires_sync
from nanoddp.parallel.ddp.mixed_precision import MixedPrecision
from nanoddp.parallel.ddp.reducer import CommHook, Reducer
from nanoddp.parallel.ddp.sparse import expects_sparse_grad
from nanoddp.parallel.detect import refuse_sharded
from nanoddp.parallel.replicas import broadcast_rank0_weights, check_same_structure, group_size_rank_src
from nanoddp.parallel.tensors import move_to, tensors_in


def _check_default_group(process_group: dist.ProcessGroup | None) -> None:
    """torch's condition and message for pickling a DDP wrapper: its group must be the default one
    (the only group an unpickling process can name)."""
    if dist.is_initialized() and (process_group is None or process_group == dist.group.WORLD):
        return
    if not dist.is_initialized() and process_group is None:
        return  # nanoddp's pass-through wrapper without torch.distributed: nothing to rebuild
    raise RuntimeError(
        "DDP Pickling/Unpickling are only supported when using DDP with the default process group. That "
        "is, when you have called init_process_group and have not passed process_group argument to DDP "
        "constructor"
    )


def _grad_ready_trampoline(ddp_ref: weakref.ref, index: int, param: torch.Tensor) -> None:
    """The hook autograd holds: a weak reference, so a discarded wrapper leaves no live hooks
    behind (and is not kept alive by them)."""
    ddp = ddp_ref()
    if ddp is not None:
        ddp._on_grad_ready(index, param)


def _output_grad_trampoline(ddp_ref: weakref.ref, grad: torch.Tensor) -> None:
    """Hook on a forward output: its gradient is computed by the backward that consumes the
    output, i.e. the OUTER backward, never by a reentrant checkpoint's inner one."""
    ddp = ddp_ref()
    if ddp is not None:
        ddp._queue_finalize()


class DistributedDataParallel(nn.Module, Joinable):
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
        # A sharded model holds pieces: the start-up broadcast would copy rank 0's over the others'.
        refuse_sharded(module, "DistributedDataParallel")
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
        self._device = torch.device(self.device_ids[0]) if self.device_ids else None
        self._args = args
        self._param_to_hook_all_reduce = param_to_hook_all_reduce
        self._ignored = ignored_names(module)  # left alone: rank-local (nanoddp.parallel.ddp.ignored)
        self._build_engine(init_sync=init_sync, unpickled=False)

    def _build_engine(self, init_sync: bool, unpickled: bool) -> None:
        """At construction, and again after unpickling (without any start-up broadcast, as
        torch): the reducer, the delayed all-reduce, and the gradient hooks on the parameters."""
        args, module, process_group = self._args, self.module, self.process_group
        self._delayed: DelayedAllReduce | None = None
        self._finalize_queued = False
        self._world_size, _rank, src = group_size_rank_src(process_group)
        skipped = self._ignored | {name for name, _ in args.delayed}  # delayed: reduced apart (delayed_params.py)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in skipped]
        self.reducer = Reducer(
            [p for _, p in named], [n for n, _ in named], bucket_limits=args.bucket_limits,
            custom_bucket_caps=args.custom_bucket_caps, gradient_as_bucket_view=self.gradient_as_bucket_view,
            reduce_dtype=self._mp.reduce_dtype if self._mp is not None else None,
            find_unused_parameters=self.find_unused_parameters, static_graph=self.static_graph,
            collectives=collectives_for(self.comm_backend), group=process_group, world_size=self._world_size,
            src=src, expect_sparse=expects_sparse_grad(module, [p for _, p in named]),
        )  # fmt: skip
        if self._world_size == 1:
            return  # the same object, as a pass-through: no hooks, no communication
        collectives = self.reducer.collectives
        if args.delayed:
            assert self._param_to_hook_all_reduce is not None  # resolve_args checked it with the delayed names
            self._delayed = DelayedAllReduce(
                args.delayed, self._param_to_hook_all_reduce, collectives, process_group, self._world_size,
                broadcast=not unpickled,  # torch broadcasts them even with init_sync=False
            )  # fmt: skip
            if not named:
                return  # every trainable parameter is delayed: nothing else to do (as torch)
        if init_sync:
            check_same_structure(module, collectives, process_group)
            states = synced_parameters(module, self._ignored)
            states += synced_buffers(module, self._ignored) if args.init_sync_buffers else []
            broadcast_rank0_weights(states, collectives, process_group)
        self.reducer.build_initial_buckets()
        ddp_ref = weakref.ref(self)
        handles = [
            p.register_post_accumulate_grad_hook(functools.partial(_grad_ready_trampoline, ddp_ref, i))
            for i, p in enumerate(self.reducer.params)
        ]
        weakref.finalize(self, lambda: [h.remove() for h in handles])

    # ---- pickling: torch.save(ddp), copy.deepcopy(ddp) -----------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """As torch's DDP: everything but the process group and the reducer (bucket state, the
        collectives module, a comm hook), so only a wrapper over the default group pickles."""
        _check_default_group(self.process_group)
        state = dict(self.__dict__)
        for rebuilt in ("process_group", "reducer", "_delayed", "_finalize_queued", "_world_size"):
            del state[rebuilt]
        state["_args"] = dataclasses.replace(self._args, process_group=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """As torch's DDP: the default group, and a fresh reducer over the unpickled parameters
        (buckets laid out again, no comm hook, no broadcast: the parameters are what was saved)."""
        super().__setstate__(state)
        self.process_group = None  # the default group, the only one a pickle can come from
        self._build_engine(init_sync=False, unpickled=True)

    # ---- 1. before backward: the forward ------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Before backward: the module's forward, armed for a synchronised backward."""
        if self._device is not None:
            inputs, kwargs = move_to(inputs, self._device, True), move_to(kwargs, self._device, True)
        if self._mp is not None:
            inputs, kwargs = self._mp.before_forward(inputs, kwargs)
        output = self.module(*inputs, **kwargs) if self._world_size == 1 else self._ddp_forward(inputs, kwargs)
        if self._mp is not None:
            self._mp.after_forward(output)  # after the DDP hooks: finalize restores first
        return output

    def _ddp_forward(self, inputs: tuple, kwargs: dict) -> Any:
        """Before backward: hook the output, whose gradient marks the outer backward."""
        if self.reducer.params or self._delayed is None:  # all delayed: no buffer sync, as torch
            self._prepare_for_forward()
        output = self.module(*inputs, **kwargs)
        if self.reducer.sync_this_backward:
            ddp_ref = weakref.ref(self)
            for tensor in tensors_in(output):
                if tensor.grad_fn is not None:
                    tensor.register_hook(functools.partial(_output_grad_trampoline, ddp_ref))
        if self._delayed is not None:
            self._delayed.after_forward()
        return output

    def _prepare_for_forward(self) -> None:
        """Before the forward: rebuild buckets if due, sync buffers, arm (or not) the backward.

        Under a Join context, tell the joined ranks that this one still trains and whether its
        backward synchronises (a joined rank shadows these collectives: nanoddp.parallel.ddp.join).
        """
        reducer = self.reducer
        reducer.begin_timeline()
        work = Join.notify_join_context(self)  # None outside a join context
        reducer.divisor = self._world_size
        if work is not None and not reducer.divide_by_initial_world_size:
            reducer.divisor = int(work.get_future().wait()[0].item())  # ranks that have not joined
        if reducer.rebuild_due:
            reducer.rebuild_buckets()
        if self.broadcast_buffers:
            if self._join_config.enable:
                broadcast_buffers_from_trainer(reducer, self.module, self._ignored, training=True)
            elif buffers := synced_buffers(self.module, self._ignored):
                broadcast_rank0_weights(buffers, reducer.collectives, self.process_group)
        reducer.reset()
        self._finalize_queued = False
        reducer.sync_this_backward = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self._join_config.enable:
            global_requires_sync(reducer, reducer.sync_this_backward)

    # ---- 2. during backward: per-gradient hook ------------------------------------------------

    def _on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        """During backward, each time `param.grad` has received (part of) its gradient."""
        if self.reducer.sync_this_backward and not self.reducer.backward_started:
            self._queue_finalize()  # normally done already, from the output's hook
        self.reducer.grad_ready(index)

    def _queue_finalize(self) -> None:
        """During backward: queue `_finalize_backward` on the graph task now running, once.

        Called first from the hook on the forward output, which runs in the outer backward: a
        callback queued there runs when the OUTER backward ends, after any reentrant backward
        (activation checkpointing) nested inside it has delivered its gradients. Queued from a
        parameter's hook instead, it could land on an inner graph task and finalise too early.
        """
        if not self._finalize_queued:
            self._finalize_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)

    # ---- 3. end of backward ---------------------------------------------------------------------

    def _finalize_backward(self) -> None:
        """Autograd-engine callback, after every gradient hook and before backward() returns:
        handle parameters without gradients, wait for every bucket, write `.grad`."""
        self._finalize_queued = False
        if not self.reducer.backward_started:
            return  # e.g. torch.autograd.grad through the output: no .grad written, nothing to sync
        self.reducer.finalize_backward(before_write_back=self._mp.restore if self._mp is not None else None)

    # ---- between iterations: what the next one reads ----------------------------------------------

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient synchronisation for backward passes whose forward runs inside the block;
        gradients accumulate locally and the next synchronised backward reduces their sum."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Replace the default all-reduce with `hook(state, bucket) -> Future[Tensor]` (torch's
        contract and checks; see nanoddp.parallel.ddp.comm_hooks). Register once, between
        iterations: the next synchronised backward uses it."""
        self.reducer.register_comm_hook(state, hook)

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore: Any) -> None:
        """torch's way to name (fully qualified) the parameters and buffers DDP leaves alone; call it
        on the module before wrapping it (see nanoddp.parallel.ddp.ignored)."""
        set_params_and_buffers_to_ignore(module, params_and_buffers_to_ignore)

    @property
    def bucket_param_names(self) -> list[list[str]]:
        """Parameter names per bucket, in reduction order (for inspection and tests)."""
        return self.reducer.bucket_param_names

    @property
    def record_timeline(self) -> bool:
        """Set True to fill `last_timeline` with (event, seconds, detail) from each forward on."""
        return self.reducer.record_timeline

    @record_timeline.setter
    def record_timeline(self, value: bool) -> None:
        self.reducer.record_timeline = value

    @property
    def last_timeline(self) -> list[tuple[str, float, Any]]:
        return self.reducer.timeline

    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Join:
        """Context manager for uneven inputs, as torch DDP's: ranks that run out of batches
        shadow the others' collectives with zero gradients until every rank is done.

        divide_by_initial_world_size: average over the initial world size (True, torch's
        default) or over the ranks still training. throw_on_early_termination: instead, raise on
        every rank as soon as one has run out of data.
        """
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        if self._delayed is not None:
            raise ValueError(
                "join() is not supported with delay_all_reduce_named_params: a joined rank cannot know where "
                "in the others' backward the delayed all-reduce falls (torch's join hook leaves it unmatched "
                "too); give every rank the same number of batches, or leave the parameters in the buckets"
            )
        divide = kwargs.get("divide_by_initial_world_size", True)
        return DDPJoinHook(self.reducer, self.module, self._ignored, self.broadcast_buffers, divide)

    @property
    def join_device(self) -> torch.device:
        params = self.reducer.params
        return self._device or (params[0].device if params else torch.device("cpu"))

    @property
    def join_process_group(self) -> Any:
        return self.process_group if self.process_group is not None else dist.group.WORLD
