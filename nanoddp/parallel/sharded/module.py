"""What a flat-sharded module can do, whatever cut its flat units.

`zero2` turns a module into one whose registered parameters are this rank's pieces of flat
units (nanoddp.parallel.sharded.flat). The user-facing methods that follow from that alone
(gradient accumulation, whole-tensor state dicts, memory accounting) live here, apart from how
the units are cut and reduced, so another flat kind would only say which units it has and how
its gradient reduction is switched off. (FSDP, `fully_shard`, shards DTensor rows instead:
`fsdp_module.FSDPModule` has the same methods for it.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from nanoddp.parallel.sharded.flat import FlatParamUnit

# A mixin for nn.Module subclasses only: type-checked as one (its methods use the module's own),
# a plain class at runtime (the module's class comes after it in the MRO).
if TYPE_CHECKING:
    _ModuleBase = nn.Module
else:
    _ModuleBase = object


class ShardedModule(_ModuleBase):
    """Mixed into a module's class (before the module's own class) by `zero2`."""

    def _units(self) -> list[FlatParamUnit]:
        """The flat units whose pieces this module holds."""
        raise NotImplementedError

    def set_requires_gradient_sync(self, sync: bool) -> None:
        """False: backward accumulates full gradients locally, with no reduce-scatter."""
        raise NotImplementedError

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: micro-steps inside skip the reduce-scatter (DDP's spelling)."""
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded `state_dict` (CPU tensors, original shapes). Collective: all ranks call it."""
        return full_state_dict(self, self._units())

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load whole tensors (saved at any world size, or by a plain model); each rank keeps its pieces."""
        load_full_state_dict(self, self._units(), state)

    def sharded_bytes(self) -> dict[str, int]:
        """Parameter and gradient bytes this rank holds now, over every unit."""
        units = self._units()
        return {"params": sum(u.resident_bytes() for u in units), "grads": sum(u.grad_bytes() for u in units)}


def full_state_dict(module: nn.Module, units: list[FlatParamUnit]) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with every sharded parameter whole (CPU copies). Collective."""
    full = {}
    for unit in units:
        for p, value in zip(unit.params, unit.full_tensors(), strict=True):
            full[id(p)] = value
    return {
        name: full[id(v)] if id(v) in full else v.detach().to("cpu", copy=True)
        for name, v in module.state_dict(keep_vars=True).items()
    }


@torch.no_grad()
def load_full_state_dict(module: nn.Module, units: list[FlatParamUnit], state: dict[str, torch.Tensor]) -> None:
    """Load whole tensors (from `full_state_dict` or a plain model, at any world size): each
    rank keeps its pieces. No communication; the next forward gathers the new values."""
    own = module.state_dict(keep_vars=True)
    if set(state) != set(own):
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        raise ValueError(f"state dict keys differ from the module's: missing {missing}, unexpected {unexpected}")
    pieces = {
        id(p): (piece, shape)
        for unit in units
        for p, piece, shape in zip(unit.params, unit.pieces, unit.shapes, strict=True)
    }
    for name, target in own.items():
        value = state[name]
        if id(target) in pieces:
            piece, shape = pieces[id(target)]
            if value.shape != shape:
                raise ValueError(f"{name}: state dict has shape {tuple(value.shape)}, the parameter {tuple(shape)}")
            target.copy_(value.reshape(-1)[piece.start : piece.stop].to(target.device))  # (piece numel,)
        else:
            target.copy_(value)
