"""Groups without point-to-point: a nanoddp collective there is torch.distributed's own.

Why: nanoddp builds every collective from send/recv. torch's in-process *threaded* backend
(`torch.testing._internal.distributed.multi_threaded_pg`, where torch's own test suites run ranks
as threads of one process) implements collectives only, no send/recv, and keeps its groups in a
per-thread registry that nanoddp's worker thread cannot see. There is no wire of ours to run on,
so on such a group each public collective hands the call, arguments unchanged, to
`torch.distributed`'s function of the same name. Code and tests written against torch then run
on our DDP and FSDP over that backend too; everywhere else nothing changes (one string compare).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

COLLECTIVES_ONLY_BACKENDS = frozenset({"threaded"})
# The module that makes such groups: until it is imported, none can exist.
THREADED_PG_MODULE = "torch.testing._internal.distributed.multi_threaded_pg"
F = TypeVar("F", bound=Callable[..., Any])


def has_no_point_to_point(group: dist.ProcessGroup | None) -> bool:
    """True for a group (None: the default one) of a backend that carries collectives only."""
    if THREADED_PG_MODULE not in sys.modules:
        return False
    if group is None:
        group = dist.GroupMember.WORLD  # the threaded backend keeps WORLD per thread
    if type(group) is dist.ProcessGroup or not isinstance(group, dist.ProcessGroup):
        return False  # torch's own groups (the hot path), or uninitialised / a non-member sentinel
    return group.name() in COLLECTIVES_ONLY_BACKENDS  # a Python-made group: its backend's name


def or_torch_on_collectives_only(torch_name: str) -> Callable[[F], F]:
    """Decorate a public collective: on a collectives-only group, call `torch.distributed.<torch_name>`."""

    def decorate(ours: F) -> F:
        group_index = list(inspect.signature(ours).parameters).index("group")

        @functools.wraps(ours)
        def collective(*args: Any, **kwargs: Any) -> Any:
            # [Note: per-call cost] Every collective passes here, so the common answer comes first
            # and costs one dict lookup: no collectives-only group exists before its module is
            # imported (resolving the default group alone takes four Python calls).
            if THREADED_PG_MODULE not in sys.modules:
                return ours(*args, **kwargs)
            group = args[group_index] if len(args) > group_index else kwargs.get("group")
            # under torch.compile a group is an opaque object (and no test backend is traced)
            if not torch.compiler.is_compiling() and has_no_point_to_point(group):
                return getattr(dist, torch_name)(*args, **kwargs)
            return ours(*args, **kwargs)

        return collective  # type: ignore[return-value]

    return decorate
