"""DataParallel's data movement: split a batch across devices, and bring outputs back.

`scatter` cuts every tensor in an argument structure (tuples, lists, dicts, dataclasses) into
one chunk per device; `gather` concatenates per-replica outputs of the same structure on one
device. Both are plain differentiable tensor ops (`chunk`, `.to`, `cat`), so gradients of the
gathered output flow back to each replica. Used by `nanoddp.parallel.dp.data_parallel`; it lives
in `dp/` to keep it apart from the scatter/gather *collectives* in `nanoddp.comm`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nanoddp.parallel.tensors import contains_tensor, is_dataclass_instance, is_namedtuple

DeviceLike = int | str | torch.device


# ----------------------------------------------------------------------------- devices


def as_device(device: DeviceLike) -> torch.device:
    """An int is a CUDA index (torch's convention); strings and devices pass through torch.device."""
    if isinstance(device, bool):  # bool is an int; True is never a meaningful device
        raise ValueError(f"device must be an int, str or torch.device, got {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device index must be >= 0, got {device}; use 'cpu' for the CPU")
        return torch.device("cuda", device)
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"{device!r} is not a device: use an int GPU index, 'cpu' or 'cuda:N'") from err


def check_device_available(device: torch.device) -> None:
    if device.type != "cuda":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = 0 if device.index is None else device.index
    if index >= count:
        raise ValueError(
            f"device {device} is not available: this machine has {count} visible GPU(s); "
            "pass device_ids=['cpu', 'cpu'] to run the data-parallel path on the CPU"
        )


def normalize_device_ids(device_ids: Sequence[DeviceLike] | None) -> list[torch.device]:
    """Explicit ids are checked; None means every visible GPU (none on a CPU-only machine)."""
    if device_ids is None:
        gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [torch.device("cuda", i) for i in range(gpu_count)]
    if isinstance(device_ids, (str, int, torch.device)) or not isinstance(device_ids, Sequence):
        raise ValueError(f"device_ids must be a list such as [0, 1] or ['cpu', 'cpu'], got {device_ids!r}")
    if len(device_ids) == 0:
        raise ValueError("device_ids is empty; pass None for all visible GPUs, or a list like ['cpu', 'cpu']")
    devices = [as_device(d) for d in device_ids]
    if len({d.type for d in devices}) > 1:
        raise ValueError(f"device_ids mix device types {sorted({d.type for d in devices})}; use one type")
    for device in devices:
        check_device_available(device)
    return devices


# ----------------------------------------------------------------------------- scatter


def _per_device(items: Any, devices: Sequence[torch.device], dim: int) -> list[tuple]:
    """Scatter each item; zip the results per device, as many as the shortest split."""
    return list(zip(*(_scatter_one(x, devices, dim) for x in items), strict=False))


