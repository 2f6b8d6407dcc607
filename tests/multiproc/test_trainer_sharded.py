"""The trainer on sharded engines (zero2, fsdp): clipping by the global norm, the whole model in
snapshots and model.pt, per-rank optimizer state, bitwise resume, and evaluation with uneven
validation shards (every FSDP forward all-gathers, so every rank must run as many)."""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from helpers import FLAGS, TINY, run_on_ranks, train_tiny, trainer_params

from nanoddp.bench.training_run import TrainingRun, run_training
from nanoddp.env import DistEnv
from nanoddp.train.checkpoint import snapshot
from nanoddp.train.trainer import Trainer

STOP, END = 5, 12  # TINY's clip (0.05) is active at every step: the global norm decides every update


def _sharded_worker(env: DistEnv, tmp: str) -> dict:
    out = {}
    for engine in ("zero2", "fsdp"):
        base = replace(TINY, engine=engine, steps=END, snapshot_every=STOP)
        whole = train_tiny(replace(base, out=f"{tmp}/whole-{engine}"), env)
        dist.barrier()  # rank 0 writes model.pt after the collective gather
        out[engine] = {k: v for k, v in torch.load(f"{tmp}/whole-{engine}/model.pt", weights_only=True).items()}
        out[f"{engine}-val"] = whole.evaluate()  # 5 validation windows over 2 ranks: 3 and 2
        split = train_tiny(replace(base, out=f"{tmp}/split-{engine}"), env, stop_after=STOP)
        _check_own_pieces_only(split, f"{tmp}/split-{engine}/snapshots", env)
        resumed = Trainer.from_config(replace(base, out=f"{tmp}/split-{engine}", resume="auto"), env)
        assert resumed.step == STOP
        resumed.train()
        dist.barrier()
        resumed_model = torch.load(f"{tmp}/split-{engine}/model.pt", weights_only=True)
        for key, value in out[engine].items():  # bitwise, on every rank
            assert torch.equal(value, resumed_model[key]), (engine, key)
    return out


def _check_own_pieces_only(trainer: Trainer, directory: str, env: DistEnv) -> None:
    """A sharded snapshot gathers nothing on rank 0: its manifest holds no parameter and no
    optimizer state tensor, and each rank's shard file holds exactly this rank's pieces."""
    dist.barrier()  # rank 0 writes the manifest after every rank's shard file
    manifest = snapshot.snapshot_path(directory, STOP)
    saved = snapshot.load(manifest)["objects"]
    assert (saved["model"]["kind"], saved["optimizer"]["kind"]) == ("sharded_module", "sharded_optim")
    assert not set(saved["model"]["state"]["whole"]) & {name for name, _ in trainer.module.named_parameters()}
    assert _tensors(saved["optimizer"]) == 0  # where each piece lies; the values are in the rank files
    (mine,) = manifest.parent.glob(f"{manifest.name}.*.rank{env.rank}-of-{env.world_size}")
    held = {k: v.numel() for k, v in snapshot.load(mine)["model"]["tensors"].items()}
    pieces = trainer.module.state_dict(keep_vars=True)  # the registered parameters: this rank's pieces
    local = {k: getattr(v, "_local_tensor", v).numel() for k, v in pieces.items()}
    assert held == {k: n for k, n in local.items() if k in held}  # this rank's piece of each, no more
    whole = sum(p.numel() for p in trainer.engine.state_dict().values())  # collective
    assert 0 < sum(held.values()) < whole  # a part of the model, not all of it


def _tensors(value) -> int:
    """How many tensors `value` holds, however deep."""
    if torch.is_tensor(value):
        return 1
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return sum(_tensors(v) for v in items)


