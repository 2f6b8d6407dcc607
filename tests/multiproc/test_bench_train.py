"""`nanoddp bench train`, `bench report` and `train --trace`: the plumbing, not the timings.

One benchmark run at tiny sizes (ws 1 and 2, every engine, traces on) feeds every check of the
JSON, the markdown report, the plot and the bench traces; one 2-rank launch covers the trainer
(a traced run trains to the same weights as an untraced one, and its timeline has the regions).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import run_on_ranks

from nanoddp.bench import write_json
from nanoddp.bench.report import format_markdown
from nanoddp.bench.train import ALLCORES, ENGINES, NOCOMM, run_benchmark
from nanoddp.cli import main
from nanoddp.env import DistEnv
from nanoddp.models import GPT, count_parameters, gpt_config
from nanoddp.train.trainer import TrainConfig, Trainer

OVERRIDES = {"n_layers": 1, "d_model": 32, "n_heads": 2, "d_ff": 64, "seq_len": 16}
GLOBAL_BATCH = 8
FIELDS = (
    "engine", "world_size", "steps", "step_time_s", "step_time_p10_s", "step_time_p90_s", "spread",
    "samples_per_s", "tokens_per_s", "forward_s", "backward_s", "sync_s", "optimizer_s", "comm_time_s",
    "exposed_comm_s", "overlap_fraction", "compute_s", "bytes_sent_per_step",
    "peak_mem_bytes_per_rank", "engine_resident_bytes_per_rank", "scaling_efficiency", "speedup_vs_allcores",
    "vs_torch_ddp", "mfu",
)  # fmt: skip
REGIONS = {"forward", "backward", "optimizer step"}
# engines whose gradient communication the outside probes time (a DDP bucket layout or a manual sync)
TIMED = {"nanoddp", "torch", "allreduce", "rs_ag", "zero1", "nanoddp_torchcomm"}


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench_train")
    # memory="shared": one launch per world size (the memory pass, a launch per engine, is
    # tested on fewer engines in tests/unit/test_bench_memory_plot.py)
    data = run_benchmark([1, 2], list(ENGINES), "tiny", GLOBAL_BATCH, steps=2, warmup=2, block=1,
                         overrides=OVERRIDES, trace_dir=str(tmp / "trace"), memory="shared")  # fmt: skip
    return data, tmp


def _spans(path: Path) -> dict[str, list[tuple[float, float]]]:
    """name -> [(start, end)] of the complete events ("X") of a Chrome trace file."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for event in json.loads(path.read_text())["traceEvents"]:
        if event.get("ph") == "X":
            spans.setdefault(event["name"], []).append((event["ts"], event["ts"] + event["dur"]))
    return spans


def test_every_engine_and_field_with_consistent_values(bench):
    data, _ = bench
    rows = {(r["engine"], r["world_size"]): r for r in data["results"]}
    expected = {(e, 1) for e in ENGINES} | {(e, 2) for e in ENGINES if e != "single"} | {(NOCOMM, 2)}
    if data["meta"]["cpus"] > 1:
        expected.add((ALLCORES, 1))
    assert set(rows) == expected
    numel = count_parameters(GPT(gpt_config("tiny", **OVERRIDES)))
    assert data["meta"]["parameters"] == numel
    assert len(data["meta"]["load_average_before"]) == 3 and data["meta"]["cpu"]
    for (engine, n), row in rows.items():
        assert set(FIELDS) <= set(row), set(FIELDS) - set(row)
        assert row["steps"] == 2 and row["step_time_s"] > 0
        assert row["step_time_p10_s"] <= row["step_time_s"] <= row["step_time_p90_s"]
        torch.testing.assert_close(row["samples_per_s"], GLOBAL_BATCH / row["step_time_s"])
        torch.testing.assert_close(row["tokens_per_s"], row["samples_per_s"] * OVERRIDES["seq_len"])
        phases = row["forward_s"] + row["backward_s"] + row["sync_s"] + row["optimizer_s"]
        assert 0 < phases <= 1.05 * row["step_time_p90_s"] + 1e-3, (engine, n)
        assert row["peak_mem_bytes_per_rank"] >= row["engine_resident_bytes_per_rank"] > 0
        assert row["mfu"] is None  # CPU: no MFU
        assert row["scaling_efficiency"] > 0 and row["speedup_vs_allcores"] > 0
        sends = n > 1 and engine not in ("dp", NOCOMM)
        if sends and engine not in TIMED:  # sharding wrappers: no bucket layout to time them by
            assert row["comm_time_s"] is None and row["overlap_fraction"] is None, engine
        elif sends:
            assert row["comm_time_s"] > 0 and row["exposed_comm_s"] >= 0, (engine, n)
            # manual engines sync after backward: exposed = comm + backward's tail, overlap just below 0
            assert -0.5 <= row["overlap_fraction"] <= 1.0, (engine, n)
        else:
            assert row["comm_time_s"] is None and row["overlap_fraction"] is None
    # measured bytes (what gloo wrote to its sockets) against what each engine must send at ws 2:
    # a ring or one-round all-reduce of P bytes sends P per rank, plus framing and headers
    grads = 4 * numel
    framing = 0.1 * grads + 64 * 1024  # gloo's and nanoddp's per-message headers, buffer broadcasts
    for engine in ("torch", "nanoddp", "nanoddp_torchcomm", "allreduce", "rs_ag"):
        assert grads <= rows[(engine, 2)]["bytes_sent_per_step"] <= grads + framing, engine
    # zero1 also broadcasts each rank's parameter shard (about half the parameters) in optimizer.step
    assert rows[("zero1", 2)]["bytes_sent_per_step"] >= grads + 0.3 * grads
    for engine, n in rows:
        if n == 1 or engine in ("dp", NOCOMM):
            assert rows[(engine, n)]["bytes_sent_per_step"] < 4096, (engine, n)  # nothing to send
    assert rows[("single", 1)]["scaling_efficiency"] == 1.0
    assert rows[("torch", 2)]["vs_torch_ddp"] == 1.0


