"""The constructor arguments of torch's DDP that need more than storing, resolved in one place.

torch's `DistributedDataParallel.__init__` keeps growing (2.13: `init_sync`, `device_mesh`,
`forward_sync_buffers` replacing `broadcast_buffers`, ...). nanoddp's wrapper takes the same
signature (tests/test_ddp_args.py compares it with torch's, so a new torch argument is noticed)
and resolves each argument here into what the engine does, or refuses it clearly when the
engine cannot do what torch would do: silently ignoring an argument would train differently.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from nanoddp.comm.backend import check_comm_backend

DEFAULT_BUCKET_CAP_MB = 25  # torch DDP's default, what bucket_cap_mb=None means


@dataclass(frozen=True)
class ResolvedArgs:
    bucket_cap_mb: float
    process_group: Any
    forward_sync_buffers: bool  # broadcast buffers before every forward
    init_sync_buffers: bool  # include buffers in the construction-time broadcast


def resolve_args(
    module: nn.Module,
    device_ids: Sequence[int | torch.device] | None,
    bucket_cap_mb: float | None,
    comm_backend: str,
    broadcast_buffers: bool | None,
    forward_sync_buffers: bool | None,
    process_group: Any,
    device_mesh: Any,
    check_reduction: bool,
    delay_all_reduce_named_params: Any,
    param_to_hook_all_reduce: Any,
    mixed_precision: Any,
    bucket_cap_mb_list: list[int] | None,
) -> ResolvedArgs:
    """Validate torch DDP's arguments (same rules and defaults as torch 2.13) and resolve them."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if bucket_cap_mb is None:
        bucket_cap_mb = DEFAULT_BUCKET_CAP_MB
    is_number = isinstance(bucket_cap_mb, (int, float)) and not isinstance(bucket_cap_mb, bool)
    if not is_number or not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be a number > 0 (megabytes per bucket), got {bucket_cap_mb!r}")
    check_comm_backend(comm_backend)
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(f"device_ids must name at most one device (one process per device), got {list(device_ids)}")
    if process_group is not None and device_mesh is not None:
        raise ValueError("Cannot specify both process_group and device_mesh arguments (torch DDP's rule).")
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise ValueError(f"Only a 1-D device_mesh is supported (as in torch DDP), got {device_mesh}")
        process_group = device_mesh.get_group(mesh_dim=0)
    if check_reduction:
        warnings.warn(
            "The `check_reduction` argument of DistributedDataParallel is deprecated (as in torch) and ignored.",
            FutureWarning,
            stacklevel=3,
        )
    unsupported = {
        "delay_all_reduce_named_params": delay_all_reduce_named_params,
        "param_to_hook_all_reduce": param_to_hook_all_reduce,
        "mixed_precision": mixed_precision,
        "bucket_cap_mb_list": bucket_cap_mb_list or None,
    }
    given = [name for name, value in unsupported.items() if value is not None]
    if given:
        raise ValueError(
            f"nanoddp.DistributedDataParallel does not implement {', '.join(given)} yet; leave "
            f"{'it' if len(given) == 1 else 'them'} None, or use torch.nn.parallel.DistributedDataParallel "
            "for this model."
        )
    if forward_sync_buffers is not None:
        forward, init = forward_sync_buffers, True  # torch 2.13: buffers always synced at init
    else:
        forward = init = True if broadcast_buffers is None else bool(broadcast_buffers)
    return ResolvedArgs(bucket_cap_mb, process_group, forward, init)
