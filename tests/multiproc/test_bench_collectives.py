"""`nanoddp bench collectives`: real paired runs against torch's built-ins, each row naming the path
nanoddp.comm took (data in the header frame, or a header round and then the bulk algorithm), and
the docs' table rendered from the JSON."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
import torch.distributed as dist
from helpers import run_on_ranks

from nanoddp.bench import collectives as bench
from nanoddp.bench import floor
from nanoddp.bench.render import render_text
from nanoddp.comm import runner_for
from nanoddp.comm.plan import plan


def _limits(env) -> tuple[int, int]:
    """The switch point the collectives use on this real group, and the bench's formula for it."""
    peers = runner_for(None).peers
    return plan.inline_limit_for(peers.size, peers.gloo), plan.inline_limit_for(env.world_size, gloo=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_path_column_uses_the_collectives_own_switch_point(world_size):
    used, described = run_on_ranks(_limits, world_size)[0]
    assert used == described
    below, above = described, described + 4
    shape = "exchange" if world_size == 2 else "star via rank 0"
    assert bench.comm_path("all_reduce", below, world_size) == f"one round ({shape}): data in the frames"
    path = bench.comm_path("all_reduce", above, world_size)
    if world_size == 2:  # one exchange of whole tensors up to EXCHANGE_MAX_BYTES, the ring past it
        assert path.endswith(": one exchange of whole tensors, each piece reduced as it lands")
        assert f"first {bench._human(plan.early_bytes(above, gloo=True))} early" in path
        above = plan.EXCHANGE_MAX_BYTES + 4
        path = bench.comm_path("all_reduce", above, world_size)
    assert path.startswith(f"header round ({shape}), with its first ") and path.endswith(
        ": pipelined ring (reduce-scatter + all-gather)"
    )
    early = plan.early_bytes(above // world_size, gloo=True)  # the ring's chunk starts with early data
    assert f"first {bench._human(early)} early" in path
    # all_gather / reduce_scatter: `size` is the whole buffer; in the star, rank 0's frames hold n-1
    # ranks' shares (all_gather results) or n (reduce_scatter inputs); all_gather also leaves the
    # frames from BULK_FROM_BYTES per rank, as does broadcast
    per_rank = min(described // (1 if world_size == 2 else world_size - 1), plan.BULK_FROM_BYTES - 4)
    assert bench.comm_path("all_gather", per_rank * world_size, world_size).startswith("one round")
    assert bench.comm_path("all_gather", (per_rank + 4) * world_size, world_size).startswith("header round")
    assert bench.comm_path("reduce_scatter", (above + 4) * world_size, world_size).startswith("header round")
    assert bench.comm_path("broadcast", plan.BULK_FROM_BYTES - 4, world_size).startswith("one round")
    bulk = bench.comm_path("broadcast", plan.BULK_FROM_BYTES, world_size)
    past_direct = bench.comm_path("broadcast", plan.DIRECT_BROADCAST_MAX_BYTES + 4, world_size)
    assert past_direct.endswith(": pipelined chain")  # 3+ ranks: straight from the root up to its limit
    assert bulk.endswith(": pipelined chain" if world_size == 2 else ": straight from the root to every rank")


@pytest.mark.timeout(300)
def test_a_real_run_gives_paired_rows_and_a_table(tmp_path):
    sizes = [4096, 8 << 20]  # one under the gloo one-round limit at ws 2 (3 MB), one over it
    rows = bench.run_benchmark([2], ["all_reduce", "broadcast"], sizes, iters=2, warmup=1)
    assert {(r["op"], r["size_bytes"]) for r in rows} == {(op, s) for op in ("all_reduce", "broadcast") for s in sizes}
    for r in rows:
        assert r["nanoddp_time_us"] > 0 and r["torch_time_us"] > 0
        expected = r["nanoddp_busbw_gbps"] / r["torch_busbw_gbps"]
        torch.testing.assert_close(r["busbw_ratio"], expected)
        ours, theirs = r["samples_us"]["nanoddp"], r["samples_us"]["torch"]
        assert len(ours) == len(theirs) == r["iters"]
        assert r["paired_ratio"] == statistics.median(t / o for t, o in zip(theirs, ours, strict=True))
        assert r["path"].startswith("one round" if r["size_bytes"] == 4096 else "header round")
    data = {"meta": {"torch": torch.__version__, "iters": 2, "cpus": 2}, "results": rows}
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "c.json").write_text(json.dumps(data))
    text = "x\n<!-- bench:table docs/c.json -->\nstale\n<!-- /bench -->\n"
    rendered = render_text(text, tmp_path)
    assert "stale" not in rendered
    lines = [line for line in rendered.splitlines() if line.startswith("| all_reduce | 2 | 8 MB |")]
    assert len(lines) == 1 and "header round (exchange), with its first 4 MB early: pipelined ring" in lines[0]
    ratio = next(r["paired_ratio"] for r in rows if r["op"] == "all_reduce" and r["size_bytes"] == 8 << 20)
    assert f"| {ratio:.2f} |" in lines[0]


def _bare_pattern_delivers(env, op: str) -> bool:
    """Runs `op`'s bare send/recv pattern and checks every received byte against what its sender
    held (gathered beforehand with torch's all_gather): the floor moves the real data."""
    n, me = env.world_size, env.rank
    run, buffers = floor.bare_pattern(op, 4096 * n + 12, me, n)  # a size not divisible by n
    held = {}  # name -> every rank's copy of that buffer before the run
    for name, buf in buffers.items():
        held[name] = [torch.empty_like(buf) for _ in range(n)]
        dist.all_gather(held[name], buf)
    run()
    others = [p for p in range(n) if p != me]
    if op == "broadcast":
        assert torch.equal(buffers["message"], held["message"][0])
    elif op == "all_gather":  # row p of the output is rank p's own row
        assert torch.equal(buffers["output"], torch.stack([held["output"][p][p] for p in range(n)]))
    elif op in ("reduce_scatter", "all_to_all"):  # peer p sent me row `me` of its input
        assert all(torch.equal(buffers["received"][p], held["input"][p][me]) for p in others)
    elif n == 2:  # all_reduce at 2 ranks: one exchange of whole tensors
        assert torch.equal(buffers["received"], held["tensor"][others[0]])
    else:  # all_reduce: the reduce-scatter round's rows, then the all-gather round's
        assert all(torch.equal(buffers["received"][p], held["tensor"][p][me]) for p in others)
        assert torch.equal(buffers["tensor"], torch.stack([held["tensor"][p][p] for p in range(n)]))
    return True


def _every_bare_pattern_delivers(env) -> list[str]:
    """Every op's pattern in turn, in one launch: process start-up, not the bytes, is the cost."""
    return [op for op in floor.PATTERNS if _bare_pattern_delivers(env, op)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_bare_floor_moves_every_ops_real_bytes(world_size):
    assert run_on_ranks(_every_bare_pattern_delivers, world_size) == [list(floor.PATTERNS)] * world_size


@pytest.mark.timeout(300)
def test_a_run_with_the_floor_adds_the_bare_columns(tmp_path):
    rows = bench.run_benchmark([2], ["all_gather"], [1 << 20], iters=2, warmup=1, floor=True)
    (r,) = rows
    assert r["bare_time_us"] > 0
    torch.testing.assert_close(r["bare_ratio"], r["bare_busbw_gbps"] / r["torch_busbw_gbps"])
    torch.testing.assert_close(r["nanoddp_vs_bare"], r["nanoddp_busbw_gbps"] / r["bare_busbw_gbps"])
    table = bench.format_markdown({"meta": {"iters": 2}, "results": rows})
    assert "| bare send/recv µs | bare ÷ torch |" in table and bench.BARE_LEGEND in table
    line = next(line for line in table.splitlines() if line.startswith("| all_gather | 2 | 1 MB |"))
    assert f"| {r['bare_time_us']:,.0f} | {r['bare_paired_ratio']:.2f} |" in line
    bare, theirs = r["samples_us"]["bare"], r["samples_us"]["torch"]
    assert r["bare_paired_ratio"] == statistics.median(t / b for t, b in zip(theirs, bare, strict=True))
    with pytest.raises(ValueError, match="no bare send/recv pattern for op 'gather'"):
        floor.bare_pattern("gather", 4096, 0, 1)
