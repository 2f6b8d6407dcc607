"""Walking the nested structures that carry tensors in and out of a model.

Batches and forward outputs are tensors inside tuples, lists, dicts, namedtuples and
dataclasses. Every wrapper needs the same two walks over them: DDP and the trainer move a batch
to the device (`move_to`), and DDP, mixed precision, ZeRO-2 and FSDP hook the tensors of a
forward output (`tensors_in`). One definition here, so the structures they understand agree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch


def is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested) forward output: tensors, sequences, mappings, dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from tensors_in(item)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from tensors_in(item)
    elif is_dataclass_instance(obj):
        for field in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, field.name))


def contains_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, Mapping):
        return any(contains_tensor(v) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return any(contains_tensor(v) for v in obj)
    if is_dataclass_instance(obj):
        return any(contains_tensor(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return False


def move_to(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """`obj` with every tensor moved to `device` (the very same objects when already there)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if not contains_tensor(obj):
        return obj
    if is_namedtuple(obj):
        return type(obj)(*(move_to(x, device, non_blocking) for x in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(move_to(x, device, non_blocking) for x in obj)
    if isinstance(obj, Mapping):
        mapping_type: Any = type(obj)
        return mapping_type((k, move_to(v, device, non_blocking)) for k, v in obj.items())
    names = [f.name for f in dataclasses.fields(obj) if f.init]  # a dataclass (contains_tensor)
    return dataclasses.replace(obj, **{n: move_to(getattr(obj, n), device, non_blocking) for n in names})
