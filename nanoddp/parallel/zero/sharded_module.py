"""What a flat-sharded module can do, whatever cut its flat units.

`zero2` turns a module into one whose registered parameters are this rank's pieces of flat
units (nanoddp.parallel.zero.flat). The user-facing methods that follow from that alone
(gradient accumulation, whole-tensor state dicts, memory accounting) live here, apart from how
the units are cut and reduced, so another flat kind would only say which units it has and how
its gradient reduction is switched off. (FSDP, `fully_shard`, shards DTensor rows instead:
`parallel.fsdp.module.FSDPModule` has the same methods for it.) Whole tensors go in and out
through the one conversion, `parallel.fsdp.state_dict`, which cuts a piece as it cuts rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from nanoddp.parallel.fsdp.state_dict import FlatPiece, full_state, load_full_state, piece_of_whole
from nanoddp.parallel.zero.flat import FlatParamUnit

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


# [Note: whole tensors in state_dict]
# A ZeRO-2 module's registered parameters are 1-D pieces, so torch's `state_dict()` would hold
# fragments: a rank-0 `torch.save` would write 1/ws of the model in shapes no plain model loads.
# Its hooks (`install_whole_state_dict`) swap each piece's entry for the whole tensor, which
# ZeRO-2 keeps in memory anyway: no copy, but a gather first when an optimizer changed the
# shards since the last one (the next forward's gather, done early). So `state_dict()` is
# collective after an optimizer step, as FSDP1's full state dict is: call it on every rank.
# `state_dict(keep_vars=True)` asks for the registered parameters themselves and gets them: the
# pieces (what the sharded checkpoint writes per rank). Loading takes whole tensors and keeps
# this rank's piece of each (pieces load as they are).


def install_whole_state_dict(module: nn.Module, units: list[FlatParamUnit]) -> None:
    """Make `module.state_dict()` hold whole tensors and `load_state_dict` take them."""

    def whole_entries(mod: nn.Module, state: dict[str, Any], prefix: str, _meta: Any) -> None:
        pieces = _piece_names(mod, units)
        # keep_vars=True asks for the registered parameters themselves: the pieces (no gather)
        pieces = {name: at for name, at in pieces.items() if not isinstance(state.get(prefix + name), nn.Parameter)}
        if not pieces:
            return
        for unit in {id(unit): unit for unit, _ in pieces.values()}.values():
            unit.wait_gather()
            if unit.stale:  # collective: every rank's optimizer stepped the same shards
                work = unit.gather()
                if work is not None:
                    work.wait()
        for name, (unit, i) in pieces.items():
            if prefix + name in state:
                state[prefix + name] = unit.unsharded[i].detach()

    def take_pieces(mod: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
        for name, (unit, i) in _piece_names(mod, units).items():
            value = state.get(prefix + name)
            if isinstance(value, torch.Tensor) and value.shape == unit.shapes[i]:
                piece = FlatPiece(unit.shapes[i], unit.pieces[i].start, unit.pieces[i].stop)
                state[prefix + name] = piece_of_whole(value, piece)  # (piece numel,)

    module.register_state_dict_post_hook(whole_entries)
    module.register_load_state_dict_pre_hook(take_pieces)


def _piece_names(module: nn.Module, units: list[FlatParamUnit]) -> dict[str, tuple[FlatParamUnit, int]]:
    """Each name a sharded parameter has in `module` (tied ones have several) -> its unit and index,
    whether the piece or the whole view is registered now."""
    where = {}
    for unit in units:
        for i, (p, u) in enumerate(zip(unit.params, unit.unsharded, strict=True)):
            where[id(p)] = where[id(u)] = (unit, i)
    named = module.named_parameters(remove_duplicate=False)
    return {name: where[id(p)] for name, p in named if id(p) in where}


def flat_pieces(units: list[FlatParamUnit]) -> dict[int, FlatPiece]:
    """id(registered piece) -> which elements of its whole parameter it holds: what a
    whole <-> piece conversion (`load_full_state`, a sharded checkpoint) needs to know."""
    return {
        id(p): FlatPiece(shape, piece.start, piece.stop)
        for unit in units
        for p, piece, shape in zip(unit.params, unit.pieces, unit.shapes, strict=True)
    }


def full_state_dict(module: nn.Module, units: list[FlatParamUnit]) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with every sharded parameter whole (CPU copies). Collective."""
    wholes = {id(p): value for unit in units for p, value in zip(unit.params, unit.full_tensors(), strict=True)}
    return full_state(module, wholes)


def load_full_state_dict(module: nn.Module, units: list[FlatParamUnit], state: dict[str, torch.Tensor]) -> None:
    """Load whole tensors (from `full_state_dict` or a plain model, at any world size): each
    rank keeps its pieces. No communication; the next forward gathers the new values."""
    load_full_state(module, state, flat_pieces(units))
