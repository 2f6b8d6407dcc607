"""When a sharded module's parameters are gathered, freed and reduced: the forward and backward hooks.

Why hooks and not a wrapper: FSDP2 code calls the module itself (`model(x)`), keeps its class
and its attribute paths, so all the work happens in hooks `fully_shard` registers:
  1. pre-forward: cast floating inputs to `param_dtype`; finish this unit's all-gather (started
     here, or earlier by a prefetch or `unshard()`) and register the whole tensors; launch the
     all-gathers of the units expected next (prefetch);
  2. post-forward: if `reshard_after_forward`, free the whole tensors and register the DTensor
     shards again (autograd keeps the objects, their bytes come back in 3); if not, the whole
     tensors stay registered, as torch's FSDP2 leaves them, until a reshard (end of backward,
     `reshard()`, `state_dict()`); hook the outputs so backward reaching them runs 3; cast
     outputs to `output_dtype`;
  3. pre-backward: all-gather again; prefetch the unit backward reaches next;
  4. post-accumulate-grad hooks on the whole tensors: when every trainable one of a unit has its
     gradient, launch the unit's reduce-scatter and free its whole tensors;
  5. end of backward (an autograd engine callback, queued once per backward): launch the units
     that began backward but never completed, wait for every reduce-scatter, hand the shards
     their `.grad`, reshard everything.

A unit over several modules (`fully_shard([a, b])`, one state for all of them): each module's
pre-forward gathers (the first one does the work), and the post-forward of the last of them to
run finishes the unit (2). When the root's forward ran only some of them (a head called later,
chunk by chunk), the root's post-forward finishes the unit; a later call gathers it again.

Prefetch, by default learned: the first step records the order in which units run forward and
begin backward (every rank runs the same code, so every rank records the same order); from
then on each unit launches the next one's all-gather before computing. The values are the same
bytes gathered earlier, so results do not change. `set_modules_to_forward_prefetch` /
`set_modules_to_backward_prefetch` replace the learned choice for a module.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum, auto
from typing import Any, cast

import torch
import torch.nn as nn

from nanoddp.parallel.fsdp.param import ShardedParam
from nanoddp.parallel.fsdp.policies import MixedPrecisionPolicy
from nanoddp.parallel.fsdp.unit import ShardedUnit
from nanoddp.parallel.tensors import cast_floats, tensors_in


class TrainingState(Enum):
    """Where one state is in the iteration (torch's `TrainingState`)."""

    IDLE = auto()  # between passes: before forward, after forward, after the end of backward
    FORWARD = auto()  # from the unit's first pre-forward to the end of its forward
    PRE_BACKWARD = auto()  # backward reached the unit's outputs: gathered again, grads awaited
    POST_BACKWARD = auto()  # the unit's reduce-scatter launched; the end of backward waits for it


def _in_backward() -> bool:
    """True while autograd runs backward (e.g. an activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


class ModuleState:
    """What `fully_shard` attached to one module: its unit (None if it took no parameters),
    its policies and switches, and the tree it belongs to."""

    def __init__(
        self, modules: tuple[nn.Module, ...], unit: ShardedUnit | None, mp: MixedPrecisionPolicy, reshard: bool | None
    ):
        self.modules = modules  # one for fully_shard(module); every module of fully_shard([a, b])
        self.to_run: list[nn.Module] = []  # this forward pass: the unit's modules whose forward has not ended
        self.unit = unit
        self.mp = mp
        self.reshard_after_forward = reshard  # None: True except for the root
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.unshard_in_backward = True
        self.forward_prefetch: list[ModuleState] | None = None  # explicit, else learned
        self.backward_prefetch: list[ModuleState] | None = None
        self.tree = TreeState(self)
        self._hooked: set[int] = set()  # ids of whole tensors carrying our grad hook
        self._fired: set[int] = set()  # ids of whole tensors whose gradient landed this backward
        self.training_state = TrainingState.IDLE

    def is_root(self) -> bool:
        return self.tree.root is self

    # --- torch's names, for torch's `register_fsdp_forward_method` on our modules ----------------

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return pre_forward(module, args, kwargs)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        return post_forward(module, args, {}, output)

    def resharding_after_forward(self) -> bool:
        if self.reshard_after_forward is None:
            return not self.is_root()
        return self.reshard_after_forward

    # --- parameters ------------------------------------------------------------------------------

    def unshard(self) -> None:
        """Whole tensors ready (gathered now, or a prefetch waited for) and hooked for grads."""
        unit = self.unit
        assert unit is not None  # called for states with a unit only
        # A parameter assigned since (a DTensor, as torch's lazy init re-reads it) becomes the shard
        unit.adopt_registered()
        if unit.is_unsharded and unit.stale():
            unit.reshard()
        unit.finish_unshard()
        for p in unit.trainable():
            if id(p.unsharded) not in self._hooked:
                assert p.unsharded is not None  # finish_unshard allocated it
                self._hooked.add(id(p.unsharded))
                p.unsharded.register_post_accumulate_grad_hook(lambda _, p=p: self._on_grad(p))

    def prefetch(self, targets: list[ModuleState]) -> None:
        for t in targets:
            if t.unit is not None and (not t.unit.is_unsharded or t.unit.stale()):
                if t.unit.is_unsharded:
                    t.unit.reshard()
                t.unit.start_unshard()

    # --- gradients -------------------------------------------------------------------------------

    def _on_grad(self, p: ShardedParam) -> None:
        self.tree.queue_final_callback()
        self._fired.add(id(p.unsharded))
        assert self.unit is not None  # its hooks are on the unit's whole tensors
        ready = all(id(q.unsharded) in self._fired for q in self.unit.trainable())
        if self.requires_gradient_sync and self.training_state != TrainingState.POST_BACKWARD and ready:
            self._launch()

    def _launch(self) -> None:
        self.training_state = TrainingState.POST_BACKWARD
        assert self.unit is not None  # launched for states with a unit only
        self.tree.pending.append(self.unit.start_reduce())
        if self.reshard_after_backward:
            self.unit.reshard()

    def end_backward(self) -> None:
        """Called by the tree's final callback, for every state, in tree order."""
        # began backward (its outputs' hook ran, or a gradient landed) but not launched yet
        unlaunched = self.training_state == TrainingState.PRE_BACKWARD or (
            self._fired and self.training_state != TrainingState.POST_BACKWARD
        )
        if self.unit is not None and self.requires_gradient_sync and unlaunched:
            self._launch()
        self._fired, self.training_state = set(), TrainingState.IDLE

    def finish_forward(self, output: Any) -> None:
        """The unit's forward ended (its last module's, or forced by the root's): reshard or keep
        the whole tensors registered, and hook `output` so backward reaching it gathers again."""
        self.to_run, self.training_state = [], TrainingState.IDLE
        if self.unit is not None and self.resharding_after_forward():
            self.unit.reshard_after_forward()
        outputs = [t for t in tensors_in(output) if t.requires_grad]
        if outputs:
            torch.autograd.graph.register_multi_grad_hook(outputs, lambda _: pre_backward(self), mode="any")

    def reset_iter_state(self) -> None:
        """Forget a forward or backward an exception cut short (`FSDPModule.reset_iter_state`)."""
        self.to_run = []
        self._fired, self.training_state = set(), TrainingState.IDLE
        if self.unit is not None:
            self.unit.reset_iter_state()

    def after_backward(self) -> None:
        self.to_run = []
        if self.unit is None:
            return
        if self.reshard_after_backward:
            self.unit.reshard()
        else:
            self.unit.register(unsharded=False)


class TreeState:
    """Shared by every sharded module under one root (the outermost `fully_shard` call): the
    learned orders and the end-of-backward bookkeeping."""

    def __init__(self, root: ModuleState):
        self.root = root
        self.states: list[ModuleState] = [root]
        self.learned_prefetch = True
        self.forward_order: list[ModuleState] | None = None
        self.backward_order: list[ModuleState] | None = None
        self._recording: list[ModuleState] | None = None
        self._backward_recording: list[ModuleState] = []
        self.pending: list[Callable[..., None]] = []  # finishers of launched reduce-scatters, in launch order
        self._callback_queued = False
        self.is_last_backward = True  # set_is_last_backward: every backward waits anyway
        self.checked = False  # the root's first forward checked the tree (torch's lazy init)

    def adopt(self, other: TreeState) -> None:
        """`other`'s root was sharded before this root: its modules join this tree."""
        for s in other.states:
            s.tree = self
            self.states.append(s)

    def lazy_init(self, root_module: nn.Module) -> None:
        """The root's first forward: every `fully_shard` call has been made by now, so a
        parameter two calls took (a tie across units) is refused here, as torch's lazy init
        refuses it, naming it by its path from the root."""
        if self.checked:
            return
        states = {id(_state_of(m)): _state_of(m) for m in root_module.modules() if hasattr(m, "_fsdp_state")}
        names = {id(p): n for n, p in root_module.named_parameters()}
        first: dict[int, tuple[str, ModuleState]] = {}  # orig_uid -> (its name, the state that took it)
        for state in states.values():  # in root_module.modules() order, as torch's
            for p in state.unit.params if state.unit is not None else ():
                name = names.get(id(p.sharded), names.get(id(p.unsharded), "?"))
                if p.orig_uid in first:
                    other, by = first[p.orig_uid]
                    raise ValueError(
                        f"Parameter '{name}' is shared with a parameter already managed by another FSDP group. "
                        "For shared/tied parameters, use fully_shard([module_a, module_b]) to place them in "
                        f"the same FSDP group. ('{name}' is '{other}', which fully_shard on "
                        f"{_where(by, root_module)} took; fully_shard on {_where(state, root_module)} took it again)"
                    )
                first[p.orig_uid] = (name, state)
        self.checked = True

    def reset_iter_state(self) -> None:
        """After an exception cut a forward or backward short: wait for (and drop) the launched
        reduce-scatters, reshard every unit, and forget the half-run iteration, so the next
        forward starts clean. Its gradients are lost (torch's `reset_iter_state`)."""
        pending, self.pending = self.pending, []
        for finish in pending:
            finish(keep=False)
        self._callback_queued = False  # autograd drops a failed backward's callbacks
        self._recording = None  # a half-recorded first forward is recorded again next time
        if self.backward_order is None:
            self._backward_recording = []
        for s in self.states:
            s.reset_iter_state()

    # --- learned order ---------------------------------------------------------------------------

    def forward_begins(self) -> None:
        if self.backward_order is None and self._backward_recording:
            self.backward_order = self._backward_recording
        if self.forward_order is None:
            self._recording = []

    def forward_ends(self) -> None:
        if self._recording is not None:
            self.forward_order, self._recording = self._recording, None

    def ran_forward(self, state: ModuleState) -> list[ModuleState]:
        """Note `state`'s forward; the states whose all-gather to launch now."""
        if self._recording is not None and state not in self._recording:
            self._recording.append(state)
        if state.forward_prefetch is not None:
            return state.forward_prefetch
        return self._after(self.forward_order, state)

    def finish_partial_units(self, output: Any) -> None:
        """The root's forward ended: finish the units of which only some modules ran (their
        rest runs later, e.g. a head called per chunk), hooking the root's output for them."""
        for s in reversed(self.states):
            if s is not self.root and s.to_run:
                s.finish_forward(output)

    def ran_backward(self, state: ModuleState) -> list[ModuleState]:
        if self.backward_order is None and state not in self._backward_recording:
            self._backward_recording.append(state)
        if state.backward_prefetch is not None:
            return state.backward_prefetch
        return self._after(self.backward_order, state)

    def _after(self, order: list[ModuleState] | None, state: ModuleState) -> list[ModuleState]:
        if not self.learned_prefetch or order is None or state not in order:
            return []
        i = order.index(state)
        return order[i + 1 : i + 2]

    # --- end of backward -------------------------------------------------------------------------

    def queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._final_callback)

    def _final_callback(self) -> None:
        self._callback_queued = False
        for s in self.states:
            s.end_backward()
        pending, self.pending = self.pending, []
        for finish in pending:
            finish()
        for s in self.states:
            s.after_backward()


