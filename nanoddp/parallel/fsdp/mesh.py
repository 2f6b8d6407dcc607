"""Which ranks a sharded module's parameters are cut over, and which hold copies.

Why a mesh and not a process group: FSDP2 code passes a `DeviceMesh`, and the sharded
parameters are DTensors that name it, so `full_tensor()`, `clip_grad_norm_` and
`torch.distributed.checkpoint` know where the other shards are. A 1-D mesh shards over all of
it (`Shard(0)`); a 2-D mesh is HSDP: dim 0 replicates, dim 1 shards (`Replicate(), Shard(0)`).
A `shard_placement_fn` may cut a parameter along another tensor dim (`Shard(1)`): the mesh is
the same, only the placement's tensor dim differs (`placements_for`).
This module turns a mesh into the process groups and coordinates the collectives need, and
refuses the meshes torch's FSDP2 refuses, with its error types.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard


def default_mesh() -> DeviceMesh:
    """Every rank of the default group on one dimension, on the default group's device type."""
    if not dist.is_initialized():
        raise RuntimeError("fully_shard needs torch.distributed initialised (nanoddp.init or init_process_group)")
    backend = dist.get_backend()
    device_type = "cuda" if backend == "nccl" else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


# Row meshes for `reshard_after_forward=<int>`, one per (mesh object, size): the fully_shard calls
# of one model on one mesh make the row groups once. Keyed by the mesh *object* (kept alive here so
# its id is never reused), not by its ranks: another world in this process (torch's threaded
# tests run one per thread; a re-initialised process group) has other groups for the same ranks.
_post_forward_meshes: dict[tuple[int, int], tuple[DeviceMesh, DeviceMesh]] = {}


@dataclass(frozen=True)
class MeshInfo:
    """The groups one unit's collectives run over: all-gather / reduce-scatter within
    `shard_group` (`shard_size` ranks, this one `shard_rank`), then, for HSDP, an all-reduce of
    the gradient shards across `replicate_group`."""

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup
    shard_size: int
    shard_rank: int
    replicate_group: dist.ProcessGroup | None
    placements: tuple[Placement, ...]

    @classmethod
    def of(cls, mesh: DeviceMesh) -> MeshInfo:
        """The groups of a 1-D or 2-D mesh; anything else refused as torch refuses it."""
        if mesh.ndim not in (1, 2):
            raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}")
        if mesh.ndim == 2 and mesh.mesh_dim_names is None:
            # torch raises an AssertionError here; the same type, so code catching it works on ours
            raise AssertionError(
                "Please init the 2D mesh for HSDP with mesh_dim_names specified, "
                "e.g. init_device_mesh(device, (replicas, shards), mesh_dim_names=('replicate', 'shard'))"
            )
        shard_dim = mesh.ndim - 1
        replicate = mesh.get_group(0) if mesh.ndim == 2 else None
        placements = (Replicate(), Shard(0)) if mesh.ndim == 2 else (Shard(0),)
        return cls(
            mesh=mesh,
            shard_group=mesh.get_group(shard_dim),
            shard_size=mesh.size(shard_dim),
            shard_rank=mesh.get_local_rank(shard_dim),
            replicate_group=replicate,
            placements=placements,
        )

    def post_forward(self, group_size: int) -> MeshInfo:
        """`reshard_after_forward=group_size`: the mesh's ranks in rows of `group_size`
        consecutive ranks (torch's `mesh.view(-1, group_size)`); between forward and backward
        the ranks of one row hold the whole parameters between them. Collective: every rank
        builds the row groups."""
        key = (id(self.mesh), group_size)
        if key not in _post_forward_meshes:
            rows = self.mesh.mesh.reshape(-1, group_size)  # (replicas * shard_size / group_size, group_size)
            names = ("post_forward_replicate", "post_forward_shard")
            row_mesh = DeviceMesh(self.mesh.device_type, rows, mesh_dim_names=names)
            _post_forward_meshes[key] = (self.mesh, row_mesh)
        return MeshInfo.of(_post_forward_meshes[key][1])

    def placements_for(self, shard: Shard) -> tuple[Placement, ...]:
        """The DTensor placements of a parameter cut along tensor dim `shard.dim`."""
        return (Replicate(), shard) if self.mesh.ndim == 2 else (shard,)

    @property
    def data_parallel_size(self) -> int:
        """Ranks whose gradients are averaged: shard group times replicas."""
        return self.mesh.size()
