"""ZeRO-2: shard the gradients and the optimizer state; keep every parameter whole.

Why: ZeRO-1 still materialises the whole averaged gradient on every rank, then throws away
all but 1/ws of it. Here each gradient bucket is reduce-scattered as soon as backward has
produced it, straight into the owning rank's flat gradient shard, and the full-size gradients
of that bucket are released: per rank, gradient memory after backward is 1/ws (plus the
buckets in flight), optimizer state is 1/ws, parameters stay whole for forward and backward.

The life of one step (`zero2(module)` installs it on the module, in place):
  1. forward: the root's pre-forward hook registers the full parameter views; if an optimizer
     changed the shards since the last gather, each bucket's updated shard is all-gathered
     first (the "all-gather the updated parameters" of ZeRO-2, done lazily so that several
     accumulation micro-steps cost one);
  2. backward: buckets are cut in reverse registration order (roughly the order gradients
     appear) up to `bucket_cap_mb`; a bucket whose gradients are all there is reduce-scattered
     at once, overlapped with the rest of backward (`GradReduceScatter`); its full gradients
     are dropped as it is flattened;
  3. end of backward: wait for every bucket and average it into the shard pieces' `.grad`;
  4. `optimizer.step()`: a plain optimizer over `module.parameters()` (the shard pieces,
     1-D) steps on 1/ws of the elements, so its state is 1/ws. Clip with
     `nanoddp.clip_grad_norm_` (torch's would see one rank's pieces: it is refused, see clip.py).

`module.state_dict()` holds whole tensors, loadable into the plain model, and `load_state_dict`
takes them (see module.py's note: it gathers first after an optimizer step, so every rank calls it).

Each bucket is one `FlatParamUnit` whose chunks are equal across ranks, so the shard of every
rank is ceil(B/ws) per bucket: 1/ws within padding. Buckets stay whole in memory (that is the
difference from `fully_shard`), so there is no all-gather in backward.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from nanoddp.comm.api.backend import DEFAULT_COMM_BACKEND, collectives_for
from nanoddp.parallel.clip import PIECE_GROUPS, mark_piece_grads
from nanoddp.parallel.tensors import tensors_in
from nanoddp.parallel.zero.flat import FlatParamUnit
from nanoddp.parallel.zero.grad_reduce import GradReduceScatter
from nanoddp.parallel.zero.sharded_module import ShardedModule, install_whole_state_dict

logger = logging.getLogger(__name__)


def bucket_params(params: list[nn.Parameter], cap_numel: int) -> list[list[nn.Parameter]]:
    """Reverse registration order, cut whenever a bucket reaches `cap_numel` elements; one
    dtype/device per bucket. Pure function of the sizes: every rank gets the same buckets."""
    buckets: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    for p in reversed(params):
        same_kind = not current or (current[0].dtype, current[0].device) == (p.dtype, p.device)
        if current and (not same_kind or sum(q.numel() for q in current) >= cap_numel):
            buckets.append(current)
            current = []
        current.append(p)
    if current:
        buckets.append(current)
    return buckets


class Zero2Module(ShardedModule):
    """Mixed into the module's class by `zero2`: one gradient reduction over all its buckets."""

    _zero2_units: list[FlatParamUnit]
    _zero2_reduce: GradReduceScatter

    def set_requires_gradient_sync(self, sync: bool) -> None:
        """False: backward keeps full gradients, no reduce-scatter (what `no_sync` sets)."""
        self._zero2_reduce.sync = sync

    def _units(self) -> list[FlatParamUnit]:
        return self._zero2_units


def _pre_forward(module: Zero2Module, args: Any) -> None:
    for unit in module._zero2_units:
        if unit.stale:
            unit.gather()
        unit.use_unsharded()


def _post_forward(module: Zero2Module, args: Any, output: Any) -> Any:
    """Outside autograd, register the shards again now; with a backward to come, keep the full
    views until it ends, so an activation-checkpoint recompute inside it still finds them."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors_in(output)):
        _use_sharded(module)
    return output


def _use_sharded(module: Zero2Module) -> None:
    for unit in module._zero2_units:
        unit.use_sharded()


def _after_backward(module: Zero2Module) -> None:
    """The pieces are registered again, each with a gradient that refuses a per-rank norm."""
    _use_sharded(module)
    mark_piece_grads(p for unit in module._zero2_units for p in unit.params)


def zero2(
    module: nn.Module,
    *,
    group: dist.ProcessGroup | None = None,
    bucket_cap_mb: float = 25.0,
    comm_backend: str = DEFAULT_COMM_BACKEND,
) -> nn.Module:
    """Install ZeRO-2 on `module` (in place; returns it). Build the optimizer over
    `module.parameters()` (before or after: the parameter objects are kept). Every rank must
    start from the same values."""
    if bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
    if isinstance(module, Zero2Module):
        raise ValueError(f"{type(module).__name__} already has ZeRO-2 installed: call zero2 once")
    collectives = collectives_for(comm_backend)
    params = [p for p in module.parameters()]
    if not params:
        raise ValueError("zero2 needs a module with parameters")
    cap = max(1, int(bucket_cap_mb * 2**20) // params[0].element_size())
    units = [
        FlatParamUnit(module, bucket, group, collectives, shard_in_full=True) for bucket in bucket_params(params, cap)
    ]
    cls = module.__class__
    module.__class__ = type(f"Zero2{cls.__name__}", (Zero2Module, cls), {})
    assert isinstance(module, Zero2Module)  # its class now derives from Zero2Module
    zmodule = module  # narrowed, for the closure below
    module._zero2_units = units
    module._zero2_reduce = GradReduceScatter(units, after_backward=lambda: _after_backward(zmodule))
    module.register_forward_pre_hook(_pre_forward)
    module.register_forward_hook(_post_forward)
    install_whole_state_dict(module, units)  # state_dict(): whole tensors, never this rank's pieces
    for p in params:  # nanoddp.clip_grad_norm_ sums these pieces' norms over the group
        PIECE_GROUPS[p] = (group, collectives)
    logger.debug("zero2: %d buckets, %d elements", len(units), sum(u.layout.total for u in units))
    return module