# --- the hooks -----------------------------------------------------------------------------------


def _state_of(module: nn.Module) -> ModuleState:
    """What `fully_shard` attached (`FSDPModule._fsdp_state`; nn.Module types attributes as tensors/modules)."""
    return cast(ModuleState, module._fsdp_state)


def _where(state: ModuleState, root: nn.Module) -> str:
    """`state`'s modules by their paths from `root`, for an error message."""
    paths = {id(m): n for n, m in root.named_modules()}
    return ", ".join(f"'{paths[id(m)]}'" if paths.get(id(m)) else "the root" for m in state.modules)


def pre_forward(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Before `module`'s forward (or a method given to `register_fsdp_forward_method`)."""
    state = _state_of(module)
    if state.mp.cast_forward_inputs and state.mp.param_dtype is not None:
        args, kwargs = cast_floats(args, state.mp.param_dtype), cast_floats(kwargs, state.mp.param_dtype)
    if _in_backward():  # a checkpoint recompute: the whole tensors must be there
        if state.unit is not None:
            state.unshard()
            state.unit.register(unsharded=True)
        return args, kwargs
    tree = state.tree
    if state.is_root():
        if len(state.modules) > 1:  # nothing would run before its first module or after its last
            raise RuntimeError(
                f"FSDP requires a single root module but got {state.modules}: call fully_shard on a "
                "module that contains them all after fully_shard([...])"
            )
        tree.lazy_init(module)
        tree.forward_begins()
    first_of_unit = state.training_state != TrainingState.FORWARD  # the first of the unit's modules
    if first_of_unit:
        state.to_run, state.training_state = list(state.modules), TrainingState.FORWARD
    if state.unit is not None:
        state.unshard()
        state.unit.register(unsharded=True)
    if first_of_unit:
        state.prefetch(tree.ran_forward(state))
    return args, kwargs


def post_forward(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    """After `module`'s forward: finish the unit once all of its modules that run have run."""
    state = _state_of(module)
    if _in_backward():
        if state.unit is not None:
            state.unit.register(unsharded=False)
        return cast_floats(output, state.mp.output_dtype)
    if module in state.to_run:
        state.to_run.remove(module)
    if state.to_run:  # more of the unit's modules to run: keep the whole tensors (torch: cast only)
        return cast_floats(output, state.mp.output_dtype)
    if state.is_root():
        state.tree.forward_ends()
    state.finish_forward(output)
    if state.is_root():
        state.tree.finish_partial_units(output)
    return cast_floats(output, state.mp.output_dtype)


def pre_backward(state: ModuleState) -> None:
    state.tree.queue_final_callback()
    if state.training_state != TrainingState.POST_BACKWARD:  # a later output: launched already
        state.training_state = TrainingState.PRE_BACKWARD
    if state.unit is not None and state.unshard_in_backward:
        state.unshard()
    state.prefetch(state.tree.ran_backward(state))
