"""How ZeroRedundancyOptimizer shares the parameters out: by element (default) or whole parameters.

Both partitions answer the same three questions for the optimizer:
  - `add(params)`: which local tensors this rank's inner optimizer steps on, and which slice
    [start, stop) of which parameter each one is;
  - `prepare_grads()`: before the inner step, give those tensors their (already averaged)
    gradients;
  - `sync()`: after it, send every rank's updated values to everyone.

`ElementPartition` (exact): each batch of parameters added together is laid out flat per
dtype/device (`nanoddp.parallel.zero.flat.FlatLayout`) and rank r owns elements [r*c, (r+1)*c),
c = ceil(N/ws). A parameter cut by a boundary is stepped in pieces; an elementwise optimizer
(AdamW, SGD, Adam...) computes on a piece exactly what it computes on that part of the whole
tensor. The inner optimizer works on views of the pieces (the model's parameters stay whole
for the forward, and the update lands in them directly); their gradients are views of the
parameters' gradients, and `sync` is one all-gather per flat space. Not for optimizers whose math reads a whole tensor
(LAMB, Adafactor): use `partition="parameter"` there.

`ParameterPartition` (torch's behaviour): whole parameters, greedy largest first to the
least-loaded rank; the inner optimizer steps on the parameters themselves; `sync` is one
broadcast per owner. State per rank is off the mean by up to one parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from nanoddp.comm.api.backend import Collectives
from nanoddp.parallel.zero.flat import FlatLayout

# (local tensor the inner optimizer steps on, parameter, start, stop): elements [start, stop) of it
Local = tuple[torch.Tensor, torch.Tensor, int, int]


class Partition(Protocol):
    """What the optimizer asks of a partition (the module docstring says when each runs)."""

    def add(self, params: list[torch.Tensor]) -> dict[torch.Tensor, Local]: ...
    def prepare_grads(self) -> None: ...
    def owned_by(self, rank: int, index_of: dict[torch.Tensor, int]) -> list[Any]: ...
    def local_numel(self) -> int: ...
    def sync(self) -> None: ...


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


class ParameterPartition:
    """Whole parameters per rank (see the module docstring)."""

    def __init__(self, rank: int, world_size: int, comm: Collectives, group, global_ranks: Sequence[int]):
        self.rank, self.world_size, self.comm, self.group = rank, world_size, comm, group
        self.global_ranks = list(global_ranks)
        self.loads = [0] * world_size
        self.owner: dict[torch.Tensor, int] = {}
        self.order: list[torch.Tensor] = []

    def add(self, params: list[torch.Tensor]) -> dict[torch.Tensor, Local]:
        owners = assign_owners([p.numel() for p in params], self.world_size, self.loads)
        self.owner.update(zip(params, owners, strict=True))
        self.order.extend(params)
        return {p: (p, p, 0, p.numel()) for p in params if self.owner[p] == self.rank}

    def prepare_grads(self) -> None:
        """Nothing to do: the inner optimizer steps on the parameters and their own gradients."""

    def owned_by(self, rank: int, index_of: dict[torch.Tensor, int]) -> list[int]:
        return [index_of[p] for p in self.order if self.owner[p] == rank]

    def local_numel(self) -> int:
        return self.loads[self.rank]

    @torch.no_grad()
    def sync(self) -> None:
        """Owners broadcast their parameters, one flat buffer per (owner, dtype, device)."""
        buckets: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
        for p in self.order:
            buckets.setdefault((self.owner[p], p.dtype, p.device), []).append(p)
        for (owner, dtype, device), params in sorted(buckets.items(), key=lambda item: item[0][0]):
            if owner == self.rank:
                flat = torch.cat([p.detach().reshape(-1) for p in params])  # (bucket numel,)
            else:
                flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=device)
            self.comm.broadcast(flat, src=self.global_ranks[owner], group=self.group)
            if owner != self.rank:
                for p, piece in zip(params, flat.split([p.numel() for p in params]), strict=True):
                    p.copy_(piece.view_as(p))


def _piece_view(p: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    flat = p.detach().view(-1) if p.is_contiguous() else p.detach().reshape(-1).clone()
    return flat[start:stop]  # (stop - start,)


class _FlatSpace:
    """One dtype/device's parameters of one `add` call, laid out flat."""

    def __init__(self, params: list[torch.Tensor], rank: int, world_size: int):
        self.params = params
        self.layout = FlatLayout([p.numel() for p in params], world_size)
        self.pieces = self.layout.pieces(rank)
        # The pieces alias the parameters (detached views: leaves the inner optimizer may update
        # in place), so the shard costs no second copy; a non-contiguous parameter gets a copy.
        self.locals = [_piece_view(params[s.index], s.start, s.stop) for s in self.pieces]


