"""The methods a module gains from `fully_shard`: FSDP2's `FSDPModule` surface.

Why a mixin: `fully_shard` changes the module's class to a new `FSDP<Cls>` deriving from
(`FSDPModule`, Cls), as torch does, so `isinstance(m, FSDPModule)` holds, the module keeps its
own methods and attribute paths, and these methods are just there.

Why it derives from torch's `FSDPModule`: code that branches on
`isinstance(m, torch.distributed.fsdp.FSDPModule)` (torch's `register_fsdp_forward_method`,
pipelining, memory trackers) must treat our modules as FSDP modules. torch's methods reach
into torch's state, so every one we do not implement (custom collectives, streams, symmetric
memory) is made absent (`_Absent`: `hasattr` is False, a call is an AttributeError naming it),
and `_get_fsdp_state()` returns our state, which has the `_pre_forward`/`_post_forward` that
torch's `register_fsdp_forward_method` calls.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import UnshardHandle as TorchUnshardHandle
from torch.distributed.tensor import DTensor

from nanoddp.parallel.fsdp.state import ModuleState, post_forward, pre_forward
from nanoddp.parallel.fsdp.state_dict import full_state, load_full_state

# A mixin for nn.Module subclasses only: type-checked as one (its methods use the module's own),
# a plain class at runtime (the module's class comes after it in the MRO).
if TYPE_CHECKING:
    _ModuleBase = nn.Module
else:
    _ModuleBase = object


class UnshardHandle(TorchUnshardHandle):
    """What `unshard(async_op=True)` returns: `wait()` makes the whole parameters usable."""

    def __init__(self, state: ModuleState | None = None):
        self._state = state

    def wait(self) -> None:
        if self._state is not None:
            self._state.unshard()
            assert self._state.unit is not None  # unshard() hands out a state handle only for a unit
            self._state.unit.register(unsharded=True)
            self._state = None


class _Absent:
    """A torch `FSDPModule` method nanoddp does not implement: reading it raises AttributeError."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj: object, owner: type | None = None) -> NoReturn:
        raise AttributeError(
            f"nanoddp's FSDPModule has no {self.name}: a torch FSDP2 feature nanoddp does not implement "
            "(torch.distributed.fsdp.fully_shard has it)"
        )


def no_deepcopy(*args: Any, **kwargs: Any) -> NoReturn:
    """`copy.deepcopy` of a sharded module: refused as torch refuses it (the copy would share
    the hooks' state with the original)."""
    raise AssertionError("FSDP does not support deepcopy. Please use state dict for serialization.")


