"""The constructor arguments of torch's DDP that need more than storing, resolved in one place.

torch's `DistributedDataParallel.__init__` keeps growing (2.13: `init_sync`, `device_mesh`,
`forward_sync_buffers` replacing `broadcast_buffers`, ...). nanoddp's wrapper takes the same
signature (tests/multiproc/test_ddp_args.py compares it with torch's, so a new torch argument is noticed)
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

from nanoddp.comm.api.backend import check_comm_backend
from nanoddp.parallel.ddp.buckets import bucket_limits
from nanoddp.parallel.ddp.delayed_params import check_delayed_args
from nanoddp.parallel.ddp.ignored import ignored_names
from nanoddp.parallel.ddp.mixed_precision import check_mixed_precision

DEFAULT_BUCKET_CAP_MB = 25  # torch DDP's default, what bucket_cap_mb=None means
MB = 1024 * 1024  # torch's "MB" in bucket_cap_mb is a MiB


@dataclass(frozen=True)
class ResolvedArgs:
    bucket_cap_mb: float
    process_group: Any
    forward_sync_buffers: bool  # broadcast buffers before every forward
    init_sync_buffers: bool  # include buffers in the construction-time broadcast
    bucket_limits: list[int]  # bytes of the 1st, 2nd, ... bucket (the last repeats)
    custom_bucket_caps: bool  # bucket_cap_mb_list given: torch's initial layout for it
    delayed: list[tuple[str, nn.Parameter]]  # delay_all_reduce_named_params, checked ([] if None)


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
    gradient_as_bucket_view: bool,
) -> ResolvedArgs:
    """Validate torch DDP's arguments (same rules and defaults as torch 2.13) and resolve them."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if bucket_cap_mb is None:
        bucket_cap_mb = DEFAULT_BUCKET_CAP_MB
    if not _positive_number(bucket_cap_mb):
        raise ValueError(f"bucket_cap_mb must be a number > 0 (megabytes per bucket), got {bucket_cap_mb!r}")
    caps = list(bucket_cap_mb_list or [])  # torch: an empty list means "not given"
    if not all(_positive_number(cap) for cap in caps):
        raise ValueError(f"bucket_cap_mb_list must hold numbers > 0 (megabytes of the 1st, 2nd, ... bucket), "
                         f"got {bucket_cap_mb_list!r}")  # fmt: skip
    if caps:
        bucket_cap_mb = max(caps)  # as torch: bucket_cap_mb is then ignored
    limits = bucket_limits(max(1, int(bucket_cap_mb * MB)), [max(1, int(cap * MB)) for cap in caps])
    delayed = check_delayed_args(module, delay_all_reduce_named_params, param_to_hook_all_reduce)
    check_comm_backend(comm_backend)
    # torch's checks, in torch's order, with its error types and messages (code written against
    # torch's DDP may catch them)
    if process_group is not None and device_mesh is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
        process_group = device_mesh.get_group(mesh_dim=0)
    check_some_param_requires_grad(module, delayed)
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(  # torch's text first (code may match it), then the value and the fix
            f"device_ids can only be None or contain a single element. Got {list(device_ids)}: name at most one "
            "device (one process per device)"
        )
    if check_reduction:
        warnings.warn(
            "The `check_reduction` argument of DistributedDataParallel is deprecated (as in torch) and ignored.",
            FutureWarning,
            stacklevel=3,
        )
    check_mixed_precision(mixed_precision, gradient_as_bucket_view, bool(delayed))
    if forward_sync_buffers is not None:
        forward, init = forward_sync_buffers, True  # torch 2.13: buffers always synced at init
    else:
        forward = init = True if broadcast_buffers is None else bool(broadcast_buffers)
    return ResolvedArgs(bucket_cap_mb, process_group, forward, init, limits, bool(caps), delayed)


def check_some_param_requires_grad(module: nn.Module, delayed: list[tuple[str, nn.Parameter]]) -> None:
    """torch's refusal, word for word: a module none of whose parameters (ignored and delayed ones
    left out) requires grad has no gradient to synchronise. Wrapping it anyway usually means the
    model was frozen by mistake; use the module itself. Delayed parameters alone are accepted."""
    skipped = ignored_names(module) | {name for name, _ in delayed}
    if delayed or any(p.requires_grad for name, p in module.named_parameters() if name not in skipped):
        return
    raise RuntimeError(
        "DistributedDataParallel is not needed when a module doesn't have any parameter that requires a gradient."
    )


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
