"""The autograd hooks nanoddp's DDP installs.

Autograd holds these functions, not the engine: each keeps only a weak reference, so a
discarded wrapper leaves no live hooks behind (and is not kept alive by them).
"""

from __future__ import annotations

import weakref

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
