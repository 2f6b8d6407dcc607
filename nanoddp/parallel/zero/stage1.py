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
  3. the updated shards go to every rank (all-gather of the flat chunks, or one broadcast
     per owner for the whole-parameter partition), and the replicas are identical again.

Partition (`nanoddp.parallel.zero.partition`): by default *by element*, the parameters laid
end to end and cut into ceil(N/ws) elements per rank, so state per rank is 1/ws within
padding for any model, parameters split across rank boundaries; an elementwise optimizer
(AdamW, SGD) gives the same values as on whole tensors. `partition="parameter"` keeps
torch's whole-parameter greedy split, for optimizers whose math reads a whole tensor (LAMB,
Adafactor) and for comparison: its imbalance is up to one parameter's size. Both are pure
functions of the parameter sizes, so every rank computes them alone.

State dicts follow `torch.distributed.optim.ZeroRedundancyOptimizer`: every rank calls
`consolidate_state_dict(to=0)`, then `state_dict()` on rank 0 returns the full state in the
plain optimizer format (indices over all parameters, so a plain AdamW can load it; pieces of a
split parameter are put back together), and `load_state_dict(full)` on every rank keeps that
rank's shard. One deliberate difference: a
`step()` invalidates the consolidated copy, so a stale state can't be saved silently.
`sharded_state_dict()` / `load_sharded_state_dict()` skip the gather: each rank saves its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms import Join, Joinable, JoinHook
from torch.optim import Optimizer

from nanoddp.comm.api.backend import DEFAULT_COMM_BACKEND, collectives_for
from nanoddp.parallel.zero.join import ZeroJoinHook
from nanoddp.parallel.zero.partition import PARTITIONS, assemble_state, assign_owners, cut_state

logger = logging.getLogger(__name__)

__all__ = ["ZeroRedundancyOptimizer", "assign_owners", "optimizer_state_bytes"]