def test_sharded_engines_match_one_process_and_resume_bitwise(tmp_path):
    results = run_on_ranks(_sharded_worker, 2, str(tmp_path / "ws2"), timeout=300)[0]
    reference = train_tiny(
        replace(TINY, engine="single", steps=END, out=str(tmp_path / "single")), DistEnv.single_process("gloo")
    )
    expected = trainer_params(reference)
    for engine in ("zero2", "fsdp"):
        assert results[engine].keys() == expected.keys()
        # rtol as for the other engines in test_trainer: gradient sums and the clip norm are
        # added in another order than in one process (shards, then ranks)
        torch.testing.assert_close(results[engine], expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(results[f"{engine}-val"], reference.evaluate(), rtol=1e-4, atol=1e-5)


def _nanoddp_train(out, *flags: str) -> TrainingRun:
    cmd = [sys.executable, "-m", "nanoddp", "train", *FLAGS, "--engine", "fsdp", "--nproc", "2", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return run_training([*cmd, *flags], out, timeout_s=400, env=env, forked=True)


@pytest.mark.timeout(900)
def test_cli_resumes_a_sharded_run_whose_snapshot_keeps_the_model_in_rank_files(tmp_path):
    """`nanoddp train` checks a snapshot against the model before any worker starts: for a sharded
    run the shapes come from the manifest's layout (the model itself is in the rank files)."""
    first = _nanoddp_train(tmp_path, "--steps", "2")
    assert first.returncode == 0, first.output[-3000:]
    assert (
        snapshot.load(snapshot.snapshot_path(tmp_path / "snapshots", 2))["objects"]["model"]["kind"] == "sharded_module"
    )
    again = _nanoddp_train(tmp_path, "--steps", "4", "--resume", "auto")
    assert again.returncode == 0, again.output[-3000:]
    assert "resuming from" in again.output and "step 2" in again.output
    bigger = _nanoddp_train(tmp_path, "--steps", "6", "--resume", "auto", "--d-model", "64")
    assert bigger.returncode == 2, bigger.output[-3000:]  # refused in the launcher, named
    assert "does not fit this model" in bigger.output or "different configuration" in bigger.output


# ---- the cross-replica phase of a fault-tolerant step, engine by engine -----------------------
# 4 ranks: restart mode is one world of 4; continue is 2 replica groups of 2 ranks (each its own
# default group, as under torchft) whose rank g sums its buffers with the other group's rank g
# over a group torch's registry does not know (torchft's shape), by the rank-order all-reduce.
CROSS_ENGINES = ("nanoddp", "zero2", "fsdp", "hsdp")
CROSS_LR = 0.5


def _default_group(store, prefix: str, rank: int, world_size: int) -> None:
    from nanoddp.comm.transport.runner import forget_groups

    if dist.is_initialized():
        dist.destroy_process_group()
        forget_groups()
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size)


def _one_step_of(name: str, env: DistEnv, rank: int, cross=None) -> dict[str, torch.Tensor]:
    """Build `name` over the default group, run one backward on global rank `rank`'s rows, sum
    across groups by `cross` (None: restart mode), step SGD; the whole parameters after it."""
    from helpers import B, build, global_batch, shard

    from nanoddp.comm.api.rank_order import all_reduce_in_rank_order
    from nanoddp.train.engines import ENGINE_REGISTRY

    engine = ENGINE_REGISTRY[name].build(build("mlp"), env)
    optimizer = torch.optim.SGD(engine.module.parameters(), lr=CROSS_LR)
    if cross is not None:
        engine.use_cross_replica()
    x, y = global_batch("mlp", 4 * B, step=1)
    with engine.micro_step(sync=True):
        engine.model(shard(x, rank), shard(y, rank))[1].backward()
    if cross is not None:
        for buffer in engine.cross_replica_grads():
            buffer.mul_(0.5)  # this group's weight: 2 of the 4 ranks' rows
            all_reduce_in_rank_order(buffer, cross)
        engine.finish_cross_replica()
    optimizer.step()
    return engine.state_dict()


def _cross_worker(env: DistEnv) -> dict:
    store = dist.distributed_c10d._get_default_store()  # outlives the groups made over it
    replica, g = divmod(env.rank, 2)
    as_hosts = replace(env, local_rank=g, local_world_size=2, node_rank=replica)  # hsdp: a group per "host"
    as_group = replace(env, rank=g, local_rank=g, world_size=2, local_world_size=2, node_rank=0)
    results = {}
    for i, name in enumerate(CROSS_ENGINES):
        if i:
            _default_group(store, f"world{i}", env.rank, 4)
        restart = _one_step_of(name, as_hosts, env.rank)
        _default_group(store, f"replica{replica}-{i}", g, 2)
        cross = _row_group(store, f"row{g}-{i}", replica)
        cont = _one_step_of(name, as_group, env.rank, cross)
        results[name] = {k: (restart[k], cont[k]) for k in restart}
    return results


def _row_group(store, prefix: str, rank: int) -> dist.ProcessGroup:
    """A bare c10d gloo group of 2 (rank g of each replica group), as torchft's Manager configures."""
    import datetime

    prefixed = dist.PrefixStore(prefix, store)
    group = dist.ProcessGroup(prefixed, rank, 2)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    backend = dist.ProcessGroupGloo(prefixed, rank, 2, datetime.timedelta(seconds=60))
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


def test_engines_cross_buffers_sum_to_restart_modes_gradients():
    """Each engine's `cross_replica_grads`, summed across two replica groups and finished, give
    the step restart mode's all-reduce over every rank gives: the same sum of 4 ranks' gradients,
    in another order (a ring's) for nanoddp/zero2/fsdp, in the same one for hsdp (its restart mode
    reduce-scatters within the group, then all-reduces across the 2 groups): bitwise there."""
    per_rank = run_on_ranks(_cross_worker, 4, timeout=300)
    for rank, results in enumerate(per_rank):
        assert set(results) == set(CROSS_ENGINES)
        for name, tensors in results.items():
            for key, (restart, cont) in tensors.items():
                if name == "hsdp":
                    assert torch.equal(cont, restart), f"rank {rank} {name} {key}: not bitwise"
                torch.testing.assert_close(cont, restart, rtol=1e-6, atol=1e-7, msg=f"rank {rank} {name} {key}")
