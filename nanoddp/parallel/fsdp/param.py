"""One parameter under `fully_shard`: a DTensor shard between runs, a plain tensor while it runs.

Why two objects per parameter: optimizers, `state_dict`, `clip_grad_norm_` and checkpoints
must see what the rank owns (a `DTensor` sharded on dim 0, whose `shape` is still the global
one, so FSDP2 code runs unchanged), while the module's own forward needs the whole tensor as a
plain one. So the module's `_parameters` entry is swapped: `sharded` (an nn.Parameter wrapping
a DTensor) normally, `unsharded` (an nn.Parameter of the full shape, in the compute dtype) from
the unit's all-gather until it reshards.

The cut is torch.chunk's along the shard dim, dim 0 unless `shard_placement_fn` says
`Shard(d)`: each shard rank holds `rows = ceil(size / ws)` slices, the last ranks fewer or none.
For the collectives every rank's part is padded to `rows` slices, so a unit's all-gather and
reduce-scatter move equal-sized pieces (`padded_numel` per rank). Along a dim other than 0 the
cut must be even (torch's rule too): no padding, and each part is made contiguous, so the
gathered parts are concatenated along that dim (`copy_out`) and a gradient's parts are its
chunks along it (`write_padded_grad`).
"""

from __future__ import annotations

import itertools
import math
from typing import cast

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from nanoddp.parallel.fsdp.mesh import MeshInfo
from nanoddp.parallel.fsdp.state_dict import rows_of_whole


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= size
    return tuple(reversed(stride))


def check_shardable(name: str, param: nn.Parameter, shard: Shard, shard_size: int) -> Shard:
    """Refuse what torch's FSDP2 refuses, with its error types, before anything is changed;
    return `shard` with a negative dim made positive (Shard(-1) of a matrix is Shard(1))."""
    if param.dim() == 0:
        raise ValueError(
            f"fully_shard doesn't support scalar parameters. Change {name} to a 1D tensor with numel equal to 1."
        )
    if not param.is_contiguous():  # e.g. channels_last: the flat collectives assume row-major parts
        raise NotImplementedError(
            f"FSDP does not support non-contiguous parameters yet: {name}: param.shape={param.shape} "
            f"param.stride()={param.stride()}; make it contiguous (e.g. .contiguous()) before fully_shard"
        )
    dim = shard.dim + param.dim() if shard.dim < 0 else shard.dim
    if not 0 <= dim < param.dim():
        raise AssertionError(f"Shard dim {shard.dim} is invalid for {param.dim()}D tensor: {param.shape} ({name})")
    if dim > 0 and param.shape[dim] % shard_size != 0:
        raise NotImplementedError(
            f"FSDP does not support uneven sharding on dim {dim}: {param.shape} (world size: {shard_size}) "
            f"({name}); shard it on dim 0 (return None from shard_placement_fn) or on an even dim"
        )
    return Shard(dim)


_orig_uids = itertools.count()


def orig_uid(param: nn.Parameter) -> int:
    """A number for the parameter object `fully_shard` found, kept on it (as torch's FSDP2 does):
    two calls that take one tied parameter make two `ShardedParam`s with the same number, which
    the root's first forward refuses (the tie would become two parameters that drift apart)."""
    if not hasattr(param, "_nanoddp_fsdp_uid"):
        param._nanoddp_fsdp_uid = next(_orig_uids)  # type: ignore[attr-defined]
    return param._nanoddp_fsdp_uid  # type: ignore[attr-defined]


