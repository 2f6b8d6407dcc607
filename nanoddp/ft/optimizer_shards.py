"""ZeRO-1/2/3 under per-step fault tolerance: each rank of the current group steps the parameters
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
   what it changes; then the owners' updated parameters are all-gathered over the group, into
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

Stage 3 (`nanoddp train --engine fsdp` under continue) shards the parameters too, by the same
owners: after a step commits, a rank keeps only the parameters it owns (the others are freed);
at the next boundary they are all-gathered again (`gather_params`), and forward and backward run
on whole parameters, once per step rather than unit by unit as `fully_shard` does (the same
math). A parameter whose only holder was lost cannot be taken from a snapshot alone (the
weights of one step must all be of that step): every member then rolls the whole state back to
the newest snapshot (`restore`: weights, optimizer, schedule, RNG; the step and history it
returns) and the group goes on from there at its new size.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import nanoddp.comm as comm
from nanoddp.ft.stopped import RunStopped
from nanoddp.parallel.zero.partition import assign_owners

# () -> (snapshot step, a whole optimizer state_dict) of the newest snapshot, or None
Fallback = Callable[[], tuple[int, dict[str, Any]] | None]
# () -> (step, history) of the newest snapshot, loaded whole into model, optimizer and schedule
Restore = Callable[[], tuple[int, list[int]] | None]


class StateLost(RunStopped):
    """Weights lost with their owner and no snapshot to roll back to: the run cannot go on."""


@dataclass(frozen=True)
class Refill:
    """What one re-partition could not take live: parameter `names` (indices `indices`), whose
    state came from the snapshot of step `snapshot_step` (None: none existed, it restarts).
    `rolled_back`: stage 3 lost weights, and the whole state went back to that snapshot."""

    indices: list[int]
    names: list[str]
    snapshot_step: int | None
    rolled_back: bool = False
    history: list[int] | None = None  # after a roll-back: the world size of each step up to it


class OptimizerShards:
    """This rank's share of `optimizer`'s parameters and state in the current group (see above)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        names: list[str],
        stage: int,
        fallback: Fallback,
        restore: Restore | None = None,
    ) -> None:
        if stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1 (zero1), 2 (zero2) or 3 (fsdp), got {stage}")
        if stage == 3 and restore is None:
            raise ValueError("stage 3 shards the weights: pass restore, what rolls the state back to a snapshot")
        self.optimizer, self.stage, self.fallback, self.restore = optimizer, stage, fallback, restore
        self.params: list[torch.Tensor] = [p for group in optimizer.param_groups for p in group["params"]]
        if len(names) != len(self.params):
            raise ValueError(f"names must name the optimizer's {len(self.params)} parameters, got {len(names)}")
        self.names = names
        self.shapes = [p.shape for p in self.params]
        self.gathered = True  # stage 3: every parameter is whole here (False: only the owned ones)
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
        """Collective over the current group at `step` committed steps: the state (stage 3: and
        the weights) of the group's parameters from whoever holds it current, the rest from the
        snapshot; keep this rank's share. Returns what did not come live (None: all of it did)."""
        optimizer = self.optimizer
        current = self.current_at == step
        states = {i: optimizer.state[p] for i, p in enumerate(self.params) if current and p in optimizer.state}
        values = {}
        if self.stage == 3 and current:  # the owners' weights (every one's after a resume or roll-back)
            values = {i: p.detach() for i, p in enumerate(self.params) if not self.owner or self.owner[i] == self.rank}
        contributions: list[Any] = [None] * world_size
        dist.all_gather_object(contributions, (states, values))
        whole: dict[int, Any] = {}
        weights: dict[int, torch.Tensor] = {}
        for their_states, their_values in contributions:  # rank order: after a resume every rank holds it all
            for index, state in their_states.items():
                whole.setdefault(index, state)
            for index, value in their_values.items():
                weights.setdefault(index, value)
        lost = [i for i in range(len(self.params)) if i not in weights] if self.stage == 3 else []
        refill: Refill | None
        if lost:
            refill = self._roll_back(lost)
            whole = {i: optimizer.state[p] for i, p in enumerate(self.params) if p in optimizer.state}
        else:
            refill = self._refill(whole, step)
            self._set_weights(weights)
        self.rank, self.world_size, self.owner = rank, world_size, self._owners(world_size)
        optimizer.state.clear()
        for i in (i for i, p in enumerate(self.params) if self.owner[i] == rank and i in whole):
            optimizer.state[self.params[i]] = copy.deepcopy(whole[i])  # not the sender's objects
        self.current_at = step if refill is None or not refill.rolled_back else refill.snapshot_step
        return refill

    def _refill(self, whole: dict[int, Any], step: int) -> Refill | None:
        """Put the newest snapshot's state of the parameters nobody holds into `whole`; every
        rank reads the same newest snapshot, so they agree on what came from where."""
        missing = [] if step == 0 else [i for i in range(len(self.params)) if i not in whole]
        if not missing:
            return None
        found = self.fallback()
        if found is not None:
            whole.update((i, found[1]["state"][i]) for i in missing)
        return Refill(missing, [self.names[i] for i in missing], None if found is None else found[0])

    def _roll_back(self, lost: list[int]) -> Refill:
        """Stage 3 lost weights: every member loads the newest snapshot whole (`restore`)."""
        assert self.restore is not None
        self._materialize()
        restored = self.restore()
        if restored is None:
            raise StateLost(
                f"the weights of {len(lost)} parameters were lost with their owner and there is no snapshot to "
                "roll back to: run fsdp under --on-failure continue with --snapshot-every N"
            )
        self.gathered = True
        return Refill(lost, [self.names[i] for i in lost], restored[0], rolled_back=True, history=restored[1])

    @torch.no_grad()
    def _set_weights(self, weights: dict[int, torch.Tensor]) -> None:
        """Stage 3: every parameter whole, from the values the group gathered."""
        if self.stage != 3:
            return
        self._materialize()
        for i, value in weights.items():
            self.params[i].copy_(value)
        self.gathered = True

    def _materialize(self) -> None:
        """Give every freed parameter its storage back (values to be written)."""
        for p, shape in zip(self.params, self.shapes, strict=True):
            if p.shape != shape:
                p.data = torch.empty(shape, dtype=p.dtype, device=p.device)

    @torch.no_grad()
    def gather_params(self) -> None:
        """Stage 3, at a boundary: the owners share their parameters, every rank holds them
        whole for the step's forward and backward (collective; nothing to do when they are)."""
        if self.gathered:
            return
        self._materialize()
        _write(self._share_owned())
        self.gathered = True

    def _share_owned(self) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
        """Collective: every other owner's parameters, flat, as (its parameters, their values).

        One all-gather of each rank's owned parameters (padded to the largest share) rather than
        a broadcast per owner: when a peer dies, every survivor receives from it and so fails at
        once; with broadcasts, a survivor waiting on a live root that had given up waited out the
        whole collective timeout (seen in a trial: 10 s instead of about one)."""
        shares = [[p for p, o in zip(self.params, self.owner, strict=True) if o == r] for r in range(self.world_size)]
        sizes = [sum(p.numel() for p in share) for share in shares]
        chunk = max(sizes)
        mine = torch.zeros(chunk, dtype=self.params[0].dtype)  # (chunk,)
        if sizes[self.rank]:
            torch.cat([p.detach().reshape(-1) for p in shares[self.rank]], out=mine[: sizes[self.rank]])
        gathered = torch.empty(self.world_size * chunk, dtype=mine.dtype)  # (world_size * chunk,)
        comm.all_gather_into_tensor(gathered, mine)
        return [
            (shares[r], gathered[r * chunk : r * chunk + sizes[r]])
            for r in range(self.world_size)
            if r != self.rank and sizes[r]
        ]

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
        # stage 3 keeps only its own: the others' come at the next boundary (`gather_params`)
        self._received = self._share_owned() if self.stage < 3 else []

    @torch.no_grad()
    def keep(self, step: int) -> None:
        """The step committed (now `step` committed steps): take the owners' parameters."""
        _write(self._received)
        self._kept, self._received = [], []
        self.current_at = step
        if self.stage == 3 and self.world_size > 1:  # keep only the owned weights until the next gather
            for p, owner in zip(self.params, self.owner, strict=True):
                if owner != self.rank:
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self.gathered = False

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
    def live_model_take(self, model: torch.nn.Module) -> dict[str, Any]:
        """Stage 3: a healing replica receives the buffers only; the weights come in the
        re-partition (the source holds only its own)."""
        return {name: b for name, b in model.named_buffers()}

    def live_model_put(self, model: torch.nn.Module, state: dict[str, Any]) -> None:
        """Stage 3: take the source's buffers; this replica's weights are now of no step."""
        buffers = dict(model.named_buffers())
        with torch.no_grad():
            for name, value in state.items():
                buffers[name].copy_(value)
        self.current_at = None

    def live_take(self) -> dict[str, Any]:
        """What a healing replica receives of the optimizer: its hyperparameters (the schedule's
        lr), no state: its share comes in the re-partition that follows."""
        return {"state": {}, "param_groups": self.optimizer.state_dict()["param_groups"]}

    def live_put(self, state: dict[str, Any]) -> None:
        """Become the source's optimizer, without state: ours was of a step the group has left."""
        self.optimizer.load_state_dict(state)
        self.current_at = None


@torch.no_grad()
def _write(shared: list[tuple[list[torch.Tensor], torch.Tensor]]) -> None:
    """Copy each owner's flat values (`_share_owned`) into its parameters."""
    for params, flat in shared:
        for p, piece in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.copy_(piece.view_as(p))
