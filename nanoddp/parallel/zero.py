"""ZeRO stage 1: shard the optimizer state across data-parallel ranks.

Why: under plain DDP every rank keeps the whole optimizer state, for AdamW two fp32 tensors
per parameter, i.e. twice the model. The update itself doesn't need that. Each rank can update
only the parameters it *owns* and then send the new values to the others. Optimizer memory
per rank drops to about 1/world_size. The price is one broadcast of the parameters per step,
the same number of bytes as the gradient all-reduce DDP already does.

One `step()` (gradients already averaged by DDP, torch's or ours):
  1. `param_groups` hyperparameters (an LR scheduler's lr, ...) are copied into the inner
     optimizer, a plain `optimizer_class` built over this rank's shard only;
  2. the inner optimizer steps, so state exists only for the shard;
  3. each owner packs its updated parameters into one flat buffer per dtype/device and
     broadcasts it; the other ranks unpack it, and the replicas are identical again.

Partition: whole parameters, greedy, largest first, each to the least-loaded rank (ties go
to the lower rank). Why not contiguous flat sharding? With whole parameters the inner
optimizer can be any torch optimizer unchanged, including ones whose math depends on a
tensor's shape or norm (LAMB trust ratios, Adafactor). The state dict also maps one to one
onto the standard torch format. The cost is an imbalance of at most one parameter's size. For
a transformer, made of many same-sized matrices, that is a few percent. The assignment is a
pure function of the parameter sizes, so every rank computes it alone, without communicating.

State dicts follow `torch.distributed.optim.ZeroRedundancyOptimizer`: every rank calls
`consolidate_state_dict(to=0)`, then `state_dict()` on rank 0 returns the full state in the
plain optimizer format (indices over all parameters, so a plain AdamW can load it), and
`load_state_dict(full)` on every rank keeps that rank's shard. One deliberate difference: a
`step()` invalidates the consolidated copy, so a stale state can't be saved silently.
`sharded_state_dict()` / `load_sharded_state_dict()` skip the gather: each rank saves its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from nanoddp.comm.backend import DEFAULT_COMM_BACKEND, collectives_for

logger = logging.getLogger(__name__)

SHARD_KEY = "zero_shard"  # marks a sharded state dict, so the two load paths can't be confused


def assign_owners(numels: list[int], world_size: int, loads: list[int] | None = None) -> list[int]:
    """Owner rank of each parameter: largest first, each to the least-loaded rank.

    `loads` (elements already owned per rank) is updated in place, so a later param group
    continues the balance without moving earlier parameters. Ties go to the lower index, so
    every rank derives the same assignment from the same sizes.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    loads = [0] * world_size if loads is None else loads
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += numels[i]
    return owners


def optimizer_state_bytes(optimizer: Optimizer) -> int:
    """Bytes of tensors held in `optimizer.state` (for ZeRO: this rank's shard only)."""
    total = 0
    for per_param in optimizer.state.values():
        for value in per_param.values():
            if torch.is_tensor(value):
                total += value.numel() * value.element_size()
    return total


def _check_params(params: Any) -> list:
    """The params argument as a list, or a TypeError/ValueError that says what was wrong."""
    rule = "params must be an iterable of Tensors or of dicts with a 'params' key (e.g. model.parameters())"
    if isinstance(params, torch.Tensor):
        raise TypeError(f"{rule}, got a single Tensor; wrap it in a list: [tensor]")
    if isinstance(params, dict):
        raise TypeError(f"{rule}, got one dict; wrap the param group in a list: [group]")
    try:
        items = list(params)
    except TypeError:
        raise TypeError(f"{rule}, got {type(params).__name__}") from None
    if not items:
        raise ValueError(f"{rule}, got an empty iterable (was a model.parameters() generator used twice?)")
    if all(isinstance(item, dict) for item in items):
        for i, group in enumerate(items):
            if "params" not in group:
                raise ValueError(f"param group {i} has no 'params' key; {rule}")
            group_params = group["params"]
            group_params = [group_params] if torch.is_tensor(group_params) else list(group_params)
            if not all(torch.is_tensor(p) for p in group_params):
                raise TypeError(f"param group {i}: every entry of 'params' must be a Tensor")
        return items
    bad = next((item for item in items if not torch.is_tensor(item)), None)
    if bad is not None:
        raise TypeError(f"{rule}; found an element of type {type(bad).__name__}")
    return items


