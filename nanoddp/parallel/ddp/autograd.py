"""The autograd hooks nanoddp's DDP installs, and how it finds the forward output's tensors.

Autograd holds these functions, not the engine: each keeps only a weak reference, so a
discarded wrapper leaves no live hooks behind (and is not kept alive by them).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch


def grad_ready_trampoline(engine_ref: weakref.ref, index: int, param: torch.Tensor) -> None:
    """The hook autograd holds: a weak reference, so a discarded wrapper leaves no live hooks."""
    engine = engine_ref()
    if engine is not None:
        engine._on_grad_ready(index, param)


def output_grad_trampoline(engine_ref: weakref.ref, grad: torch.Tensor) -> None:
    """Hook on a forward output: its gradient is computed by the backward that consumes the
    output, i.e. the OUTER backward, never by a reentrant checkpoint's inner one."""
    engine = engine_ref()
    if engine is not None:
        engine._queue_finalize()


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
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, field.name))
