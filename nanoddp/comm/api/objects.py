"""Collectives of picklable Python objects, with torch.distributed's signatures.

Security: objects travel as pickles and are unpickled on arrival, and unpickling runs
arbitrary code. Use these only between ranks you trust (your own job), exactly as with
torch.distributed's object collectives.

Each call first runs its local checks (list lengths, the root, pickling) inside a header
round (`alltoall.agree`), so a bad call on one rank raises the same error on every rank.
Then the pickles move as uint8 tensors through nanoddp's own collectives: their byte counts
first, then the bytes, padded to the longest so the equal-size collectives can carry them.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed as dist

from nanoddp.comm.api.alltoall import agree
from nanoddp.comm.api.collectives import all_gather_into_tensor
from nanoddp.comm.api.rooted import broadcast, gather, scatter
from nanoddp.comm.protocol.checks import default_device
from nanoddp.comm.transport.collectives_only import or_torch_on_collectives_only
from nanoddp.comm.transport.runner import runner_for
from nanoddp.comm.transport.transport import Peers


@or_torch_on_collectives_only("broadcast_object_list")
def broadcast_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    group_src: int | None = None,
) -> None:
    """Replace every rank's `object_list` items, in place, with the root's (pickled; trusted ranks only)."""
    runner = runner_for(group, "broadcast_object_list")
    if runner is None:
        return
    peers = runner.peers

    def local() -> tuple[int, list[torch.Tensor] | None]:
        if not isinstance(object_list, list):
            raise TypeError(f"object_list must be a list, got {type(object_list).__name__}")
        root = _root(peers, src, group_src, "src")
        return root, [_pickle(o) for o in object_list] if peers.rank == root else None

    root, pickles = agree(runner, "broadcast_object_list", local)
    where = _device(peers, device)
    sizes = torch.tensor(
        [p.numel() for p in pickles] if pickles else [0] * len(object_list), dtype=torch.int64, device=where
    )
    broadcast(sizes, src=peers.global_ranks[root], group=group)  # raises everywhere if the lengths differ
    data = torch.cat(pickles).to(where) if pickles else torch.empty(int(sizes.sum()), dtype=torch.uint8, device=where)
    broadcast(data, src=peers.global_ranks[root], group=group)
    if peers.rank != root:
        object_list[:] = _unpickle_all(data, sizes.tolist())


@or_torch_on_collectives_only("all_gather_object")
def all_gather_object(object_list: list[Any], obj: Any, group: dist.ProcessGroup | None = None) -> None:
    """Every rank's `obj`, in group-rank order, into every rank's `object_list` (trusted ranks only)."""
    runner = runner_for(group, "all_gather_object")
    if runner is None:
        return
    peers = runner.peers

    def local() -> torch.Tensor:
        _check_slots(object_list, peers.size, "object_list")
        return _pickle(obj)

    mine = agree(runner, "all_gather_object", local)
    object_list[:] = _all_gather_pickles(peers, mine, group)


@or_torch_on_collectives_only("gather_object")
def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: dist.ProcessGroup | None = None,
    group_dst: int | None = None,
) -> None:
    """Every rank's `obj` into the root's `object_gather_list` (pickled; trusted ranks only)."""
    runner = runner_for(group, "gather_object")
    if runner is None:
        return
    peers = runner.peers

    def local() -> tuple[int, torch.Tensor]:
        root = _root(peers, dst, group_dst, "dst")
        if peers.rank == root:
            _check_slots(object_gather_list, peers.size, "object_gather_list")
        return root, _pickle(obj)

    root, mine = agree(runner, "gather_object", local)
    where = _device(peers, None)
    sizes = torch.empty(peers.size, dtype=torch.int64, device=where)  # every rank needs the longest
    all_gather_into_tensor(sizes, torch.tensor([mine.numel()], device=where), group=group)
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8, device=where)
    padded[: mine.numel()] = mine.to(where)
    slots = [torch.empty_like(padded) for _ in range(peers.size)] if peers.rank == root else None
    gather(padded, slots, dst=peers.global_ranks[root], group=group)
    if peers.rank == root:
        assert object_gather_list is not None and slots is not None  # the root's list passed _check_slots
        object_gather_list[:] = [_unpickle(s[:n]) for s, n in zip(slots, sizes.tolist(), strict=True)]


@or_torch_on_collectives_only("scatter_object_list")
def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: dist.ProcessGroup | None = None,
    group_src: int | None = None,
) -> None:
    """The root's `scatter_object_input_list[i]` into group rank i's `scatter_object_output_list[0]`."""
    runner = runner_for(group, "scatter_object_list")
    if runner is None:
        return
    peers = runner.peers

    def local() -> tuple[int, list[torch.Tensor] | None]:
        out = scatter_object_output_list
        if not isinstance(out, list) or not out:
            raise ValueError("scatter_object_output_list must be a non-empty list (its item 0 is replaced)")
        root = _root(peers, src, group_src, "src")
        if peers.rank != root:
            return root, None
        _check_slots(scatter_object_input_list, peers.size, "scatter_object_input_list")
        assert scatter_object_input_list is not None  # _check_slots raised for anything but a list
        return root, [_pickle(o) for o in scatter_object_input_list]

    root, pickles = agree(runner, "scatter_object_list", local)
    where = _device(peers, None)
    sizes = torch.tensor([p.numel() for p in pickles] if pickles else [0] * peers.size, dtype=torch.int64, device=where)
    broadcast(sizes, src=peers.global_ranks[root], group=group)
    longest = int(sizes.max())
    parts = None
    if pickles is not None:
        parts = [torch.zeros(longest, dtype=torch.uint8, device=where) for _ in pickles]
        for part, p in zip(parts, pickles, strict=True):
            part[: p.numel()] = p.to(where)
    mine = torch.empty(longest, dtype=torch.uint8, device=where)
    scatter(mine, parts, src=peers.global_ranks[root], group=group)
    scatter_object_output_list[0] = _unpickle(mine[: int(sizes[peers.rank])])


# --- helpers -------------------------------------------------------------------------------------


def _all_gather_pickles(peers: Peers, mine: torch.Tensor, group: dist.ProcessGroup | None) -> list[Any]:
    where = _device(peers, None)
    sizes = torch.empty(peers.size, dtype=torch.int64, device=where)
    all_gather_into_tensor(sizes, torch.tensor([mine.numel()], device=where), group=group)
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8, device=where)
    padded[: mine.numel()] = mine.to(where)
    everyone = torch.empty(peers.size * longest, dtype=torch.uint8, device=where)  # (n * longest,)
    all_gather_into_tensor(everyone, padded, group=group)
    return [_unpickle(everyone[i * longest : i * longest + n]) for i, n in enumerate(sizes.tolist())]


def _root(peers: Peers, rank: int | None, group_rank: int | None, what: str) -> int:
    """The root as a group rank, from a global rank or a group rank (torch's rules; default 0)."""
    if rank is not None and group_rank is not None:
        raise ValueError(f"pass {what} (a global rank) or group_{what} (a group rank), not both")
    if group_rank is not None:
        if not isinstance(group_rank, int) or not 0 <= group_rank < peers.size:
            raise ValueError(f"group_{what} must be a group rank in [0, {peers.size}), got {group_rank!r}")
        return group_rank
    rank = 0 if rank is None else rank
    if not isinstance(rank, int) or rank not in peers.global_ranks:
        raise ValueError(f"{what}={rank!r} is not a global rank of the group (members {list(peers.global_ranks)})")
    return peers.global_ranks.index(rank)


def _check_slots(objects: list[Any] | None, n: int, what: str) -> None:
    if not isinstance(objects, list) or len(objects) != n:
        got = type(objects).__name__ if not isinstance(objects, list) else f"a list of {len(objects)}"
        raise ValueError(f"{what} must be a list with one slot per group rank ({n}), got {got}")


def _device(peers: Peers, device: torch.device | None) -> torch.device:
    return torch.device(device) if device is not None else default_device(peers)


def _pickle(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    try:
        pickle.dump(obj, buffer)
    except Exception as exc:  # noqa: BLE001 - any pickling failure is the caller's bad input
        raise ValueError(f"cannot pickle {type(obj).__name__}: {exc}") from exc
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)  # (nbytes,)


def _unpickle(data: torch.Tensor) -> Any:
    return pickle.loads(data.cpu().numpy().tobytes())  # noqa: S301 - trusted ranks only (module docstring)


def _unpickle_all(data: torch.Tensor, sizes: list[int]) -> list[Any]:
    out, start = [], 0
    for n in sizes:
        out.append(_unpickle(data[start : start + n]))
        start += n
    return out