class ShardedParam:
    """`param`'s rows of this shard rank as a DTensor, and a whole-tensor stand-in on demand."""

    def __init__(self, param: nn.Parameter, mesh: MeshInfo, locations: list[tuple[nn.Module, str]], shard: Shard):
        if isinstance(param, DTensor):
            raise ValueError("fully_shard takes plain parameters; this one is already a DTensor")
        self.shape = param.shape
        self.orig_uid = orig_uid(param)
        self.dim = shard.dim  # the tensor dim cut over the shard ranks (check_shardable normalised it)
        self.locations = locations  # every (module, name) this parameter is registered under
        self.rows = -(-self.shape[self.dim] // mesh.shard_size)  # ceil(size / ws) slices along dim
        self.row_numel = math.prod(s for i, s in enumerate(self.shape) if i != self.dim)  # numel of one slice
        self.padded_numel = self.rows * self.row_numel  # this rank's part in the collectives
        placements = mesh.placements_for(shard)
        # (local_rows, *shape[1:]) for dim 0, where the last ranks may hold fewer rows or none;
        # a contiguous copy of the chunk for another dim
        local = rows_of_whole(param.detach(), mesh.mesh, placements).clone(memory_format=torch.contiguous_format)
        self.local_shape = local.shape
        self.local_rows = local.shape[self.dim]
        dtensor = DTensor.from_local(
            local,
            mesh.mesh,
            placements,
            run_check=False,
            shape=self.shape,
            stride=_contiguous_stride(self.shape),
        )
        self.sharded = nn.Parameter(dtensor, requires_grad=param.requires_grad)
        self.unsharded: nn.Parameter | None = None
        # The alias the all-gather writes through: its own version counter, so a refill before
        # backward does not look like an in-place change to the tensors autograd saved.
        self._unsharded_data: torch.Tensor | None = None

    @property
    def requires_grad(self) -> bool:
        return self.sharded.requires_grad

    def local(self) -> torch.Tensor:
        """This rank's rows (local_rows, *shape[1:]): the DTensor's local tensor, no copy."""
        return self._dtensor()._local_tensor

    def _dtensor(self) -> DTensor:
        """The shard as the DTensor it is (nn.Parameter keeps a DTensor's class; torch's stubs say Parameter)."""
        return cast(DTensor, self.sharded)

    def copy_out(self, column: torch.Tensor, whole: torch.Tensor) -> None:
        """Every rank's gathered part (`column`: (ws, padded_numel)) into the whole tensor: end
        to end for dim 0 (dropping the padding), concatenated along the shard dim otherwise."""
        if self.dim == 0:
            whole.view(-1).copy_(column.reshape(-1)[: whole.numel()])
            return
        parts = column.reshape(column.shape[0], *self.local_shape)  # (ws, *local_shape)
        whole.copy_(parts.movedim(0, self.dim).reshape(self.shape))  # rank r's chunk r along dim

    def write_padded_local(self, into: torch.Tensor) -> None:
        """This rank's rows flat, zero-padded to `padded_numel`, cast to `into`'s dtype: its part
        of the all-gather input, written where the unit's gathered buffer has it."""
        rows = self.local_rows * self.row_numel
        into[:rows].copy_(self.local().reshape(-1))
        into[rows:].zero_()

    # --- the whole tensor ----------------------------------------------------------------------

    def alloc_unsharded(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The tensor the all-gather's values go to, storage allocated; the same object every
        step (autograd saved it), made anew only when `_apply` changed the dtype or device."""
        u = self.unsharded
        if u is None or u.dtype != dtype or u.device != device:
            u = nn.Parameter(torch.empty(self.shape, dtype=dtype, device=device), requires_grad=self.requires_grad)
            self.unsharded, self._unsharded_data = u, u.data
            self.nbytes = u.untyped_storage().nbytes()
        data = self._unsharded_data
        assert data is not None  # made with self.unsharded
        storage = data.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.nbytes)
        return data

    def free_unsharded(self) -> None:
        """Give back the whole tensor's memory; the object stays valid for autograd's references."""
        if self._unsharded_data is not None:
            self._unsharded_data.untyped_storage().resize_(0)

    def unsharded_allocated(self) -> bool:
        return self._unsharded_data is not None and self._unsharded_data.untyped_storage().nbytes() > 0

    def register(self, unsharded: bool) -> None:
        """Put the whole (True) or the sharded (False) parameter where the module looks it up."""
        p = self.unsharded if unsharded else self.sharded
        for module, name in self.locations:
            module._parameters[name] = p

    def adopt_registered(self) -> None:
        """After `load_state_dict(assign=True)`, or an assignment before the first forward (which
        calls this, as torch's lazy init re-reads the registered parameter), a new DTensor sits
        where the shard was: take it as the shard (on every location of a tied parameter)."""
        module, name = self.locations[0]
        p = module._parameters[name]
        if p is self.sharded or p is self.unsharded or p is None:
            return
        if not isinstance(p, DTensor):
            raise ValueError(
                f"{name}: a plain {type(p).__name__} {tuple(p.shape)} was assigned after fully_shard; assign "
                f"nn.Parameter(distribute_tensor(value, mesh, {list(self._dtensor().placements)})), as torch's "
                "FSDP2 needs too, or assign before fully_shard"
            )
        placements = self._dtensor().placements
        if p.shape != self.shape or p.to_local().shape != self.local_shape or p.placements != placements:
            raise ValueError(
                f"{name}: assigned DTensor {tuple(p.shape)} placed {p.placements} with local shape "
                f"{tuple(p.to_local().shape)}; this shard is {tuple(self.shape)} placed "
                f"{self._dtensor().placements} with local shape {tuple(self.local_shape)}"
            )
        self.sharded = p if isinstance(p, nn.Parameter) else nn.Parameter(p, requires_grad=self.requires_grad)
        self.register(unsharded=False)

    # --- gradients ------------------------------------------------------------------------------

    def has_grad(self) -> bool:
        """The whole tensor got a gradient (this backward, or kept by `set_requires_gradient_sync(False)`)."""
        return self.unsharded is not None and self.unsharded.grad is not None

    @torch.no_grad()
    def write_padded_grad(self, out: torch.Tensor) -> None:
        """The whole gradient into `out` (ws, padded_numel), cast to its dtype: rank r's rows in
        row r, zeros past d0 (all zeros when there is no gradient). `out` may be a column view."""
        g = self.unsharded.grad if self.unsharded is not None else None
        if g is None:
            out.zero_()
            return
        self.write_parts(g, out)

    @torch.no_grad()
    def write_parts(self, g: torch.Tensor, out: torch.Tensor) -> None:
        """A whole tensor `g` into `out` (ws, padded_numel): each rank's padded part in its row."""
        if self.dim != 0:  # even: row r is chunk r along the dim, flattened
            parts = g.reshape(*self.shape[: self.dim], out.shape[0], self.rows, *self.shape[self.dim + 1 :])
            out.copy_(parts.movedim(self.dim, 0).reshape(out.shape[0], -1))
            return
        flat = g.reshape(-1)
        full = flat.numel() // self.padded_numel  # ranks whose part is all rows
        out[:full].copy_(flat[: full * self.padded_numel].view(full, self.padded_numel))
        rest = flat.numel() - full * self.padded_numel
        if full < out.shape[0]:
            out[full, :rest].copy_(flat[full * self.padded_numel :])
            out[full, rest:].zero_()
            out[full + 1 :].zero_()

    def accumulate_grad(self, padded: torch.Tensor) -> None:
        """Hand this rank's reduced rows (padded_numel,) to the sharded parameter's `.grad`."""
        local = padded[: self.local_rows * self.row_numel].view(self.local_shape)
        local = local.to(self.sharded.dtype)
        grad = self.sharded.grad
        if grad is None:
            self.sharded.grad = DTensor.from_local(
                local,
                self._dtensor().device_mesh,
                self._dtensor().placements,
                run_check=False,
                shape=self.shape,
                stride=_contiguous_stride(self.shape),
            )
        else:
            cast(DTensor, grad)._local_tensor.add_(local)  # the DTensor made above, a step ago