def test_report_cli_renders_the_table_and_writes_the_plot(bench, capsys):
    data, tmp = bench
    write_json(str(tmp / "bench.json"), data)
    assert main(["bench", "report", str(tmp / "bench.json"), "--plot", str(tmp / "bench.png")]) == 0
    out = capsys.readouterr().out
    assert out.strip().startswith("Measured on") and data["meta"]["cpu"] in out
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(data["results"])  # header + one row each
    assert table[0].count("|") == table[1].count("|")
    assert format_markdown(data) in out
    assert (tmp / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp / "bad.json").write_text("[1, 2]")
    assert main(["bench", "report", str(tmp / "bad.json")]) == 2
    assert "not a `nanoddp bench train --json` file" in capsys.readouterr().err


def test_bench_traces_have_the_named_regions(bench):
    _, tmp = bench
    for rank in (0, 1):
        for engine in ("nanoddp", "torch", "zero1"):
            spans = _spans(tmp / "trace" / f"{engine}-ws2-rank{rank}.trace.json")
            assert REGIONS | {"bucket 0 all-reduce"} <= set(spans), (engine, sorted(spans)[:20])
            # launched inside backward: the bucket span starts before the backward span ends
            (launch, done), backward = spans["bucket 0 all-reduce"][0], spans["backward"]
            assert any(start <= launch <= end for start, end in backward), engine
            assert done >= launch
        assert REGIONS | {"gradient sync"} <= set(_spans(tmp / "trace" / f"rs_ag-ws2-rank{rank}.trace.json"))
    assert set(_spans(tmp / "trace" / "single-ws1-rank0.trace.json")) >= REGIONS


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"engines": ["nanoddp", "no_such_engine"]}, "unknown engine"),
        ({"global_batch": 9}, "divisible by every world size"),
        ({"nprocs": [0]}, "world sizes >= 1"),
        ({"steps": 0}, "--steps must be >= 1"),
        ({"memory": "isolated"}, "memory must be one of"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs, message):
    args = {"nprocs": [1, 2], "engines": ["nanoddp"], "global_batch": 8, "steps": 1, **kwargs}
    with pytest.raises(ValueError, match=message):
        run_benchmark(**args)


TINY = TrainConfig(
    data="synthetic", seq_len=16, d_model=32, n_layers=2, n_heads=2, d_ff=64, batch_size=8, steps=5,
    warmup_steps=1, log_every=5, eval_every=0, eval_samples=8, snapshot_every=0, resume="never", progress=False,
)  # fmt: skip


def _traced_vs_plain(env: DistEnv, tmp: str) -> dict:
    out = {}
    for engine in ("nanoddp", "torch", "allreduce"):
        for trace in (None, f"{tmp}/trace-{engine}"):
            trainer = Trainer.from_config(
                replace(TINY, engine=engine, trace=trace, out=f"{tmp}/{engine}-{bool(trace)}"), env
            )
            trainer.train()
            out[(engine, bool(trace))] = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    return out


def test_train_trace_writes_a_timeline_per_rank_and_trains_the_same(tmp_path):
    results = run_on_ranks(_traced_vs_plain, 2, str(tmp_path), timeout=180)
    for per_rank in results:
        for engine in ("nanoddp", "torch", "allreduce"):
            torch.testing.assert_close(per_rank[(engine, True)], per_rank[(engine, False)], rtol=0, atol=0)
    for engine in ("nanoddp", "torch", "allreduce"):
        for rank in (0, 1):
            spans = _spans(tmp_path / f"trace-{engine}" / f"rank{rank}.trace.json")
            extra = {"gradient sync"} if engine == "allreduce" else {"bucket 0 all-reduce"}
            assert REGIONS | extra <= set(spans), (engine, rank)
            assert len(spans["optimizer step"]) == 3  # steps 3-5 are recorded
