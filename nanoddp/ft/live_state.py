"""Live state transfer: what a joiner receives from a peer, and how it is taken and put back.

A joiner (a replacement, or a replica that fell behind) gets everything that makes the next step
equal on every replica: the weights, the optimizer's state, the step (which is also the data
position: `GlobalBatches` is a function of the step), the world size each committed step had,
and every RNG the step may draw from. torchft's Manager asks a replica that is up to date for
this dictionary and sends it to the joiner over the group across the replicas (its `PGTransport`
on `ReplicaGroup`): no file is written or read. The source packs its tensors into one flat tensor
per dtype at the step boundary (`packed_state`), so the transfer is a few sends, not one per
tensor; the Manager holds the optimizer back (`should_commit`) until the transfer is over.

What moves is each object's state on this rank, as it holds it: a sharded engine's DTensors as
their local shards, ZeRO-1's optimizer as its own shard. Source and joiner run the same engine
over the same layout, so each piece is put back where it was taken from, in place: nothing is
gathered or re-cut.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nanoddp.base.rng import capture_rng_state, restore_rng_state
from nanoddp.ft.packed_state import pack, unpack
from nanoddp.parallel.lowcomm.periodic import PeriodicSync
from nanoddp.parallel.tensors import is_dtensor


def _local(value: Any) -> Any:
    return value.to_local() if is_dtensor(value) else value


def take_model(model: torch.nn.Module) -> dict[str, Any]:
    """The model's state on this rank: a DTensor's local shard in its place, ZeRO-2's piece of a
    parameter in its place.

    [Note: no collective in take] The registered tensors themselves (`keep_vars=True`), not
    `state_dict()`'s whole ones: ZeRO-2's are gathered within the replica group on the way, a
    collective, and torchft asks each rank of a joiner's group to heal from the same rank of any
    up-to-date group (it spreads the sources by rank), so the ranks of one source group do not
    all send: a gather among them would wait for a peer that never comes."""
    return {name: _local(value).detach() for name, value in model.state_dict(keep_vars=True).items()}


@torch.no_grad()
def put_model(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """`take_model`'s state copied in place into this rank's tensors (same engine, same layout; an
    in-place copy marks ZeRO-2's whole tensors stale, so the next forward gathers them again)."""
    own = model.state_dict(keep_vars=True)
    if own.keys() != state.keys():
        raise ValueError(f"the received model state names other tensors: {sorted(own.keys() ^ state.keys())[:5]}")
    for name, value in state.items():
        _local(own[name]).copy_(value)


def take_optimizer(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state on this rank: ZeRO-1's own shard; a LocalSGD/DiLoCo wrapper's whole
    state (this replica's inner optimizer, step count, last-sync weights, outer optimizer); a plain
    optimizer's state with each DTensor (the state of a sharded parameter) as its local shard."""
    sharded = getattr(optimizer, "sharded_state_dict", None)
    if sharded is not None:
        return sharded()
    if isinstance(optimizer, PeriodicSync):  # localsgd/diloco: inner state, step count, last-sync weights, outer
        return optimizer.state_dict()
    state = optimizer.state_dict()
    per_param = {i: {k: _local(v) for k, v in entry.items()} for i, entry in state["state"].items()}
    return {**state, "state": per_param}


def put_optimizer(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load `take_optimizer`'s state: a sharded parameter's state tensors become DTensors laid
    out as the parameter is, as the optimizer made them on the source."""
    load_sharded = getattr(optimizer, "load_sharded_state_dict", None)
    if load_sharded is not None:
        load_sharded(state)
        return
    if isinstance(optimizer, PeriodicSync):
        optimizer.load_state_dict(state)
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    per_param = {}
    for i, entry in state["state"].items():
        p = params[int(i)]
        per_param[i] = {k: _like(p, v) for k, v in entry.items()}
    optimizer.load_state_dict({**state, "state": per_param})


def _like(param: torch.Tensor, value: Any) -> Any:
    """`value` as a DTensor laid out as `param` when it is a local shard of one (AdamW's moments);
    anything else (a step count) as it is."""
    if not is_dtensor(param) or not torch.is_tensor(value) or value.shape != param.to_local().shape:
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


class LiveState:
    """The state dict functions torchft's Manager calls: `take` on a source, `put` on a joiner."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        history: list[int],
        extra: tuple[Callable[[], Any], Callable[[Any], None]] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.history = history  # world size of each committed step, shared with the step loop
        self.extra = extra
        # whether this replica holds the run's committed state (False: a joiner before it healed);
        # travels with the state, so a replica healed from a source that held none holds none
        self.holds_state = True
        # called first in `take`, which torchft calls inside the quorum on a joiner's source: what
        # must be done before seconds of sending, in which the source may be lost
        self.before_send: Callable[[], None] | None = None

    def take(self) -> dict[str, Any]:
        """This replica's state at the step boundary, its tensors packed (`packed_state.pack`)."""
        if self.before_send is not None:
            self.before_send()
        state: dict[str, Any] = {
            "model": take_model(self.model),
            "optimizer": take_optimizer(self.optimizer),
            "history": list(self.history),
            "holds_state": self.holds_state,
            "rng": capture_rng_state(),  # the same generators a snapshot holds, numpy included
        }
        if self.extra is not None:
            state["extra"] = self.extra[0]()
        return pack(state)

    def put(self, packed: dict[str, Any]) -> None:
        """Become the source replica: load what `take` gave there."""
        state = unpack(packed)
        put_model(self.model, state["model"])
        put_optimizer(self.optimizer, state["optimizer"])
        self.history[:] = state["history"]
        self.holds_state = bool(state["holds_state"])
        restore_rng_state(state["rng"])
        if self.extra is not None:
            self.extra[1](state["extra"])
