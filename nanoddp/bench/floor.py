"""The transport floor behind `nanoddp bench collectives --floor`: the same bytes, bare send/recv.

A collective of ours that trails torch's built-in is only ours to speed up if point-to-point
itself can do better. This module moves, for each op, the bytes every rank must send and receive
(the bus-bandwidth volume), with the group's own send/recv (the calls nanoddp.comm makes on gloo),
every message of a round posted at once, and nothing else: no header round, no checks, no
reductions, no pipeline bookkeeping. Timed beside ours and torch's, it shows per size how far the
transport alone gets; where it is itself slower than torch's built-in (gloo's collectives keep
their own buffers and I/O loop in C++), no algorithm over send/recv reaches torch there.

The patterns (n ranks, `size` bytes as the bench counts them, part = size / n):

* all_gather: one round; each rank sends its part to every peer and receives theirs in place.
* reduce_scatter, all_to_all: one round; each rank sends peer p the p-th part of its input and
  receives n-1 parts.
* all_reduce: the reduce-scatter round, then the all-gather round (a rank can only send a reduced
  part once it has the others'); at 2 ranks one exchange of whole tensors (same bytes, one round).
* broadcast: one round; the root sends the whole message to every peer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from nanoddp.comm.transport.transport import Peers, wait_all

TAG_BARE = 0x6E6420  # a tag of its own: a bare message can never land in one of comm's receives

PATTERNS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
Round = tuple[list[tuple[torch.Tensor, int]], list[tuple[torch.Tensor, int]]]  # (sends, receives)


def bare_pattern(op: str, size: int, rank: int, world_size: int) -> tuple[Callable[[], None], dict[str, torch.Tensor]]:
    """(run, buffers): `run()` moves `op`'s bytes for a `size`-byte message on the default group;
    `buffers` are the tensors it sends from and receives into (so a test can check what arrived)."""
    if op not in PATTERNS:
        raise ValueError(f"no bare send/recv pattern for op {op!r}; choose from {list(PATTERNS)}")
    world = dist.group.WORLD
    assert world is not None, "bare_pattern runs in an initialised process group"
    peers = Peers(world)
    others = [p for p in range(world_size) if p != rank]
    numel = max(1, size // 4)  # float32, as the bench
    part = max(1, numel // world_size)
    rounds: list[Round]
    if op == "broadcast":
        buffers = {"message": torch.randn(numel)}
        if rank == 0:
            rounds = [([(buffers["message"], p) for p in others], [])]
        else:
            rounds = [([], [(buffers["message"], 0)])]
    elif op == "all_gather":
        buffers = {"output": torch.randn(world_size, part)}  # (n, part); row `rank` is this rank's
        mine = buffers["output"][rank]
        rounds = [([(mine, p) for p in others], [(buffers["output"][p], p) for p in others])]
    elif op in ("reduce_scatter", "all_to_all"):
        buffers = {"input": torch.randn(world_size, part), "received": torch.empty(world_size, part)}  # (n, part)
        inp, got = buffers["input"], buffers["received"]
        rounds = [([(inp[p], p) for p in others], [(got[p], p) for p in others])]
    elif op == "all_reduce" and world_size == 2:
        buffers = {"tensor": torch.randn(numel), "received": torch.empty(numel)}
        rounds = [([(buffers["tensor"], others[0])], [(buffers["received"], others[0])])]
    else:  # all_reduce at 3+ ranks
        buffers = {"tensor": torch.randn(world_size, part), "received": torch.empty(world_size, part)}  # (n, part)
        x, got = buffers["tensor"], buffers["received"]
        reduce_scatter_round = ([(x[p], p) for p in others], [(got[p], p) for p in others])
        all_gather_round = ([(x[rank], p) for p in others], [(x[p], p) for p in others])
        rounds = [reduce_scatter_round, all_gather_round]

    def run() -> None:
        for sends, receives in rounds:  # a round's messages all in flight at once, rounds in order
            wait_all(peers.exchange(sends, receives, tag=TAG_BARE))

    return run, buffers
