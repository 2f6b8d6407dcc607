"""Engines: the ways to keep N model replicas in step, behind one small interface.

| engine      | wraps the model in                  | gradient sync                          |
|-------------|-------------------------------------|----------------------------------------|
| `nanoddp`   | `nanoddp.DistributedDataParallel`   | bucketed all-reduce hooked into backward |
| `torch`     | `torch.nn.parallel.DistributedDataParallel` | the same, torch's C++ reducer   |
| `allreduce` | nothing                             | one all-reduce per parameter after backward |
| `rs_ag`     | nothing                             | one flat reduce-scatter + all-gather after backward |
| `single`    | nothing (one process)               | none                                   |
| `zero1`     | `nanoddp.DistributedDataParallel`   | as `nanoddp`; optimizer: `ZeroRedundancyOptimizer` |
| `zero2`     | ZeRO-2 hooks on the module (`parallel.zero.stage2`) | bucketed reduce-scatter into gradient shards |
| `fsdp`      | `nanoddp.fsdp.fully_shard` per unit, then the root | all-gather params per unit, reduce-scatter grads |

Gradient accumulation differs by kind: the DDP engines run the non-final micro-steps inside
`no_sync()` so that backward skips the all-reduce; the manual engines simply do not call their
sync function until the last micro-step. `Engine.micro_step(sync)` hides the difference.

The nanoddp modules are imported lazily, so this file works on its own.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, cast

import torch
import torch.nn as nn

from nanoddp.env import DistEnv

logger = logging.getLogger(__name__)


class CommTimer:
    """How long gradient communication was in flight during a step (first launch to last done),
    and how much of that was *exposed*: the step waiting on it after backward's last gradient
    was computed (the rest ran hidden under backward's compute).

    Exposed time is known where the engine sees when compute ended: nanoddp's DDP timeline (its
    last gradient hook) and the manual engines (their sync starts after backward, so all of it
    is exposed). A timed comm hook alone (traced torch DDP) gives the window only.
    """

    def __init__(self) -> None:
        self.total_s = 0.0
        self.exposed_s = 0.0
        self.exposed_known = True  # False once a step's window came without its compute end
        self._first: float | None = None
        self._last: float | None = None
        self._compute_done: float | None = None

    def launched(self) -> None:
        if self._first is None:
            self._first = time.perf_counter()

    def finished(self) -> None:
        self._last = time.perf_counter()

    def compute_done(self) -> None:
        """Backward's compute is over: whatever communication remains is waited for."""
        self._compute_done = time.perf_counter()

    def close_step(self) -> None:
        """Fold the current step's window into the totals (called once per optimizer step)."""
        if self._first is not None and self._last is not None:
            window = max(self._last - self._first, 0.0)
            self.total_s += window
            if self._compute_done is None:
                self.exposed_known = False
            else:  # never more than the window: a launch after compute (manual engines) is all exposed
                self.exposed_s += min(max(self._last - self._compute_done, 0.0), window)
        self._first = self._last = self._compute_done = None

    def add_timeline(self, timeline: list[tuple[str, float, object]]) -> None:
        """Take the step from a nanoddp DDP `last_timeline`: first bucket launch to all done, and
        the last gradient hook (else the finalize callback) as the end of backward's compute."""
        launches = [t for event, t, _ in timeline if event == "launch"]
        done = [t for event, t, _ in timeline if event == "done"]
        ready = [t for event, t, _ in timeline if event == "grad_ready"] or [
            t for event, t, _ in timeline if event == "finalize"
        ]
        if launches and done:
            self._first, self._last = launches[0], done[-1]
            self._compute_done = ready[-1] if ready else None

    def pop(self) -> tuple[float, float | None]:
        """(comm seconds, exposed seconds or None where not measured) since the last pop."""
        total, exposed = self.total_s, self.exposed_s if self.exposed_known else None
        self.total_s, self.exposed_s, self.exposed_known = 0.0, 0.0, True
        return total, exposed


def timed_comm_hook(hook: Callable, timer: CommTimer) -> Callable:
    """`hook` (state, bucket) -> Future, telling `timer` when the first bucket launches and each
    one finishes: the one way a DDP comm hook is timed (the trainer's and the tracer's).

    No return annotation on purpose: torch DDP rejects a hook whose annotation is anything but
    `Future[Tensor]`, and an absent one is accepted.
    """

    def timed(state, bucket):
        timer.launched()

        def done(fut: torch.futures.Future):
            timer.finished()
            return fut.value()

        return hook(state, bucket).then(done)

    timed.__name__ = f"timed_{getattr(hook, '__name__', 'hook')}"
    return timed