def _to_cpu_copy(value: Any) -> Any:
    """A snapshot is a value, not a view of live training state: copy tensors to the CPU."""
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu_copy(v) for k, v in value.items()}
    return value


def _hyperparams(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


class ZeroRedundancyOptimizer(Optimizer):
    """Wrap `optimizer_class` so each rank keeps state only for its shard of the parameters.

    Same constructor as torch's: `ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
    lr=1e-3)`; `**defaults` go to `optimizer_class`. `process_group` (default: the world) is
    the data-parallel group. `comm_backend` picks the collectives of the per-step broadcast:
    `"nanoddp"` (ours, the default) or `"torch"` (torch.distributed's). Without an initialised process group it
    runs as a single rank, so the same script works in a notebook.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[Optimizer],
        *,
        process_group: dist.ProcessGroup | None = None,
        comm_backend: str = DEFAULT_COMM_BACKEND,
        **defaults: Any,
    ):
        params = _check_params(params)
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(
                f"optimizer_class must be a torch.optim.Optimizer subclass such as torch.optim.AdamW "
                f"(the class, not an instance), got {optimizer_class!r}"
            )
        self._inner: Optimizer | None = None  # add_param_group runs inside super().__init__
        self._group = process_group
        self._broadcast = collectives_for(comm_backend).broadcast  # checks the name too
        if process_group is None and not dist.is_initialized():
            self.rank, self.world_size, self._global_ranks = 0, 1, [0]
        else:
            self.rank = dist.get_rank(process_group)
            self.world_size = dist.get_world_size(process_group)
            if self.rank < 0:
                raise ValueError("this process is not a member of process_group")
            self._global_ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
        super().__init__(params, defaults)
        all_params = [p for group in self.param_groups for p in group["params"]]
        self._check_same_params_on_every_rank(all_params)
        self._loads = [0] * self.world_size
        owners = assign_owners([p.numel() for p in all_params], self.world_size, self._loads)
        self._owner = dict(zip(all_params, owners, strict=True))
        self._inner = optimizer_class(
            [{**_hyperparams(g), "params": self._owned(g["params"])} for g in self.param_groups], **defaults
        )
        self._pull_hyperparams()  # the inner optimizer's own defaults (betas, eps...) show outside too
        self.state = self._inner.state  # this rank's shard; read by tools like optimizer_state_bytes
        self._consolidated: dict[int, Any] | None = None
        self._index_params()
        logger.debug("rank %d owns %d/%d elements", self.rank, self._loads[self.rank], sum(self._loads))

    # --- partition bookkeeping -------------------------------------------------------------

    def _owned(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        return [p for p in params if self._owner[p] == self.rank]

    def _index_params(self) -> None:
        """Global index of each parameter (torch's state_dict numbering) and broadcast buckets.

        A bucket is one owner's parameters of one dtype and device, in global order, so every
        rank builds the same list and the broadcasts pair up.
        """
        all_params = [p for group in self.param_groups for p in group["params"]]
        self._index_of = {p: i for i, p in enumerate(all_params)}
        buckets: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
        for p in all_params:
            buckets.setdefault((self._owner[p], p.dtype, p.device), []).append(p)
        self._buckets = sorted(buckets.items(), key=lambda item: item[0][0])  # stable: keeps order

    @property
    def partition(self) -> list[list[int]]:
        """Global parameter indices owned by each rank: `partition[rank]`."""
        owned: list[list[int]] = [[] for _ in range(self.world_size)]
        for p, i in self._index_of.items():
            owned[self._owner[p]].append(i)
        return owned

    def _check_same_params_on_every_rank(self, all_params: list[torch.Tensor]) -> None:
        """Every rank must derive the same partition: compare a signature of the sizes.

        A mismatch would otherwise pair broadcasts of different sizes (a hang or garbage);
        here every rank sees all signatures and raises the same error.
        """
        if self.world_size == 1:
            return
        numels = torch.tensor([p.numel() for p in all_params], dtype=torch.int64)
        weights = torch.arange(1, len(all_params) + 1, dtype=torch.int64)
        signature = torch.stack([torch.tensor(len(all_params)), numels.sum(), (numels * weights).sum()])
        device = all_params[0].device if dist.get_backend(self._group) == "nccl" else torch.device("cpu")
        gathered = [torch.empty_like(signature, device=device) for _ in range(self.world_size)]
        dist.all_gather(gathered, signature.to(device), group=self._group)
        rows = [tuple(t.tolist()) for t in gathered]
        if len(set(rows)) > 1:
            raise ValueError(
                "ZeroRedundancyOptimizer needs the same parameters (count and sizes, in the same "
                f"order) on every rank; (count, numel, weighted numel) per rank = {rows}"
            )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its parameters are shared out continuing the current balance."""
        super().add_param_group(param_group)
        if self._inner is None:  # called from Optimizer.__init__; partitioned right after
            return
        group = self.param_groups[-1]
        owners = assign_owners([p.numel() for p in group["params"]], self.world_size, self._loads)
        self._owner.update(zip(group["params"], owners, strict=True))
        self._inner.add_param_group({**_hyperparams(group), "params": self._owned(group["params"])})
        group.update(_hyperparams(self._inner.param_groups[-1]))
        self._consolidated = None
        self._index_params()

    # --- the step ----------------------------------------------------------------------------

    def _push_hyperparams(self) -> None:
        """Outer groups -> inner: what an LR scheduler or the user changed takes effect."""
        for outer, inner in zip(self.param_groups, self._inner.param_groups, strict=True):
            inner.update(_hyperparams(outer))

    def _pull_hyperparams(self) -> None:
        """Inner groups -> outer: defaults filled in, or values the inner optimizer changed."""
        for outer, inner in zip(self.param_groups, self._inner.param_groups, strict=True):
            outer.update(_hyperparams(inner))

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        """Update this rank's shard, then broadcast every shard from its owner.

        Collective: every rank must call it. Returns the closure's loss, if any.
        """
        self._consolidated = None
        self._push_hyperparams()
        loss = self._inner.step(closure=closure, **kwargs)
        self._pull_hyperparams()
        if self.world_size > 1:
            self._broadcast_shards()
        return loss

    @torch.no_grad()
    def _broadcast_shards(self) -> None:
        """Runs right after the local update: owners send, the others overwrite their copies.

        One bucket at a time, so the extra memory is one shard, not a second model.
        """
        for (owner, dtype, device), params in self._buckets:
            if owner == self.rank:
                flat = torch.cat([p.detach().reshape(-1) for p in params])  # (shard numel,)
            else:
                flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=device)
            self._broadcast(flat, src=self._global_ranks[owner], group=self._group)
            if owner != self.rank:
                for p, piece in zip(params, flat.split([p.numel() for p in params]), strict=True):
                    p.copy_(piece.view_as(p))

    # --- state dicts -------------------------------------------------------------------------

    def _local_state(self) -> dict[int, dict[str, Any]]:
        """This rank's optimizer state, keyed by global index, copied to the CPU.

        Read through the inner optimizer's own `state_dict()`, so its packing rules apply.
        """
        local_params = [p for group in self._inner.param_groups for p in group["params"]]
        inner_state = self._inner.state_dict()["state"]
        return {self._index_of[local_params[i]]: _to_cpu_copy(s) for i, s in inner_state.items()}

    def _indexed_param_groups(self) -> list[dict[str, Any]]:
        """param_groups in the plain optimizer's state_dict format: params as global indices."""
        groups, start = [], 0
        for group in self.param_groups:
            groups.append({**_hyperparams(group), "params": list(range(start, start + len(group["params"])))})
            start += len(group["params"])
        return groups

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full optimizer state on rank `to` (a rank of the process group).

        Collective: every rank must call it, after the last `step()` it wants saved.
        """
        if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < self.world_size:
            raise ValueError(
                f"to must be a rank of the optimizer's process group, in [0, {self.world_size}), got {to!r}"
            )
        local = self._local_state()
        if self.world_size == 1:
            shards = [local]
        else:
            shards = [None] * self.world_size if self.rank == to else None
            dist.gather_object(local, shards, dst=self._global_ranks[to], group=self._group)
        if self.rank != to:
            self._consolidated = None
            return
        merged: dict[int, Any] = {}
        for shard in shards:
            merged.update(shard)
        self._consolidated = dict(sorted(merged.items()))

    def state_dict(self) -> dict[str, Any]:
        """The full state gathered by `consolidate_state_dict`, in the plain optimizer format."""
        if self._consolidated is None:
            raise RuntimeError(
                f"the optimizer state has not been consolidated on rank {self.rank} since the last "
                f"step(): call consolidate_state_dict(to={self.rank}) on all ranks first "
                "(or sharded_state_dict() on every rank to save shards)"
            )
        return {"state": dict(self._consolidated), "param_groups": self._indexed_param_groups()}

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shard only, with the partition it belongs to. No communication."""
        return {
            "state": self._local_state(),
            "param_groups": self._indexed_param_groups(),
            SHARD_KEY: {"rank": self.rank, "world_size": self.world_size, "owned": self.partition[self.rank]},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state (from `state_dict()` or a plain optimizer's); keep this rank's shard.

        Call it on every rank with the same dict; no communication happens.
        """
        self._check_state_dict(state_dict)
        if SHARD_KEY in state_dict:
            raise ValueError(
                "this is a sharded state dict (from sharded_state_dict()): load it with load_sharded_state_dict"
            )
        self._load(state_dict)

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the shard this rank saved with `sharded_state_dict()`."""
        self._check_state_dict(state_dict)
        shard = state_dict.get(SHARD_KEY)
        if shard is None:
            raise ValueError("not a sharded state dict (no 'zero_shard' entry): load a full state with load_state_dict")
        if shard["world_size"] != self.world_size or shard["rank"] != self.rank:
            raise ValueError(
                f"shard was saved by rank {shard['rank']} of {shard['world_size']}, loading on rank "
                f"{self.rank} of {self.world_size}: to change the world size, save a consolidated "
                "state_dict() and load_state_dict() it instead"
            )
        if list(shard["owned"]) != self.partition[self.rank]:
            raise ValueError(
                "the shard's parameters differ from this rank's current partition (the parameters "
                "changed since it was saved): save and load a consolidated state_dict() instead"
            )
        self._load(state_dict)

    def _check_state_dict(self, state_dict: Any) -> None:
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
            raise ValueError(
                "state_dict must be a dict with 'state' and 'param_groups' (from state_dict() or "
                f"sharded_state_dict()), got {type(state_dict).__name__}"
                + (f" with keys {sorted(state_dict)}" if isinstance(state_dict, dict) else "")
            )
        saved, current = state_dict["param_groups"], self.param_groups
        if len(saved) != len(current):
            raise ValueError(f"state_dict has {len(saved)} param groups, this optimizer has {len(current)}")
        for i, (s, c) in enumerate(zip(saved, current, strict=True)):
            if len(s["params"]) != len(c["params"]):
                raise ValueError(
                    f"param group {i}: state_dict has {len(s['params'])} parameters, this optimizer has "
                    f"{len(c['params'])}"
                )

    def _load(self, state_dict: dict[str, Any]) -> None:
        """Pick this rank's parameters out of `state_dict` and hand them to the inner optimizer.

        Saved ids pair with parameters by position, as in `Optimizer.load_state_dict`, so a
        state saved by a plain optimizer over the same parameters loads too.
        """
        saved_state = state_dict["state"]
        state_of: dict[torch.Tensor, Any] = {}
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups, strict=True):
            group.update(_hyperparams(saved_group))
            for saved_id, p in zip(saved_group["params"], group["params"], strict=True):
                if saved_id in saved_state:
                    state_of[p] = saved_state[saved_id]
        local_state, local_groups, local_index = {}, [], 0
        for group in self._inner.param_groups:
            ids = []
            for p in group["params"]:
                if p in state_of:
                    local_state[local_index] = _to_cpu_copy(state_of[p])  # never alias the caller's dict
                ids.append(local_index)
                local_index += 1
            local_groups.append({"params": ids})
        for local_group, outer in zip(local_groups, self.param_groups, strict=True):
            local_group.update(_hyperparams(outer))
        self._inner.load_state_dict({"state": local_state, "param_groups": local_groups})
        self._consolidated = None
