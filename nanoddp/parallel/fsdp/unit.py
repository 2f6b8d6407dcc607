"""One `fully_shard` call's parameters as one communication unit: one all-gather, one reduce-scatter.

Why grouped: a collective per parameter would pay the per-message cost dozens of times per
block. A unit lays its parameters' padded per-rank parts end to end (`ShardedParam.padded_numel`
each, `numel` in all), so rank r's contribution to the all-gather is one flat tensor and the
gathered buffer is (ws, numel) with rank r's parts in row r. Copy-out turns each parameter's
column of that buffer back into its whole tensor (`ShardedParam.copy_out`: end to end along
dim 0, concatenated along another shard dim). Gradients go the other way: every
parameter's padded whole gradient as a (ws, padded_numel) column, one reduce-scatter (AVG in
the reduce dtype), each rank's row cut back into its parameters' `.grad` DTensors.

States (`ShardedState`, torch's names): SHARDED (only the DTensor shards exist; an all-gather
may be in flight, e.g. a prefetch) -> UNSHARDED (whole tensors allocated, filled, registerable)
-> SHARDED again by `reshard()`, or SHARDED_POST_FORWARD after a forward that resharded to a
smaller group (below).

`reshard_after_forward=<int g>` (torch's reshard to a smaller group, e.g. the ranks of one node):
after forward each rank keeps, besides its shard, the rows of the gathered buffer of its block
of ranks (`post_forward_shard`: rank j of its row of g ranks keeps rows j*ws/g .. (j+1)*ws/g),
so the row's g ranks hold the whole buffer between them; backward's all-gather runs within the
row (g ranks, not ws) and yields the same buffer, so the values are the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum, auto

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from nanoddp.comm.api.backend import Collectives
from nanoddp.comm.transport.transport import Waitable
from nanoddp.parallel.fsdp.mesh import MeshInfo
from nanoddp.parallel.fsdp.param import ShardedParam
from nanoddp.parallel.fsdp.policies import MixedPrecisionPolicy

_step_hook: RemovableHandle | None = None


class ShardedState(Enum):
    """What a unit's parameters hold now (torch's `ShardedState`)."""

    SHARDED = auto()  # only the DTensor shards: what optimizers and state_dict see
    SHARDED_POST_FORWARD = auto()  # the shards plus this rank's block of the row's gathered buffer
    UNSHARDED = auto()  # whole tensors allocated and filled, for forward and backward


def count_optimizer_steps() -> None:
    """Make every optimizer step bump its DTensor parameters' version counters (once per process).

    [Note: foreach and fused steps] `stale()` reads the DTensor parameter's version counter. A
    for-loop step (`foreach=False`, the CPU default) bumps it, but a `foreach` or `fused` step
    on DTensors (the CUDA default) bumps neither it nor the local tensor's, so without this a
    unit holding whole tensors across `opt.step()` would run the old weights next forward."""
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_post_hook(_bump_versions)


def _bump_versions(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"] if isinstance(p, DTensor)]
    if params:
        torch.autograd.graph.increment_version(params)


def gradient_reduce_op(divide_factor: float | None) -> dist.ReduceOp.RedOpType:
    """The op of a unit's gradient collectives: how FSDP averages.

    [Note: averaging in FSDP] With no divide factor the collectives themselves average
    (ReduceOp.AVG, as torch's FSDP2 does for fp32/bf16): the reduce-scatter over the shard
    group and HSDP's all-reduce over the replicas each divide by their own size, so the result
    is the mean over every data-parallel rank with no separate divide. With
    `set_gradient_divide_factor(f)` both sum, and the sum is divided by f once, at the end."""
    return dist.ReduceOp.AVG if divide_factor is None else dist.ReduceOp.SUM


class ShardedUnit:
    """The parameters one `fully_shard` call took, gathered and reduced together."""

    def __init__(self, params: list[ShardedParam], mesh: MeshInfo, comm: Collectives, mp: MixedPrecisionPolicy):
        self.params = params
        self.mesh = mesh
        self.comm = comm
        self.mp = mp
        self.numel = sum(p.padded_numel for p in params)
        self.sharded_state = ShardedState.SHARDED
        self._gather: tuple[Waitable | None, torch.Tensor] | None = None  # (work, output) in flight
        self.divide_factor: float | None = None  # set_gradient_divide_factor; None: the dp size
        self.all_reduce = True  # HSDP: False skips the all-reduce across replicas (accumulation)
        self._partial: torch.Tensor | None = None  # HSDP gradients reduce-scattered, not all-reduced yet
        self._partial_had: list[bool] = []  # which parameters had a gradient in the deferred micro-steps
        self._gathered_versions: tuple[tuple[int, int, int, int], ...] = ()
        self.post_forward_mesh: MeshInfo | None = None  # reshard_after_forward=<int>: the rows
        self._post_forward: tuple[torch.Tensor, tuple[tuple[int, int, int, int], ...]] | None = None
        count_optimizer_steps()

    @property
    def is_sharded(self) -> bool:
        return self.sharded_state == ShardedState.SHARDED

    @property
    def is_unsharded(self) -> bool:
        return self.sharded_state == ShardedState.UNSHARDED

    def compute_dtype(self) -> torch.dtype:
        return self.mp.param_dtype or self.params[0].sharded.dtype

    def reduce_dtype(self) -> torch.dtype:
        return self.mp.reduce_dtype or self.mp.param_dtype or self.params[0].sharded.dtype

    # --- parameters ------------------------------------------------------------------------------

    @torch.no_grad()
    def start_unshard(self) -> None:
        """Launch the all-gather (asynchronously); no-op if unsharded or already in flight."""
        if self.is_unsharded or self._gather is not None:
            return
        ws, rank = self.mesh.shard_size, self.mesh.shard_rank
        device = self.params[0].local().device
        output = torch.empty(ws * self.numel, dtype=self.compute_dtype(), device=device)  # (ws * numel,)
        held, self._post_forward = self._post_forward, None
        self.sharded_state = ShardedState.SHARDED  # the held block, if any, goes into the gather
        if held is not None and held[0].dtype == output.dtype and held[1] == self._versions():
            row = self.post_forward_mesh
            assert row is not None  # held only when resharded to the rows
            mine = output.view(row.shard_size, -1)[row.shard_rank]  # its block of ranks' rows
            mine.copy_(held[0])
            work = self.comm.all_gather_into_tensor(output, mine, group=row.shard_group, async_op=True)
            self._gather = (work, output)
            return
        # The input is this rank's row of the output, as torch's FSDP2 lays it: no separate copy
        # of the shards, and the all-gather leaves that row as it is.
        shard = output[rank * self.numel : (rank + 1) * self.numel]  # (numel,)
        offset = 0
        for p in self.params:
            p.write_padded_local(shard[offset : offset + p.padded_numel])
            offset += p.padded_numel
        work = None
        if ws > 1:
            work = self.comm.all_gather_into_tensor(output, shard, group=self.mesh.shard_group, async_op=True)
        self._gather = (work, output)

    def gathering(self) -> bool:
        return self._gather is not None

    @torch.no_grad()
    def finish_unshard(self) -> None:
        """Wait for the all-gather and copy every parameter's column out into its whole tensor."""
        if self.is_unsharded:
            return
        self.start_unshard()
        assert self._gather is not None  # start_unshard launched it (not unsharded)
        work, output = self._gather
        self._gather = None
        if work is not None:
            work.wait()
        ws = self.mesh.shard_size
        columns = output.view(ws, self.numel)  # row r: rank r's parts, parameter after parameter
        offset = 0
        for p in self.params:
            whole = p.alloc_unsharded(output.dtype, output.device)  # (d0, ...)
            column = columns[:, offset : offset + p.padded_numel]  # (ws, padded_numel)
            p.copy_out(column, whole)
            offset += p.padded_numel
        self.sharded_state = ShardedState.UNSHARDED
        self._gathered_versions = self._versions()

    def _versions(self) -> tuple[tuple[int, int, int, int], ...]:
        """Each shard's identity and version counters: the DTensor parameter's own (an in-place
        op through it, `p.mul_(2)` or an optimizer step, bumps only that one) and its local
        tensor's (a write to `p.to_local()` or `_local_tensor`, a load, bumps only this one)."""
        return tuple((id(p.sharded), p.sharded._version, id(p.local()), p.local()._version) for p in self.params)

    def stale(self) -> bool:
        """Unsharded, but a shard changed since (an optimizer step, an in-place op on the
        parameter or its local tensor, a load, `to_empty`)."""
        return self.is_unsharded and self._versions() != self._gathered_versions

    @torch.no_grad()
    def reshard_after_forward(self) -> None:
        """Free the whole tensors; with a row mesh (`reshard_after_forward=<int>`) keep this
        rank's block of the gathered buffer first, for backward's all-gather within the row."""
        row = self.post_forward_mesh
        if row is None or not self.is_unsharded:
            self.reshard()
            return
        ws = self.mesh.shard_size
        parts = torch.empty(ws, self.numel, dtype=self.compute_dtype(), device=self.params[0].local().device)
        offset = 0
        for p in self.params:  # the gathered buffer again, from the whole tensors
            assert p.unsharded is not None  # unsharded
            p.write_parts(p.unsharded.detach(), parts[:, offset : offset + p.padded_numel])
            offset += p.padded_numel
        block = ws // row.shard_size
        kept = parts[row.shard_rank * block : (row.shard_rank + 1) * block].reshape(-1).clone()  # (block * numel,)
        versions = self._gathered_versions
        self.reshard()
        self._post_forward = (kept, versions)
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    def reshard(self) -> None:
        """Free the whole tensors (waiting out a gather still in flight) and register the shards."""
        self._post_forward = None
        if self._gather is not None:
            work, _ = self._gather
            self._gather = None
            if work is not None:
                work.wait()
        for p in self.params:
            p.free_unsharded()
            p.register(unsharded=False)
        self.sharded_state = ShardedState.SHARDED

    def adopt_registered(self, *_) -> None:
        """A load_state_dict post-hook: shards replaced by `assign=True` become this unit's."""
        for p in self.params:
            p.adopt_registered()

    def register(self, unsharded: bool) -> None:
        for p in self.params:
            p.register(unsharded)

    # --- gradients -------------------------------------------------------------------------------

    def trainable(self) -> list[ShardedParam]:
        return [p for p in self.params if p.requires_grad]

    @torch.no_grad()
    def start_reduce(self) -> Callable[..., None]:
        """Launch the reduce-scatter of the whole gradients (which it frees). Returns a finisher:
        call it (after backward) to wait and accumulate into the sharded `.grad`s, or with
        `keep=False` (`reset_iter_state`) to wait and drop them.

        Every trainable parameter has its column (zeros for one without a gradient), so the
        collective's size does not depend on which parameters backward reached; one that no
        rank gave a gradient gets none (torch's rule: it took no part in backward)."""
        params = self.trainable()
        if not params:
            return lambda keep=True: None
        had = [p.has_grad() for p in params]  # before the whole gradients are freed below
        ws, dtype = self.mesh.shard_size, self.reduce_dtype()
        total = sum(p.padded_numel for p in params)
        rows = torch.empty(ws, total, dtype=dtype, device=params[0].local().device)  # rank r's parts: row r
        offset = 0
        for p in params:  # each whole gradient written into its column once, then freed
            p.write_padded_grad(rows[:, offset : offset + p.padded_numel])
            if p.unsharded is not None:
                p.unsharded.grad = None
            offset += p.padded_numel
        flat = rows.view(-1)  # (ws * trainable numel,)
        output = torch.empty(flat.numel() // ws, dtype=dtype, device=flat.device)
        op = gradient_reduce_op(self.divide_factor)
        work: Waitable | None = None
        if ws == 1:
            output.copy_(flat)
        else:
            work = self.comm.reduce_scatter_tensor(output, flat, op=op, group=self.mesh.shard_group, async_op=True)

        def finish(keep: bool = True) -> None:
            if work is not None:
                work.wait()
            if keep:
                self._finish_reduce(params, output, flat, had)

        return finish

    def _finish_reduce(
        self, params: list[ShardedParam], output: torch.Tensor, _keep_alive: torch.Tensor, had: list[bool]
    ) -> None:
        replicas = self.mesh.replicate_group
        if replicas is not None:
            if self._partial is not None:
                output += self._partial
                self._partial = None
                had = [a or b for a, b in zip(had, self._partial_had, strict=True)]
            if not self.all_reduce:  # accumulate across micro-steps, all-reduce on the last
                self._partial, self._partial_had = output, had
                return
            self.comm.all_reduce(output, op=gradient_reduce_op(self.divide_factor), group=replicas)
        if self.divide_factor is not None:  # summed above: [Note: averaging in FSDP]
            output.div_(self.divide_factor)
        offset = 0
        for p, local_grad in zip(params, had, strict=True):
            part = output[offset : offset + p.padded_numel]
            # No gradient here: torch gives none. Another rank's may have reached these rows
            # (torch needs every rank to reach the same parameters; we take the sum then).
            if local_grad or bool(part.any()):
                p.accumulate_grad(part)
            offset += p.padded_numel

    def reset_iter_state(self) -> None:
        """After an exception mid-iteration: wait out a gather, reshard, and drop the gradients
        kept for later (no_sync's whole ones, HSDP's deferred sum): that iteration is lost."""
        self.reshard()
        self._partial, self._partial_had = None, []
        for p in self.params:
            if p.unsharded is not None:
                p.unsharded.grad = None

    # --- bookkeeping -----------------------------------------------------------------------------

    def resident_bytes(self) -> int:
        """Parameter bytes held now: the shards, any allocated whole tensors, a post-forward block."""
        held = sum(p.local().numel() * p.local().element_size() for p in self.params)
        if self._post_forward is not None:
            held += self._post_forward[0].numel() * self._post_forward[0].element_size()
        return held + sum(p.nbytes for p in self.params if p.unsharded_allocated())