def _scatter_one(obj: Any, devices: Sequence[torch.device], dim: int) -> list:
    """Per-device versions of `obj`; fewer than len(devices) when a batch has fewer chunks."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0:  # a scalar tensor has no batch dimension: every device gets a copy
            return [obj.to(device) for device in devices]
        chunks = obj.chunk(len(devices), dim)  # torch's split: sizes ceil(B/n), ..., remainder
        return [chunk.to(device, non_blocking=True) for chunk, device in zip(chunks, devices, strict=False)]
    if isinstance(obj, (tuple, list, Mapping)) and len(obj) == 0:
        return [obj for _ in devices]
    if is_namedtuple(obj):
        return [type(obj)(*parts) for parts in _per_device(obj, devices, dim)]
    if isinstance(obj, (tuple, list)):
        return [type(obj)(parts) for parts in _per_device(obj, devices, dim)]
    if isinstance(obj, Mapping):
        keys = list(obj)
        mapping_type: Any = type(obj)
        return [mapping_type(zip(keys, parts, strict=True)) for parts in _per_device(obj.values(), devices, dim)]
    if is_dataclass_instance(obj):
        names = [f.name for f in dataclasses.fields(obj) if f.init]
        fields = [getattr(obj, n) for n in names]
        return [
            dataclasses.replace(obj, **dict(zip(names, parts, strict=True)))
            for parts in _per_device(fields, devices, dim)
        ]
    return [obj for _ in devices]  # ints, strings, None...: every replica sees the same value


def scatter(inputs: Any, devices: Sequence[DeviceLike], dim: int = 0) -> list:
    """Split `inputs` (tensor, or tuple/list/dict/dataclass of them) along `dim` across `devices`.

    Returns one structure per device. Tensors are cut with `Tensor.chunk`, so a batch of 5 on
    4 devices gives chunks of 2, 2, 1 and only 3 entries: callers then use fewer replicas,
    exactly as torch.nn.DataParallel does. Non-tensors (and 0-dim tensors) are given to every
    device; containers take the shortest split of their tensors.
    """
    targets = [as_device(d) for d in devices]
    if not targets:
        raise ValueError("scatter needs at least one device")
    return _scatter_one(inputs, targets, dim)


def scatter_kwargs(
    inputs: tuple, kwargs: dict | None, devices: Sequence[DeviceLike], dim: int = 0
) -> tuple[list[tuple], list[dict]]:
    """Scatter positional and keyword arguments; both lists padded to the same length."""
    scattered_inputs = scatter(tuple(inputs), devices, dim) if inputs else []
    scattered_kwargs = scatter(dict(kwargs), devices, dim) if kwargs else []
    n = max(len(scattered_inputs), len(scattered_kwargs))
    if scattered_inputs and scattered_kwargs:  # a tensor split shorter in one of them limits both
        n = min(len(scattered_inputs), len(scattered_kwargs))
    scattered_inputs = (scattered_inputs + [()] * n)[:n]
    scattered_kwargs = (scattered_kwargs + [{}] * n)[:n]
    return scattered_inputs, scattered_kwargs


def batch_size_of(obj: Any, dim: int = 0) -> int | None:
    """Size along `dim` of the first batched tensor in `obj` (None when there is none)."""
    if isinstance(obj, torch.Tensor):
        return obj.size(dim) if obj.dim() > 0 else None
    values = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, (tuple, list)) else ()
    if is_dataclass_instance(obj):
        values = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    for value in values:
        size = batch_size_of(value, dim)
        if size is not None:
            return size
    return None


# ----------------------------------------------------------------------------- gather


def _gather_tensors(tensors: list[torch.Tensor], target: torch.device, dim: int) -> torch.Tensor:
    if all(t.dim() == 0 for t in tensors):  # one scalar per replica (a loss): a vector, like torch
        return torch.stack([t.to(target) for t in tensors])  # (R,)
    return torch.cat([t.to(target) for t in tensors], dim=dim)  # differentiable: grads go back per device


def _gather_one(outputs: list, target: torch.device, dim: int) -> Any:
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(o, torch.Tensor) for o in outputs):
            raise ValueError(f"gather: replicas returned mixed types {[type(o).__name__ for o in outputs]}")
        return _gather_tensors(outputs, target, dim)
    if first is None or not contains_tensor(first):
        # Non-tensor leaves (None, ints, strings): one value if every replica agrees, else a list.
        return first if all(o == first for o in outputs) else list(outputs)
    if isinstance(first, Mapping):
        if any(set(o) != set(first) for o in outputs):
            keys = [sorted(o) for o in outputs]
            raise ValueError(f"gather: replicas returned dicts with different keys {keys}")
        mapping_type: Any = type(first)
        return mapping_type((k, _gather_one([o[k] for o in outputs], target, dim)) for k in first)
    if isinstance(first, (tuple, list)):
        if any(len(o) != len(first) for o in outputs):
            raise ValueError(f"gather: replicas returned sequences of lengths {[len(o) for o in outputs]}")
        parts = [_gather_one(list(column), target, dim) for column in zip(*outputs, strict=True)]
        return type(first)(*parts) if is_namedtuple(first) else type(first)(parts)
    if is_dataclass_instance(first):
        names = [f.name for f in dataclasses.fields(first) if f.init]
        return dataclasses.replace(
            first, **{n: _gather_one([getattr(o, n) for o in outputs], target, dim) for n in names}
        )
    raise ValueError(
        f"gather: cannot gather outputs of type {type(first).__name__}; return tensors, "
        "tuples, lists, dicts or dataclasses of tensors"
    )


def gather(outputs: Sequence[Any], target_device: DeviceLike, dim: int = 0) -> Any:
    """Concatenate per-replica outputs along `dim` on `target_device`, keeping their structure.

    Tensors are concatenated (0-dim scalars, e.g. per-replica losses, are stacked into a
    vector of length R); tuples, lists, dicts, namedtuples and dataclasses are gathered field
    by field. The copies are differentiable, so backward sends each slice's gradient home.
    """
    if len(outputs) == 0:
        raise ValueError("gather needs at least one output")
    return _gather_one(list(outputs), as_device(target_device), dim)