class ElementPartition:
    """ceil(N/ws) consecutive elements per rank (see the module docstring)."""

    def __init__(self, rank: int, world_size: int, comm: Collectives, group, global_ranks: Sequence[int]):
        self.rank, self.world_size, self.comm, self.group = rank, world_size, comm, group
        self.spaces: list[_FlatSpace] = []

    def add(self, params: list[torch.Tensor]) -> dict[torch.Tensor, Local]:
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for p in params:
            by_kind.setdefault((p.dtype, p.device), []).append(p)
        out = {}
        for kind_params in by_kind.values():
            space = _FlatSpace(kind_params, self.rank, self.world_size)
            self.spaces.append(space)
            for s, local in zip(space.pieces, space.locals, strict=True):
                out[kind_params[s.index]] = (local, kind_params[s.index], s.start, s.stop)
        return out

    def prepare_grads(self) -> None:
        """Each piece's gradient is the matching slice of its parameter's (a view, no copy)."""
        for space in self.spaces:
            for s, local in zip(space.pieces, space.locals, strict=True):
                grad = space.params[s.index].grad
                local.grad = None if grad is None else grad.reshape(-1)[s.start : s.stop]

    def owned_by(self, rank: int, index_of: dict[torch.Tensor, int]) -> list[tuple[int, int, int]]:
        return [
            (index_of[space.params[s.index]], s.start, s.stop)
            for space in self.spaces
            for s in space.layout.pieces(rank)
        ]

    def local_numel(self) -> int:
        return sum(local.numel() for space in self.spaces for local in space.locals)

    @torch.no_grad()
    def sync(self) -> None:
        """One all-gather per flat space: every rank's updated chunk into every parameter."""
        for space in self.spaces:
            lay = space.layout
            first = space.params[0]
            shard = torch.zeros(lay.chunk, dtype=first.dtype, device=first.device)  # (chunk,)
            for s, local in zip(space.pieces, space.locals, strict=True):
                shard[s.shard_start : s.shard_start + s.numel].copy_(local)
            if self.world_size == 1:
                full = shard
            else:
                full = torch.empty(lay.padded, dtype=first.dtype, device=first.device)  # (ws * chunk,)
                self.comm.all_gather_into_tensor(full, shard, group=self.group)
            for p, offset, n in zip(space.params, lay.offsets, lay.numels, strict=True):
                p.copy_(full[offset : offset + n].view_as(p))


# --- optimizer state of pieces --------------------------------------------------------------


def _is_per_element(key: str, value: Any, numel: int) -> bool:
    """A state entry with one value per parameter element (exp_avg...), not a scalar ("step")."""
    return key != "step" and torch.is_tensor(value) and value.numel() == numel


def assemble_state(param: torch.Tensor, parts: list[tuple[int, int, dict[str, Any]]]) -> dict[str, Any]:
    """One parameter's full state from the states of its pieces [start, stop)."""
    covered = sorted((start, stop) for start, stop, _ in parts)
    starts, stops = [a for a, _ in covered], [b for _, b in covered]
    if starts != [0, *stops[:-1]] or stops[-1] != param.numel():
        raise RuntimeError(f"optimizer state of a parameter of {param.numel()} elements covers only {covered}")
    first = parts[0][2]
    out = {}
    for key, value in first.items():
        if not _is_per_element(key, value, parts[0][1] - parts[0][0]):
            out[key] = value  # the same on every piece
            continue
        full = torch.empty(param.numel(), dtype=value.dtype)  # (numel,)
        for start, stop, state in parts:
            full[start:stop] = state[key].reshape(-1)
        out[key] = full.view(param.shape)
    return out


def cut_state(state: dict[str, Any], numel: int, start: int, stop: int, local: torch.Tensor) -> dict[str, Any]:
    """A full parameter's state cut to the piece [start, stop), shaped like `local`."""
    return {
        k: v.reshape(-1)[start:stop].clone().view(local.shape) if _is_per_element(k, v, numel) else v
        for k, v in state.items()
    }


PARTITIONS: dict[str, Callable[..., Partition]] = {"element": ElementPartition, "parameter": ParameterPartition}
