"""`nanoddp bench zero` plumbing: the CLI runs both variants and writes coherent JSON.

Tiny sizes (one step, one round): this checks wiring and accounting, not speed.
"""

from __future__ import annotations

import json

from nanoddp.cli import main


def test_bench_zero_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "zero.json"
    argv = ["bench", "zero", "--nproc", "2", "--steps", "1", "--warmup", "0", "--rounds", "1",
            "--batch-size", "1", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "ddp_zero" in capsys.readouterr().out
    results = json.loads(out.read_text())["results"]
    assert [(r["world_size"], r["variant"]) for r in results] == [(2, "ddp_adamw"), (2, "ddp_zero")]
    adamw, zero = results
    # Sharding loses nothing: the shards add up to exactly the unsharded AdamW state.
    assert zero["state_bytes_total"] == adamw["state_bytes_per_rank"] == adamw["state_bytes_total"] / 2
    assert zero["state_fraction_of_unsharded"] <= 0.5 * 1.05
    for row in results:
        assert row["samples_per_s"] > 0 and row["peak_rss_bytes_per_rank"] > 0
