"""ZeRO-1/2 under per-step fault tolerance: each rank of the current group steps the parameters
it owns, and the owners' state is re-partitioned whenever the group changes.

The optimizer stays the user's plain one (AdamW over every parameter, the schedule bound to it);
what is sharded is which parameters it steps, and so which parameters it holds state for. The
owners are nanoddp ZeRO's whole-parameter partition (`assign_owners`: largest first to the least
loaded rank, param group after param group), a pure function of the sizes and the world size.
Whole parameters, not elements: AdamW steps each tensor on its own, so a parameter stepped by
its owner gets the same bits as when one process steps them all (the run equals engine nanoddp's
bitwise), and a parameter's state is never split between two ranks that may not both survive.

The life of one step, after `WeightedPieceSum` has given every rank the whole averaged gradient:
1. `step_owned`: the optimizer steps this rank's parameters only (the others' gradients are
   hidden; zero2 drops them for good, zero1 keeps them to `zero_grad`), after keeping a copy of
   what it changes; then every owner broadcasts its updated parameters to the group, into
   buffers. A lost peer fails here, before the step may commit.
2. `keep` (the step commits): the received parameters are written into the model.
   `roll_back` (it does not): the owned parameters and their state are put back, so that the
   redone step starts from the committed state.

When the group changes (`repartition`, at the boundary after the quorum), every member
contributes the state it holds if it is current, i.e. of the step the group is at: a survivor's
is; a joiner has none; a replica healed from a peer (it was behind) has dropped its own. The
state of a parameter nobody holds was lost with its owner: it is read from the newest snapshot
(`fallback`), or starts from zero if there is none, and the caller says so. Every rank then
keeps the state of the parameters it owns in the new group. The contributions are all-gathered,
so every rank holds the whole state for a moment: cheap for the CPU-sized models this serves.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import nanoddp.comm as comm
from nanoddp.parallel.zero.partition import assign_owners

# () -> (snapshot step, a whole optimizer state_dict) of the newest snapshot, or None
Fallback = Callable[[], tuple[int, dict[str, Any]] | None]


@dataclass(frozen=True)
class Refill:
    """What one re-partition could not take live: parameter `names` (indices `indices`), whose
    state came from the snapshot of step `snapshot_step` (None: none existed, it restarts)."""

    indices: list[int]
    names: list[str]
    snapshot_step: int | None


class OptimizerShards:
    """This rank's share of `optimizer`'s parameters and state in the current group (see above)."""

    def __init__(self, optimizer: torch.optim.Optimizer, names: list[str], stage: int, fallback: Fallback) -> None:
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 (zero1) or 2 (zero2), got {stage}")
        self.optimizer, self.stage, self.fallback = optimizer, stage, fallback
        self.params: list[torch.Tensor] = [p for group in optimizer.param_groups for p in group["params"]]
        if len(names) != len(self.params):
            raise ValueError(f"names must name the optimizer's {len(self.params)} parameters, got {len(names)}")
        self.names = names
        self.rank, self.world_size = 0, 1
        self.owner: list[int] = []
        self.current_at: int | None = 0  # the step this replica's state belongs to (None: dropped)
        self._kept: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any] | None]] = []
        self._received: list[tuple[list[torch.Tensor], torch.Tensor]] = []

    # -- the partition ------------------------------------------------------------------------
    def _owners(self, world_size: int) -> list[int]:
        loads = [0] * world_size  # continued from group to group, as ZeRO's optimizer does
        owners: list[int] = []
        for group in self.optimizer.param_groups:
            owners += assign_owners([p.numel() for p in group["params"]], world_size, loads)
        return owners

    def owned(self) -> list[torch.Tensor]:
        """The parameters this rank steps in the current group."""
        return [p for p, owner in zip(self.params, self.owner, strict=True) if owner == self.rank]

    def repartition(self, rank: int, world_size: int, step: int) -> Refill | None:
        """Collective over the current group at `step` committed steps: the state of the group's
        parameters from whoever holds it, the rest from the fallback; keep this rank's share.
        Returns what came from the fallback (None: everything was live)."""
        optimizer = self.optimizer
        mine = {}
        if self.current_at == step:
            mine = {i: optimizer.state[p] for i, p in enumerate(self.params) if p in optimizer.state}
        contributions: list[Any] = [None] * world_size
        dist.all_gather_object(contributions, mine)
        whole: dict[int, Any] = {}
        for contribution in contributions:  # rank order: after a resume every rank holds it all
            for index, state in contribution.items():
                whole.setdefault(index, state)
        missing = [] if step == 0 else [i for i in range(len(self.params)) if i not in whole]
        refill = None
        if missing:  # every rank reads the same newest snapshot: they agree on what came from where
            found = self.fallback()
            if found is not None:
                whole.update((i, found[1]["state"][i]) for i in missing)
            refill = Refill(missing, [self.names[i] for i in missing], None if found is None else found[0])
        self.rank, self.world_size, self.owner = rank, world_size, self._owners(world_size)
        optimizer.state.clear()
        for i in (i for i, p in enumerate(self.params) if self.owner[i] == rank and i in whole):
            optimizer.state[self.params[i]] = copy.deepcopy(whole[i])  # not the sender's objects
        self.current_at = step
        return refill

    def whole_state_dict(self) -> dict[str, Any]:
        """Collective: the optimizer's state_dict as one process holding every parameter's state
        would give it (what a snapshot keeps, so that it resumes at any world size and mode)."""
        optimizer = self.optimizer
        mine = {i: optimizer.state[p] for i, p in enumerate(self.params) if p in optimizer.state}
        contributions: list[Any] = [None] * self.world_size
        dist.all_gather_object(contributions, mine)
        state = optimizer.state_dict()
        state["state"] = {i: c[i] for c in contributions for i in c}
        state["state"] = dict(sorted(state["state"].items()))
        return state

    # -- one step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step_owned(self) -> None:
        """Step this rank's parameters, then share them with the group (collective; see above)."""
        owned = set(self.owned())
        self._kept = [
            (p, p.detach().clone(), copy.deepcopy(self.optimizer.state[p]) if p in self.optimizer.state else None)
            for p in owned
        ]
        hidden = [(p, p.grad) for p in self.params if p not in owned]
        for p, _ in hidden:
            p.grad = None  # torch's optimizers skip a parameter without a gradient
        self.optimizer.step()
        if self.stage == 1:
            for p, grad in hidden:
                p.grad = grad
        self._received = []
        for owner in range(self.world_size):
            params = [p for p, o in zip(self.params, self.owner, strict=True) if o == owner]
            if not params:
                continue
            if owner == self.rank:
                flat = torch.cat([p.detach().reshape(-1) for p in params])  # (owned numel,)
            else:
                flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype)
            comm.broadcast(flat, src=owner)
            if owner != self.rank:
                self._received.append((params, flat))

    @torch.no_grad()
    def keep(self, step: int) -> None:
        """The step committed (now `step` committed steps): take the owners' parameters."""
        for params, flat in self._received:
            for p, piece in zip(params, flat.split([p.numel() for p in params]), strict=True):
                p.copy_(piece.view_as(p))
        self._kept, self._received = [], []
        self.current_at = step

    @torch.no_grad()
    def roll_back(self) -> None:
        """The step did not commit: put back what `step_owned` changed (nothing if it did not run)."""
        for p, value, state in self._kept:
            p.copy_(value)
            if state is None:
                self.optimizer.state.pop(p, None)
            else:
                self.optimizer.state[p] = state
        self._kept, self._received = [], []

    # -- a joiner's state ---------------------------------------------------------------------
    def live_take(self) -> dict[str, Any]:
        """What a healing replica receives of the optimizer: its hyperparameters (the schedule's
        lr), no state: its share comes in the re-partition that follows."""
        return {"state": {}, "param_groups": self.optimizer.state_dict()["param_groups"]}

    def live_put(self, state: dict[str, Any]) -> None:
        """Become the source's optimizer, without state: ours was of a step the group has left."""
        self.optimizer.load_state_dict(state)
        self.current_at = None
