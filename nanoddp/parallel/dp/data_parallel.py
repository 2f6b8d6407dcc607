"""Single-process, multi-device data parallelism, built from four visible steps.

One forward of `DataParallel` is:

1. `scatter`: cut the batch into one chunk per device (`Tensor.chunk` semantics, like torch).
2. `replicate`: give every device its own copy of the module whose parameters are
   *differentiable copies* of the originals, so `backward()` sums every replica's gradient
   into the one set of leaf parameters -- this sum is DataParallel's gradient "all-reduce".
3. `parallel_apply`: run each replica on its chunk in its own Python thread.
4. `gather`: concatenate the outputs on the output device.

Why it loses to DDP: the threads share one GIL, the module is re-replicated on
every step, and every output lands on one device. Returning the loss from `forward` (one
scalar per replica, gathered as a vector) removes most of that last imbalance.

Devices may be CPU "devices" (`["cpu", "cpu"]`): every step above really runs, which makes the
whole path testable on a machine without GPUs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from itertools import chain
from typing import Any

import torch
import torch.nn as nn

from nanoddp.parallel.dp.scatter_gather import (
    DeviceLike,
    as_device,
    batch_size_of,
    check_device_available,
    gather,
    normalize_device_ids,
    scatter,
    scatter_kwargs,
)
from nanoddp.parallel.tensors import move_to

logger = logging.getLogger(__name__)

__all__ = ["DataParallel", "gather", "mean_over_replicas", "parallel_apply", "replicate", "scatter", "scatter_kwargs"]

# ----------------------------------------------------------------------------- replicate


def _copy_tensor(tensor: torch.Tensor, device: torch.device, share: bool) -> torch.Tensor:
    """A replica's view of one parameter/buffer.

    Tensors that require grad become *non-leaf* tensors: `.to(device)` across devices, or an
    alias (`view_as`) on the same device, which costs no memory but is still a distinct
    autograd node, so each replica's gradient flows back into the original leaf and
    accumulates there. Buffers that need no grad are shared when `share` (the replica on the
    module's own device, like torch) and otherwise cloned, so that in-place updates such as
    BatchNorm running stats never race between threads.
    """
    if tensor.requires_grad:
        return tensor.view_as(tensor) if tensor.device == device else tensor.to(device)
    if share and tensor.device == device:
        return tensor
    return tensor.to(device, copy=True)


def _copy_module_tree(module: nn.Module, tensors: dict[int, torch.Tensor], memo: dict[int, nn.Module]) -> nn.Module:
    """A shallow copy of every module in the tree with parameters/buffers swapped for `tensors`.

    Built without `__init__` and without `copy.deepcopy`: attributes (hooks, configs, the
    training flag) are shared with the original, only the tensor tables and child tables are new.
    The replica's parameters are plain non-leaf tensors, kept in `_parameters` so forward code
    that inspects `next(self.parameters()).dtype` still works. Shared (tied) modules and
    tensors stay shared in the copy.
    """
    if id(module) in memo:
        return memo[id(module)]
    replica = module.__class__.__new__(module.__class__)
    replica.__dict__.update(module.__dict__)
    memo[id(module)] = replica
    replica.__dict__["_parameters"] = {k: tensors.get(id(p)) for k, p in module._parameters.items()}
    replica.__dict__["_buffers"] = {k: tensors.get(id(b)) for k, b in module._buffers.items()}
    replica.__dict__["_modules"] = {
        k: None if child is None else _copy_module_tree(child, tensors, memo) for k, child in module._modules.items()
    }
    return replica


def replicate(module: nn.Module, devices: Sequence[DeviceLike]) -> list[nn.Module]:
    """One module per device whose parameters are differentiable copies of `module`'s.

    After `sum(replica(x_i)).backward()`, `module`'s parameters hold the sum of every
    replica's gradient: the reduction of DataParallel happens inside autograd. Replicas are
    throw-away (built on every forward) and must not be trained or saved on their own.
    """
    targets = [as_device(d) for d in devices]
    own_tensors = list(chain(module.parameters(), module.buffers()))  # deduplicated (tied weights)
    source = own_tensors[0].device if own_tensors else None
    replicas = []
    for index, device in enumerate(targets):
        share = index == 0 and device == source  # the first replica may use the original buffers
        tensors = {id(t): _copy_tensor(t, device, share) for t in own_tensors}
        replicas.append(_copy_module_tree(module, tensors, {}))
    return replicas


# ----------------------------------------------------------------------------- parallel_apply


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    try:
        return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError):  # torch < 2.4: per-device-type functions
        if device_type == "cpu":
            return torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
        return torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()


def _run_replica(
    replica: nn.Module,
    args: tuple,
    kwargs: dict,
    device: torch.device,
    grad_enabled: bool,
    autocast: tuple[bool, torch.dtype],
) -> Any:
    """Run one replica with the caller's grad/autocast modes (both are thread-local in torch)."""
    enabled, dtype = autocast
    with torch.set_grad_enabled(grad_enabled), torch.autocast(device.type, dtype=dtype, enabled=enabled):
        if device.type == "cuda":
            with torch.cuda.device(device):
                return replica(*args, **kwargs)
        return replica(*args, **kwargs)


def _replica_error(index: int, device: torch.device, exc: BaseException) -> BaseException:
    """The same exception type, its message prefixed with the replica; the original is the cause."""
    message = f"in replica {index} on device {device}: {type(exc).__name__}: {exc}"
    try:
        wrapped = type(exc)(message)
    except Exception:  # exception types whose constructor wants other arguments
        wrapped = RuntimeError(message)
    wrapped.replica_index = index  # type: ignore[attr-defined]
    return wrapped


def parallel_apply(
    replicas: Sequence[nn.Module],
    inputs: Sequence[tuple],
    kwargs: Sequence[dict] | None = None,
    devices: Sequence[DeviceLike] | None = None,
) -> list:
    """`[replica_i(*inputs[i], **kwargs[i])]`, each in its own thread (one replica runs inline).

    Devices default to where each replica's first parameter lives. If a replica raises, the
    first failing replica's exception is re-raised here with its index in the message and
    the original exception (with its traceback from the worker thread) as `__cause__`.
    """
    n = len(replicas)
    kwargs = list(kwargs) if kwargs is not None else [{}] * n
    if not (len(inputs) == n and len(kwargs) == n):
        raise ValueError(
            f"parallel_apply needs one input per replica: {n} replicas, {len(inputs)} inputs, {len(kwargs)} kwargs"
        )
    if devices is None:
        devices = [next(chain(r.parameters(), r.buffers()), torch.empty(0)).device for r in replicas]
    targets = [as_device(d) for d in devices]
    grad_enabled = torch.is_grad_enabled()
    autocast = {d.type: _autocast_state(d.type) for d in targets}
    results: list[Any] = [None] * n
    errors: dict[int, BaseException] = {}

    def worker(i: int) -> None:
        try:
            results[i] = _run_replica(
                replicas[i], tuple(inputs[i]), kwargs[i], targets[i], grad_enabled, autocast[targets[i].type]
            )
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread below
            errors[i] = exc

    if n == 1:
        worker(0)
    else:
        threads = [threading.Thread(target=worker, args=(i,), name=f"nanoddp-dp-{i}") for i in range(n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if errors:
        index = min(errors)
        if len(errors) > 1:
            logger.error("replicas %s raised; re-raising replica %d's error", sorted(errors), index)
        raise _replica_error(index, targets[index], errors[index]) from errors[index]
    return results


# ----------------------------------------------------------------------------- the wrapper


def mean_over_replicas(losses: torch.Tensor, batch_sizes: Sequence[int]) -> torch.Tensor:
    """The full-batch mean from per-replica means: weighted by each replica's share of the batch.

    A plain `losses.mean()` is only right when every replica got the same number of samples
    (batch 5 on 2 devices gives 3 + 2: the mean of means over-weights the smaller chunk).
    """
    if losses.dim() != 1 or losses.numel() != len(batch_sizes):
        raise ValueError(
            f"need one loss per replica: got losses of shape {tuple(losses.shape)} and {len(batch_sizes)} batch sizes"
        )
    weights = torch.tensor(batch_sizes, dtype=losses.dtype, device=losses.device)  # (R,)
    return (losses * weights).sum() / weights.sum()


class DataParallel(nn.Module):
    """`torch.nn.DataParallel`, rebuilt: scatter -> replicate -> parallel_apply -> gather.

    `device_ids` defaults to every visible GPU; on a machine without GPUs (or with one
    device) the wrapper simply calls `.module`. CPU "devices" (`["cpu", "cpu"]`) run the
    full multi-replica path with threads. The module must live on `device_ids[0]`.

    BatchNorm & other buffers: each replica normalises with its own chunk's statistics, and
    only replica 0's in-place buffer updates (running stats) reach `.module` -- torch's rule.
    Use loss-in-forward (`model(x, y)` returning a loss) and `reduce_loss` for training.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
    ):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DataParallel wraps an nn.Module, got {type(module).__name__}")
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise ValueError(f"dim must be an int (the batch dimension), got {dim!r}")
        self.module = module
        self.device_ids = normalize_device_ids(device_ids)
        self.dim = dim
        if output_device is None:
            self.output_device = self.device_ids[0] if self.device_ids else None
        else:
            self.output_device = as_device(output_device)
            check_device_available(self.output_device)
        self.replica_batch_sizes: list[int] | None = None
        """Rows each replica got in the last forward (for `reduce_loss`)."""
        if not self.device_ids:
            logger.info("DataParallel: no GPU visible, calling the module directly")

    def _check_module_device(self) -> None:
        source = self.device_ids[0]
        for tensor in chain(self.module.parameters(), self.module.buffers()):
            if tensor.device != source:
                raise ValueError(
                    f"module must have its parameters and buffers on device_ids[0] = {source}, "
                    f"found one on {tensor.device}; call module.to({str(source)!r}) first"
                )

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not self.device_ids:
            return self.module(*inputs, **kwargs)
        self._check_module_device()
        if len(self.device_ids) == 1:  # nothing to split: the wrapped module, on its device
            return self.module(*move_to(inputs, self.device_ids[0]), **move_to(kwargs, self.device_ids[0]))
        scattered_inputs, scattered_kwargs = self.scatter(inputs, kwargs, self.device_ids)
        if not scattered_inputs:  # called with no arguments at all: one replica is enough
            scattered_inputs, scattered_kwargs = [()], [{}]
        devices = self.device_ids[: len(scattered_inputs)]
        per_replica = zip(scattered_inputs, scattered_kwargs, strict=True)
        sizes = [batch_size_of(args_and_kwargs, self.dim) for args_and_kwargs in per_replica]
        known = [size for size in sizes if size is not None]
        self.replica_batch_sizes = known if len(known) == len(sizes) else None
        replicas = self.replicate(self.module, devices)
        outputs = self.parallel_apply(replicas, scattered_inputs, scattered_kwargs, devices)
        assert self.output_device is not None  # set whenever device_ids is
        return self.gather(outputs, self.output_device)

    # The four steps as methods, so a subclass can swap one (torch's structure).
    def scatter(self, inputs: tuple, kwargs: dict, device_ids: Sequence[torch.device]) -> tuple[list, list]:
        return scatter_kwargs(inputs, kwargs, device_ids, self.dim)

    def replicate(self, module: nn.Module, device_ids: Sequence[torch.device]) -> list[nn.Module]:
        return replicate(module, device_ids)

    def parallel_apply(
        self,
        replicas: Sequence[nn.Module],
        inputs: Sequence[tuple],
        kwargs: Sequence[dict],
        devices: Sequence[torch.device] | None = None,
    ) -> list:
        return parallel_apply(replicas, inputs, kwargs, devices)

    def gather(self, outputs: Sequence[Any], output_device: torch.device) -> Any:
        return gather(outputs, output_device, self.dim)

    def reduce_loss(self, losses: torch.Tensor) -> torch.Tensor:
        """Full-batch mean loss from the gathered per-replica losses of the last forward."""
        if losses.dim() == 0:  # single-device path: the module's own scalar
            return losses
        if self.replica_batch_sizes is None:
            raise ValueError(
                "reduce_loss needs a preceding multi-replica forward whose inputs hold a "
                "batched tensor; otherwise average the losses yourself"
            )
        return mean_over_replicas(losses, self.replica_batch_sizes)
