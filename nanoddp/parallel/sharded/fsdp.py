"""FSDP / ZeRO-3: `fully_shard(module)` keeps only this rank's 1/ws of the parameters.

Why: ZeRO-2 still holds every parameter on every rank. Here a module's parameters live as
flat shards (`nanoddp.parallel.sharded.flat.FlatParamUnit`) and exist whole only while that module
runs. Applied FSDP2-style, to each block and then to the root, at most one block (plus the
root's own parameters) is whole at a time.

The life of one step, per sharded module ("unit"):
  1. pre-forward hook: all-gather the unit's flat shard into its full buffer (if it is not
     there already, or an optimizer changed the shard) and register the full views on the
     module, so its forward runs unchanged;
  2. post-forward hook: register the shard pieces again; free the full buffer if
     `reshard_after_forward` (autograd keeps the views, their bytes come back in step 3); a
     multi-grad hook on the outputs marks where this unit's backward begins;
  3. pre-backward (that hook): all-gather again into the same buffer;
  4. post-accumulate-grad hooks: once every view has its gradient the unit's backward is done:
     its gradients are reduce-scattered into the shard pieces' `.grad` and the full buffer is
     freed (`GradReduceScatter`);
  5. `optimizer.step()`: a plain optimizer over `model.parameters()` sees only the shard
     pieces (1-D) and their gradients, so its state is 1/ws too.

Prefetch (`prefetch=True`, the root's setting governs its tree): the first step records the
order in which units run forward and begin backward (`_Schedule`); from then on a unit's
pre-forward (pre-backward) launches the next unit's all-gather asynchronously, so it travels
while this unit computes, and the next unit's hook only waits for it. Two units are whole at
a time instead of one; the values are the same bytes, so results are bitwise unchanged.

The registered parameters stay the same `nn.Parameter` objects (their data becomes the shard
piece), so an optimizer built before `fully_shard` works as well as one built after.
Shapes: `p.shape` of a sharded parameter is its 1-D piece; `full_state_dict()` gives the
original tensors. Gradient clipping must reduce the norm over ranks: `clip_grad_norm_`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from nanoddp.comm.backend import DEFAULT_COMM_BACKEND, collectives_for
from nanoddp.parallel.sharded.flat import FlatParamUnit
from nanoddp.parallel.sharded.grad_reduce import GradReduceScatter
from nanoddp.parallel.sharded.module import ShardedModule
from nanoddp.parallel.tensors import tensors_in

logger = logging.getLogger(__name__)


def _in_backward() -> bool:
    """True while autograd runs backward (e.g. an activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


class FSDPModule(ShardedModule):
    """Mixed into a module's class by `fully_shard`: the methods of a sharded module."""

    _fsdp_unit: FlatParamUnit | None
    _fsdp_reduce: GradReduceScatter | None
    _fsdp_schedule: _Schedule

    def _fsdp_tree(self) -> list[FSDPModule]:
        return [m for m in self.modules() if isinstance(m, FSDPModule)]

    def set_requires_gradient_sync(self, sync: bool) -> None:
        """False: backward accumulates full gradients locally (no reduce-scatter) for this
        module and every sharded module inside it."""
        for m in self._fsdp_tree():
            if m._fsdp_reduce is not None:
                m._fsdp_reduce.sync = sync

    def _units(self) -> list[FlatParamUnit]:
        return [m._fsdp_unit for m in self._fsdp_tree() if m._fsdp_unit is not None]


class _Schedule:
    """The order a tree's units ran in, learned once, to know which all-gather to start next.

    Why learned and not derived: the module tree does not say in which order `forward` calls
    its blocks, the first run does. The forward order is recorded during the root's first
    forward; the backward order (pre-backward hooks firing) during the first backward, and
    closed by the next root forward. Every rank runs the same code, so every rank records the
    same order and launches the same prefetches in the same order.
    """

    def __init__(self, root: nn.Module, prefetch: bool):
        self.root = root
        self.prefetch = prefetch
        self.forward: list[FlatParamUnit] | None = None
        self.backward: list[FlatParamUnit] | None = None
        self._recording: list[FlatParamUnit] | None = None
        self._backward_recording: list[FlatParamUnit] = []

    def forward_begins(self) -> None:
        if self.backward is None and self._backward_recording:
            self.backward = self._backward_recording
        if self.forward is None:
            self._recording = []

    def forward_ends(self) -> None:
        if self._recording is not None:
            self.forward, self._recording = self._recording, None

    def ran_forward(self, unit: FlatParamUnit) -> FlatParamUnit | None:
        """Note `unit`'s forward; the unit to prefetch now (None: none, or not learned yet)."""
        if self._recording is not None and unit not in self._recording:
            self._recording.append(unit)
        return self._after(self.forward, unit)

    def ran_backward(self, unit: FlatParamUnit) -> FlatParamUnit | None:
        if self.backward is None and unit not in self._backward_recording:
            self._backward_recording.append(unit)
        return self._after(self.backward, unit)

    def _after(self, order: list[FlatParamUnit] | None, unit: FlatParamUnit) -> FlatParamUnit | None:
        if not self.prefetch or order is None or unit not in order:
            return None
        i = order.index(unit)
        return order[i + 1] if i + 1 < len(order) else None


def _prefetch(unit: FlatParamUnit | None) -> None:
    """Start `unit`'s all-gather now, without waiting, unless its full values are current."""
    if unit is not None and unit.stale:
        unit.gather(async_op=True)


def _pre_forward(module: nn.Module, args: Any) -> None:
    schedule, unit = module._fsdp_schedule, module._fsdp_unit
    recompute = _in_backward()  # a checkpoint recompute: pre-backward gathered already
    if schedule.root is module and not recompute:
        schedule.forward_begins()
    if unit is None:
        return
    unit.wait_gather()
    if unit.stale:
        unit.gather()
    unit.use_unsharded()
    if not recompute:
        _prefetch(schedule.ran_forward(unit))


def _post_forward(module: nn.Module, args: Any, output: Any) -> Any:
    if _in_backward():  # checkpoint recompute: backward is about to use these values
        if module._fsdp_unit is not None:
            module._fsdp_unit.use_sharded()
        return output
    if module._fsdp_schedule.root is module:
        module._fsdp_schedule.forward_ends()
    unit = module._fsdp_unit
    if unit is None:
        return output
    unit.use_sharded()
    if module._fsdp_reshard:
        unit.free()
    outputs = [t for t in tensors_in(output) if t.requires_grad]
    if outputs:
        torch.autograd.graph.register_multi_grad_hook(outputs, lambda _: _pre_backward(module), mode="any")
    return output


def _pre_backward(module: nn.Module) -> None:
    unit = module._fsdp_unit
    unit.wait_gather()
    if not unit.gathered:
        unit.gather()
    _prefetch(module._fsdp_schedule.ran_backward(unit))


def fully_shard(
    module: nn.Module,
    *,
    group: dist.ProcessGroup | None = None,
    reshard_after_forward: bool = True,
    comm_backend: str = DEFAULT_COMM_BACKEND,
    prefetch: bool = True,
) -> nn.Module:
    """Shard `module`'s own parameters (those not in an already sharded submodule) over `group`.

    In place; returns `module`, whose class now also derives from `FSDPModule`. Every rank
    must start from the same values (seed the init, or broadcast first). Build the optimizer
    over `module.parameters()` afterwards, or before: the parameter objects are kept.
    `prefetch`: overlap the next unit's all-gather with this one's compute (the outermost
    `fully_shard` call's value holds for every sharded module inside it).
    """
    if isinstance(module, FSDPModule):
        raise ValueError(f"{type(module).__name__} is already sharded: call fully_shard once per module")
    collectives = collectives_for(comm_backend)
    inner = {
        id(p)
        for sub in module.modules()
        if isinstance(sub, FSDPModule) and sub._fsdp_unit
        for p in sub._fsdp_unit.params
    }
    params = [p for p in module.parameters() if id(p) not in inner]
    cls = module.__class__
    module.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    module._fsdp_unit = None
    module._fsdp_reduce = None
    module._fsdp_reshard = reshard_after_forward
    schedule = _Schedule(module, prefetch)  # this module is the root of every unit inside it
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub._fsdp_schedule = schedule
    module.register_forward_pre_hook(_pre_forward)
    module.register_forward_hook(_post_forward)
    if not params:
        return module
    unit = FlatParamUnit(module, params, group, collectives)
    module._fsdp_unit = unit
    after_unit = (lambda u: u.free()) if reshard_after_forward else None
    # A checkpoint recompute may stop early, skipping the post-forward hook: the shards are
    # registered again when backward ends, whatever happened inside it.
    module._fsdp_reduce = GradReduceScatter([unit], after_unit=after_unit, after_backward=unit.use_sharded)
    if reshard_after_forward:
        unit.free()
    logger.debug(
        "fully_shard %s: %d params, %d elements, %d per rank",
        cls.__name__,
        len(params),
        unit.layout.total,
        unit.layout.chunk,
    )
    return module


@torch.no_grad()
def clip_grad_norm_(module: nn.Module, max_norm: float, comm_backend: str = DEFAULT_COMM_BACKEND) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for sharded gradients: the norm is summed over ranks."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    local = torch.zeros((), dtype=torch.float32)
    for g in grads:
        local += g.detach().float().pow(2).sum().cpu()
    if dist.is_initialized():
        collectives_for(comm_backend).all_reduce(local)
    total = local.sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.to(g.device))
    return total
