"""`--memory-plot`: per-rank memory by part (parameters, gradients, optimizer state, transient
peak) as stacked bars, one per engine. A tiny ws=2 benchmark of a replicated engine and the
sharded ones: the PNG is written, the bar heights drawn are the JSON's numbers, and the parts
themselves say what each engine shards (exact tensor bytes, so exact bounds)."""

from __future__ import annotations

import json

import pytest

from nanoddp.bench import write_json
from nanoddp.bench.report import MB, MEMORY_PARTS, write_memory_plot
from nanoddp.bench.train import run_benchmark
from nanoddp.cli import main
from nanoddp.models import GPT, gpt_config

OVERRIDES = {"n_layers": 2, "d_model": 32, "n_heads": 2, "d_ff": 64, "seq_len": 16}
ENGINES = ["nanoddp", "zero2", "fsdp", "torch_fsdp"]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench_memory")
    # five 2-rank launches (one timed, one per engine alone)
    data = run_benchmark([2], ENGINES, "tiny", 8, steps=2, warmup=2, block=1, overrides=OVERRIDES)
    write_json(str(tmp / "bench.json"), data)
    return tmp


def test_memory_plot_draws_the_json_numbers(bench_json, capsys):
    path, png = bench_json / "bench.json", bench_json / "memory.png"
    assert main(["bench", "report", str(path), "--memory-plot", str(png)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == PNG
    data = json.loads(path.read_text())
    drawn = write_memory_plot(str(bench_json / "again.png"), data)
    rows = {f"{r['engine']}\nws={r['world_size']}": r["memory_bytes_per_rank"] for r in data["results"]}
    assert set(drawn) == set(MEMORY_PARTS)
    for part in MEMORY_PARTS:
        assert drawn[part] == {label: parts[part] / MB for label, parts in rows.items()}, part


def test_memory_parts_show_what_each_engine_shards(bench_json):
    data = json.loads((bench_json / "bench.json").read_text())
    assert data["meta"]["memory"] == "alone"  # the default: each engine measured in a launch of its own
    results = data["results"]
    rows = {r["engine"]: r["memory_bytes_per_rank"] for r in results}
    model = GPT(gpt_config("tiny", **OVERRIDES))
    unique = {p.untyped_storage().data_ptr(): p.numel() for p in model.parameters()}
    whole = 4 * sum(unique.values())  # float32 bytes, a tied weight once
    replicated = rows["nanoddp"]
    assert replicated["params"] == whole and replicated["grads"] == whole
    # AdamW: exp_avg + exp_avg_sq per element, plus a 4-byte step per parameter tensor
    assert 2 * whole <= replicated["optimizer_state"] <= 2 * whole + 4 * len(unique)
    half = whole / 2 * 1.05  # 1/ws, within the padding of each flat unit to a multiple of ws
    assert rows["zero2"]["params"] >= whole  # parameters stay whole
    assert rows["zero2"]["grads"] <= half
    assert rows["fsdp"]["params"] <= half and rows["fsdp"]["grads"] <= half
    for engine in ("zero2", "fsdp", "torch_fsdp"):
        assert rows[engine]["optimizer_state"] <= 2 * half + 4 * len(unique), engine
    assert rows["torch_fsdp"]["params"] <= half
    for parts in rows.values():
        assert parts["transient_peak"] >= 0