class FSDPModule(TorchFSDPModule, _ModuleBase):
    """Mixed in before the module's own class by `fully_shard`."""

    _fsdp_state: ModuleState
    # torch's `__new__` builds the original class, found at this index of an `FSDP<Cls>`'s MRO:
    # [FSDP<Cls>, FSDPModule, torch's FSDPModule, Cls, ...]; so slicing an `nn.Sequential` works.
    _orig_cls_mro_index: int = 3

    def _get_fsdp_state(self) -> ModuleState:  # type: ignore[override]
        """Our state, under torch's name (torch's `register_fsdp_forward_method` calls it)."""
        return self._fsdp_state

    def _fsdp_states(self, recurse: bool = True) -> list[ModuleState]:
        if not recurse:
            return [self._fsdp_state]
        states = {id(m._fsdp_state): m._fsdp_state for m in self.modules() if isinstance(m, FSDPModule)}
        return list(states.values())  # a unit over several modules counted once

    # --- parameters ------------------------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's own parameters now (not its sharded submodules'). With
        `async_op` the gather is only launched: the returned handle's `wait()` (or this module's
        next forward) finishes it."""
        state = self._fsdp_state
        if state.unit is None:
            return UnshardHandle() if async_op else None
        state.unit.start_unshard()
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's whole parameters and register the shards again (not recursive)."""
        if self._fsdp_state.unit is not None:
            self._fsdp_state.unit.reshard()

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:  # type: ignore[override]
        """This module's pre-forward launches these modules' all-gathers (instead of the learned next)."""
        self._fsdp_state.forward_prefetch = [_state_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:  # type: ignore[override]
        """This module's pre-backward launches these modules' all-gathers (instead of the learned next)."""
        self._fsdp_state.backward_prefetch = [_state_of(m) for m in modules]

    # --- switches --------------------------------------------------------------------------------

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward accumulates whole gradients locally, with no reduce-scatter (gradient
        accumulation); the next backward with True reduces the sum."""
        for s in self._fsdp_states(recurse):
            s.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free the whole parameters after forward (True) or keep them for backward (False)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward must be a bool, got {reshard_after_forward!r}")
        for s in self._fsdp_states(recurse):
            s.reshard_after_forward = reshard_after_forward
            if s.unit is not None:  # a bool replaces a `fully_shard(reshard_after_forward=<int>)`, as torch's
                s.unit.post_forward_mesh = None

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Free the whole parameters once a unit's gradients are reduced (True) or keep them."""
        for s in self._fsdp_states(recurse):
            s.reshard_after_backward = reshard_after_backward

    def reset_iter_state(self) -> None:
        """After an exception cut a forward or backward short, call this on the root, then run
        the next iteration as usual: it waits for the collectives in flight, reshards every
        unit, and forgets the half-run iteration. That iteration's gradients are lost, also
        those kept by `set_requires_gradient_sync(False)` or `set_requires_all_reduce(False)`:
        restart the accumulation. A RuntimeError on a module that is not the root, as torch's."""
        state = self._fsdp_state
        if not state.is_root():
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")
        state.tree.reset_iter_state()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 code: every backward here already waits for all of its reductions
        before it returns, which is what the last backward must do."""
        self._fsdp_state.tree.is_last_backward = is_last_backward

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters within the shard group but defers the all-reduce across
        replicas, accumulating; the next backward with True all-reduces the sum."""
        for s in self._fsdp_states(recurse):
            if s.unit is not None:
                s.unit.all_reduce = requires_all_reduce

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by `factor` instead of the data-parallel size."""
        for s in self._fsdp_states():
            if s.unit is not None:
                s.unit.divide_factor = factor

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: backward does not all-gather this module's parameters (for modules whose
        backward does not need them)."""
        self._fsdp_state.unshard_in_backward = unshard_in_backward

    # --- nanoddp's own -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's spelling of gradient accumulation: `set_requires_gradient_sync(False)` inside."""
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """`state_dict()` with every DTensor whole, as CPU tensors. Collective: all ranks call it."""
        return full_state(self)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load whole tensors (saved at any world size): each rank copies in its own rows."""
        load_full_state(self, state)

    def sharded_bytes(self) -> dict[str, int]:
        """Parameter and gradient bytes this rank holds now, over this module's tree."""
        units = [s.unit for s in self._fsdp_states() if s.unit is not None]
        grads = [p.sharded.grad for u in units for p in u.params] + [
            p.unsharded.grad for u in units for p in u.params if p.unsharded is not None
        ]
        local = [g._local_tensor if isinstance(g, DTensor) else g for g in grads if g is not None]
        grad_bytes = sum(g.numel() * g.element_size() for g in local)
        return {"params": sum(u.resident_bytes() for u in units), "grads": grad_bytes}

    def _apply(self, fn, recurse: bool = True):
        """`to`, `to_empty`, `double()`...: reshard first, so only the DTensor shards (and the
        buffers) are converted; the next all-gather allocates whole tensors to match."""
        for s in self._fsdp_states():
            if s.unit is not None:
                s.unit.reshard()
        return super(TorchFSDPModule, self)._apply(fn, recurse)  # past torch's, which reads its state


# torch's methods we do not implement: absent, not torch's (which would reach into torch's state)
for _name in dir(TorchFSDPModule):
    if not _name.startswith("__") and _name not in vars(FSDPModule) and callable(getattr(TorchFSDPModule, _name)):
        setattr(FSDPModule, _name, _Absent(_name))


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make `module.<method_name>` (e.g. `generate`) gather the parameters before it runs and
    reshard after, as forward does. A no-op for a module `fully_shard` did not shard, as in
    torch (so the same code runs sharded or not); torch's own function works on ours too."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    method = getattr(module, method_name)

    @functools.wraps(method)
    def gathered(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = pre_forward(module, args, kwargs)
        return post_forward(module, args, kwargs, method(*args, **kwargs))

    setattr(module, method_name, gathered)


def _state_of(module: nn.Module) -> ModuleState:
    if not isinstance(module, FSDPModule):
        raise ValueError(f"{type(module).__name__} is not sharded: call fully_shard on it first")
    return module._fsdp_state