class _RecordsTimeline(Protocol):
    """nanoddp's DDP with `record_timeline` on (what `Engine.micro_step` checks for, by attribute)."""

    @property
    def last_timeline(self) -> list[tuple[str, float, object]]: ...


class Engine:
    """A model plus the rule for syncing its gradients.

    `model` is what the trainer calls forward on; `module` is the bare model (for saving,
    evaluation and the optimizer). `comm` times gradient communication where it can be seen.
    """

    def __init__(
        self,
        name: str,
        model: nn.Module,
        module: nn.Module,
        sync_grads: Callable[[nn.Module], None] | None = None,
        comm: CommTimer | None = None,
    ):
        self.name = name
        self.model = model
        self.module = module
        self.sync_grads = sync_grads
        self.comm = comm
        # zero2 / fsdp: after backward each rank holds a shard of the gradients (fsdp: of the
        # parameters too), so clipping, saving and evaluation must involve every rank.
        self.sharded = name in SHARDED_ENGINES

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the averaged gradients by their global norm: `nanoddp.clip_grad_norm_`, which
        takes each kind of gradient's part of the norm (replicated as is, fsdp's DTensors over
        the mesh, zero2's pieces over the group; collective for the sharded engines)."""
        from nanoddp.parallel.clip import clip_grad_norm_

        return clip_grad_norm_(self.module, max_norm)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's plain state_dict. Collective for sharded engines: call on every rank."""
        if self.name == "fsdp":  # DTensor parameters, nanoddp's fully_shard or torch's
            from nanoddp.parallel.fsdp.state_dict import full_state

            return full_state(self.module)
        if self.sharded:  # zero2: the module gained ShardedModule's methods
            from nanoddp.parallel.zero.module import ShardedModule

            assert isinstance(self.module, ShardedModule)
            return self.module.full_state_dict()
        return self.module.state_dict()

    @contextlib.contextmanager
    def micro_step(self, sync: bool) -> Iterator[None]:
        """Run one forward+backward inside this; gradients are averaged over ranks iff `sync`.

        DDP engines: `no_sync()` around the non-final micro-steps. Manual engines: the sync
        function runs after backward, on the final micro-step only.
        """
        no_sync = getattr(self.model, "no_sync", None)
        context = no_sync() if (not sync and no_sync is not None) else contextlib.nullcontext()
        with context:
            yield
        if sync and self.comm is not None and getattr(self.model, "record_timeline", False):
            self.comm.add_timeline(cast(_RecordsTimeline, self.model).last_timeline)
        if sync and self.sync_grads is not None:
            if self.comm is not None:
                self.comm.compute_done()  # the sync starts after backward: all of it is exposed
                self.comm.launched()
            self.sync_grads(self.module)
            if self.comm is not None:
                self.comm.finished()

    def end_step(self) -> None:
        if self.comm is not None:
            self.comm.close_step()


def device_ids_for(env: DistEnv) -> list[int] | None:
    return [env.device.index] if env.device.type == "cuda" else None


def _single(module: nn.Module, env: DistEnv) -> Engine:
    if env.world_size != 1:
        raise ValueError(
            f"engine 'single' runs one process, but the world size is {env.world_size}; use --nproc 1 or another engine"
        )
    return Engine("single", module, module)


def _torch_ddp(module: nn.Module, env: DistEnv) -> Engine:
    """torch's DDP exactly as users construct it: no comm hook, so its C++ reducer runs its own
    all-reduce path. Nothing here times it (`comm=None`); `nanoddp bench train` times every
    engine from outside (gradient hooks on the parameters and backward()'s return)."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    return Engine("torch", TorchDDP(module, device_ids=device_ids_for(env)), module)


def _nanoddp_ddp(module: nn.Module, env: DistEnv, name: str = "nanoddp") -> Engine:
    """Our DDP; also `zero1`'s engine (the trainer gives zero1 a ZeroRedundancyOptimizer)."""
    from nanoddp.parallel.ddp.wrapper import DistributedDataParallel

    model = DistributedDataParallel(module, device_ids=device_ids_for(env))
    model.record_timeline = True  # a few timestamps per step: the comm window for the log line
    return Engine(name, model, module, comm=CommTimer())


def _manual(name: str, sync_name: str) -> Callable[[nn.Module, DistEnv], Engine]:
    """A manual engine: no wrapper, `nanoddp.parallel.manual.<sync_name>` after backward."""

    def build(module: nn.Module, env: DistEnv) -> Engine:
        from nanoddp.comm.backend import collectives_for
        from nanoddp.parallel import manual
        from nanoddp.parallel.replicas import broadcast_coalesced

        # every replica starts from rank 0's weights (DDP does this itself; manual engines don't)
        broadcast_coalesced([*module.parameters(), *module.buffers()], collectives_for())
        return Engine(name, module, module, sync_grads=getattr(manual, sync_name), comm=CommTimer())

    return build


