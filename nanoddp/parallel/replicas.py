"""Keeping replicas identical: check their structure, copy rank 0's weights, compare values.

Data parallelism is only correct if every rank starts from the same model. Two failure modes
are common and silent: a different architecture on some rank (a config typo) and the same
architecture with different initial values (forgotten seed). The first must be caught before
any collective runs, because collectives over mismatched tensors hang or corrupt memory; the
second is cured by broadcasting rank 0's state, and can be audited with `verify_replicas`.

Every check gathers the facts from all ranks and decides on identical data, so every rank
raises the same error: nobody is left waiting in a collective for a peer that gave up.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from nanoddp.comm.api.backend import DEFAULT_COMM_BACKEND, Collectives, collectives_for
from nanoddp.parallel.tensors import through_flat

logger = logging.getLogger(__name__)


def group_size_rank_src(group) -> tuple[int, int, int]:
    """(world size, this rank within `group`, global rank of the group's rank 0).

    No process group at all (a notebook, a unit test, a script run without a launcher) is one rank
    alone, (1, 0, 0): DDP and the low-communication optimizers then wrap without syncing, the one
    rule for all of them."""
    if group is None and not dist.is_initialized():
        return 1, 0, 0
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    src = 0 if group is None else dist.get_global_rank(group, 0)
    return world_size, rank, src


def gather_json(value, collectives: Collectives, group=None) -> list:
    """All-gather a JSON-serialisable value from every rank (as padded uint8 tensors)."""
    world_size = dist.get_world_size(group)
    payload = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)  # (L,)
    length = torch.tensor([payload.numel()], dtype=torch.int64)
    lengths = [torch.zeros_like(length) for _ in range(world_size)]
    collectives.all_gather(lengths, length, group=group)
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    gathered = [torch.zeros_like(padded) for _ in range(world_size)]
    collectives.all_gather(gathered, padded, group=group)
    return [json.loads(bytes(t[: int(n.item())].tolist())) for t, n in zip(gathered, lengths, strict=True)]


def _describe(entry) -> str:
    name, shape, dtype = entry
    return f"'{name}' shape {tuple(shape)} {dtype}"


def check_same_structure(module: nn.Module, collectives: Collectives, group=None) -> None:
    """Raise ValueError on every rank unless all ranks hold the same parameter and buffer
    names, shapes, dtypes and requires_grad flags, naming the first one that differs and where.

    requires_grad is part of the structure because it decides which gradients get bucketed: a
    layer frozen on one rank only would make the ranks' collectives disagree."""
    mine = [
        [f"parameter {n}", list(p.shape), f"{p.dtype}{'' if p.requires_grad else ' (frozen)'}"]
        for n, p in module.named_parameters()
    ]
    mine += [[f"buffer {n}", list(b.shape), str(b.dtype)] for n, b in module.named_buffers()]
    everyone = gather_json(mine, collectives, group)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone):
        for position in range(max(len(reference), len(theirs))):
            ours = reference[position] if position < len(reference) else None
            other = theirs[position] if position < len(theirs) else None
            if ours == other:
                continue
            ours_text = _describe(ours) if ours else "nothing (it has fewer tensors)"
            other_text = _describe(other) if other else "nothing (it has fewer tensors)"
            raise ValueError(
                f"model replicas differ across ranks: tensor #{position} is {ours_text} on rank 0 "
                f"but {other_text} on rank {rank} ({len(reference)} vs {len(theirs)} parameters+buffers). "
                "Every rank must build the same model (same config, same code) before wrapping it."
            )


@torch.no_grad()
def broadcast_coalesced(tensors: Sequence[torch.Tensor], collectives: Collectives, group=None, src: int = 0) -> None:
    """Overwrite `tensors` with `src`'s values using one broadcast per dtype/device."""
    through_flat(tensors, lambda flat: collectives.broadcast(flat, src=src, group=group))


@torch.no_grad()
def broadcast_rank0_weights(
    weights: nn.Module | Iterable[torch.Tensor], collectives: Collectives | None = None, group=None
) -> None:
    """Overwrite every rank's weights with those of rank 0 of `group` (the default group if None).

    `weights` is a module (all its parameters and buffers: what an engine syncs before it
    shards or trains) or the tensors to sync (DDP leaves out what the user told it to ignore;
    its delayed parameters and its per-forward buffer sync pass theirs).
    [Note: why sync at all] Seeding makes replicas equal only if every rank builds the model
    the same way; one broadcast makes it so whatever happened before, one message per dtype."""
    if isinstance(weights, nn.Module):
        weights = [*weights.parameters(), *weights.buffers()]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    broadcast_coalesced([t.detach() for t in weights], collectives or collectives_for(), group, src)


@torch.no_grad()
def verify_replicas(model: nn.Module, atol: float = 0.0, group=None, comm_backend: str = DEFAULT_COMM_BACKEND) -> None:
    """Check that every rank holds the same parameter and buffer values (the check SimpleDDP makes at construction).

    Call it on every rank, e.g. after construction or every N steps to catch silent divergence.
    Returns None when all replicas agree within `atol`; otherwise raises ValueError on every rank
    naming the first tensor that differs, the ranks that differ from rank 0 and by how much.
    """
    if atol < 0:
        raise ValueError(f"atol must be >= 0, got {atol}")
    collectives = collectives_for(comm_backend)
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return
    check_same_structure(model, collectives, group)
    named = list(model.named_parameters()) + list(model.named_buffers())
    position_of = {name: i for i, (name, _) in enumerate(named)}
    by_kind: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named:
        by_kind.setdefault((t.dtype, t.device), []).append((name, t))
    first_bad: tuple[int, str, list[int], float] | None = None
    for same_kind in by_kind.values():
        flat = torch.cat([t.detach().reshape(-1) for _, t in same_kind])  # (N,)
        gathered = [torch.empty_like(flat) for _ in range(world_size)]  # ws x (N,)
        collectives.all_gather(gathered, flat, group=group)
        offset = 0
        for name, t in same_kind:
            span = slice(offset, offset + t.numel())
            offset += t.numel()
            ref = gathered[0][span]
            bad_ranks, worst = [], 0.0
            for rank in range(1, world_size):
                other = gathered[rank][span]
                if not _close(ref, other, atol):
                    bad_ranks.append(rank)
                    worst = max(worst, (other.double() - ref.double()).abs().max().item())
            if bad_ranks and (first_bad is None or position_of[name] < first_bad[0]):
                first_bad = (position_of[name], name, bad_ranks, worst)
    if first_bad is not None:
        _, name, ranks, worst = first_bad
        raise ValueError(
            f"replicas differ: '{name}' on ranks {ranks} differs from rank 0 "
            f"(max abs diff {worst:.3g}, atol={atol}); seed every rank identically before building the "
            "model, or let DistributedDataParallel broadcast rank 0's weights"
        )


def _close(a: torch.Tensor, b: torch.Tensor, atol: float) -> bool:
    if not (a.is_floating_point() or a.is_complex()) or atol == 0:
        return torch.equal(a, b) or bool(torch.all((a == b) | (a.isnan() & b.isnan())))
    return torch.allclose(a, b, rtol=0.0, atol=atol, equal_nan=True)
