"""Parameters and buffers DDP leaves alone: torch's `_ddp_params_and_buffers_to_ignore`.

torch's DDP reads a list of fully qualified names from the wrapped module's
`_ddp_params_and_buffers_to_ignore` attribute (set by
`DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`). Those tensors are
rank-local: not broadcast from rank 0 at construction, their gradients not averaged, not synced
as buffers before a forward or at the end of a Join. Typical uses are a parameter another
mechanism already reduces (tensor-parallel shards, an expert held by one rank) and per-rank
statistics. Every place the wrapper and its Join hook gather the module's tensors asks here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn


def set_params_and_buffers_to_ignore(module: nn.Module, names: Iterable[str]) -> None:
    """Mark `names` (fully qualified, e.g. "layer.0.weight") as left alone by DDP, as torch's
    static method does: the list goes on the module, and each tensor gets `_ddp_ignored = True`."""
    names = list(names)
    module._ddp_params_and_buffers_to_ignore = names  # type: ignore[assignment]  # a list, not a submodule
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if name in names:
            tensor._ddp_ignored = True  # type: ignore[attr-defined]  # torch's mark


def ignored_names(module: nn.Module) -> frozenset[str]:
    """The names DDP must leave alone (empty unless the module carries torch's attribute)."""
    return frozenset(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


def synced_parameters(module: nn.Module, ignored: frozenset[str]) -> list[torch.Tensor]:
    """The module's parameters that replicas share (broadcast at construction and after Join)."""
    return [p for name, p in module.named_parameters() if name not in ignored]


def synced_buffers(module: nn.Module, ignored: frozenset[str]) -> list[torch.Tensor]:
    """The module's buffers that replicas share. Read again each time: a module may reassign them."""
    return [b for name, b in module.named_buffers() if name not in ignored]
