"""Snapshot files: round trip, checksum, truncation/corruption skipped, keep-last-K, RNG state."""

from __future__ import annotations

import random
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from nanoddp.base.rng import capture_rng_state, restore_rng_state
from nanoddp.train.checkpoint import snapshot


def _state(step: int) -> dict:
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return {
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": [capture_rng_state()],
        "config": {"lr": 1e-3, "data": "text"},
    }


def _assert_same(a, b):
    torch.testing.assert_close(a["model"], b["model"], rtol=0, atol=0)
    torch.testing.assert_close(a["optimizer"]["state"], b["optimizer"]["state"], rtol=0, atol=0)
    assert a["step"] == b["step"] and a["config"] == b["config"]


def test_round_trip_is_exact_and_atomic(tmp_path):
    state = _state(3)
    path = snapshot.save(snapshot.snapshot_path(tmp_path, 3), state)
    assert path.name == "step-00000003.pt"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temp file left behind
    _assert_same(snapshot.load(path), state)


def test_truncated_and_corrupted_snapshots_are_skipped(tmp_path, caplog):
    states = {step: _state(step) for step in (10, 20, 30)}
    for step, state in states.items():
        snapshot.save(snapshot.snapshot_path(tmp_path, step), state)
    newest = snapshot.snapshot_path(tmp_path, 30)
    raw = newest.read_bytes()
    newest.write_bytes(raw[: len(raw) // 2])  # killed mid-write without the atomic rename
    with pytest.raises(snapshot.SnapshotError, match="truncated"):
        snapshot.load(newest)
    middle = snapshot.snapshot_path(tmp_path, 20)
    raw = bytearray(middle.read_bytes())
    raw[-10] ^= 0xFF  # one flipped bit in the payload
    middle.write_bytes(bytes(raw))
    with pytest.raises(snapshot.SnapshotError, match="checksum"):
        snapshot.load(middle)
    with caplog.at_level("WARNING"):
        path, state = snapshot.find_latest_valid(tmp_path)
    assert path == snapshot.snapshot_path(tmp_path, 10)
    _assert_same(state, states[10])
    assert "truncated" in caplog.text and "checksum" in caplog.text
    (tmp_path / "step-00000040.pt").write_bytes(b"not a snapshot")
    with pytest.raises(snapshot.SnapshotError, match="not a nanoddp snapshot"):
        snapshot.load(tmp_path / "step-00000040.pt")
    assert snapshot.find_latest_valid(tmp_path / "nothing-here") is None


def test_keep_last_k(tmp_path):
    for step in (1, 5, 12, 100):
        snapshot.save(snapshot.snapshot_path(tmp_path, step), {"step": step})
    (tmp_path / "notes.txt").write_text("not a snapshot, left alone")
    removed = snapshot.prune(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["step-00000001.pt", "step-00000005.pt"]
    assert [step for step, _ in snapshot.list_snapshots(tmp_path)] == [100, 12]
    assert (tmp_path / "notes.txt").exists()
    with pytest.raises(ValueError, match="keep must be >= 1"):
        snapshot.prune(tmp_path, keep=0)


def _sharded(directory, step: int, ranks: int = 2) -> list:
    """A sharded snapshot: a manifest listing one shard file per rank beside it (as a Trainer
    on a sharded engine writes it through save_state); returns the shard files."""
    path = snapshot.snapshot_path(directory, step)
    shards = [path.with_name(f"{path.name}.abcd{step:04d}.rank{r}-of-{ranks}") for r in range(ranks)]
    for r, shard in enumerate(shards):
        snapshot.save(shard, {"rank": r, "piece": torch.full((3,), float(step))})
    listed = [{"file": f.name, "sha256": snapshot.payload_digest(f)} for f in shards]
    snapshot.save(path, {"format": "nanoddp.save_state/2", "step": step, "shards": listed})
    return shards


def test_a_snapshot_whose_shard_files_are_incomplete_is_skipped(tmp_path):
    """Resume must not pick a snapshot whose per-rank shard files are missing or replaced: it
    falls back to the newest snapshot whose shard files are all there, naming what was wrong."""
    _sharded(tmp_path, 3)
    newer = _sharded(tmp_path, 6)
    assert snapshot.find_latest_valid(tmp_path)[0].name == "step-00000006.pt"
    newer[1].unlink()
    skipped: list[str] = []
    assert snapshot.find_latest_valid(tmp_path, skipped)[0].name == "step-00000003.pt"
    assert "step-00000006.pt.abcd0006.rank1-of-2" in skipped[0]
    snapshot.save(newer[1], {"rank": 1, "piece": torch.zeros(3)})  # a valid file, but not the one listed
    skipped.clear()
    assert snapshot.find_latest_valid(tmp_path, skipped)[0].name == "step-00000003.pt"
    assert "is not the shard file" in skipped[0]
    snapshot.snapshot_path(tmp_path, 6).unlink()
    skipped.clear()
    assert snapshot.find_latest_valid(tmp_path, skipped)[0].name == "step-00000003.pt"
    assert not skipped  # shard files with no manifest are no snapshot: nothing to skip


def test_prune_takes_shard_files_with_their_snapshots(tmp_path):
    """Pruning deletes a snapshot's shard files with it, and those of a sharded save whose
    manifest was never written (killed in between); a user's file stays."""
    for step in (1, 2, 3):
        _sharded(tmp_path, step)
    orphan = _sharded(tmp_path, 4)
    snapshot.snapshot_path(tmp_path, 4).unlink()  # killed after the shards, before the manifest
    (tmp_path / "step-00000001.pt.bak").write_text("the user's copy, left alone")
    snapshot.prune(tmp_path, keep=2)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(
        ["step-00000001.pt.bak"]
        + [f"step-0000000{s}.pt" for s in (2, 3)]
        + [f"step-0000000{s}.pt.abcd000{s}.rank{r}-of-2" for s in (2, 3) for r in (0, 1)]
    )
    assert not any(p.exists() for p in orphan)


def test_rng_state_survives_a_snapshot(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.randn()  # leave numpy with a cached gaussian, the awkward part of its state
    snapshot.save(tmp_path / "step-00000001.pt", {"rng": capture_rng_state()})
    expected = (random.random(), np.random.randn(3), torch.rand(3))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng_state(snapshot.load(tmp_path / "step-00000001.pt")["rng"])
    got = (random.random(), np.random.randn(3), torch.rand(3))
    assert got[0] == expected[0]
    np.testing.assert_array_equal(got[1], expected[1])
    assert torch.equal(got[2], expected[2])


_WRITER = """
import sys, torch
from nanoddp.train.checkpoint import snapshot
state = {"step": 2, "blob": torch.randn(6_000_000)}  # 24 MB: a write takes a while
while True:
    snapshot.save(sys.argv[1], state)
"""


def test_a_kill_during_a_snapshot_write_never_leaves_a_readable_half_file(tmp_path):
    """SIGKILL the writer mid-write: the newest valid snapshot is the old one or a complete new
    one, never a half-written file (the temp file is ignored)."""
    directory = tmp_path / "snapshots"
    snapshot.save(snapshot.snapshot_path(directory, 1), {"step": 1})
    target = snapshot.snapshot_path(directory, 2)
    for _ in range(3):
        writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(target)])
        try:
            deadline = time.monotonic() + 60
            while not list(directory.glob(".step-00000002.pt.tmp-*")):  # caught mid-write
                assert writer.poll() is None and time.monotonic() < deadline, "writer never started a write"
                time.sleep(0.005)
        finally:
            writer.kill()
            writer.wait(timeout=30)
        path, state = snapshot.find_latest_valid(directory)
        assert state["step"] in (1, 2) and path.name in ("step-00000001.pt", "step-00000002.pt")
        if target.exists():  # whatever sits under the real name is complete
            assert snapshot.load(target)["blob"].numel() == 6_000_000
    snapshot.prune(directory, keep=2)  # the dead writers' temp files go with the pruning
    assert not list(directory.glob(".step-*"))


class _NotAWeight:
    """A pickled class: the checksum is fine, but weights_only loading refuses it."""


def test_checksummed_but_unloadable_snapshot_is_skipped_for_the_older_one(tmp_path, caplog):
    older = snapshot.save(snapshot.snapshot_path(tmp_path, 1), {"step": 1, "x": torch.ones(2)})
    snapshot.save(snapshot.snapshot_path(tmp_path, 2), {"step": 2, "x": torch.ones(2), "odd": _NotAWeight()})
    with pytest.raises(snapshot.SnapshotError, match="weights_only"):
        snapshot.load(snapshot.snapshot_path(tmp_path, 2))
    with caplog.at_level("WARNING"):
        path, state = snapshot.find_latest_valid(tmp_path)
    assert path == older and state["step"] == 1
    assert any("step-" in r.getMessage() and "weights_only" in r.getMessage() for r in caplog.records)
