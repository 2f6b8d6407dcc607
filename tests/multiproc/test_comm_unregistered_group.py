"""nanoddp.comm on a process group torch's registry does not know, against torch's built-ins on WORLD.

A fault-tolerance manager (torchft's `ProcessGroupGloo`) builds a bare c10d `ProcessGroup` with a
gloo backend over a store of its own; `dist.get_rank(group)` and its kin fail on it, and our
collectives must ask the group itself (`nanoddp.comm.transport.membership`). Here three gloo ranks
build such a group the way torchft's `_create_pg` does, over a `PrefixStore` on the default store,
with its ranks rotated against the world's (group rank = global rank + 1 mod 3), so that any
answer taken from the registry or any global-rank translation would show. Every collective on it
must equal torch.distributed's on WORLD, bitwise (inputs are small integers), once the rotation is
undone. One launch runs every case.
"""

from __future__ import annotations

import datetime
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import run_suite

from nanoddp import comm
from nanoddp.comm import ReduceOp
from nanoddp.comm.plan import plan
from nanoddp.comm.transport import watchdog

WORLD = 3
# one frame, one round; just over the one-round limit; the ring's pieces (float32)
SIZES = (0, 1, 7, plan.INLINE_SEND_BYTES // (WORLD - 1) // 4 + 1, 300_001)


def _bare_gloo_group(env, name: str) -> dist.ProcessGroup:
    """A c10d ProcessGroup + gloo backend, as torchft's `ProcessGroupGloo._create_pg` makes one:
    never registered with torch.distributed."""
    store = dist.PrefixStore(f"unregistered/{name}", dist.distributed_c10d._get_default_store())
    rank = (env.rank + 1) % WORLD
    group = dist.ProcessGroup(store, rank, WORLD)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    backend = dist.ProcessGroupGloo(store, rank, WORLD, datetime.timedelta(seconds=60))
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


def _global(group_rank: int) -> int:
    return (group_rank - 1) % WORLD


def _ints(numel: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randint(-3, 4, (numel,), generator=torch.Generator().manual_seed(seed)).to(dtype)


def _the_registry_does_not_know_it(env, group) -> None:
    try:
        dist.get_rank(group)
    except ValueError:
        pass
    else:
        raise AssertionError("the bare group is registered: the test would not test the fallback")
    runner = comm.runner_for(group)
    assert runner is not None
    assert (runner.peers.rank, runner.peers.size, runner.peers.backend) == ((env.rank + 1) % WORLD, WORLD, "gloo")
    assert runner.peers.global_ranks == (0, 1, 2)


def _src_outside_the_group(env, group) -> None:
    """src/dst name the group's own ranks: one past its size is refused on every rank, before any traffic."""
    try:
        comm.broadcast(torch.ones(3), src=WORLD, group=group)
    except ValueError as error:
        assert "must be a rank of the group in [0, 3)" in str(error), error
    else:
        raise AssertionError("broadcast from src=3 on a group of 3 was accepted")


def _all_reduce(env, group) -> None:
    for numel in SIZES:
        for dtype in (torch.float32, torch.bfloat16):
            x = _ints(numel, seed=env.rank, dtype=dtype)
            for op in (ReduceOp.SUM, ReduceOp.MAX):
                ours, ref = x.clone(), x.clone()
                comm.all_reduce(ours, op=op, group=group)
                dist.all_reduce(ref, op=op)
                assert torch.equal(ours, ref), f"all_reduce {op} {numel} {dtype}"
            if dtype.is_floating_point:  # gloo has no AVG: its SUM, divided once, as ours does
                ours, ref = x.clone(), x.clone()
                comm.all_reduce(ours, op=ReduceOp.AVG, group=group)
                dist.all_reduce(ref)
                assert torch.equal(ours, ref / WORLD), f"all_reduce AVG {numel} {dtype}"


def _all_gather(env, group) -> None:
    for numel in SIZES:
        x = _ints(numel, seed=10 + env.rank)
        ours, ref = [torch.empty_like(x) for _ in range(WORLD)], [torch.empty_like(x) for _ in range(WORLD)]
        comm.all_gather(ours, x, group=group)
        dist.all_gather(ref, x)
        assert all(torch.equal(ours[g], ref[_global(g)]) for g in range(WORLD)), f"all_gather {numel}"
        whole = torch.empty(WORLD * numel)
        comm.all_gather_into_tensor(whole, x, group=group)
        assert torch.equal(whole, torch.cat(ours)), f"all_gather_into_tensor {numel}"


def _reduce_scatter(env, group) -> None:
    for numel in SIZES:
        inputs = [_ints(numel, seed=20 + 3 * env.rank + g) for g in range(WORLD)]  # by group rank
        for op in (ReduceOp.SUM, ReduceOp.MAX):
            ours, ref = torch.empty(numel), torch.empty(numel)
            comm.reduce_scatter(ours, inputs, op=op, group=group)
            dist.reduce_scatter_tensor(ref, torch.cat([inputs[(r + 1) % WORLD] for r in range(WORLD)]), op=op)
            assert torch.equal(ours, ref), f"reduce_scatter {op} {numel}"


def _broadcast(env, group) -> None:
    for numel in SIZES:
        for src in range(WORLD):  # on an unregistered group, src is the group's own rank
            ours = _ints(numel, seed=30 + env.rank)
            ref = ours.clone()
            comm.broadcast(ours, src=src, group=group)
            dist.broadcast(ref, src=_global(src))
            assert torch.equal(ours, ref), f"broadcast src {src} {numel}"


def _all_to_all(env, group) -> None:
    for rows in (1, 40_000):
        inputs = [_ints(rows, seed=40 + 3 * env.rank + g) for g in range(WORLD)]  # to group rank g
        ours = [torch.empty(rows) for _ in range(WORLD)]  # from group rank g
        ref = [torch.empty(rows) for _ in range(WORLD)]  # from global rank r
        comm.all_to_all(ours, inputs, group=group)
        dist.all_to_all(ref, [inputs[(r + 1) % WORLD] for r in range(WORLD)])
        assert all(torch.equal(ours[g], ref[_global(g)]) for g in range(WORLD)), f"all_to_all {rows}"


def _async_work_beside_world(env, group) -> None:
    """An async call on the bare group, and one on WORLD while it runs: two runners, no mix-up."""
    x = _ints(300_001, seed=50 + env.rank)
    ours, ref, on_world = x.clone(), x.clone(), x.clone()
    work = comm.all_reduce(ours, group=group, async_op=True)
    comm.all_reduce(on_world)
    assert work is not None
    work.wait()
    dist.all_reduce(ref)
    assert torch.equal(ours, ref) and torch.equal(on_world, ref), "async all_reduce"


def _hang_report_without_the_store(env, group, log_dir: str) -> None:
    """Rank 0 waits alone in a call on the bare group: the watchdog's report names the group as
    one whose members' progress it cannot read (they need not share its store), and does not exit."""
    logging.basicConfig(filename=str(Path(log_dir, f"rank{env.rank}.log")), level=logging.INFO, force=True)
    watched = watchdog.enable(0.5, poll_s=0.1, exit_on_hang=False)
    try:
        x = torch.ones(5)
        if env.rank == 0:
            work = comm.all_reduce(x, group=group, async_op=True)
            deadline = time.monotonic() + 60
            while watched.last_report is None and time.monotonic() < deadline:
                time.sleep(0.05)
            report = watched.last_report
            dist.barrier()  # now the others join it
            assert work is not None
            work.wait()
        else:
            dist.barrier()
            comm.all_reduce(x, group=group)
            report = None
        assert torch.equal(x, torch.full((5,), float(WORLD))), "the late call still completes"
        if env.rank == 0:
            assert report is not None and "all_reduce #" in report, report
            assert "group of 3 ranks torch's registry does not know" in report, report
            assert "which of them did not arrive is unknown" in report, report
    finally:
        watchdog.disable()


CASES = {
    "registry": _the_registry_does_not_know_it,
    "src_outside": _src_outside_the_group,
    "all_reduce": _all_reduce,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "broadcast": _broadcast,
    "all_to_all": _all_to_all,
    "async": _async_work_beside_world,
}


def _worker(env, out_dir: str) -> None:
    from helpers import run_cases

    group = _bare_gloo_group(env, "suite")
    cases = [(name, lambda env, fn=fn: fn(env, group)) for name, fn in CASES.items()]
    cases.append(("hang_report", lambda env: _hang_report_without_the_store(env, group, out_dir)))
    run_cases(env, cases, out_dir)


def test_every_collective_on_an_unregistered_group_equals_torch_on_world(tmp_path):
    results = run_suite(_worker, WORLD, tmp_path, timeout=180)
    for case in [*CASES, "hang_report"]:
        results.check(case)
