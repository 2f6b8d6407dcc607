"""save_state/load_state: a hand-written DDP loop resumed at step k ends bitwise where an
uninterrupted run ends at step n; files are checked, and a damaged newest file is skipped."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import run_on_ranks
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import nanoddp
from nanoddp.train.checkpoint import snapshot, user_state
from nanoddp.train.data.sampler import ResumableDistributedSampler

STEPS, SAVE_AT, BATCH = 9, 4, 4
DATASET_LEN = 27  # 27 / (2 ranks x 4) is not whole: the resume lands mid-epoch, the run crosses epochs


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(DATASET_LEN, 6, generator=generator)  # (N, 6)
    return TensorDataset(x, (x.sum(1) > 0).long())  # (N,)


def _setup(env, engine: str):
    """Fresh objects, as a restarted process would build them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2))
    if engine == "torch":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:  # nanoddp DDP + ZeRO: the optimizer state is sharded over the ranks
        wrapped = nanoddp.DistributedDataParallel(model)
        optimizer = nanoddp.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    sampler = ResumableDistributedSampler(_dataset(), seed=1)
    # Its own generator: iter(loader) would otherwise draw from the global RNG at a different point after a resume
    loader = DataLoader(_dataset(), batch_size=BATCH, sampler=sampler, generator=torch.Generator().manual_seed(0))
    nanoddp.seed_everything(123, env.rank)  # per-rank dropout and augmentation streams
    return model, wrapped, optimizer, scheduler, scaler, sampler, loader


def _batches(sampler, loader):
    while True:
        sampler.set_epoch(sampler.epoch)  # keeps a resumed mid-epoch position
        yield from loader
        sampler.set_epoch(sampler.epoch + 1)


