"""FSDP / ZeRO-3: `fully_shard(module)` keeps only this rank's 1/ws of the parameters.

Why: ZeRO-2 still holds every parameter on every rank. Here a module's parameters live as
flat shards (`nanoddp.parallel.flat.FlatParamUnit`) and exist whole only while that module
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

The registered parameters stay the same `nn.Parameter` objects (their data becomes the shard
piece), so an optimizer built before `fully_shard` works as well as one built after.
Shapes: `p.shape` of a sharded parameter is its 1-D piece; `full_state_dict()` gives the
original tensors. Gradient clipping must reduce the norm over ranks: `clip_grad_norm_`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from nanoddp.comm.backend import DEFAULT_COMM_BACKEND, collectives_for
from nanoddp.parallel import flat
from nanoddp.parallel.flat import FlatParamUnit, GradReduceScatter, tensors_in

logger = logging.getLogger(__name__)


def _in_backward() -> bool:
    """True while autograd runs backward (e.g. an activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


class FSDPModule:
    """Mixed into a module's class by `fully_shard`: the methods of a sharded module."""

    _fsdp_unit: FlatParamUnit | None
    _fsdp_reduce: GradReduceScatter | None

    def _fsdp_tree(self) -> list[FSDPModule]:
        return [m for m in self.modules() if isinstance(m, FSDPModule)]

    def set_requires_gradient_sync(self, sync: bool) -> None:
        """False: backward accumulates full gradients locally (no reduce-scatter) for this
        module and every sharded module inside it."""
        for m in self._fsdp_tree():
            if m._fsdp_reduce is not None:
                m._fsdp_reduce.sync = sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: micro-steps inside skip the reduce-scatter (DDP's spelling)."""
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)

    def _units(self) -> list[FlatParamUnit]:
        return [m._fsdp_unit for m in self._fsdp_tree() if m._fsdp_unit is not None]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded `state_dict` (CPU tensors, original shapes). Collective: all ranks call it."""
        return flat.full_state_dict(self, self._units())

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load whole tensors (saved at any world size, or by a plain model); each rank keeps its pieces."""
        flat.load_full_state_dict(self, self._units(), state)

    def sharded_bytes(self) -> dict[str, int]:
        """Parameter and gradient bytes this rank holds now, over every unit in the tree."""
        units = [m._fsdp_unit for m in self._fsdp_tree() if m._fsdp_unit is not None]
        return {"params": sum(u.resident_bytes() for u in units), "grads": sum(u.grad_bytes() for u in units)}


def _pre_forward(module: nn.Module, args: Any) -> None:
    unit = module._fsdp_unit
    if unit.stale:
        unit.gather()
    unit.use_unsharded()


def _post_forward(module: nn.Module, args: Any, output: Any) -> Any:
    unit = module._fsdp_unit
    unit.use_sharded()
    if _in_backward():  # checkpoint recompute: backward is about to use these values
        return output
    if module._fsdp_reshard:
        unit.free()
    outputs = [t for t in tensors_in(output) if t.requires_grad]
    if outputs:
        torch.autograd.graph.register_multi_grad_hook(outputs, lambda _: _pre_backward(unit), mode="any")
    return output


def _pre_backward(unit: FlatParamUnit) -> None:
    if not unit.gathered:
        unit.gather()


def fully_shard(
    module: nn.Module,
    *,
    group: dist.ProcessGroup | None = None,
    reshard_after_forward: bool = True,
    comm_backend: str = DEFAULT_COMM_BACKEND,
) -> nn.Module:
    """Shard `module`'s own parameters (those not in an already sharded submodule) over `group`.

    In place; returns `module`, whose class now also derives from `FSDPModule`. Every rank
    must start from the same values (seed the init, or broadcast first). Build the optimizer
    over `module.parameters()` afterwards, or before: the parameter objects are kept.
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
    module.register_forward_pre_hook(_pre_forward)
    module.register_forward_hook(_post_forward)
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
