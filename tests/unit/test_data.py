"""Sampler sharding, padding, exact resume (also with a changed world size), and datasets."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from nanoddp.train.data.datasets import (
    BYTE_VOCAB,
    TokenWindows,
    build_datasets,
    copy_task,
    read_text_source,
    stdlib_source_files,
)
from nanoddp.train.data.sampler import ResumableDistributedSampler, shard

SIZES = (1, 7, 10, 33, 64)


def _shards(n, world_size, drop_last=False, epoch=0, position=0, seed=3, shuffle=True):
    shards = []
    for rank in range(world_size):
        sampler = ResumableDistributedSampler(
            range(n), world_size, rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        sampler.set_epoch(epoch)
        sampler.position = position
        shards.append(list(sampler))
        assert len(sampler) == len(shards[-1])
    return shards


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shards_cover_each_epoch_with_equal_lengths(world_size):
    for n in SIZES:
        if n < world_size:
            continue
        for epoch in (0, 1):
            shards = _shards(n, world_size, epoch=epoch)
            assert len({len(s) for s in shards}) == 1, "every rank must do the same number of steps"
            flat = [i for s in shards for i in s]
            assert set(flat) == set(range(n))  # covers the dataset
            padding = len(flat) - n
            assert 0 <= padding < world_size
            assert all(count <= 2 for count in Counter(flat).values())
            # drop_last: disjoint, equal, and only the last n % W samples skipped
            dropped = _shards(n, world_size, drop_last=True, epoch=epoch)
            flat = [i for s in dropped for i in s]
            assert len(flat) == len(set(flat)) == n - n % world_size
            assert len({len(s) for s in dropped}) == 1


def test_epochs_shuffle_differently_and_reproducibly():
    a0, a1 = _shards(50, 2, epoch=0), _shards(50, 2, epoch=1)
    assert a0 != a1
    assert a0 == _shards(50, 2, epoch=0)
    assert _shards(10, 1, shuffle=False) == [list(range(10))]


@pytest.mark.parametrize("old_ws,new_ws", [(2, 3), (4, 1), (1, 4), (3, 2), (2, 2)])
def test_resume_with_changed_world_size_sees_remaining_samples_once(old_ws, new_ws):
    n, batch = 61, 4
    samplers = [ResumableDistributedSampler(range(n), old_ws, r, seed=5, drop_last=True) for r in range(old_ws)]
    seen = []
    for sampler in samplers:
        sampler.set_epoch(2)
        seen += list(sampler)[: 3 * batch]  # every rank consumed 3 batches...
        sampler.advance(3 * batch)  # ...and says so
    state = samplers[0].state_dict()
    assert state["position"] == 3 * batch * old_ws
    resumed = []
    for rank in range(new_ws):
        sampler = ResumableDistributedSampler(range(n), new_ws, rank, seed=5, drop_last=True)
        sampler.load_state_dict(state)
        sampler.set_epoch(2)  # the usual per-epoch call must not reset a resumed position
        resumed += list(sampler)
    remaining = set(range(n)) - set(seen)
    assert len(resumed) == len(set(resumed)), "a remaining sample was seen twice"
    assert set(resumed) <= remaining and not set(resumed) & set(seen)
    assert len(remaining) - len(resumed) < new_ws  # only the uneven tail is dropped
    # and the resumed order is exactly the rest of the same permutation
    order = samplers[0].permutation(2).tolist()
    assert sorted(resumed, key=order.index) == order[len(seen) : len(seen) + len(resumed)]


def test_next_epoch_restarts_position_and_padding_wraps_tiny_datasets():
    sampler = ResumableDistributedSampler(range(10), 2, 0, seed=1)
    sampler.advance(3)
    assert sampler.position == 6 and len(sampler) == 2
    sampler.set_epoch(1)
    assert sampler.position == 0 and len(sampler) == 5
    sampler.advance(5)
    assert list(sampler) == [] and len(sampler) == 0
    shards = _shards(3, 3, position=1)  # 2 left for 3 ranks: one padded from the epoch's start
    assert all(len(s) == 1 for s in shards)


def test_clear_errors():
    with pytest.raises(ValueError, match="dataset has 2 samples but the world size is 3"):
        ResumableDistributedSampler(range(2), 3, 0)
    with pytest.raises(ValueError, match="rank must be in"):
        ResumableDistributedSampler(range(8), 2, 2)
    sampler = ResumableDistributedSampler(range(8), 2, 0)
    with pytest.raises(ValueError, match="dataset of 8 samples"):
        ResumableDistributedSampler(range(9), 2, 0).load_state_dict(sampler.state_dict())
    with pytest.raises(ValueError, match="world size is 4"):
        shard(range(3), 0, 4)


def test_manual_shard_helper():
    parts = [list(shard(range(11), r, 3)) for r in range(3)]
    assert parts == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    uneven = [list(shard(range(11), r, 3, drop_last=False)) for r in range(3)]
    assert sorted(i for p in uneven for i in p) == list(range(11))


def test_text_datasets(tmp_path):
    files = stdlib_source_files()
    assert files == sorted(files, key=lambda p: p.as_posix()) and all(p.suffix == ".py" for p in files)
    assert not any("test" in p.parts or "site-packages" in p.parts for p in files)
    blob = read_text_source("text", max_bytes=20_000)
    assert len(blob) == 20_000 and blob == read_text_source("text", max_bytes=20_000)  # deterministic
    train, val, spec = build_datasets("text", seq_len=16, val_fraction=0.1, max_bytes=20_000)
    assert spec.vocab_size == BYTE_VOCAB == 256 and len(train) > 9 * len(val) > 0
    x, y = train[3]
    assert x.shape == y.shape == (16,) and torch.equal(x[1:], y[:-1])
    assert bytes(train.tokens[48:64].tolist()) == blob[48:64]
    # a user's file and directory
    (tmp_path / "a.txt").write_text("hello world " * 20)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("more text " * 20)
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2" * 10)  # binary files are skipped
    assert read_text_source(str(tmp_path / "a.txt")) == b"hello world " * 20
    assert read_text_source(str(tmp_path)) == b"hello world " * 20 + b"\n" + b"more text " * 20
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_text_source(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="too few"):
        build_datasets(str(tmp_path / "a.txt"), seq_len=1000, val_fraction=0.1)


def test_synthetic_and_digits():
    rows = copy_task(5, seq_len=20, vocab_size=16, period=4)
    x, y = rows[0]
    assert torch.equal(x[4:], x[:-4]) and torch.equal(y, rows.rows[0, 1:]) and int(x.max()) < 16
    train, val, spec = build_datasets("synthetic", seq_len=8, val_fraction=0.25, synthetic_samples=40)
    assert (len(train), len(val), spec.kind) == (30, 10, "lm")
    train, val, spec = build_datasets("digits", seq_len=8, val_fraction=0.2)
    assert spec == spec.__class__("classification", 10, in_features=64)
    assert len(train) + len(val) == 1797 and train[0][0].shape == (64,) and float(train.features.max()) <= 1.0
    assert len(TokenWindows(torch.arange(10), 3)) == 3
