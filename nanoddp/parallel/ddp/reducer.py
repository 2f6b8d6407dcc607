"""The reducer: DDP's bucket state machine, apart from the module wrapper that drives it.

The wrapper (nanoddp.parallel.ddp.wrapper) decides *when* things happen: it runs the forward,
owns the autograd hooks and the end-of-backward callback, and knows about mixed precision,
delayed parameters and the Join context. The reducer decides *what* happens to gradients: which
bucket each one lands in, when a bucket is complete and launched, how the sums are averaged and
written back to `.grad`, which parameters went unused, and when the buckets are rebuilt in the
observed arrival order. Keeping that state in one object gives the Join hook
(nanoddp.parallel.ddp.join) a small public surface to shadow an iteration with, instead of the
wrapper's private members. Like torch's `Reducer`, it holds no reference to the wrapper.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nanoddp.comm.api.backend import Collectives
from nanoddp.parallel.ddp import buckets as bucketing
from nanoddp.parallel.ddp.buckets import Bucket, GradBucket, build_buckets, unused_parameters_error
from nanoddp.parallel.ddp.comm_hooks import check_comm_hook
from nanoddp.parallel.ddp.gradient_average import divide_for_average
from nanoddp.parallel.ddp.sparse import empty_sparse_like, sparse_all_reduce

logger = logging.getLogger(__name__)

CommHook = Callable[[Any, GradBucket], torch.futures.Future]


class Reducer:
    """Buckets of the wrapped module's parameters and the state of their reduction.

    One synchronised iteration: `reset` (before the forward), `grad_ready` per gradient hook
    (during backward; complete buckets launch in index order), `finalize_backward` (when the
    outer backward ends). A joined rank replays the same collectives with `launch` on zero
    stand-in buckets, `global_use_counts(active=False)` and `after_sync_iteration`.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        *,
        bucket_limits: list[int],
        custom_bucket_caps: bool,
        gradient_as_bucket_view: bool,
        reduce_dtype: torch.dtype | None,
        find_unused_parameters: bool,
        static_graph: bool,
        collectives: Collectives,
        group: Any,
        world_size: int,
        src: int,
        expect_sparse: Sequence[bool] = (),
    ):
        self.params, self.param_names = list(params), list(names)
        self.expect_sparse = list(expect_sparse) or [False] * len(self.params)  # own buckets (sparse.py)
        self.bucket_limits, self.custom_bucket_caps = bucket_limits, custom_bucket_caps
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.reduce_dtype = reduce_dtype
        self.find_unused_parameters, self.static_graph = find_unused_parameters, static_graph
        self.collectives, self.group, self.world_size, self.src = collectives, group, world_size, src
        n = len(self.params)
        self.buckets: list[Bucket] = []  # stays empty at world size 1: nothing to reduce
        self._slot_of: list[tuple[Bucket, int] | None] = [None] * n
        self.comm_hook: CommHook | None = None
        self.comm_hook_state: Any = None
        self.serialize_hooks = False  # see register_comm_hook
        self.sync_iterations = 0
        self._used_since_sync = [False] * n
        self._last_use_counts = [0] * n  # what a joined rank reports (join.py)
        self._ready_order: list[int] | None = []  # first synced iteration's arrival order
        self.rebuild_due = False
        # static_graph: hooks per parameter in the first synced backward (None until then), the
        # parameters with no hook on this rank, and those unused on every rank
        self._static_counts: list[int] | None = None
        self._locally_unused: list[int] = []
        self._global_unused: set[int] = set()
        self.divide_by_initial_world_size = True  # set by the join hook; see nanoddp.parallel.ddp.join
        self.divisor = world_size  # what bucket sums are divided by (fewer ranks under join)
        self.record_timeline = False
        self.timeline: list[tuple[str, float, Any]] = []
        self.reset()

    # ---- bucket layout -----------------------------------------------------------------------

    def build_initial_buckets(self) -> None:
        """The layout before any gradient has been seen (see buckets.initial_groups)."""
        self._build(
            bucketing.initial_groups(self.params, self.bucket_limits, self.custom_bucket_caps, self.expect_sparse)
        )

    def _build(self, groups: Sequence[Sequence[int]]) -> None:
        """(Re)create the buckets: `groups` of parameter indices, in launch order."""
        self.buckets, self._slot_of = build_buckets(
            self.params, groups, self.gradient_as_bucket_view, self.reduce_dtype, self.expect_sparse
        )
        logger.debug("built %d buckets of sizes %s", len(self.buckets), [b.nbytes for b in self.buckets])

    def rebuild_buckets(self) -> None:
        """Once, before the second synchronised forward: regroup by the observed arrival order.

        Reverse registration order is only a guess at when gradients become ready; the real order
        (e.g. a tied embedding arrives last) is recorded during the first backward. Rank 0's order
        is broadcast so that every rank builds identical buckets.
        """
        if self._ready_order is None or len(self._ready_order) != len(self.params):  # a joined rank: no backward
            self._ready_order = [i for bucket in self.buckets for i in bucket.param_indices]
        order = torch.tensor(self._ready_order, dtype=torch.int64)  # (P,)
        self.collectives.broadcast(order, src=self.src, group=self.group)
        groups = bucketing.group_in_order(
            self.params, order.tolist(), self.bucket_limits, self.expect_sparse, sort=False
        )
        if groups != [bucket.param_indices for bucket in self.buckets]:
            self._build(groups)
        self.rebuild_due, self._ready_order = False, None

    @property
    def bucket_param_names(self) -> list[list[str]]:
        return [[self.param_names[i] for i in b.param_indices] for b in self.buckets]

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """torch's contract and checks; see DistributedDataParallel.register_comm_hook.

        As torch, a hook may be registered after some iterations (the next synchronised
        backward uses it), never while a backward is in flight, and only once."""
        check_comm_hook(hook)
        if self.comm_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        if self.backward_started:
            raise RuntimeError(
                "register_comm_hook was called during a synchronised backward; register it between iterations"
            )
        self.comm_hook, self.comm_hook_state = hook, state
        # gloo (CPU tensors) completes futures, and so runs their callbacks, on its own threads:
        # a hook that issues collectives from a callback (torch's PowerSGD: its second
        # all-reduce) would race the next bucket's launch, and ranks would issue collectives in
        # different orders (an abort or a hang; torch's own DDP fails so). For such hooks the
        # reducer waits for each bucket's future before launching the next hook. nanoddp's own
        # hooks (and its wrappers of them) issue every collective in the call: no wait, the
        # buckets keep overlapping.
        foreign = not getattr(hook, "__module__", "").startswith("nanoddp.")
        self.serialize_hooks = foreign and all(p.device.type == "cpu" for p in self.params)

    # ---- one iteration -----------------------------------------------------------------------

    def begin_timeline(self) -> None:
        if self.record_timeline:
            self.timeline = [("forward", time.perf_counter(), None)]

    def trace(self, event: str, detail: Any = None) -> None:
        if self.record_timeline:
            self.timeline.append((event, time.perf_counter(), detail))

    def reset(self) -> None:
        """Forget the iteration in progress: nothing ready, nothing launched, no sync armed."""
        self._ready = [False] * len(self.params)
        self._hook_counts = [0] * len(self.params)
        self._arrival: list[int] = []  # static_graph's first iteration: first-hook order
        self._next_bucket = 0
        self._last_hook_future: torch.futures.Future | None = None
        self.backward_started = False
        self.sync_this_backward = False
        for bucket in self.buckets:
            bucket.reset()

    @property
    def _delay_all_reduce(self) -> bool:
        """static_graph's first synced backward: only count hooks, reduce everything at the end
        (a parameter may get several partial gradients, e.g. a block checkpointed twice)."""
        return self.static_graph and self._static_counts is None

    def grad_ready(self, index: int) -> None:
        """During backward, each time parameter `index`'s `.grad` received (part of) its gradient."""
        self._used_since_sync[index] = True
        if not self.sync_this_backward:
            return  # no_sync: gradients simply accumulate in .grad
        if not self.backward_started:
            self.backward_started = True
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
                f"parameter '{self.param_names[index]}' received a gradient {self._hook_counts[index]} times "
                f"in one synchronised backward (expected {expected}); DistributedDataParallel supports one "
                "backward per forward (wrap extra backward passes in no_sync(), or run a new forward); a "
                "block run several times under reentrant checkpointing needs static_graph=True"
            )
        if self._hook_counts[index] == expected:
            self.trace("grad_ready", index)
            self._mark_ready(index)

    @torch.no_grad()
    def _mark_ready(self, index: int) -> None:
        """Put `index`'s gradient in its bucket; launch every bucket that is now complete."""
        self._ready[index] = True
        if self._ready_order is not None:
            self._ready_order.append(index)
        entry = self._slot_of[index]
        assert entry is not None, f"parameter {index} has no bucket slot"  # only reduced ones reach here
        bucket, slot = entry
        if bucket.sparse:
            self._sparse_grad_ready(bucket, index)
        else:
            self._copy_into_bucket(bucket, index, slot)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready_buckets()

    def _copy_into_bucket(self, bucket: Bucket, index: int, slot: int) -> None:
        """A dense gradient: copied into its slot of the flat buffer (or already there, as a view)."""
        param, view = self.params[index], bucket.views[slot]
        grad = param.grad
        if grad is None:
            view.zero_()  # no gradient here: contribute zeros
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
            if self.gradient_as_bucket_view:
                param.grad = view

    def _sparse_grad_ready(self, bucket: Bucket, index: int) -> None:
        """A sparse gradient is its bucket's buffer (torch's reducer does the same). Without a
        comm hook it is averaged here, in place, as torch divides it before its all-reduce."""
        param = self.params[index]
        grad = param.grad
        if grad is None:
            bucket.buffer = empty_sparse_like(param)  # no gradient here: contribute no rows
            return
        if not grad.is_sparse:
            raise RuntimeError(
                f"parameter '{self.param_names[index]}' belongs to an Embedding/EmbeddingBag built with "
                f"sparse=True but its gradient is {grad.layout}; DistributedDataParallel expects a sparse "
                "gradient there (as torch's does): build the module with sparse=False to reduce it densely"
            )
        if self.comm_hook is None:
            divide_for_average(grad, self.divisor)
        bucket.buffer = grad

    def _launch_ready_buckets(self) -> None:
        """Launch complete buckets in index order; a complete bucket behind an incomplete one
        waits, because every rank must issue its collectives in the same order."""
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
            self.launch(self.buckets[self._next_bucket])
            self._next_bucket += 1

    def launch(self, bucket: Bucket) -> None:
        """Start reducing one bucket (the default averaging all-reduce, or the comm hook)."""
        self.trace("launch", bucket.index)
        if self.comm_hook is None and bucket.sparse:
            bucket.handle = sparse_all_reduce(bucket.buffer, self.collectives, self.group)  # averaged when ready
        elif self.comm_hook is None:
            # average as we sum: (N,); a copied-in gradient by the reciprocal, as torch's reducer
            divide_for_average(bucket.buffer, self.divisor, by_reciprocal=not self.gradient_as_bucket_view)
            bucket.handle = self.collectives.all_reduce(bucket.buffer, group=self.group, async_op=True)
        else:
            if self.serialize_hooks and self._last_hook_future is not None:
                self._last_hook_future.wait()  # see register_comm_hook
            grad_bucket = GradBucket(bucket, len(self.buckets), self.collectives, self.group)
            bucket.handle = self._last_hook_future = self.comm_hook(self.comm_hook_state, grad_bucket)

    # ---- end of backward ---------------------------------------------------------------------

    def finalize_backward(self, before_write_back: Callable[[], None] | None = None) -> None:
        """When the outer backward ends: parameters without gradients contribute zeros, every
        bucket is waited for, `.grad` becomes the average. `before_write_back` runs once every
        collective has been issued (mixed precision restores full-precision parameters)."""
        self.trace("finalize")
        for i in self._arrival:  # static_graph's first iteration: reduce in arrival order
            self._mark_ready(i)
        missing = [i for i, ready in enumerate(self._ready) if not ready]
        for i in missing:
            self._mark_ready(i)  # launches the remaining buckets, in order
        if self.comm_hook is not None:
            # a hook may issue more collectives from its futures' callbacks, on another thread
            # (PowerSGD does): let them all finish before this thread issues the next collective
            for bucket in self.buckets:
                bucket.handle.wait()
        if before_write_back is not None:
            before_write_back()
        use_counts = self.global_use_counts()
        for bucket in self.buckets:
            self._wait_and_write_back(bucket, use_counts)
        self.trace("done")
        self.after_sync_iteration(use_counts)
        if use_counts is not None and not (self.find_unused_parameters or self.static_graph):
            self._raise_if_unused(use_counts)

    def after_sync_iteration(self, use_counts: list[int] | None, shadowed: bool = False) -> None:
        """Bookkeeping after a synchronised iteration, run or (joined rank) shadowed."""
        if self._ready_order is not None:
            self.rebuild_due = True
        if self._delay_all_reduce:
            counts = [0] * len(self.params) if shadowed else list(self._hook_counts)
            self._static_counts = counts
            self._locally_unused = [i for i, n in enumerate(counts) if n == 0]
            per_param = (use_counts or counts)[: len(self.params)]
            self._global_unused = {i for i, n in enumerate(per_param) if n == 0}
        self.sync_iterations += 1
        self._used_since_sync = [False] * len(self.params)
        self.reset()

    def global_use_counts(self, active: bool = True) -> list[int] | None:
        """How many ranks produced a gradient for each parameter since the last sync, and (last
        entry) how many ranks took part: fewer than the world size under join().

        Costs one tiny all-reduce per synchronised iteration; with static_graph it is done in
        the first iteration only (the set of unused parameters cannot change).
        """
        if self.static_graph and self._static_counts is not None:
            return None
        flags = self._used_since_sync if active else self._last_use_counts
        used = torch.tensor([*flags, active], dtype=torch.int32)  # (P + 1,)
        self.collectives.all_reduce(used, group=self.group, async_op=True).wait()
        if self.find_unused_parameters:
            self._last_use_counts = used.tolist()[:-1]
        return used.tolist()

    @torch.no_grad()
    def _wait_and_write_back(self, bucket: Bucket, use_counts: list[int] | None) -> None:
        """Block until `bucket` is reduced, then make each parameter's `.grad` the average."""
        if bucket.sparse:
            self._write_back_sparse(bucket, use_counts)
            return
        if self.comm_hook is None:
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

    def _write_back_sparse(self, bucket: Bucket, use_counts: list[int] | None) -> None:
        """A sparse bucket's result becomes its parameter's `.grad` (copied into the local
        gradient, which keeps its identity, as torch's reducer does)."""
        result = bucket.handle.wait()
        index, param = bucket.param_indices[0], bucket.params[0]
        if not isinstance(result, torch.Tensor) or not result.is_sparse or result.shape != param.shape:
            raise RuntimeError(
                f"comm hook must return a Future holding a sparse tensor of shape {tuple(param.shape)} for the "
                f"sparse gradient of '{self.param_names[index]}', got "
                f"{getattr(result, 'layout', type(result).__name__)} {tuple(getattr(result, 'shape', ()))}"
            )
        if index in self._global_unused or (use_counts is not None and use_counts[index] == 0):
            return  # unused on every rank: leave .grad alone, like torch DDP
        if param.grad is None:
            param.grad = result
        elif result is not param.grad:
            param.grad.copy_(result)

    def _raise_if_unused(self, use_counts: list[int]) -> None:
        """Raised on every rank (all see the same counts), after all collectives completed."""
        error = unused_parameters_error(self.param_names, use_counts)
        if error is not None:
            raise error
