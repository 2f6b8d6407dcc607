"""Trainer engines `localsgd` and `diloco`: equal to a single process that simulates both ranks'
replicas, bitwise; resume between syncs is exact; every step record says what the step sent.

One launch at world size 2 runs every trainer; the references and the record checks run here.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch
from helpers import TINY, run_on_ranks, train_tiny, trainer_params
from torch.utils.data import TensorDataset, default_collate

from nanoddp import cli
from nanoddp.base.records import read_records, step_records
from nanoddp.comm.plan import plan
from nanoddp.comm.protocol import wire
from nanoddp.env import DistEnv
from nanoddp.parallel.clip import clip_grad_norm_
from nanoddp.parallel.lowcomm import LocalSGD
from nanoddp.train.checkpoint import snapshot
from nanoddp.train.config import build_model
from nanoddp.train.data.batch_rules import batch_loss_for
from nanoddp.train.data.datasets import build_datasets
from nanoddp.train.data.sampler import ResumableDistributedSampler
from nanoddp.train.recipe import WarmupCosine, make_optimizer
from nanoddp.train.trainer import Trainer

WORLD_SIZE, SYNC_EVERY, STEPS, STOP = 2, 3, 7, 4  # syncs after steps 3 and 6; stop and end between syncs
LOWCOMM = ("localsgd", "diloco")
STREAMING_STOP = 3


def _config(engine: str, **changes) -> object:
    # one thread per rank, as in the reference: matmul sums split over threads in another order
    return replace(TINY, engine=engine, sync_every=SYNC_EVERY, steps=STEPS, threads=1, **changes)


def _worker(env: DistEnv, tmp: str) -> dict:
    """Every trainer of this file on one launch: per engine a straight run, and one stopped
    between syncs and resumed (compared bitwise here, on each rank's own replica)."""
    out = {}
    for engine in LOWCOMM:
        whole = train_tiny(_config(engine, out=f"{tmp}/whole-{engine}"), env)
        stopped = train_tiny(_config(engine, out=f"{tmp}/split-{engine}"), env, stop_after=STOP)
        out[f"{engine}-stop"] = trainer_params(stopped)
        resumed = Trainer.from_config(_config(engine, out=f"{tmp}/split-{engine}", resume="auto"), env)
        assert resumed.step == STOP and resumed.optimizer.local_step == STOP
        resumed.train()
        for key, value in trainer_params(whole).items():
            assert torch.equal(value, resumed.module.state_dict()[key]), (engine, key)
        out[engine] = trainer_params(whole)
    plain_outer = train_tiny(_config("diloco", outer_momentum=0.0, out=f"{tmp}/diloco-momentum0"), env)
    out["diloco-momentum0"] = trainer_params(plain_outer)
    accum = train_tiny(_config("localsgd", grad_accum=2, out=f"{tmp}/accum-localsgd"), env)
    out["localsgd-accum2"] = trainer_params(accum)
    train_tiny(_config("diloco", amp="bf16", out=f"{tmp}/bf16-diloco"), env)
    out |= _streaming(env, tmp)
    for engine in ("nanoddp", "torch"):
        train_tiny(replace(TINY, engine=engine, steps=2, out=f"{tmp}/{engine}"), env)
    out["user"] = _users_own_wrapper(env, tmp)
    return out


def _streaming_config(**changes) -> object:
    # 2 fragments every 4 steps, each all-reduce started a step early: starts after steps 1, 3, 5, 7
    streaming = {"fragments": 2, "sync_delay": 1, "mix": 0.5, "pseudo_grad_dtype": "int8"}
    return replace(_config("diloco", **streaming, **changes), sync_every=4)


def _streaming(env: DistEnv, tmp: str) -> dict:
    """--fragments 2 --sync-delay 1 --mix 0.5 --pseudo-grad-dtype int8: straight, and stopped after
    step 3 (fragment 1's mean on the wire) and resumed."""
    whole = train_tiny(_streaming_config(out=f"{tmp}/whole-streaming"), env)
    train_tiny(_streaming_config(out=f"{tmp}/split-streaming"), env, stop_after=STREAMING_STOP)
    resumed = Trainer.from_config(_streaming_config(out=f"{tmp}/split-streaming", resume="auto"), env)
    assert resumed.step == STREAMING_STOP and resumed.optimizer.in_flight.keys() == {1}
    resumed.train()
    return {"streaming": trainer_params(whole), "streaming-resumed": trainer_params(resumed)}


def _users_own_wrapper(env: DistEnv, tmp: str) -> dict[str, torch.Tensor]:
    """nanoddp.Trainer given a LocalSGD the user built: refused while the options say another
    sync_every (the run's config would lie), used as is once they agree."""
    torch.manual_seed(env.rank)  # different weights per rank: the wrapper broadcasts rank 0's
    model = torch.nn.Linear(4, 1)
    data = TensorDataset(torch.randn(32, 4, generator=torch.Generator().manual_seed(0)), torch.zeros(32, 1))
    wrapper = LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)
    options = {"loss_fn": torch.nn.functional.mse_loss, "engine": "localsgd", "steps": 3, "batch_size": 8}
    options |= {"progress": False, "log_every": 1}
    with pytest.raises(
        ValueError, match=r"engine 'localsgd' steps a LocalSGD with the run's options \{'sync_every': 50\}"
    ):
        Trainer(model, wrapper, data, out=f"{tmp}/user-refused", **options)
    trainer = Trainer(model, wrapper, data, out=f"{tmp}/user", sync_every=2, **options)
    trainer.fit()
    assert trainer.optimizer is wrapper and wrapper.local_step == 3
    return trainer_params(trainer)