# --- sharded engines (ZeRO-2, FSDP) ----------------------------------------------------------
# The trainer builds its optimizer before the engine. zero2 keeps the parameter objects (their
# data becomes this rank's 1-D shard piece); fsdp (`nanoddp.fsdp.fully_shard`) registers new
# DTensor parameters, so the trainer shards the model and moves the optimizer onto them before
# resume (train/fsdp_engine.py), and the engine takes the sharded model as it is.
# What the trainer still needs for them (not here: train/trainer.py): gradient clipping over
# ranks (`Engine.clip_grad_norm_`), snapshots and model.pt from every rank (`Engine.state_dict`
# is collective, or per-rank sharded state), and the same number of eval forwards on every rank
# (fsdp all-gathers in every forward).


def _zero2(module: nn.Module, env: DistEnv) -> Engine:
    from nanoddp.comm.backend import collectives_for
    from nanoddp.parallel.replicas import broadcast_coalesced
    from nanoddp.parallel.zero.stage2 import Zero2Module, zero2

    if isinstance(module, Zero2Module):  # installed by the user: used as is
        return Engine("zero2", module, module)
    broadcast_coalesced([*module.parameters(), *module.buffers()], collectives_for())  # rank 0's start
    return Engine("zero2", zero2(module), module)


def _fsdp(module: nn.Module, env: DistEnv) -> Engine:
    """A model sharded already (the trainer's `fsdp_engine.prepare_model`, or the user's own
    `fully_shard`) as is; a plain one sharded by the default auto-wrap rule, then the root."""
    from nanoddp.parallel.detect import sharded_by
    from nanoddp.train.fsdp_engine import shard_model

    if sharded_by(module) != "fsdp":
        shard_model(module, env)
    return Engine("fsdp", module, module)


# Engines whose ranks hold shards: their optimizer state is saved per rank (see the trainer).
SHARDED_ENGINES = frozenset({"zero2", "fsdp"})
# Engines that wrap the model in nanoddp's DDP (its timeline times communication; tracing hooks it).
NANODDP_DDP_ENGINES = frozenset({"nanoddp", "zero1"})


@dataclass(frozen=True)
class EngineKind:
    """One registry entry: how to build the engine, and its line in `nanoddp train --help`."""

    build: Callable[[nn.Module, DistEnv], Engine]
    help: str
    zero_optimizer: bool = False  # the optimizer must be a ZeroRedundancyOptimizer (ZeRO-1)


# The one engine registry: `nanoddp train --engine` (choices and help), TrainConfig's Literal,
# `bench train` and the traced engines all read it, so an engine added here is an engine everywhere.
ENGINE_REGISTRY: dict[str, EngineKind] = {
    "nanoddp": EngineKind(_nanoddp_ddp, "our DDP: bucketed all-reduce in backward"),
    "torch": EngineKind(_torch_ddp, "torch's DDP (its C++ reducer)"),
    "allreduce": EngineKind(_manual("allreduce", "allreduce_gradients"), "all-reduce per parameter after backward"),
    "rs_ag": EngineKind(
        _manual("rs_ag", "reduce_scatter_all_gather_gradients"),
        "reduce-scatter, all-gather after backward",
    ),
    "single": EngineKind(_single, "one process, no communication"),
    "zero1": EngineKind(
        functools.partial(_nanoddp_ddp, name="zero1"),
        "ZeRO-1: nanoddp + optimizer state sharded",
        zero_optimizer=True,
    ),
    "zero2": EngineKind(_zero2, "ZeRO-2: grads, optimizer state sharded"),
    "fsdp": EngineKind(_fsdp, "FSDP: parameters sharded too, per block"),
}
ENGINES = tuple(ENGINE_REGISTRY)
if TYPE_CHECKING:  # the checker needs the names spelled out; keep them in ENGINE_REGISTRY's order
    EngineName = Literal["nanoddp", "torch", "allreduce", "rs_ag", "single", "zero1", "zero2", "fsdp"]
else:
    EngineName = Literal[ENGINES]  # the type of TrainConfig.engine: its --engine choices


def engine_help() -> str:
    """One line per registry engine, `name  explanation`, for `--engine`'s help."""
    width = max(map(len, ENGINES))
    return "\n".join(f"  {name:<{width}}  {kind.help}" for name, kind in ENGINE_REGISTRY.items())


def build_engine(name: str, module: nn.Module, env: DistEnv) -> Engine:
    """Wrap `module` (already on `env.device`) for engine `name`."""
    if name not in ENGINE_REGISTRY:
        raise ValueError(f"unknown engine {name!r}; choose one of {list(ENGINES)}")
    return ENGINE_REGISTRY[name].build(module, env)
