"""torch DDP's `delay_all_reduce_named_params` / `param_to_hook_all_reduce`, for nanoddp's DDP.

Some parameters are better left out of the overlapped buckets: e.g. a huge embedding whose
gradient arrives last anyway, or parameters a user wants reduced in one piece. torch 2.13 lets
the caller name them; DDP then

* leaves them out of the buckets (and of the unused-parameter accounting),
* broadcasts them from rank 0 at construction, whatever `init_sync` says,
* keeps one flat buffer for their gradients: at the end of every forward, a delayed parameter
  whose `.grad` is None gets a view of that buffer as `.grad` (zeroed), so autograd accumulates
  straight into it,
* and, from a tensor hook on `param_to_hook_all_reduce` (it fires when that parameter's gradient
  has been computed, before it is accumulated), divides the buffer by the world size and starts
  one all-reduce of it. This happens in every backward, under `no_sync` too (torch does the same;
  the sum is unchanged, because a reduced gradient is the same on every rank and averaging it
  again leaves it as is).

So the caller must pick a `param_to_hook_all_reduce` whose gradient is computed after those of
the delayed parameters (typically one of the first layer's), as with torch. One deliberate
difference: torch never waits for that all-reduce (its result lands whenever the collective
finishes); here the end of the backward waits for it, so `.grad` is final when `backward()`
returns. When every trainable parameter is delayed, DDP does nothing else (as in torch: no
buckets, no buffer broadcasts, no construction-time buffer sync).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from nanoddp.comm.api.backend import Collectives
from nanoddp.parallel.ddp.gradient_average import divide_for_average
from nanoddp.parallel.replicas import broadcast_rank0_weights


def check_delayed_args(module: nn.Module, named_params: Any, hook_param: Any) -> list[tuple[str, nn.Parameter]]:
    """Validate the pair of arguments (torch's rule: both or neither) and each (name, parameter)."""
    if (named_params is None) != (hook_param is None):
        raise ValueError(
            "delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the same time "
            f"(torch DDP's rule); got delay_all_reduce_named_params={'None' if named_params is None else '...'} "
            f"and param_to_hook_all_reduce={'None' if hook_param is None else '...'}"
        )
    if named_params is None:
        return []
    named = list(named_params)
    own = dict(module.named_parameters())
    for item in named:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ValueError(f"delay_all_reduce_named_params must hold (name, parameter) pairs, got {item!r}")
        name, param = item
        if own.get(name) is not param:
            raise ValueError(
                f"delay_all_reduce_named_params: {name!r} is not the name of that parameter in the module "
                "(use the names of module.named_parameters(); a mismatched name would reduce the parameter twice)"
            )
    if not isinstance(hook_param, torch.Tensor) or not hook_param.requires_grad:
        raise ValueError("param_to_hook_all_reduce must be a parameter that requires grad (its gradient triggers "
                         f"the delayed all-reduce), got {type(hook_param).__name__}")  # fmt: skip
    if not named:
        raise ValueError("delay_all_reduce_named_params is empty; pass None to delay nothing")
    if any(p is hook_param for _, p in named):
        raise ValueError(
            "param_to_hook_all_reduce must not be one of delay_all_reduce_named_params: its hook fires before "
            "its own gradient is accumulated, which would then land in the buffer while the all-reduce reads it "
            "(torch races there); hook a parameter whose gradient is computed after the delayed ones"
        )
    if len({p.dtype for _, p in named}) != 1 or len({p.device for _, p in named}) != 1:
        raise ValueError("delay_all_reduce_named_params: all delayed parameters must share one dtype and device "
                         "(their gradients live in one flat buffer)")  # fmt: skip
    return named


def _hook_trampoline(engine_ref: weakref.ref, grad: torch.Tensor) -> torch.Tensor:
    engine = engine_ref()
    if engine is not None:
        engine.launch()
    return grad


class DelayedAllReduce:
    """The delayed parameters' flat gradient buffer and its one all-reduce per backward."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        hook_param: torch.Tensor,
        collectives: Collectives,
        group: Any,
        world_size: int,
        broadcast: bool = True,
    ):
        self.names = {name for name, _ in named_params}
        self.params = [p for _, p in named_params]
        self._collectives, self._group, self._world_size = collectives, group, world_size
        first = self.params[0]
        self.buffer = torch.zeros(sum(p.numel() for p in self.params), dtype=first.dtype, device=first.device)  # (N,)
        self.views, offset = [], 0
        for p in self.params:
            self.views.append(self.buffer[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        self._handle = None
        if broadcast:  # at construction; not after unpickling (the parameters are what was saved)
            broadcast_rank0_weights(self.params, collectives, group)
        handle = hook_param.register_hook(functools.partial(_hook_trampoline, weakref.ref(self)))
        weakref.finalize(self, handle.remove)

    @torch.no_grad()
    def after_forward(self) -> None:
        """Point every delayed parameter without a gradient at its (zeroed) buffer view; if none
        has one (e.g. after zero_grad(set_to_none=True)), zero the whole buffer at once."""
        all_none = all(p.grad is None for p in self.params)
        for param, view in zip(self.params, self.views, strict=True):
            if param.grad is None:
                param.grad = view
                if not all_none:
                    view.zero_()
        if all_none:
            self.buffer.zero_()

    @torch.no_grad()
    def launch(self) -> None:
        """From the hook: average as we sum, start the all-reduce, and wait for it once the
        outermost backward ends (an engine callback), before `backward()` returns."""
        self.wait()  # a second firing in one backward (reentrant checkpointing): keep order
        divide_for_average(self.buffer, self._world_size)
        self._handle = self._collectives.all_reduce(self.buffer, group=self._group, async_op=True)
        torch.autograd.Variable._execution_engine.queue_callback(self.wait)

    def wait(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            handle.wait()
