"""Every path `plan` chooses, run by the general header round and by the cached rounds: same bytes.

A rank on a cached round (`nanoddp.comm.protocol.cached_rounds`) may meet a peer on the general one
(`nanoddp.comm.protocol.header_round`); both speak `nanoddp.comm.protocol.wire`. These tests run each size class
both ways and compare the bytes with each other and with torch's built-ins, and check two
things the cached rounds must do that the general round does by construction: the star
broadcast's hub checks every rank's header, the last one included, and a threshold change takes
effect at the next call, the frames and the rounds prepared on them following it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import run_on_ranks

from nanoddp import comm
from nanoddp.comm.plan import plan
from nanoddp.comm.plan.plan import Path
from nanoddp.comm.protocol import cached_rounds, wire
from nanoddp.comm.transport.runner import runner_for

KB = 1024
CPU = torch.device("cpu")
# Thresholds shrunk so every size class is a few KB: frames hold 4 KB, all_gather and broadcast
# leave them from 2 KB, the exchange and the direct broadcast reach 16 KB, pieces are 4-8 KB.
SMALL = {
    "INLINE_SEND_BYTES": 0, "INLINE_MAX_BYTES": 4 * KB, "BULK_FROM_BYTES": 2 * KB, "EXCHANGE_MAX_BYTES": 16 * KB,
    "DIRECT_BROADCAST_MAX_BYTES": 16 * KB, "PIECE_MIN_BYTES": 4 * KB, "PIECE_MAX_BYTES": 8 * KB,
    "EARLY_MIN_BYTES": 4 * KB, "EARLY_MAX_BYTES": 8 * KB,
}  # fmt: skip
SHARES = (4, 1 * KB, 2 * KB - 4, 2 * KB, 4 * KB, 4 * KB + 4, 12 * KB, 20 * KB)  # bytes per rank


def _ints(numel: int, seed: int) -> torch.Tensor:
    """Small integers as float32: every sum, in any order, is exact (bitwise comparable with torch)."""
    return torch.randint(-3, 4, (numel,), generator=torch.Generator().manual_seed(seed)).float()


def _each_collective(env, share: int, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(ours, torch's) results of every collective with `share` bytes per rank."""
    r, n, m = env.rank, env.world_size, share // 4
    x = _ints(m, seed + r)
    ours, ref = {}, {}
    for op in (comm.ReduceOp.SUM, comm.ReduceOp.MAX):
        name = f"all_reduce {op}"
        ours[name], ref[name] = x.clone(), x.clone()
        comm.all_reduce(ours[name], op=op)
        dist.all_reduce(ref[name], op=op)
    ours["reduce"], ref["reduce"] = x.clone(), x.clone()
    comm.reduce(ours["reduce"], dst=n - 1)
    dist.reduce(ref["reduce"], dst=n - 1)
    if r != n - 1:  # the others' tensors: ours leaves them as they were (gloo's may hold partial sums)
        ref["reduce"] = x
    for src in range(n):
        name = f"broadcast from {src}"
        ours[name], ref[name] = x.clone(), x.clone()
        comm.broadcast(ours[name], src=src)
        dist.broadcast(ref[name], src=src)
    ours["all_gather"], ref["all_gather"] = torch.zeros(n * m), torch.zeros(n * m)
    comm.all_gather_into_tensor(ours["all_gather"], x)
    dist.all_gather_into_tensor(ref["all_gather"], x)
    whole = _ints(n * m, seed + 10 + r)
    ours["reduce_scatter"], ref["reduce_scatter"] = torch.zeros(m), torch.zeros(m)
    comm.reduce_scatter_tensor(ours["reduce_scatter"], whole)
    dist.all_reduce(reference := whole.clone())  # gloo has no reduce_scatter: the chunk of the sum
    ref["reduce_scatter"] = reference[r * m : (r + 1) * m]
    parts = list(whole.chunk(n)) if r == 0 else None
    ours["scatter"], ref["scatter"] = torch.zeros(m), torch.zeros(m)
    comm.scatter(ours["scatter"], parts, src=0)
    dist.scatter(ref["scatter"], parts, src=0)
    ours["gather"] = torch.zeros(n * m)
    comm.gather(x, list(ours["gather"].chunk(n)) if r == 0 else None, dst=0)
    ref["gather"] = ref["all_gather"] if r == 0 else ours["gather"]  # the root's list only
    return ours, ref