SHARD_KEY = "zero_shard"  # marks a sharded state dict, so the two load paths can't be confused


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


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """Wrap `optimizer_class` so each rank keeps state only for its shard of the parameters.

    Same constructor as torch's: `ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
    lr=1e-3)`; `**defaults` go to `optimizer_class`. `process_group` (default: the world) is
    the data-parallel group. `partition` is "element" (exact 1/ws, the default) or "parameter"
    (whole parameters, torch's). `comm_backend` picks the collectives of the per-step sync:
    `"nanoddp"` (ours, the default) or `"torch"` (torch.distributed's). Without an initialised process group it
    runs as a single rank, so the same script works in a notebook. A `Joinable`: uneven inputs
    work under `Join([ddp_model, optimizer])` (nanoddp.parallel.zero.join).
    """

    _inner: Optimizer  # set after Optimizer.__init__, whose add_param_group calls come first

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[Optimizer],
        *,
        process_group: dist.ProcessGroup | None = None,
        comm_backend: str = DEFAULT_COMM_BACKEND,
        partition: str = "element",
        **defaults: Any,
    ):
        params = _check_params(params)
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(
                f"optimizer_class must be a torch.optim.Optimizer subclass such as torch.optim.AdamW "
                f"(the class, not an instance), got {optimizer_class!r}"
            )
        if partition not in PARTITIONS:
            raise ValueError(f"partition must be one of {sorted(PARTITIONS)}, got {partition!r}")
        Joinable.__init__(self)
        self.shadowing = False  # True while the Join hook takes a joined rank's step
        self._group = process_group
        collectives = collectives_for(comm_backend)  # checks the name too
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
        self.partition_kind = partition
        self._partition = PARTITIONS[partition](
            self.rank, self.world_size, collectives, process_group, self._global_ranks
        )
        self._local: dict[torch.Tensor, tuple] = self._partition.add(all_params)
        self._inner = optimizer_class(
            [{**_hyperparams(g), "params": self._owned(g["params"])} for g in self.param_groups], **defaults
        )
        self._pull_hyperparams()  # the inner optimizer's own defaults (betas, eps...) show outside too
        self.state = self._inner.state  # this rank's shard; read by tools like optimizer_state_bytes
        self._consolidated: dict[int, Any] | None = None
        self._index_params()
        logger.debug("rank %d owns %d elements", self.rank, self._partition.local_numel())

    # --- partition bookkeeping -------------------------------------------------------------

    def _owned(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors this rank's inner optimizer steps on for `params` (pieces or parameters)."""
        return [self._local[p][0] for p in params if p in self._local]

    def _index_params(self) -> None:
        """Global index of each parameter (torch's state_dict numbering)."""
        all_params = [p for group in self.param_groups for p in group["params"]]
        self._index_of = {p: i for i, p in enumerate(all_params)}

    @property
    def partition(self) -> list[list]:
        """What each rank owns, `partition[rank]`: global parameter indices ("parameter"), or
        (index, start, stop) element ranges of the flattened parameters ("element")."""
        return [self._partition.owned_by(r, self._index_of) for r in range(self.world_size)]

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
        if not hasattr(self, "_inner"):  # called from Optimizer.__init__; partitioned right after
            return
        group = self.param_groups[-1]
        self._local.update(self._partition.add(group["params"]))  # a flat space of its own
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

    def step(  # type: ignore[override]  # torch's ZeRO signature: one method, not torch.optim's overloads
        self, closure: Callable[[], float] | None = None, **kwargs: Any
    ) -> float | None:
        """Update this rank's shard, then broadcast every shard from its owner.

        Collective: every rank must call it. Returns the closure's loss, if any.
        """
        if not self.shadowing:  # a joined rank's shadow step (nanoddp.parallel.zero.join) trains nothing
            Join.notify_join_context(self)  # under Join: "still training" (if the first joinable)
        self._consolidated = None
        self._push_hyperparams()
        if closure is not None:  # the closure computes the gradients the pieces read
            inner_closure = closure

            def closure() -> float:
                loss = inner_closure()
                self._partition.prepare_grads()
                return loss

        else:
            self._partition.prepare_grads()
        loss = self._inner.step(closure=closure, **kwargs)
        self._pull_hyperparams()
        if self.world_size > 1 or self.partition_kind == "element":
            self._partition.sync()
        return loss

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """Under Join, a joined rank shadows each of the others' steps by taking one."""
        return ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.param_groups[0]["params"][0].device

    @property
    def join_process_group(self) -> Any:
        return self._group if self._group is not None else dist.group.WORLD

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' gradients and the pieces' views of them."""
        super().zero_grad(set_to_none=set_to_none)
        if self._inner is not None:
            self._inner.zero_grad(set_to_none=True)

    # --- state dicts -------------------------------------------------------------------------

    def _local_state(self) -> dict[int, dict[str, Any]]:
        """This rank's optimizer state, keyed by global index, copied to the CPU.

        Read through the inner optimizer's own `state_dict()`, so its packing rules apply.
        """
        param_of = {local: p for local, p, _, _ in self._local.values()}
        local_tensors = [t for group in self._inner.param_groups for t in group["params"]]
        inner_state = self._inner.state_dict()["state"]
        return {self._index_of[param_of[local_tensors[i]]]: _to_cpu_copy(s) for i, s in inner_state.items()}

    def _local_ranges(self) -> dict[int, tuple[int, int]]:
        """Global index -> the element range [start, stop) of it this rank steps on."""
        return {self._index_of[p]: (start, stop) for _, p, start, stop in self._local.values()}

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
        local = (self._local_state(), self._local_ranges())
        shards: list[Any] | None
        if self.world_size == 1:
            shards = [local]
        else:
            shards = [None] * self.world_size if self.rank == to else None
            dist.gather_object(local, shards, dst=self._global_ranks[to], group=self._group)
        if self.rank != to:
            self._consolidated = None
            return
        parts: dict[int, list[tuple[int, int, dict[str, Any]]]] = {}
        for state, ranges in shards or ():
            for i, value in state.items():
                parts.setdefault(i, []).append((*ranges[i], value))
        all_params = [p for group in self.param_groups for p in group["params"]]
        self._consolidated = {i: assemble_state(all_params[i], parts[i]) for i in sorted(parts)}

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
        self._load(state_dict, sharded=False)

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
        if [tuple(o) if isinstance(o, (list, tuple)) else o for o in shard["owned"]] != self.partition[self.rank]:
            raise ValueError(
                "the shard's parameters differ from this rank's current partition (the parameters "
                "changed since it was saved): save and load a consolidated state_dict() instead"
            )
        self._load(state_dict, sharded=True)

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

    def _load(self, state_dict: dict[str, Any], sharded: bool) -> None:
        """Pick this rank's parameters out of `state_dict` and hand them to the inner optimizer.

        Saved ids pair with parameters by position, as in `Optimizer.load_state_dict`, so a
        state saved by a plain optimizer over the same parameters loads too. A full state is
        cut to this rank's element ranges; a sharded one already holds just them.
        """
        piece_of = {local: (p, start, stop) for local, p, start, stop in self._local.values()}
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
            for local in group["params"]:
                p, start, stop = piece_of[local]
                if p in state_of:
                    value = _to_cpu_copy(state_of[p])  # never alias the caller's dict
                    local_state[local_index] = value if sharded else cut_state(value, p.numel(), start, stop, local)
                ids.append(local_index)
                local_index += 1
            local_groups.append({"params": ids})
        for local_group, outer in zip(local_groups, self.param_groups, strict=True):
            local_group.update(_hyperparams(outer))
        self._inner.load_state_dict({"state": local_state, "param_groups": local_groups})
        with torch.no_grad():  # the model may have been loaded since the pieces were cut: step from its values
            for local, (p, start, stop) in piece_of.items():
                if local is not p:
                    local.copy_(p.detach().reshape(-1)[start:stop].view_as(local))
        self._consolidated = None