@pytest.fixture(scope="module")
def ws2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lowcomm")
    return run_on_ranks(_worker, WORLD_SIZE, str(tmp), timeout=240), tmp


def _resume_alone(env: DistEnv, snapshot_file: str, out: str) -> dict:
    """One rank resuming a 2-rank diloco snapshot: the replica it loads, and DiLoCo's state."""
    trainer = Trainer.from_config(_config("diloco", out=out, resume=snapshot_file), env)
    return {"params": trainer_params(trainer), "optimizer": trainer.optimizer.state_dict()}


def _reference(engine: str, **changes) -> list[dict[str, torch.Tensor]]:
    """`_simulate` on one thread, as every rank ran (then the thread count is given back)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _simulate(engine, **changes)
    finally:
        torch.set_num_threads(threads)


def _simulate(engine: str, **changes) -> list[dict[str, torch.Tensor]]:
    """Both ranks' replicas in one process, by the algorithm: each steps its own AdamW on its
    own batches (the sampler's rank r share), clipped by its own norm; every SYNC_EVERY steps
    LocalSGD averages the weights, DiLoCo takes an outer SGD step (Nesterov unless its momentum
    is 0) on the mean of (weights at the last sync - weights now). Divide, then sum in rank
    order: the ranks' math. `changes`: config fields the run was given besides the engine's."""
    config = _config(engine, **changes)
    train_set, _, spec = build_datasets(
        config.data, config.seq_len, config.val_fraction, config.text_max_bytes, model=config.model
    )
    torch.manual_seed(config.seed)
    first = build_model(config, spec)
    replicas = [first, copy.deepcopy(first)]
    optimizers = [make_optimizer(m, config) for m in replicas]
    schedule = WarmupCosine(config.warmup_steps, config.steps, config.min_lr_ratio)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in optimizers]
    params = [[p for g in o.param_groups for p in g["params"]] for o in optimizers]
    last_sync = [p.detach().clone() for p in params[0]]
    if engine == "diloco":
        momentum = config.outer_momentum
        outer = torch.optim.SGD(last_sync, lr=config.outer_lr, momentum=momentum, nesterov=momentum > 0)
    order = ResumableDistributedSampler(train_set, WORLD_SIZE, 0, seed=config.seed).permutation(0).tolist()
    micro, loss_of = config.batch_size // WORLD_SIZE, batch_loss_for(None)
    for step in range(STEPS):
        for rank, (model, optimizer, scheduler) in enumerate(zip(replicas, optimizers, schedulers, strict=True)):
            mine = order[rank::WORLD_SIZE][step * micro : (step + 1) * micro]
            optimizer.zero_grad(set_to_none=True)
            loss_of(model, default_collate([train_set[i] for i in mine])).backward()
            clip_grad_norm_(model, config.grad_clip)  # plain gradients: this replica's own norm
            optimizer.step()
            scheduler.step()
        if (step + 1) % SYNC_EVERY == 0:
            _sync(engine, params, last_sync, outer if engine == "diloco" else None)
    return [dict(m.named_parameters()) for m in replicas]


@torch.no_grad()
def _sync(engine: str, params: list[list[torch.Tensor]], last_sync: list[torch.Tensor], outer) -> None:
    for i, (a, b) in enumerate(zip(*params, strict=True)):
        if outer is None:  # LocalSGD: the mean of the weights
            mean = a / WORLD_SIZE + b / WORLD_SIZE
        else:  # DiLoCo: the outer step on the mean pseudo-gradient moves the last-sync weights
            last_sync[i].grad = (last_sync[i] - a) / WORLD_SIZE + (last_sync[i] - b) / WORLD_SIZE
            mean = None
        if mean is not None:
            a.copy_(mean)
            b.copy_(mean)
    if outer is not None:
        outer.step()
        for i, (a, b) in enumerate(zip(*params, strict=True)):
            a.copy_(last_sync[i])
            b.copy_(last_sync[i])


@pytest.mark.parametrize("engine", LOWCOMM)
def test_replicas_equal_a_single_process_simulation_bitwise(ws2, engine):
    results, tmp = ws2
    named = _reference(engine)
    for rank in range(WORLD_SIZE):  # step 7 is past the last sync: each rank its own replica
        for name, expected in named[rank].items():
            assert torch.equal(results[rank][engine][name], expected), (engine, rank, name)
    assert not all(torch.equal(results[0][engine][n], results[1][engine][n]) for n in named[0])  # they drifted
    # model.pt: the replicas' mean (what a LocalSGD sync at the last step would give), same bits
    exported = torch.load(tmp / f"whole-{engine}" / "model.pt", weights_only=True)
    for name, a in named[0].items():
        assert torch.equal(exported[name], a.detach() / WORLD_SIZE + named[1][name].detach() / WORLD_SIZE), name


def test_diloco_outer_momentum_reaches_the_engine(ws2):
    """`outer_momentum=0` (`--outer-momentum 0`): plain outer SGD, the simulation's bits, which
    differ from the default momentum's."""
    results, _ = ws2
    named = _reference("diloco", outer_momentum=0.0)
    for rank in range(WORLD_SIZE):
        for name, expected in named[rank].items():
            assert torch.equal(results[rank]["diloco-momentum0"][name], expected), (rank, name)
    assert not all(torch.equal(results[0]["diloco"][n], results[0]["diloco-momentum0"][n]) for n in named[0])


def test_resume_at_another_world_size_continues_rank_0s_replica(ws2, tmp_path):
    results, tmp = ws2
    snapshot_file = snapshot.snapshot_path(tmp / "split-diloco" / "snapshots", STOP)
    alone = run_on_ranks(_resume_alone, 1, str(snapshot_file), str(tmp_path / "alone"))[0]
    assert alone["optimizer"]["local_step"] == STOP
    stopped = results[0]["diloco-stop"]
    assert stopped.keys() == alone["params"].keys()
    assert all(torch.equal(alone["params"][k], v) for k, v in stopped.items())  # rank 0's, not rank 1's
    assert not all(torch.equal(results[1]["diloco-stop"][k], v) for k, v in stopped.items())


def _records(path) -> list[dict]:
    return step_records(read_records(path))


def test_comm_bytes_count_the_syncs_and_every_step_says_its_world_size(ws2):
    _, tmp = ws2
    module = build_model(TINY, build_datasets(TINY.data, TINY.seq_len, 0.05, TINY.text_max_bytes)[2])
    payload = sum(p.numel() * p.element_size() for p in module.parameters())  # one fp32 flat per sync
    # ws 2: a payload this small rides in the header round's frame, one send of header + data
    assert plan.plan("all_reduce", payload, WORLD_SIZE, "gloo") is plan.Path.PAIR
    sync_bytes = wire.HEADER_BYTES + payload
    for engine in LOWCOMM:
        records = _records(tmp / f"whole-{engine}" / "metrics.jsonl")
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))
        expected = [sync_bytes if r["step"] % SYNC_EVERY == 0 else 0 for r in records]
        assert [r["comm_bytes"] for r in records] == expected, engine
    ours = _records(tmp / "nanoddp" / "metrics.jsonl")
    assert ours and all(r["comm_bytes"] > payload for r in ours)  # every gradient, every step
    # torch's DDP sends through gloo's own all-reduce: modelled as a ring, 2 (ws - 1) / ws x bytes
    torch_records = _records(tmp / "torch" / "metrics.jsonl")
    assert [r["comm_bytes"] for r in torch_records] == [2 * (WORLD_SIZE - 1) * payload // WORLD_SIZE] * 2
    for engine in (*LOWCOMM, "nanoddp", "torch"):
        run = f"whole-{engine}" if engine in LOWCOMM else engine
        assert all(r["world_size"] == WORLD_SIZE for r in _records(tmp / run / "metrics.jsonl"))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sync-every", "3"], "--sync-every applies to --engine localsgd|diloco, not 'nanoddp'"),
        (["--engine", "localsgd", "--outer-lr", "0.5"], "--outer-lr applies to --engine diloco, not 'localsgd'"),
        (["--engine", "diloco", "--sync-every", "0"], "sync_every must be >= 1"),
        (["--engine", "diloco", "--outer-momentum", "1"], "outer_momentum must be in [0, 1)"),
    ],
)
def test_engine_options_are_checked_in_the_launcher(argv, message, capsys):
    assert cli.main(["train", *argv]) == 2
    assert message in capsys.readouterr().err


