"""`nanoddp train --on-failure continue`: the built-in job on `nanoddp.ft`'s step loop.

The launcher (`nanoddp.train.launcher.cli`) hands the job to `nanoddp.ft.supervisor`, which runs
`python -m nanoddp.train.ft_loop FLAGS...` once per replica. Each builds the same model, data,
AdamW and warmup-cosine schedule as `nanoddp train` (`nanoddp.train.build`), then steps through
`FaultTolerant`: the global batch of each step is split over the replicas present at that step,
the gradients are averaged in rank order, and a lost replica costs the others the step in flight.

What differs from the restart path, and why:
- the gradient average is `nanoddp.ft`'s (all-gather, sum in rank order), not DDP's buckets: a
  group rebuilt mid-run needs no reducer rebuilt, and the sum is the same on every rank whatever
  the world size;
- a joiner takes its state (weights, AdamW's moments, the schedule's position, the step, RNG)
  from a peer, not from a snapshot; snapshots (`--snapshot-every`, the restart path's files) and
  the validation loss (`--eval-every`) are taken at step boundaries by the whole group
  (`nanoddp.train.ft_boundary`), and `--resume` reads either path's snapshots.

The restart path's guards hold here too: `--on-nan stop` stops the run before a non-finite
loss's update (the restart path's line, `step_check`), `--on-nan skip` commits the step without
the update and the newest finite snapshot is never pruned; `model.pt` is never written from a
non-finite state; a group that holds no state resumes from the newest snapshot.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import default_collate

from nanoddp.base import files
from nanoddp.base.processes import die_with_parent, take_descendants_along
from nanoddp.dataclass_cli import add_dataclass_args, config_from_args
from nanoddp.ft import FaultTolerant, OptimizerShards, ReplicaEnv
from nanoddp.ft.stopped import RunStopped, run_replica
from nanoddp.train import ft_boundary, step_check
from nanoddp.train.build import Job, build_job
from nanoddp.train.config import TrainConfig, filled, threads_per_rank
from nanoddp.train.data.batch_rules import batch_loss_for
from nanoddp.train.metrics import format_log_line

logger = logging.getLogger(__name__)
WORKER_MODULE = "nanoddp.train.ft_loop"
CONTINUE_ENGINES = ("nanoddp", "zero1", "zero2", "fsdp")  # all but nanoddp: `OptimizerShards` stage 1, 2, 3


def check_continue(config: TrainConfig) -> None:
    """What `--on-failure continue` covers today; anything else is refused with the way out."""
    if config.engine not in CONTINUE_ENGINES:
        raise ValueError(
            f"--on-failure continue supports --engine {', '.join(CONTINUE_ENGINES)}, got {config.engine!r}; "
            "use one of those, or --on-failure restart"
        )
    unsupported = {
        "grad_accum": config.grad_accum != 1,
        "amp": config.amp != "off",
        "compile": config.compile,
        "trace": config.trace is not None,
    }
    named = [name for name, used in unsupported.items() if used]
    if named:
        flags = ", ".join("--" + name.replace("_", "-") for name in named)
        raise ValueError(f"--on-failure continue does not support {flags} yet: drop them or use --on-failure restart")


def train_replica(config: TrainConfig, env: ReplicaEnv) -> None:
    """Train this replica to `config.steps` committed steps (see the module docstring)."""
    torch.set_num_threads(threads_per_rank(config, env.replicas))
    # The plain AdamW over every parameter: zero1's ZeroRedundancyOptimizer is made for one fixed
    # group; here `OptimizerShards` decides which parameters it steps, group after group.
    job = build_job(dataclasses.replace(config, engine="nanoddp"))  # identical weights (init_sync makes sure)
    train_set, module, optimizer, scheduler = job.train_set, job.module, job.optimizer, job.scheduler
    batch_loss = batch_loss_for(None)
    resumed = None if env.joiner else ft_boundary.resume(config, job, env)  # a joiner heals from a peer
    facts = ft_boundary.RunFacts(ft_boundary.first_run_id(env, config.out), 0)
    if resumed is not None:
        facts = ft_boundary.RunFacts(resumed[2], resumed[0], newest_finite_snapshot=resumed[0])
    shards = _shards(config, job)
    whole = None if shards is None else (lambda: ft_boundary.WholeOptimizer(shards.whole_state_dict()))
    boundary = ft_boundary.Boundary(config, job, facts, whole)
    ft = FaultTolerant(
        module,
        optimizer,
        dataset_len=len(train_set),  # type: ignore[arg-type]  # map-style: torch's stub has no __len__
        batch_size=filled(config.batch_size),
        seed=config.seed,
        env=env,
        extra_state=_extra_state(scheduler, facts),
        tokens_per_sample=job.tokens_per_sample,
        boundary=boundary,
        shards=shards,
        restore=boundary.restore,  # when nobody holds the state
    )
    boundary.ft = ft
    if resumed is not None:
        ft.resume_at(resumed[0], resumed[1])
    module.train()
    for step in ft.steps(config.steps):
        batch = default_collate([train_set[i] for i in ft.batch_for(step).tolist()])
        loss = batch_loss(module, batch)
        loss.backward()
        averaged = ft.average_gradients(loss) is not None
        nonfinite = ft.nonfinite_ranks if averaged else ()  # the same on every member: from the gathered losses
        if nonfinite and config.on_nan == "stop":  # before the update: the weights stay the last finite step's
            raise RunStopped(step_check.stop_line(step + 1, nonfinite), ft.is_master)
        if averaged and not nonfinite and config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(module.parameters(), config.grad_clip)  # the same on every rank
        if ft.commit(update=not nonfinite):
            scheduler.step()
            facts.last_step_finite = not nonfinite
            if nonfinite:
                _skipped(ft, step, nonfinite)
            elif ft.is_master and (step + 1) % config.log_every == 0:
                logger.info("%s | world %d", format_log_line(ft.last_record), ft.world_size)
    if config.out is not None:
        _export(ft, module, config.out)
    ft.close()


def _skipped(ft: FaultTolerant, step: int, ranks: tuple[int, ...]) -> None:
    """`--on-nan skip`: the restart path's line and record for a step committed without its update."""
    if ft.is_master:
        logger.warning("%s", step_check.skip_line(step + 1, ranks))
        event = {"event": "nonfinite_loss", "step": step + 1, "ranks": list(ranks), "action": "skipped"}
        ft.metrics.write({**event, "world_size": ft.world_size})


