"""`nanoddp bench restarts`' failure-cost part: how it reads a run's progress, its
summary of the committed measurement, and the data split of its torchft mode.
(The measurement itself runs real 3-rank trainings, minutes long: its figures are committed under
docs/bench/ft/, not re-measured here.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanoddp.bench.failure_cost import (
    MODES,
    RATIOS,
    SEEN_KEYS,
    SYNC_KEYS,
    _logged_step,
    _seen_at_syncs,
    describe,
    describe_rounds,
    seen_by_survivors,
    summarize,
    summarize_rounds,
)
from nanoddp.bench.torchft_ddp import ShardBatches, per_replica_batch
from nanoddp.ft.global_batches import GlobalBatches


def test_the_kill_waits_for_the_newest_logged_step(tmp_path):
    assert _logged_step(tmp_path) == 0  # no metrics.jsonl yet
    records = [
        {"step": 10, "loss": 2.0, "world_size": 3},
        {"event": "rank_lost", "step": 11, "world_size": 2},  # an event is not a step record
        {"step": 20, "loss": 1.5, "world_size": 2},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert _logged_step(tmp_path) == 20


def test_the_survivors_stall_and_extra_wait_are_read_around_the_kill():
    """Commits 0.2 s apart (two 0.1 s apart), a kill at 2.5 s, the next commit at 3.4 s at world
    size 2 and full size again at 3.6 s: the stall is 1.0 s; an ordinary step, the median wait
    over the 10 steps before the kill, 0.2 s; what the failure added, 0.8 s."""
    times = [0.2, 0.4, 0.5, 0.7, 0.9, 1.1, 1.3, 1.5, 1.7, 1.9, 2.1, 2.3, 2.4]
    records = [{"step": i + 1, "loss": 1.0, "world_size": 3, "time": t} for i, t in enumerate(times)]
    records.append({"event": "rank_lost", "step": 14, "world_size": 2})
    records.append({"step": 14, "loss": 1.0, "world_size": 2, "time": 3.4})
    records.append({"step": 15, "loss": 1.0, "world_size": 3, "time": 3.6})
    seen = seen_by_survivors(records, killed_at=2.5)
    assert set(seen) == set(SEEN_KEYS)  # every key a trial's record copies
    assert seen == {"stall_s": 1.0, "join_s": 0.2, "steps_short": 1, "step_s": 0.2, "extra_s": 0.8}
    assert seen_by_survivors(records, killed_at=0.3) == dict.fromkeys(SEEN_KEYS) | {"steps_short": 0}


def test_the_rounds_stall_is_read_at_the_first_sync_after_the_kill():
    """`--cost-engine diloco`: a sync every 2 steps (0.1, 0.3, 0.2 s), a kill at 2.5 s, the next
    sync 0.9 s: an ordinary sync is 0.2 s (the median before the kill), the kill added 0.7 s; the
    replacement joined at the sync of step 8 (`rank_joined` is noted on step 9), 0.5 s; the last
    sync (step 10, with the final evaluation) is left out."""
    comm = {2: 0.1, 4: 0.3, 6: 0.2, 8: 0.9, 10: 0.5, 12: 3.0}
    records = [{"step": i, "loss": 1.0, "world_size": 3 if i <= 8 or i > 10 else 2, "time": 0.4 * i,
                "comm_time_s": comm.get(i)} for i in range(1, 13)]  # fmt: skip
    records.insert(8, {"event": "rank_lost", "step": 9, "world_size": 2, "replicas": [1]})
    records.insert(11, {"event": "rank_joined", "step": 11, "world_size": 3, "replicas": [1]})
    seen = _seen_at_syncs(records, killed_at=2.5)
    assert set(seen) == set(SYNC_KEYS)
    assert seen == {"sync_s": 0.2, "stall_s": 0.9, "extra_s": 0.7, "join_sync_s": 0.5, "join_step": 10}
    assert _seen_at_syncs(records, killed_at=0.3) == dict.fromkeys(SYNC_KEYS)  # before the first sync
    summary = summarize_rounds([{**seen, "val_loss_gap": 0.01}, {**seen, "extra_s": 0.3, "val_loss_gap": -0.02}])
    assert (summary["median_extra_s"], summary["max_extra_s"]) == (0.5, 0.7)
    assert summary["max_val_loss_gap"] == -0.02  # the worst: the largest in size


BENCH_FT = Path(__file__).resolve().parents[2] / "docs" / "bench" / "ft"
ROUNDS_MEASURED = {
    "diloco": "failure-cost-diloco-2026-11-29.json",
    "streaming": "failure-cost-streaming-2026-11-30.json",
}


@pytest.mark.parametrize("engine", list(ROUNDS_MEASURED))
def test_the_summary_and_report_of_the_committed_rounds_measurement(engine):
    """The real records of `nanoddp bench restarts --cost-trials 2 --cost-engine diloco|streaming`:
    the summary recomputed from them, and its two report lines, which name the run's flags."""
    report = json.loads((BENCH_FT / ROUNDS_MEASURED[engine]).read_text())["failure_cost_rounds"]
    streaming = "--fragments" in report["meta"]["train_args"]
    assert streaming == (engine == "streaming")
    assert [r["trial"] for r in report["results"]] == list(range(report["meta"]["trials"]))
    assert summarize_rounds(report["results"]) == report["summary"]
    for r in report["results"]:
        assert r["val_loss_gap"] == round(r["killed_val_loss"] / r["clean_val_loss"] - 1, 5)
    stall, loss = describe_rounds(report).splitlines()
    assert f"adds {report['summary']['median_extra_s']:.2f} s" in stall
    assert ("--fragments 2 --sync-delay 1 --pseudo-grad-dtype int8 under continue" in stall) == streaming
    assert f"{100 * report['summary']['max_val_loss_gap']:+.2f} %" in loss


