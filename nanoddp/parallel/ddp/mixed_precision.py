"""torch DDP's `mixed_precision` argument (`torch.nn.parallel.distributed._MixedPrecision`).

torch 2.13's own implementation runs on accelerators only: its root pre-forward hook records a
`torch.Event` after the low-precision copies, and on CPU that raises "cpu backend doesn't
support events" on the first forward (tests/multiproc/test_ddp_mixed_precision.py checks this, so a torch
that lifts the limit gets noticed). nanoddp implements the semantics torch documents, on any
device, with the same mechanism (the parameters' `.data` is swapped for low-precision copies):

* `param_dtype`: forward and backward run on copies of the parameters in param_dtype, and
  floating-point inputs are cast to it; outside forward/backward the parameters are the
  original full-precision tensors, so optimizers and checkpoints see full precision.
* `reduce_dtype`: gradients travel in buckets of reduce_dtype (if None: param_dtype, else the
  parameters' own dtype), averaged like the default all-reduce.
* `buffer_dtype`: floating-point buffers are cast once, at construction. (torch casts every
  buffer, integer ones such as BatchNorm's `num_batches_tracked` too, although its docstring
  says only floating-point tensors are cast; nanoddp follows the docstring.)
* after every backward `.grad` is in the parameters' dtype. A `.grad` kept across iterations
  (no_sync accumulation, zero_grad(set_to_none=False)) is cast down to param_dtype at the next
  forward and accumulates there, as torch does.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
import torch.nn as nn

from nanoddp.parallel.tensors import cast_floats, tensors_in

FIELDS = ("param_dtype", "reduce_dtype", "buffer_dtype")


def check_mixed_precision(config: Any, gradient_as_bucket_view: bool, delayed: bool) -> None:
    """A `_MixedPrecision`-like config (three floating dtypes or None), and what it cannot mix with."""
    if config is None:
        return
    for field in FIELDS:
        value = getattr(config, field, "missing")
        if not (value is None or (isinstance(value, torch.dtype) and value.is_floating_point)):
            raise ValueError(
                f"mixed_precision.{field} must be a floating-point torch.dtype or None, got {value!r}; pass "
                "torch.nn.parallel.distributed._MixedPrecision(param_dtype=..., reduce_dtype=..., buffer_dtype=...)"
            )
    if gradient_as_bucket_view:
        raise ValueError(
            "mixed_precision with gradient_as_bucket_view=True is not supported: .grad is full precision while "
            "the bucket holds reduce_dtype; leave gradient_as_bucket_view False"
        )
    if delayed:
        raise ValueError(
            "mixed_precision with delay_all_reduce_named_params is not supported (the delayed buffer would mix "
            "dtypes); use one or the other"
        )


def _ddp_ignored(tensor: torch.Tensor) -> bool:
    """Marked by `_set_params_and_buffers_to_ignore_for_model` (nanoddp.parallel.ddp.ignored)."""
    return bool(getattr(tensor, "_ddp_ignored", False))


def _restore_trampoline(ref: weakref.ref, grad: torch.Tensor) -> None:
    helper = ref()
    if helper is not None and not helper.restore_queued:
        helper.restore_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(helper.restore)


class MixedPrecision:
    """Swaps the module's parameters to param_dtype for forward+backward and back afterwards."""

    def __init__(self, config: Any, module: nn.Module):
        self.param_dtype: torch.dtype | None = config.param_dtype
        self.reduce_dtype: torch.dtype | None = config.reduce_dtype or config.param_dtype
        self.module = module
        self.restore_queued = False
        self._full: list[tuple[nn.Parameter, torch.Tensor]] | None = None  # (param, full data) while swapped
        if config.buffer_dtype is not None:
            for buffer in module.buffers():
                if buffer.is_floating_point() and not _ddp_ignored(buffer):
                    buffer.data = buffer.data.to(config.buffer_dtype)

    @torch.no_grad()
    def before_forward(self, inputs: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Swap in low-precision copies (kept if already swapped: a graph not yet backwarded
        still reads them) and cast accumulated gradients and floating inputs to param_dtype."""
        if self.param_dtype is None:
            return inputs, kwargs
        if self._full is None:
            self._full = []
            for param in self.module.parameters():
                if _ddp_ignored(param):
                    continue  # left alone by DDP, in full precision too (as torch)
                self._full.append((param, param.data))
                if param.grad is not None:
                    param.grad.data = param.grad.to(self.param_dtype)
                param.data = param.data.to(self.param_dtype)
        return cast_floats(inputs, self.param_dtype), cast_floats(kwargs, self.param_dtype)

    def after_forward(self, output: Any) -> None:
        """Restore now if no backward will follow, else once the backward ends (a hook on the
        output queues `restore` on the outer backward's graph task)."""
        hooked = False
        if torch.is_grad_enabled():
            ref = weakref.ref(self)
            for tensor in tensors_in(output):
                if tensor.grad_fn is not None:
                    tensor.register_hook(functools.partial(_restore_trampoline, ref))
                    hooked = True
        if not hooked:
            self.restore()

    @torch.no_grad()
    def restore(self) -> None:
        """Full-precision parameters back in place, and their gradients cast up to match."""
        self.restore_queued = False
        if self._full is None:
            return
        for param, full in self._full:
            param.data = full
            if param.grad is not None and param.grad.dtype != full.dtype:
                param.grad = param.grad.to(full.dtype)
        self._full = None
