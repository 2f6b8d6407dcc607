"""Gradient buckets: which parameters travel together, and the flat buffer they travel in.

Reducing every gradient with its own collective pays the per-message latency ~50 times per
step for a small transformer; reducing one giant flat tensor at the end of backward hides
nothing. Buckets are the middle ground: parameters are grouped, in the order their gradients
are expected to become ready (reverse registration order at first, the observed order after
one iteration), into flat buffers of at most `bucket_cap_mb`. A bucket's all-reduce starts the
moment its last gradient lands, while backward keeps computing the earlier layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nanoddp.comm.api.backend import Collectives
from nanoddp.parallel.ddp.sparse import empty_sparse_like

# torch DDP's first bucket is 1 MiB whatever the cap: the last layers' gradients arrive first,
# and a small first bucket puts communication on the wire as early as possible.
FIRST_BUCKET_BYTES = 1024 * 1024


def bucket_limits(cap_bytes: int, per_bucket_caps: Sequence[int] = ()) -> list[int]:
    """Byte limits of the 1st, 2nd, ... bucket (the last one repeats), as torch DDP uses them:
    `bucket_cap_mb_list` as given, else a small first bucket then `bucket_cap_mb`."""
    if per_bucket_caps:
        return list(per_bucket_caps)
    return [min(FIRST_BUCKET_BYTES, cap_bytes), cap_bytes]


def assign_buckets(
    params: Sequence[torch.Tensor], limits: Sequence[int], alone: Sequence[bool] = (), sort: bool = True
) -> list[list[int]]:
    """Group positions of `params` (given in expected ready order) into buckets.

    A bucket closes once it holds >= its limit in bytes (so a parameter larger than the limit gets
    a bucket of its own); the k-th bucket of each (dtype, device) gets `limits[k]`, the last limit
    repeating (torch's `_compute_bucket_assignment_by_size`). Buckets never mix dtypes or devices,
    because each is one flat tensor. A position flagged in `alone` (a sparse gradient) gets a
    bucket of its own and counts towards no limit, as in torch. Buckets are returned ordered by
    their first member, or with `sort=False` as torch's rebuild leaves them: in the order they
    closed, the ones still open at the end last.
    """
    if not limits or min(limits) <= 0:
        raise ValueError(f"bucket limits must be > 0 bytes, got {list(limits)}")
    open_buckets: dict[tuple, list[int]] = {}
    open_bytes: dict[tuple, int] = {}
    closed_count: dict[tuple, int] = {}
    closed: list[list[int]] = []
    for position, param in enumerate(params):
        if alone and alone[position]:
            closed.append([position])
            continue
        key = (param.dtype, param.device)
        members = open_buckets.setdefault(key, [])
        members.append(position)
        open_bytes[key] = open_bytes.get(key, 0) + param.numel() * param.element_size()
        count = closed_count.get(key, 0)
        if open_bytes[key] >= limits[min(count, len(limits) - 1)]:
            closed.append(members)
            open_buckets[key], open_bytes[key], closed_count[key] = [], 0, count + 1
    closed.extend(members for members in open_buckets.values() if members)
    if sort:
        closed.sort(key=lambda members: members[0])
    return closed


def group_in_order(
    params: Sequence[torch.Tensor],
    order: Sequence[int],
    limits: Sequence[int],
    sparse: Sequence[bool] = (),
    sort: bool = True,
) -> list[list[int]]:
    """Buckets (lists of indices into `params`) for gradients expected to arrive in `order`;
    `sparse[i]`: parameter i's gradient is sparse (a bucket of its own); `sort`: see assign_buckets."""
    alone = [sparse[i] for i in order] if sparse else ()
    positions_per_bucket = assign_buckets([params[i] for i in order], limits, alone, sort)
    return [[order[pos] for pos in positions] for positions in positions_per_bucket]


def initial_groups(
    params: Sequence[torch.Tensor], limits: Sequence[int], per_bucket_caps: bool, sparse: Sequence[bool] = ()
) -> list[list[int]]:
    """The buckets before any gradient has been seen. With `bucket_cap_mb_list`, torch's layout:
    the limits applied in registration order, then the bucket list reversed (members keep their
    registration order). Otherwise reverse registration order, grouped by the limits."""
    if per_bucket_caps:
        return list(reversed(assign_buckets(params, limits, sparse)))
    return group_in_order(params, list(reversed(range(len(params)))), limits, sparse)


class Bucket:
    """One flat gradient buffer shared by a group of parameters, and its in-flight reduction.

    `views[i]` is the slice of `buffer` holding `params[i]`'s gradient, shaped like the parameter
    (with gradient_as_bucket_view those views *are* the parameters' `.grad`). A `sparse` bucket
    holds one parameter with a sparse gradient and no flat buffer: `buffer` is that gradient
    itself, set each iteration when it lands (an empty sparse tensor until then), and `views` is
    empty, as in torch's reducer.
    """

    def __init__(
        self, index: int, params: Sequence[torch.Tensor], param_indices: Sequence[int], dtype=None, sparse=False
    ):
        self.index = index
        self.params = list(params)
        self.param_indices = list(param_indices)  # positions in the engine's parameter list
        self.sparse = sparse
        self.views: list[torch.Tensor] = []
        first = self.params[0]
        if sparse:
            self.buffer = empty_sparse_like(first)  # (*param.shape) sparse, no rows
        else:
            total = sum(p.numel() for p in self.params)
            self.buffer = torch.zeros(total, dtype=dtype or first.dtype, device=first.device)  # (N,)
            offset = 0
            for p in self.params:
                self.views.append(self.buffer[offset : offset + p.numel()].view(p.shape))
                offset += p.numel()
        self.pending = len(self.params)  # gradients still to land this iteration
        self.handle: Any = None  # a Work (default all-reduce) or a Future (comm hook, sparse) while in flight

    @property
    def nbytes(self) -> int:
        if self.sparse:
            return self.params[0].numel() * self.params[0].element_size()  # its dense size, as a bound
        return self.buffer.numel() * self.buffer.element_size()

    def reset(self) -> None:
        """Forget the last iteration: every gradient is pending again, nothing in flight."""
        self.pending = len(self.params)
        self.handle = None


class GradBucket:
    """What a comm hook receives: torch's `GradBucket` interface over one of our buckets.

    The private `_collectives` and `_group` let nanoddp's own hooks reduce with the engine's
    backend and process group; torch's GradBucket has neither, so the same hooks fall back to
    torch.distributed when registered on torch DDP.
    """

    def __init__(self, bucket: Bucket, num_buckets: int, collectives: Collectives, group):
        self._bucket = bucket
        self._num_buckets = num_buckets
        self._collectives = collectives
        self._group = group
        self._buffer = bucket.buffer  # what buffer() returns; set_buffer replaces it

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        """The flat (N,) gradient buffer (a sparse bucket: the sparse gradient); reduce it in
        place or return a new tensor."""
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Make `tensor` what buffer() returns from now on, as torch's GradBucket does.

        torch's fp16/bf16 compress wrappers set a 16-bit copy here and call the wrapped hook,
        which reduces buffer(): the 16-bit tensor is what goes on the wire, and its values are
        copied (cast) into the bucket's own buffer when the hook's future is written back."""
        self._buffer = tensor

    def is_last(self) -> bool:
        """True for the last bucket to be reduced in this iteration."""
        return self._bucket.index == self._num_buckets - 1

    def parameters(self) -> list[torch.Tensor]:
        return list(self._bucket.params)

    def gradients(self) -> list[torch.Tensor]:
        """Per-parameter views into the bucket's flat buffer, shaped like the parameters (none
        for a sparse bucket, as torch's)."""
        return list(self._bucket.views)


def build_buckets(
    params: Sequence[torch.Tensor],
    groups: Sequence[Sequence[int]],
    grads_as_views: bool,
    dtype=None,
    sparse: Sequence[bool] = (),
) -> tuple[list[Bucket], list[tuple[Bucket, int] | None]]:
    """One bucket per group of indices into `params` (in launch order), and each parameter's
    (bucket, slot); buffers in `dtype` (mixed precision's reduce_dtype) or the parameters'.
    `sparse[i]`: parameter i has a sparse gradient (its group holds it alone). Existing dense
    gradients are carried over: with `grads_as_views` they are copied into the new buffers and
    `.grad` is repointed at the new views (torch ignores the view setting for sparse ones)."""
    buckets: list[Bucket] = []
    slot_of: list[tuple[Bucket, int] | None] = [None] * len(params)
    for bucket_index, indices in enumerate(groups):
        is_sparse = bool(sparse) and sparse[indices[0]]
        bucket = Bucket(bucket_index, [params[i] for i in indices], indices, dtype, sparse=is_sparse)
        for slot, i in enumerate(indices):
            slot_of[i] = (bucket, slot)
        if grads_as_views and not is_sparse:
            with torch.no_grad():
                for param, view in zip(bucket.params, bucket.views, strict=True):
                    if param.grad is not None:
                        view.copy_(param.grad)
                        param.grad = view
        buckets.append(bucket)
    return buckets, slot_of


def unused_parameters_error(names: Sequence[str], use_counts: list[int]) -> RuntimeError | None:
    """The error for parameters that got no gradient on some ranks; `use_counts` ends with the
    number of ranks that took part (fewer once some have joined)."""
    *use_counts, ws = use_counts
    missing = [(names[i], n) for i, n in enumerate(use_counts) if n < ws]
    if not missing:
        return None
    listed = ", ".join(f"{name} (no gradient on {ws - n} of {ws} ranks)" for name, n in missing)
    return RuntimeError(
        f"DistributedDataParallel: {len(missing)} parameter(s) received no gradient in this backward: "
        f"{listed}. Either make every parameter take part in the loss on every rank, or construct the "
        "wrapper with find_unused_parameters=True (unused parameters then contribute zero gradient)."
    )