# ---- the torchft mode ------------------------------------------------------------------------
# the newest measurement, with the warm spare
MEASURED = Path(__file__).resolve().parents[2] / "docs" / "bench" / "ft" / "failure-cost-2026-11-28d.json"


def test_the_summary_and_report_of_the_committed_measurement():
    """The real records of `nanoddp bench restarts --cost-trials 3` (docs/bench/ft/): modes
    interleaved trial by trial, the summary recomputed from them, one report line per mode."""
    report = json.loads(MEASURED.read_text())["failure_cost"]
    trials = report["meta"]["trials"]
    assert [(r["trial"], r["mode"]) for r in report["results"]] == [(t, m) for t in range(trials) for m in MODES]
    summary = summarize(report["results"])
    assert summary == report["summary"]
    torchft = [r["cost_s"] for r in report["results"] if r["mode"] == "torchft"]
    assert summary["torchft"]["median_cost_s"] == sorted(torchft)[len(torchft) // 2]
    lines = describe(report).splitlines()
    assert len(lines) == len(MODES) + len(RATIOS) + 2  # + each in-run stall over restart's cost
    assert lines[2].startswith("torchft's FT-DDP") and f"{summary['torchft']['median_cost_s']:.1f} s" in lines[2]
    ratios = ["continue / restart", "torchft / restart", "continue / torchft"]
    ratios += ["continue's stall / restart's cost", "torchft's stall / restart's cost"]
    assert [line.split(":")[0] for line in lines[3:]] == ratios
    stall = summary["continue"]["median_stall_s"] / summary["restart"]["median_cost_s"]
    assert summary["continue_stall_over_restart"] == round(stall, 3)


def test_torchft_shards_make_the_global_batch_of_every_step():
    """torchft's sampler gives replica r every R-th sample of the same seeded permutation that
    `nanoddp.ft` cuts into contiguous pieces: over the replicas, each step (across an epoch's
    end too) holds the same samples in both loops, which is why their runs agree."""
    import torchft

    dataset, batch, replicas, seed = list(range(50)), 12, 3, 7
    per_replica = per_replica_batch(batch, replicas)
    shards = [
        ShardBatches(torchft.DistributedSampler(dataset, replica_rank=r, num_replica_groups=replicas, group_rank=0,
                                                num_replicas=1, shuffle=True, seed=seed, drop_last=True), per_replica)
        for r in range(replicas)
    ]  # fmt: skip
    global_batches = GlobalBatches(len(dataset), batch, seed)
    assert shards[0].steps_per_epoch == global_batches.steps_per_epoch == 4
    for step in range(10):
        pieces = [shard.indices(step) for shard in shards]
        assert all(len(piece) == per_replica for piece in pieces)
        assert sorted(sum(pieces, [])) == sorted(global_batches.indices(step).tolist()), step


def test_torchft_needs_a_batch_that_splits_evenly():
    with pytest.raises(ValueError, match="--batch-size 10 must be a multiple of the 3 replicas; pick 9"):
        per_replica_batch(10, 3)


@pytest.mark.parametrize(
    "fields, message", [({"engine": "zero1"}, "use --engine nanoddp"), ({"eval_every": 10}, "pass --eval-every 0")]
)
def test_torchft_refuses_what_its_worker_does_not_do(fields, message):
    from nanoddp.bench.torchft_ddp import check_torchft
    from nanoddp.train.config import TrainConfig

    check_torchft(TrainConfig(eval_every=0))
    with pytest.raises(ValueError, match=message):
        check_torchft(TrainConfig(**{"eval_every": 0, **fields}))