def _export(ft: FaultTolerant, module: torch.nn.Module, out: str) -> None:
    """Rank 0 writes `model.pt`; never from a non-finite state (every member checks its whole
    copy, so all stop alike)."""
    state = module.state_dict()
    bad = step_check.nonfinite_entries(state)
    if bad:
        raise RunStopped(step_check.export_refusal(bad, ft.manager.current_step()), ft.is_master)
    if ft.is_master:
        files.atomic_torch_save(Path(out) / "model.pt", state)
        logger.info("saved %s", Path(out) / "model.pt")


def _shards(config: TrainConfig, job: Job) -> OptimizerShards | None:
    """zero1/zero2: the optimizer sharded over the group, a lost shard's state read from the
    newest snapshot; fsdp: the weights too, a lost shard rolls the whole state back to it."""
    stage = {"zero1": 1, "zero2": 2, "fsdp": 3}.get(config.engine)
    if stage is None:
        return None
    name_of = {p: name for name, p in job.module.named_parameters()}
    names = [name_of[p] for group in job.optimizer.param_groups for p in group["params"]]
    return OptimizerShards(
        job.optimizer,
        names,
        stage,
        lambda: ft_boundary.newest_optimizer_state(config),
        lambda: ft_boundary.restore_newest(config, job),
    )


def _extra_state(scheduler: torch.optim.lr_scheduler.LRScheduler, facts: ft_boundary.RunFacts):
    """What a joiner receives besides weights, optimizer, step and RNG: the schedule's position
    and the run's facts (its id, and the step it started at)."""

    def take() -> dict[str, Any]:
        return {"scheduler": scheduler.state_dict(), "facts": dataclasses.asdict(facts)}

    def put(state: dict[str, Any]) -> None:
        scheduler.load_state_dict(state["scheduler"])
        for name, value in state["facts"].items():
            setattr(facts, name, value)

    return take, put


def start_replica(argv: list[str] | None, module: str) -> tuple[TrainConfig, ReplicaEnv]:
    """What every replica process of a `nanoddp train` job does first (this loop's, and the
    torchft-DDP loop's of `nanoddp bench restarts`): read the config its launcher passed as flags
    and its place in the run, tie its life to the launcher's, and quiet torchft's per-step logs."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}")
    add_dataclass_args(parser, TrainConfig)  # the launcher passes the config as flags
    config = config_from_args(TrainConfig, parser.parse_args(argv))
    env = ReplicaEnv.from_environ()
    die_with_parent(env.launcher_pid)  # no replica outlives its launcher, even a SIGKILLed one
    take_descendants_along()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    # torchft logs every quorum and commit at info, and its structured loggers an empty line each
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return config, env


def main(argv: list[str] | None = None) -> int:
    """One replica: `python -m nanoddp.train.ft_loop FLAGS...` (`nanoddp train`'s flags); a
    stopped run is one line and `STOPPED_EXIT_CODE` (`nanoddp.ft.stopped`)."""
    return run_replica(lambda: train_replica(*start_replica(argv, WORKER_MODULE)))


if __name__ == "__main__":
    sys.exit(main())