def _train(wrapped, optimizer, scheduler, scaler, sampler, loader, start: int, stop: int, on_step=None) -> None:
    batches = _batches(sampler, loader)
    for step in range(start + 1, stop + 1):
        x, y = next(batches)
        noise = torch.from_numpy(np.random.randn(*x.shape).astype("float32")) * random.random()  # augmentation
        loss = torch.nn.functional.cross_entropy(wrapped(x + 0.1 * noise), y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        sampler.advance(len(x))
        if on_step:
            on_step(step)


def _resume_case(env, engine: str, directory: str) -> None:
    model, wrapped, opt, sched, scaler, sampler, loader = _setup(env, engine)
    _train(wrapped, opt, sched, scaler, sampler, loader, 0, STEPS)
    reference = {k: v.clone() for k, v in model.state_dict().items()}

    model, wrapped, opt, sched, scaler, sampler, loader = _setup(env, engine)

    def save(step: int) -> None:
        if step == SAVE_AT:
            nanoddp.save_state(directory, step=step, model=wrapped, optimizer=opt, scheduler=sched,
                               scaler=scaler, sampler=sampler)  # fmt: skip

    _train(wrapped, opt, sched, scaler, sampler, loader, 0, SAVE_AT + 2, on_step=save)  # runs past the save

    model, wrapped, opt, sched, scaler, sampler, loader = _setup(env, engine)  # "restart"
    nanoddp.seed_everything(999, env.rank)  # a restarted process's RNG is anything
    state = nanoddp.load_state(directory, model=wrapped, optimizer=opt, scheduler=sched, scaler=scaler,
                               sampler=sampler)  # fmt: skip
    assert state["step"] == SAVE_AT
    _train(wrapped, opt, sched, scaler, sampler, loader, state["step"], STEPS)
    for name, value in model.state_dict().items():
        assert torch.equal(value, reference[name]), f"{engine}: {name} differs after resume"
    saved = snapshot.load(snapshot.snapshot_path(directory, SAVE_AT))
    assert not any(k.startswith("module.") for k in saved["objects"]["model"]["state"])
    assert len(saved["rng"]) == env.world_size


def _resume_worker(env, directory: str) -> None:
    for engine in ("torch", "nanoddp_zero"):
        _resume_case(env, engine, f"{directory}/{engine}/")
        dist.barrier()


@pytest.mark.timeout(240)
def test_resume_is_bitwise_equal_to_uninterrupted_run(on_ranks, tmp_path):
    on_ranks(_resume_worker, 2, str(tmp_path), timeout=220)


def test_directory_picks_newest_valid_and_returns_plain_values(tmp_path):
    model = torch.nn.Linear(3, 2)
    for step in (1, 2):
        with torch.no_grad():
            model.weight.fill_(step)
        nanoddp.save_state(tmp_path, step=step, model=model, note=f"at {step}")
    newest = snapshot.snapshot_path(tmp_path, 2)
    newest.write_bytes(newest.read_bytes()[:-5])  # a job killed mid-write, on a non-atomic filesystem
    fresh = torch.nn.Linear(3, 2)
    state = nanoddp.load_state(tmp_path, model=fresh)
    assert state["step"] == 1 and state["note"] == "at 1"
    assert torch.equal(fresh.weight, torch.ones(2, 3))


def test_load_restores_rng_streams(tmp_path):
    nanoddp.seed_everything(5)
    path = nanoddp.save_state(tmp_path / "s.pt", step=0)
    expected = (random.random(), np.random.rand(), torch.rand(3))
    nanoddp.seed_everything(6)
    nanoddp.load_state(path)
    assert (random.random(), np.random.rand()) == expected[:2]
    assert torch.equal(torch.rand(3), expected[2])


def _draws() -> tuple:
    """The next values of this process's python, numpy and torch streams (consumes them)."""
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def _next_draws() -> tuple:
    """What `_draws` would give now, with the streams put back as they were (torch's own setters)."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    draws = _draws()
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])
    return draws


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _save_rng_worker(env, path: str) -> tuple:
    nanoddp.seed_everything(100, env.rank)  # seed 100 + rank: every rank's streams differ
    own = _next_draws()  # the streams as save_state captures them
    nanoddp.save_state(path, step=0)
    nanoddp.seed_everything(200, env.rank)
    nanoddp.load_state(path)
    assert _draws() == own, f"rank {env.rank} did not get its own streams back at the same world size"
    return own


def _load_rng_elsewhere_worker(env, path: str) -> tuple:
    warnings = _Warnings()
    logging.getLogger(user_state.__name__).addHandler(warnings)
    nanoddp.seed_everything(300, env.rank)
    before = _next_draws()
    nanoddp.load_state(path)
    return before, _draws(), warnings.lines


@pytest.mark.timeout(240)
def test_rng_streams_come_back_per_rank_at_the_same_world_size_only(tmp_path):
    """Same world size (3): each rank gets back the stream it saved. Saved at 3, loaded at 2: no
    rank may take an old rank's stream (two ranks of the old job, not these); every rank keeps
    the streams it has and rank 0 says so once. One plain process reading the job's file: its
    streams are left alone, silently (exporting weights needs no RNG)."""
    path = str(tmp_path / "rng.pt")
    saved = run_on_ranks(_save_rng_worker, 3, path, timeout=100)
    assert len({repr(s) for s in saved}) == 3, "the ranks' streams must differ for the check to mean anything"

    results = run_on_ranks(_load_rng_elsewhere_worker, 2, path, timeout=100)
    for rank, (before, after, _) in enumerate(results):
        assert before != saved[rank]  # the restored stream would be told apart
        assert after == before, f"rank {rank}: load_state at another world size changed its RNG streams"
    assert results[0][2] == ["state saved at world size 3, loaded at 2: RNG streams not restored (reseed them)"]
    assert results[1][2] == []  # rank 0 alone says it: one line per job, not per rank

    logger = logging.getLogger(user_state.__name__)
    warnings = _Warnings()
    logger.addHandler(warnings)
    try:
        nanoddp.seed_everything(400)
        before = _next_draws()
        nanoddp.load_state(path)
        assert _draws() == before != saved[0]
    finally:
        logger.removeHandler(warnings)
    assert warnings.lines == []


def test_empty_directory_is_a_fresh_start(tmp_path):
    assert nanoddp.load_state(tmp_path / "not-yet") is None


def test_bad_input_is_a_clear_error(tmp_path):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"names a directory, so the file is step-<N>.pt and needs step=N"):
        nanoddp.save_state(tmp_path, model=model)
    path = nanoddp.save_state(tmp_path / "a.pt", model=model)
    with pytest.raises(ValueError, match=r"has no \['optimizer'\]; it holds \['model'\]"):
        nanoddp.load_state(path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(FileNotFoundError, match="no saved state at"):
        nanoddp.load_state(tmp_path / "missing.pt", model=model)
    with pytest.raises(ValueError, match="at least one object"):
        nanoddp.save_state(tmp_path / "b.pt")


def test_torch_distributed_sampler_resumes_its_epoch(tmp_path):
    """torch's DistributedSampler has no state_dict: save_state keeps its epoch, and a fresh
    sampler loaded from it deals the saved epoch's order (torch's own, from set_epoch(3))."""
    saved = DistributedSampler(_dataset(), num_replicas=2, rank=1, shuffle=True, seed=5)
    saved.set_epoch(3)
    nanoddp.save_state(tmp_path / "s.pt", sampler=saved)
    fresh = DistributedSampler(_dataset(), num_replicas=2, rank=1, shuffle=True, seed=5)
    assert list(fresh) != list(saved)  # epoch 0's order differs from epoch 3's: the check can fail
    nanoddp.load_state(tmp_path / "s.pt", sampler=fresh)
    assert fresh.epoch == 3
    assert list(fresh) == list(saved)
