"""The rest of torch.distributed's surface in nanoddp.comm, against torch's built-ins on gloo.

all_to_all_single/all_to_all (uneven split sizes), reduce_scatter (list form), torch 2.13's
all_gather_single/reduce_scatter_single, barrier,
monitored_barrier, the object collectives and batch_isend_irecv, at world sizes 2-4 and in a
subgroup. One launch per world size runs every case (a launch costs seconds); a call that is
invalid on one rank only must raise the same error on every rank.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import run_on_ranks

from nanoddp import comm
from nanoddp.comm import ReduceOp
from nanoddp.groups import subgroups_by


def _ints(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randint(-3, 4, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _rows(i: int, j: int) -> int:
    """Rows group rank i sends to group rank j: uneven, and zero for some pairs."""
    return (i + 2 * j) % 3


def _all_to_all_cases(r: int, n: int, group) -> None:
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        x = _ints((2 * n, 5), dtype, seed=r)  # equal splits: 2 rows to each rank
        ours, ref = torch.empty_like(x), torch.empty_like(x)
        comm.all_to_all_single(ours, x, group=group)
        dist.all_to_all_single(ref, x, group=group)
        assert torch.equal(ours, ref), f"all_to_all_single equal {dtype}"
        sends = [_rows(r, j) for j in range(n)]
        recvs = [_rows(i, r) for i in range(n)]
        x = _ints((sum(sends), 5), dtype, seed=10 + r)
        ours, ref = x.new_empty(sum(recvs), 5), x.new_empty(sum(recvs), 5)
        comm.all_to_all_single(ours, x, recvs, sends, group=group)
        dist.all_to_all_single(ref, x, recvs, sends, group=group)
        assert torch.equal(ours, ref), f"all_to_all_single uneven {dtype}: {sends} -> {recvs}"
        inputs = [_ints((2, 3), dtype, seed=100 * r + j) for j in range(n)]  # gloo's list form: equal sizes
        ours_list, ref_list = [x.new_empty(2, 3) for _ in range(n)], [x.new_empty(2, 3) for _ in range(n)]
        comm.all_to_all(ours_list, inputs, group=group)
        dist.all_to_all(ref_list, inputs, group=group)
        assert all(torch.equal(a, b) for a, b in zip(ours_list, ref_list, strict=True)), f"all_to_all {dtype}"
        inputs = [_ints((_rows(r, j), 3), dtype, seed=100 * r + j) for j in range(n)]  # uneven: vs the single form
        ours_list = [torch.full((_rows(i, r), 3), -1).to(dtype) for i in range(n)]
        ref = x.new_empty(sum(recvs), 3)
        comm.all_to_all(ours_list, inputs, group=group)
        dist.all_to_all_single(ref, torch.cat(inputs), recvs, sends, group=group)
        assert torch.equal(torch.cat(ours_list), ref), f"all_to_all uneven {dtype}"
    big = _ints((n * 70_000,), torch.float32, seed=r)  # 280 KB per pair
    ours, ref = torch.empty_like(big), torch.empty_like(big)
    work = comm.all_to_all_single(ours, big, group=group, async_op=True)
    dist.all_to_all_single(ref, big, group=group)
    work.wait()
    assert torch.equal(ours, ref), "all_to_all_single async, large"


def _reduce_scatter_cases(r: int, n: int, group) -> None:
    for numel in (0, 1, 1023, 300_000):
        for dtype, ops in ((torch.float32, (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG)), (torch.int32, (ReduceOp.SUM,))):
            inputs = [_ints((numel,), dtype, seed=7 * r + i) for i in range(n)]
            kept = [t.clone() for t in inputs]
            for op in ops:
                ours, ref = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
                comm.reduce_scatter(ours, inputs, op=op, group=group)
                dist.reduce_scatter(ref, inputs, op=op, group=group)
                if op == ReduceOp.AVG:  # small ints: exact sums, one division each
                    torch.testing.assert_close(ours, ref, rtol=1.3e-6, atol=0)
                else:
                    assert torch.equal(ours, ref), f"reduce_scatter {numel} {dtype} {op}"
            assert all(torch.equal(a, b) for a, b in zip(inputs, kept, strict=True)), "inputs must not change"


def _single_name_cases(r: int, n: int, group) -> None:
    """torch 2.13's names for all_gather_into_tensor and reduce_scatter_tensor, against torch's own
    (under the old names on a torch that has not got the new ones)."""
    torch_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    torch_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    for numel in (3, 300_000):
        x = _ints((numel,), torch.float32, seed=r)
        ours, ref = torch.empty(n * numel), torch.empty(n * numel)
        comm.all_gather_single(ours, x, group=group)
        torch_gather(ref, x, group=group)
        assert torch.equal(ours, ref), f"all_gather_single {numel}"
        whole = _ints((n * numel,), torch.int64, seed=r)
        ours, ref = torch.empty(numel, dtype=torch.int64), torch.empty(numel, dtype=torch.int64)
        comm.reduce_scatter_single(ours, whole, op=ReduceOp.MAX, group=group)
        torch_reduce_scatter(ref, whole, op=ReduceOp.MAX, group=group)
        assert torch.equal(ours, ref), f"reduce_scatter_single {numel}"


def _object_cases(r: int, n: int, group, members: list[int]) -> None:
    def thing(rank: int):
        return {"rank": rank, "text": "x" * (37 * rank), "nested": [rank, (rank, None)], "t": torch.arange(rank)}

    def same(a, b) -> bool:
        return a.keys() == b.keys() and all(
            torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
        )

    for src in members:
        ours = [thing(r), "a" * r, 3.5 + r] if r == src else [None, None, None]
        ref = list(ours)
        comm.broadcast_object_list(ours, src=src, group=group)
        dist.broadcast_object_list(ref, src=src, group=group)
        assert same(ours[0], ref[0]) and ours[1:] == ref[1:], f"broadcast_object_list src={src}"
        gathered_ours = [None] * n if r == src else None
        gathered_ref = [None] * n if r == src else None
        comm.gather_object(thing(r), gathered_ours, dst=src, group=group)
        dist.gather_object(thing(r), gathered_ref, dst=src, group=group)
        if r == src:
            assert all(same(a, b) for a, b in zip(gathered_ours, gathered_ref, strict=True)), "gather_object"
        out_ours, out_ref = [None], [None]
        sources = [thing(i) for i in members] if r == src else None
        comm.scatter_object_list(out_ours, sources, src=src, group=group)
        dist.scatter_object_list(out_ref, sources, src=src, group=group)
        assert same(out_ours[0], out_ref[0]), f"scatter_object_list src={src}"
    ours, ref = [None] * n, [None] * n
    comm.all_gather_object(ours, thing(r), group=group)
    dist.all_gather_object(ref, thing(r), group=group)
    assert all(same(a, b) for a, b in zip(ours, ref, strict=True)) and [o["rank"] for o in ours] == members
    group_src = len(members) - 1  # the group-rank form of the root
    ours = ["mine"] if r != members[-1] else ["from the last member"]
    comm.broadcast_object_list(ours, group=group, group_src=group_src)
    assert ours == ["from the last member"]


def _batch_p2p_cases(r: int, n: int) -> None:
    right, left = (r + 1) % n, (r - 1) % n
    outgoing = [torch.full((5,), float(r)), torch.arange(3) + 10 * r]

    def ops(inbox):
        return [
            dist.P2POp(dist.isend, outgoing[0], right),
            dist.P2POp(dist.irecv, inbox[0], left),
            dist.P2POp(dist.isend, outgoing[1], left, tag=7),
            dist.P2POp(dist.irecv, inbox[1], right, tag=7),
        ]

    ours, ref = [torch.empty(5), torch.empty(3, dtype=torch.int64)], [torch.empty(5), torch.empty(3, dtype=torch.int64)]
    for work in comm.batch_isend_irecv(ops(ours)):
        work.wait()
    for work in dist.batch_isend_irecv(ops(ref)):
        work.wait()
    assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True)), "batch_isend_irecv"


def _barrier_cases(r: int, n: int, shared: Path) -> None:
    for round_ in range(3):  # the last rank writes, then enters; nobody may leave before it wrote
        marker = shared / f"barrier-{round_}"
        if r == n - 1:
            time.sleep(0.2)
            marker.write_text("written before the barrier")
        comm.barrier(async_op=round_ == 1).wait() if round_ == 1 else comm.barrier()
        assert marker.exists(), f"rank {r} left the barrier before rank {n - 1} entered it"
    comm.monitored_barrier(timeout=datetime.timedelta(seconds=60))
    comm.barrier()


def _invalid_on_one_rank(r: int, n: int) -> list[str]:
    """New ops with a bad argument on group rank 1 only: every rank must raise the same error."""
    bad = r == 1
    calls = [
        lambda: comm.all_to_all_single(torch.empty(n + bad), torch.ones(n), [1] * (n - 1) + [1 + bad], [1] * n),
        lambda: comm.all_to_all_single(torch.empty(n), torch.ones(n + bad)),
        lambda: comm.all_to_all([torch.empty(1)] * (n - bad), [torch.ones(1)] * n),
        lambda: comm.reduce_scatter(torch.empty(2), [torch.ones(2)] * (n + bad)),
        lambda: comm.reduce_scatter(
            torch.empty(2, dtype=torch.int64),
            [torch.ones(2, dtype=torch.int64)] * n,
            op=ReduceOp.AVG if bad else ReduceOp.SUM,
        ),  # fmt: skip
        lambda: comm.all_gather_object([None] * (n + bad), r),
        lambda: comm.broadcast_object_list([lambda: 0] if r == 1 else [None], src=1),  # lambdas do not pickle
        lambda: comm.scatter_object_list([None], [0] * (n - 1), src=1),  # the root's list is short
        lambda: comm.gather_object(r, None, dst=1),  # the root has no list
    ]
    messages = []
    for call in calls:
        with pytest.raises(ValueError) as caught:
            call()
        messages.append(str(caught.value))
        ok = torch.ones(2)
        comm.all_reduce(ok)
        assert ok.tolist() == [float(n)] * 2, "the group must stay usable"
    return messages


def _monitored_failure(r: int, n: int, shared: Path) -> str:
    """Ranks >= 2 arrive only after rank 0 has given up; rank 0 must name exactly them (ws 4:
    all of them, with wait_all_ranks; ws 3: the first)."""
    failed = shared / "rank0-failed"
    if r >= 2:
        deadline = time.monotonic() + 120
        while not failed.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    try:
        comm.monitored_barrier(timeout=datetime.timedelta(seconds=1), wait_all_ranks=n == 4)
    except RuntimeError as exc:
        return str(exc)
    finally:
        if r == 0:
            failed.write_text("rank 0 raised")
    raise AssertionError(f"rank {r}: monitored_barrier did not fail")


def _surface(env, shared: str) -> dict:
    torch.manual_seed(0)
    r, n, shared = env.rank, env.world_size, Path(shared)
    _all_to_all_cases(r, n, None)
    _reduce_scatter_cases(r, n, None)
    _single_name_cases(r, n, None)
    _object_cases(r, n, None, list(range(n)))
    _batch_p2p_cases(r, n)
    _barrier_cases(r, n, shared)
    parity = subgroups_by(lambda rank: rank % 2)  # even ranks and odd ranks
    members = [q for q in range(n) if q % 2 == r % 2]
    _all_to_all_cases(members.index(r), len(members), parity)
    _reduce_scatter_cases(members.index(r), len(members), parity)
    _single_name_cases(members.index(r), len(members), parity)
    _object_cases(r, len(members), parity, members)
    comm.barrier(group=parity)
    messages = _invalid_on_one_rank(r, n)
    failure = _monitored_failure(r, n, shared) if n >= 3 else ""
    return {"invalid": messages, "monitored": failure}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_rest_of_the_surface_matches_torch(world_size, tmp_path):
    per_rank = run_on_ranks(_surface, world_size, str(tmp_path), timeout=300)
    invalid = [rank["invalid"] for rank in per_rank]
    assert all(m == invalid[0] for m in invalid), "every rank must raise the same error"
    for message in invalid[0]:
        assert "invalid call on group rank 1" in message or "split sizes disagree" in message, message
    if world_size >= 3:
        late = [2, 3] if world_size == 4 else [2]
        assert f"global rank(s) {late} did not arrive" in per_rank[0]["monitored"], per_rank[0]["monitored"]
        assert all("monitored_barrier" in rank["monitored"] for rank in per_rank[1:])  # rank 1 may time out first
        assert all(f"{late} did not arrive" in per_rank[q]["monitored"] for q in late), "late ranks get the list"


def _rank_1_skips_all_to_all(env, log_dir: str) -> str:
    import logging

    from nanoddp.comm.transport import watchdog

    logging.basicConfig(filename=str(Path(log_dir, f"rank{env.rank}.log")), level=logging.INFO, force=True)
    watchdog.enable(3.0, poll_s=0.2)
    comm.barrier()  # #1, everyone
    time.sleep(1.0)  # let progress #1 be published by every rank
    if env.rank == 1:
        time.sleep(120)  # the bug: rank 1 never joins the all_to_all
    comm.all_to_all_single(torch.empty(6), torch.ones(6))
    return "not reached"


def test_new_ops_are_known_to_the_hang_watchdog(tmp_path):
    from nanoddp import LaunchError
    from nanoddp.comm.transport import watchdog

    with pytest.raises(LaunchError) as info:
        run_on_ranks(_rank_1_skips_all_to_all, 2, str(tmp_path), timeout=90)
    assert info.value.rank == 0 and info.value.exitcode == watchdog.HANG_EXIT_CODE
    report = Path(tmp_path, "rank0.log").read_text()
    assert "all_to_all_single #2 (6 elements, group [0, 1])" in report, report
    assert "not arrived: ranks [1] (rank 1 at #1)" in report, report