def test_accumulation_and_bf16_keep_the_schedule(ws2):
    results, tmp = ws2
    # two micro-batches of 2 instead of one of 4: the same gradient up to float rounding (the
    # halves are summed, not the whole batch), so close, not bitwise; AdamW normalises each
    # update, so a rounding difference stays of its own size (test_trainer.py's tolerance)
    for rank in range(WORLD_SIZE):
        torch.testing.assert_close(results[rank]["localsgd-accum2"], results[rank]["localsgd"], rtol=1e-4, atol=1e-5)
    # bf16 autocast computes in half precision but keeps fp32 weights: the syncs send what fp32 ones do
    sent = [r["comm_bytes"] for r in _records(tmp / "bf16-diloco" / "metrics.jsonl")]
    assert sent == [r["comm_bytes"] for r in _records(tmp / "whole-diloco" / "metrics.jsonl")]
    assert all(math.isfinite(r["loss"]) for r in _records(tmp / "bf16-diloco" / "metrics.jsonl"))


def test_a_users_own_wrapper_is_used_as_is_when_the_options_agree(ws2):
    results, tmp = ws2
    first, second = (results[rank]["user"] for rank in range(WORLD_SIZE))
    records = _records(tmp / "user" / "metrics.jsonl")
    assert [r["comm_bytes"] > 0 for r in records] == [False, True, False]  # its sync_every=2, not 50
    # step 3 is past the sync: the replicas (started from rank 0's weights) differ again
    assert not all(torch.equal(first[k], second[k]) for k in first)
    assert not (tmp / "user-refused").exists()  # the refused Trainer left no run directory


def test_streaming_int8_resumes_exactly_and_sends_a_quarter(ws2):
    """A streaming run stopped with a fragment in flight resumes to the straight run's bits; its
    int8 fragments send under a third of what whole-model fp32 syncs send over the same steps
    (2 whole models each way; int8 is 1 byte an element plus a scale per 256)."""
    results, tmp = ws2
    for rank in range(WORLD_SIZE):
        for name, value in results[rank]["streaming"].items():
            assert torch.equal(results[rank]["streaming-resumed"][name], value), (rank, name)
    records = _records(tmp / "whole-streaming" / "metrics.jsonl")
    # a fragment's bytes are in the record of the step that used its mean: steps 2, 4, 6 (the one
    # started after step 7 is still out when the run ends); each send is counted once, whenever
    # the background thread made it
    sent = [r["comm_bytes"] for r in records]
    assert [b > 0 for b in sent] == [r["step"] % 2 == 0 for r in records], sent
    assert sent[1] == sent[5] != sent[3], sent  # fragment 0 twice, fragment 1 (another size) once
    fp32 = sum(r["comm_bytes"] for r in _records(tmp / "whole-diloco" / "metrics.jsonl"))
    assert 0 < sum(sent) < fp32 / 3, (sent, fp32)
