"""Flat sharding: a list of parameters seen as one flat vector, cut into equal rank chunks.

Why flat and by element: sharding whole parameters can't beat the granularity of the largest
one (a 4-layer MLP at ws=3 keeps 0.49 of the state on one rank). Laying the parameters end to
end and giving each rank ceil(N/ws) consecutive elements makes every rank's share 1/ws within
padding, whatever the sizes, at the cost of parameters split across rank boundaries. The
layout is a pure function of the sizes, so every rank computes it alone.

`FlatLayout` is the arithmetic (ZeRO-1's exact partition uses it directly). `FlatParamUnit`
is ZeRO-2's storage: the module's registered parameters become this rank's
1-D pieces of the flat shard (the same `nn.Parameter` objects, so an optimizer built before or
after steps on shards only), and a full flat buffer holds the unsharded values, exposed as
one `nn.Parameter` view per original parameter, swapped into the module only while it runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from nanoddp.comm.api.backend import Collectives
from nanoddp.comm.transport.transport import Waitable

logger = logging.getLogger(__name__)


def chunk_numel(total: int, world_size: int) -> int:
    """Elements per rank: ceil(total / world_size)."""
    return -(-total // world_size)


@dataclass(frozen=True)
class Piece:
    """The part of parameter `index` in one rank's chunk: its elements [start, stop), found
    at [shard_start, shard_start + stop - start) of that rank's flat shard."""

    index: int
    start: int
    stop: int
    shard_start: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