def _general_and_cached_agree(env) -> list[str]:
    peers = runner_for(None).peers
    n, covered = env.world_size, set()
    with pytest.MonkeyPatch.context() as mp:
        for name, value in SMALL.items():
            mp.setattr(plan, name, value)
        for i, share in enumerate(SHARES):
            for op in plan.OPS:
                covered.add((op, plan.plan(op, share, n, "gloo")))
            cached, ref = _each_collective(env, share, seed=100 * i)
            again, _ = _each_collective(env, share, seed=100 * i)  # every cached round now prepared
            with pytest.MonkeyPatch.context() as general:  # the same calls, no cached round anywhere
                general.setattr(plan, "_CACHED_PAIR", ())
                general.setattr(plan, "_CACHED_STAR", ())
                general.setattr(plan, "header_round_path", lambda *a, **k: Path.IN_FRAMES)
                prepared = dict(wire.buffers(peers, CPU).rounds)
                plain, _ = _each_collective(env, share, seed=100 * i)
                assert wire.buffers(peers, CPU).rounds == prepared, "no round prepared or replaced"
            for name in ref:
                where = f"{name}, {share} bytes per rank"
                assert torch.equal(cached[name], plain[name]), where
                assert torch.equal(again[name], plain[name]), where
                torch.testing.assert_close(plain[name], ref[name], rtol=0, atol=0, msg=where)
    return sorted(f"{op}: {path.name}" for op, path in covered)


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_size_class_gives_the_same_bytes_on_the_general_and_the_cached_rounds(world_size):
    covered = run_on_ranks(_general_and_cached_agree, world_size, timeout=240)[0]
    expected = {  # each path this world size has, for each op that has it
        2: ["all_reduce: PAIR", "all_reduce: EXCHANGE", "all_reduce: RING", "broadcast: PAIR", "broadcast: CHAIN",
            "all_gather: PAIR", "all_gather: RING", "reduce_scatter: IN_FRAMES", "reduce_scatter: RING",
            "reduce: IN_FRAMES", "reduce: CHAIN", "scatter: DIRECT", "gather: DIRECT"],
        3: ["all_reduce: IN_FRAMES", "all_reduce: RING", "broadcast: STAR", "broadcast: DIRECT", "broadcast: CHAIN",
            "all_gather: IN_FRAMES", "all_gather: RING", "reduce_scatter: IN_FRAMES", "reduce_scatter: RING",
            "reduce: IN_FRAMES", "reduce: CHAIN", "scatter: IN_FRAMES", "scatter: DIRECT", "gather: IN_FRAMES",
            "gather: DIRECT"],
    }[world_size]  # fmt: skip
    assert set(expected) <= set(covered), sorted(set(expected) - set(covered))


def _last_rank_disagrees(env) -> list[str]:
    """ws 3: ranks 0 and 1 repeat a cached star broadcast; rank 2 alone passes another numel."""
    r, n, messages = env.rank, env.world_size, []
    for src in (0, n - 1):  # the hub as the root, and the disagreeing rank as the root
        for _ in range(2):  # prepared, then run again: ranks 0 and 1 use the round made the first time
            x = torch.full((4,), float(r))
            comm.broadcast(x, src=src)
            assert torch.equal(x, torch.full((4,), float(src)))
        with pytest.raises(ValueError) as caught:
            comm.broadcast(torch.zeros(5 if r == n - 1 else 4), src=src)
        messages.append(str(caught.value))
        mine, ref = torch.full((4,), float(r)), torch.full((4,), float(r))  # the group is still usable
        comm.broadcast(mine, src=src)
        dist.broadcast(ref, src=src)
        assert torch.equal(mine, ref)
    return messages


def test_the_star_hub_checks_the_last_ranks_header():
    per_rank = run_on_ranks(_last_rank_disagrees, 3, timeout=120)
    assert per_rank[0] == per_rank[1] == per_rank[2]
    for message in per_rank[0]:
        assert "disagree on numel" in message and "rank 2: 5" in message


def _limits_change(env) -> None:
    """ws 2: a threshold change takes effect at the next call: the path `plan` now gives, and frames
    sized for the new limits (re-made, with their prepared rounds, when the capacity changes)."""
    r, peers = env.rank, runner_for(None).peers
    ran: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        for name in ("all_reduce", "all_gather", "broadcast"):  # note each prepared call, then run it
            prepared = getattr(cached_rounds, name)
            mp.setattr(cached_rounds, name, lambda *a, _p=prepared, _n=name: (ran.append(_n), _p(*a))[1])
        with pytest.MonkeyPatch.context() as small:
            small.setattr(plan, "INLINE_SEND_BYTES", 0)
            small.setattr(plan, "INLINE_MAX_BYTES", 2 * KB)  # frames sized by their error room, not by this
            x = _ints(256, seed=r)  # 1 KB: in the frames, by the cached pair round
            comm.all_reduce(x.clone())
            assert ran == ["all_reduce"]
            bufs = wire.buffers(peers, CPU)
            small.setattr(plan, "INLINE_MAX_BYTES", 512)  # 1 KB no longer fits: the exchange
            assert wire.buffers(peers, CPU) is bufs, "the frames are kept (same capacity)"
            ours, ref = x.clone(), x.clone()
            comm.all_reduce(ours)
            dist.all_reduce(ref)
            assert torch.equal(ours, ref)
            assert ran == ["all_reduce"], "the exchange, not the round prepared before the change"

            out = torch.zeros(2 * 64)
            comm.all_gather_into_tensor(out, x[:64])  # 256 bytes: the cached pair round
            assert ran[-1] == "all_gather"
            small.setattr(plan, "BULK_FROM_BYTES", 128)  # all_gather leaves the frames from 128 bytes
            ours, ref = torch.zeros(2 * 64), torch.zeros(2 * 64)
            comm.all_gather_into_tensor(ours, x[:64])
            dist.all_gather_into_tensor(ref, x[:64])
            assert torch.equal(ours, ref)
            assert ran.count("all_gather") == 1
        # The limits back as they were: 512 KB rides in the frames again, so they grow to hold it.
        big = _ints(128 * KB, seed=r)
        ours, ref = big.clone(), big.clone()
        comm.broadcast(ours, src=1)
        dist.broadcast(ref, src=1)
        assert torch.equal(ours, ref)
        assert ran[-1] == "broadcast" and wire.buffers(peers, CPU) is not bufs


def test_a_threshold_change_takes_effect_at_the_next_call():
    run_on_ranks(_limits_change, 2, timeout=120)
