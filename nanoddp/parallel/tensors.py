"""Walking the nested structures that carry tensors in and out of a model.

Batches and forward outputs are tensors inside tuples, lists, dicts, namedtuples and
dataclasses. Every wrapper needs the same three walks over them: DDP and the trainer move a
batch to the device (`move_to`), DDP, mixed precision, ZeRO-2 and FSDP hook the tensors of a
forward output (`tensors_in`), and mixed precision (DDP's and FSDP's) casts floating inputs and
outputs (`cast_floats`). One definition here, so the structures they understand agree.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch.nn.utils.rnn import PackedSequence

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


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


def cast_floats(obj: Any, dtype: torch.dtype | None) -> Any:
    """`obj` with every floating-point tensor cast to `dtype` (None: `obj` itself).

    [Note: torch's containers] torch's DDP (`_cast_forward_inputs`) and FSDP2
    (`_cast_fp_tensor` over `_apply_to_tensors`) walk the same containers the same way, so one
    walk serves both: a dataclass (checked first: HF's `ModelOutput` is also an OrderedDict)
    is rebuilt with `dataclasses.replace`, an OrderedDict keeps its class, any other dict
    becomes a plain dict, a namedtuple keeps its class, a PackedSequence is left as it is, and
    a tensor already in `dtype` (or not floating) is returned itself."""
    if dtype is None:
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if torch.is_floating_point(obj) and obj.dtype != dtype else obj
    if is_dataclass_instance(obj):
        names = [f.name for f in dataclasses.fields(obj) if f.init]  # replace() takes init fields only
        return dataclasses.replace(obj, **{n: cast_floats(getattr(obj, n), dtype) for n in names})
    if isinstance(obj, OrderedDict):
        ordered = obj.__class__()
        for key, value in obj.items():
            ordered[key] = cast_floats(value, dtype)
        return ordered
    if isinstance(obj, PackedSequence):
        return obj
    if isinstance(obj, dict):
        return {key: cast_floats(value, dtype) for key, value in obj.items()}
    if is_namedtuple(obj):
        return type(obj)(*(cast_floats(x, dtype) for x in obj))
    if isinstance(obj, (tuple, list, set)):
        return type(obj)(cast_floats(x, dtype) for x in obj)
    return obj


def through_flat(tensors: Sequence[torch.Tensor], fn: Callable[[torch.Tensor], None]) -> None:
    """Run `fn` in place on one flat tensor per dtype/device holding `tensors` end to end, then
    copy the result back: how a collective over many tensors costs one message per dtype."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for same_kind in by_kind.values():
        flat = torch.cat([t.reshape(-1) for t in same_kind])  # (N,)
        fn(flat)
        offset = 0
        for t in same_kind:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def write_grads(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    """Lay `flat` (the parameters' gradients end to end, in `params` order) back as each
    parameter's `.grad`: copied into a gradient that exists, a copy of its piece where none does
    (never a view of `flat`, which the caller may reuse)."""
    offset = 0
    for param in params:
        piece = flat[offset : offset + param.numel()].view_as(param)
        if param.grad is None:
            param.grad = piece.clone()
        else:
            param.grad.copy_(piece)
        offset += param.numel()


def is_dtensor(obj: Any) -> TypeGuard[DTensor]:
    """`isinstance(obj, DTensor)`, without importing DTensor where nothing has.

    [Note: DTensor on first use] Importing `torch.distributed.tensor` costs most of a second of
    CPU (sympy, the op registrations), paid at start-up by every rank and command that imports
    it. The modules every rank imports (snapshots, clipping, ZeRO) only ask "is this a DTensor?"
    or act on one they were given, so they import it in the function that needs it, and ask
    here: no DTensor can exist before its module is imported, so until then the answer is False."""
    dtensor_module = sys.modules.get("torch.distributed.tensor")
    return dtensor_module is not None and isinstance(obj, dtensor_module.DTensor)