class FlatLayout:
    """Parameters of sizes `numels` laid end to end, cut into `world_size` chunks of `chunk`."""

    def __init__(self, numels: list[int], world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.numels = list(numels)
        self.world_size = world_size
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.total = sum(self.numels)
        self.chunk = chunk_numel(self.total, world_size)
        self.padded = self.chunk * world_size

    def pieces(self, rank: int) -> list[Piece]:
        """Every parameter's intersection with rank `rank`'s chunk, in flat order."""
        lo, hi = rank * self.chunk, min((rank + 1) * self.chunk, self.total)
        out = []
        for i, (offset, n) in enumerate(zip(self.offsets, self.numels, strict=True)):
            a, b = max(lo, offset), min(hi, offset + n)
            if a < b:
                out.append(Piece(i, a - offset, b - offset, a - lo))
        return out

    def piece_of(self, rank: int) -> list[Piece]:
        """One piece per parameter (an empty one where the chunk misses it), in parameter order."""
        found = {piece.index: piece for piece in self.pieces(rank)}
        return [found.get(i, Piece(i, 0, 0, 0)) for i in range(len(self.numels))]

    def flatten(self, tensors: list[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
        """The tensors end to end, zero-padded to `padded` elements (None counts as zeros)."""
        flat = torch.zeros(self.padded, dtype=like.dtype, device=like.device)  # (ws * chunk,)
        for t, offset, n in zip(tensors, self.offsets, self.numels, strict=True):
            if t is not None:
                flat[offset : offset + n].copy_(t.reshape(-1))
        return flat


def _locations(module: nn.Module, params: list[nn.Parameter]) -> dict[nn.Parameter, list[tuple[nn.Module, str]]]:
    """Where each parameter is registered (a shared one can sit in several places)."""
    wanted = set(params)
    where: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {p: [] for p in params}
    for sub in module.modules():
        for name, p in sub._parameters.items():
            if p is not None and p in wanted:
                where[p].append((sub, name))
    return where


class FlatParamUnit:
    """Parameters `params` of `module`, stored sharded, gathered whole on demand.

    After construction each `params[i]` (the same object) holds only this rank's 1-D piece of
    its elements: a view into `self.shard` (chunk,). `self.full` (ws * chunk,) holds the full
    values while `gathered`; `self.unsharded[i]` views it with the original shape and is what
    the module sees between `use_unsharded()` and `use_sharded()`.
    """

    def __init__(
        self,
        module: nn.Module,
        params: list[nn.Parameter],
        group,
        collectives: Collectives,
        *,
        shard_in_full: bool = False,
    ):
        dtypes = {(p.dtype, p.device) for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"one flat unit needs one dtype and device, got {sorted(map(str, dtypes))}")
        self.params = params
        self.group = group
        self.comm = collectives
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.layout = FlatLayout([p.numel() for p in params], self.world_size)
        self.shapes = [p.shape for p in params]
        self.locations = _locations(module, params)
        with torch.no_grad():
            self.full = self.layout.flatten([p.detach() for p in params], params[0])  # (ws * chunk,)
            c = self.layout.chunk
            own = self.full[self.rank * c : (self.rank + 1) * c]  # (chunk,)
            # ZeRO-2 never frees the full buffer, so the shard can live inside it (no second copy);
            # FSDP frees it, so its shard needs storage of its own.
            self.shard = own.data if shard_in_full else own.clone()
        self.shard_in_full = shard_in_full
        self.full_nbytes = self.full.untyped_storage().nbytes()
        # Refills go through an alias with its own version counter: autograd saved the views
        # in forward, and the bytes it finds after a free + gather are the same values.
        self._full_out = self.full.data
        self.unsharded = [
            nn.Parameter(self.full[o : o + n].view(shape), requires_grad=p.requires_grad)
            for p, o, n, shape in zip(params, self.layout.offsets, self.layout.numels, self.shapes, strict=True)
        ]
        self.pieces = self.layout.piece_of(self.rank)
        for p, piece in zip(params, self.pieces, strict=True):
            p.data = self.shard[piece.shard_start : piece.shard_start + piece.numel]  # (piece numel,)
        self.gathered = True
        self._gathered_versions = self._versions()
        self.grad_shard: torch.Tensor | None = None
        self._gather_work = None  # an async gather in flight into `full` (a prefetch)

    # --- parameters ------------------------------------------------------------------------

    def _versions(self) -> tuple[int, ...]:
        return tuple(p._version for p in self.params)

    @property
    def stale(self) -> bool:
        """True when the full values are freed or an optimizer changed the shard since the gather."""
        return not self.gathered or self._versions() != self._gathered_versions

    @torch.no_grad()
    def gather(self, async_op: bool = False):
        """Refill `self.full` from every rank's shard (all-gather). Returns the Work if async;
        the unit also keeps it, and `wait_gather()` is what makes `full` safe to read."""
        self.wait_gather()  # never two gathers writing into one buffer
        storage = self.full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.full_nbytes)
        self.gathered = True
        self._gathered_versions = self._versions()
        if self.world_size == 1:
            self._full_out.copy_(self.shard)
            return None
        work = self.comm.all_gather_into_tensor(self._full_out, self.shard, group=self.group, async_op=async_op)
        self._gather_work = work if async_op else None
        return work

    def wait_gather(self) -> None:
        """Block until an async gather (a prefetch) has filled `full`; no-op if none is in flight."""
        work, self._gather_work = self._gather_work, None
        if work is not None:
            work.wait()

    def free(self) -> None:
        """Release the full values' memory; the views stay valid objects, refilled by `gather`."""
        if self.shard_in_full:
            raise RuntimeError("this unit's shard lives in its full buffer, which can't be freed")
        self.wait_gather()  # a collective may still be writing into it
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def resident_bytes(self) -> int:
        """Parameter bytes held now: the shard plus the full buffer if it is allocated."""
        full = self.full.untyped_storage().nbytes()
        return full if self.shard_in_full else self.shard.numel() * self.shard.element_size() + full

    def use_unsharded(self) -> None:
        """Register the full views on the module (for its forward and backward)."""
        for p, u in zip(self.params, self.unsharded, strict=True):
            for sub, name in self.locations[p]:
                sub._parameters[name] = u

    def use_sharded(self) -> None:
        """Register the shard pieces again: what `parameters()` and optimizers see."""
        for p in self.params:
            for sub, name in self.locations[p]:
                sub._parameters[name] = p

    # --- gradients -------------------------------------------------------------------------

    def grads_ready(self) -> bool:
        return all(u.grad is not None or not u.requires_grad for u in self.unsharded)

    @torch.no_grad()
    def reduce_scatter_grads(self) -> tuple[Waitable | None, torch.Tensor]:
        """Launch the sum of the full gradients into this rank's grad shard; frees them.

        Returns (work or None, input buffer to keep alive until the work is done).
        """
        grads = [u.grad for u in self.unsharded]
        flat = self.layout.flatten(grads, self.shard)  # (ws * chunk,)
        for u in self.unsharded:
            u.grad = None  # no full-size gradient outlives the flattening
        self.grad_shard = torch.empty_like(self.shard)  # (chunk,)
        if self.world_size == 1:
            self.grad_shard.copy_(flat)
            return None, flat
        work = self.comm.reduce_scatter_tensor(self.grad_shard, flat, group=self.group, async_op=True)
        return work, flat

    @torch.no_grad()
    def finish_grads(self) -> None:
        """After the reduce-scatter: average and hand each shard piece its gradient."""
        shard_grad = self.grad_shard
        assert shard_grad is not None  # made by reduce_scatter_grads
        self.grad_shard = None
        # [Note: averaging in ZeRO-2] The one place ZeRO-2 averages: the reduce-scatter sums
        # (SUM, every backend has it), then this rank's shard alone is divided, 1/ws of the
        # elements a divide before the collective would touch.
        shard_grad.div_(self.world_size)
        for p, piece in zip(self.params, self.pieces, strict=True):
            if not p.requires_grad:
                continue
            g = shard_grad[piece.shard_start : piece.shard_start + piece.numel]  # (piece numel,)
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)

    def grad_bytes(self) -> int:
        """Gradient bytes held now (shard grads plus any full ones)."""
        held = [p.grad for p in self.params] + [u.grad for u in self.unsharded]
        return sum(g.numel() * g.element_size() for g in held if g is not None)

    @torch.no_grad()
    def full_tensors(self) -> list[torch.Tensor]:
        """Every parameter's full value, original shape (collective; CPU copies)."""
        self.wait_gather()
        was_allocated = self.full.untyped_storage().nbytes() > 0
        if self.stale:
            work = self.gather()
            if work is not None:
                work.wait()
        out = [u.detach().to("cpu", copy=True) for u in self.unsharded]
        if not was_allocated:
            self.free()
        return out
