"""The training loop: the `Trainer` shape of pytorch/examples, made exact and fault tolerant.

`_run_batch` (one forward/backward), `_run_step` (K micro-batches = one optimizer step),
`_run_epoch`-style data streaming, `_save_snapshot` and `_load_snapshot` are where users expect
them. What the tutorial version lacks and this one has:

- snapshots hold everything a step depends on (model, optimizer, scheduler, step, sampler
  position, every rank's RNG states), are written atomically with a checksum, and resume
  *mid-epoch* from the exact sample where the run stopped, so stopping at step k and resuming
  gives bitwise the same parameters at step n as never stopping;
- gradient accumulation that skips the all-reduce on all but the last micro-step;
- clipping on the *averaged* gradients (after the sync; clipping per rank before it would
  clip each rank's noisy gradient by a different factor), except where the engine never
  averages them (`localsgd`, `diloco`: each rank clips its own, then its optimizer syncs the
  replicas every few steps);
- the logged loss is the global mean (all_reduce), validation covers every rank's shard with
  the uneven tail weighted correctly, and only rank 0 prints and writes files.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, Subset, default_collate

from nanoddp.base import files
from nanoddp.base.rng import restore_rng_state
from nanoddp.comm.transport import transport
from nanoddp.dataclass_cli import to_dict
from nanoddp.env import DistEnv, seed_everything
from nanoddp.parallel.grad_scaler import ShardedGradScaler
from nanoddp.parallel.tensors import move_to
from nanoddp.train import evaluation, signals, step_check
from nanoddp.train.checkpoint import rundir, snapshot, user_state
from nanoddp.train.config import TrainConfig, check_data, threads_per_rank, validate
from nanoddp.train.data.batch_rules import batch_loss_for
from nanoddp.train.data.sampler import ResumableDistributedSampler
from nanoddp.train.engines import build_engine, prepare_model
from nanoddp.train.metrics import MetricsLogger, Window, format_log_line, redirect_logging
from nanoddp.train.options import claim_run_dir, configure_logging, joined_env, options_config, release_run_dir
from nanoddp.train.ranks import all_reduce_sum, broadcast_from_master
from nanoddp.train.recipe import build_job, follow_steps_on_resume
from nanoddp.train.trace import TraceSession, build_traced_engine, region

logger = logging.getLogger(__name__)


class Trainer:
    """Train `model` data-parallel on this rank: build it on every rank, then call `fit()`.

    Any `nn.Module` with its optimizer and dataset; `options` are `TrainConfig`'s fields
    (`steps`, `batch_size` (global), `grad_accum`, `engine`, `out`, `snapshot_every`, `seed`,
    `amp`, `grad_clip`, ...). Batches become losses by the rules in `nanoddp.train.data.batch_rules`.
    The process group comes from torchrun's environment (`nanoddp run`, torchrun) unless the
    script made one. `nanoddp train` builds its own model and data, then runs this very loop
    (`Trainer.from_config`).

    An `optimizer` built before the Trainer is fine for every engine: zero2 keeps the parameter
    objects, fsdp moves it onto the sharded ones. For ZeRO-1 pass a `nanoddp.ZeroRedundancyOptimizer` (with
    `engine="zero1"`, or any replicated engine). With `engine="localsgd"` or `"diloco"` the Trainer
    wraps it in `nanoddp.LocalSGD` / `nanoddp.DiLoCo` (`sync_every`, `outer_lr`, `outer_momentum`
    options), or uses the wrapper you pass as is.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_dataset: Dataset,
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        eval_dataset: Dataset | None = None,
        lr_scheduler: Any = None,
        env: DistEnv | None = None,
        **options: Any,
    ):
        config = options_config(options, model, optimizer, train_dataset)
        env = env or joined_env(config)
        configure_logging(env)
        config, self._lock_fd = claim_run_dir(config, env)
        datasets, batch_loss = (train_dataset, eval_dataset), batch_loss_for(loss_fn)
        try:
            self._setup(config, env, model.to(env.device), optimizer, lr_scheduler, datasets, batch_loss, collate_fn)
        except BaseException:  # give the run directory back: a corrected retry must not be refused
            release_run_dir(self._lock_fd, failed=True)
            raise

    @classmethod
    def from_config(cls, config: TrainConfig, env: DistEnv) -> Trainer:
        """`nanoddp train`'s trainer: the built-in model, data, AdamW and warmup-cosine schedule
        that `config` describes, on the same loop as any user model."""
        validate(config, env.world_size)
        if config.out is None:  # every rank must agree on one directory: rank 0 picks it
            config = replace(config, out=broadcast_from_master(rundir.default_run_dir(), env))
        job = build_job(config, env.device)
        trainer = cls.__new__(cls)
        trainer._lock_fd = None  # the launcher's agent holds the run directory
        datasets = (job.train_set, job.val_set)
        trainer._setup(config, env, job.module, job.optimizer, job.scheduler, datasets, batch_loss_for(None), None)
        return trainer

    def _setup(self, config, env, module, optimizer, scheduler, datasets, batch_loss, collate_fn) -> None:
        """The part every trainer shares: data checks, threads, sampler, loader, RNG streams,
        resume, engine, metrics."""
        self.env, self.config, self.run_dir = env, config, Path(config.out)
        self.train_set, self.val_set = datasets
        check_data(config, env.world_size, len(self.train_set))
        self.micro_batch = config.batch_size // (env.world_size * config.grad_accum)
        self.threads = threads_per_rank(config, env.world_size)
        torch.set_num_threads(self.threads)
        self.module, self.optimizer, self.scheduler = module, optimizer, scheduler
        prepare_model(config, module, optimizer, env)  # fsdp: shard now; refuse a model sharded otherwise
        self.batch_loss, self.collate_fn = batch_loss, collate_fn or default_collate
        self._tokens_per_sample = getattr(self.train_set, "tokens_per_sample", None)
        self.sampler = ResumableDistributedSampler(
            self.train_set, env.world_size, env.rank, shuffle=True, seed=config.seed
        )
        # Our own generator, so that starting an epoch never draws from the global RNG.
        self.loader = DataLoader(
            self.train_set,
            batch_size=self.micro_batch,
            sampler=self.sampler,
            drop_last=True,
            collate_fn=self.collate_fn,
            generator=torch.Generator().manual_seed(config.seed),
        )
        self.step, self._signum = 0, 0  # the stop signal the ranks agreed on at the last step
        self._last_step_finite, self._newest_finite_snapshot = True, cast(int | None, None)  # prune keeps that one
        seed_everything(config.seed, env.rank)  # per-rank streams (dropout, augmentation)
        self._build_engine(optimizer)
        self._step_comm_bytes = 0  # what the last step's collectives sent from this rank
        self.resumed_from = self._maybe_resume()  # after the engine: a sharded one loads its own pieces
        self.model = torch.compile(self.engine.model) if config.compile else self.engine.model
        self.metrics = MetricsLogger(self.run_dir, config.metrics) if env.is_master else None
        if self.metrics is not None:
            self.metrics.truncate_after(self.step)
            files.atomic_write_bytes(self.run_dir / "config.json", rundir.config_json(to_dict(config), self.run_id))

    def _build_engine(self, optimizer: torch.optim.Optimizer) -> None:
        """`config.engine` over the prepared `self.module`, the optimizer the trainer steps and the
        GradScaler: what either `--on-failure` mode trains with."""
        config, env = self.config, self.env
        self.engine = (build_traced_engine if config.trace else build_engine)(config.engine, self.module, env)
        self.optimizer = self.engine.wrap_optimizer(optimizer, config)  # localsgd/diloco: their periodic sync
        # Gradients that differ per rank (sharded, or never averaged) would let an fp16 overflow
        # skip the step on some ranks only: ShardedGradScaler agrees on the verdict.
        per_rank_grads = self.engine.sharded or self.engine.local_gradients
        scaler = ShardedGradScaler if per_rank_grads else torch.amp.GradScaler
        self.scaler = scaler(env.device.type, enabled=config.amp == "fp16")

    @property
    def is_master(self) -> bool:
        """Whether this process writes the run's files (`model.pt`, the snapshots' pruning): rank 0."""
        return self.env.is_master

    @property
    def world_size(self) -> int:
        """How many ranks train each step (what a step's records say)."""
        return self.env.world_size

    def _group_across(self) -> dist.ProcessGroup | None:
        """The group the evaluation splits its set over, if not the default one (continue's replicas)."""
        return None

    def _maybe_resume(self) -> Path | None:
        """Apply `--resume` (see `rundir.resolve_resume`); rank 0 decides and every rank follows,
        so a refusal is the same ValueError on every rank, never a peer left waiting."""
        current = to_dict(self.config)
        found, decision = None, None
        if self.env.is_master:
            try:
                found = rundir.resolve_resume(self.config.resume, self.run_dir, current, self.env.restart_count)
                decision = ("ok", str(found[0]) if found else None)
            except ValueError as exc:
                decision = ("error", str(exc))
        kind, value = broadcast_from_master(decision, self.env)
        if kind == "error":
            raise ValueError(value)
        if value is None:
            self.run_id = self._fresh_run_id()
            if self.env.is_master and self.config.resume != "never":
                logger.info("no snapshot in %s: starting fresh at step 0", self.run_dir / "snapshots")
            return None
        self._load_snapshot(Path(value), found[1] if found else snapshot.load(value))
        if self.env.is_master:
            why = f"restart {self.env.restart_count}: " if self.env.restart_count else ""
            logger.info("%sresumed from %s (step %d) in epoch %d", why, value, self.step, self.sampler.epoch)
        return Path(value)

    def _fresh_run_id(self) -> str:
        """The id of a run that starts at step 0, the same on every rank: rank 0's."""
        return broadcast_from_master(rundir.new_run_id(), self.env)

    # --- snapshots --------------------------------------------------------------------------

    def _parts(self) -> dict[str, Any]:
        """What a snapshot holds besides the loop's own facts and the RNG streams, by the names
        it keeps them under (`nanoddp.load_state(snapshot, model=..., optimizer=...)` reads them)."""
        parts = {"model": self.module, "optimizer": self.optimizer, "scheduler": self.scheduler}
        parts |= {"scaler": self.scaler if self.scaler.is_enabled() else None, "sampler": self.sampler}
        return {name: part for name, part in parts.items() if part is not None}

    def _save_snapshot(self, interrupted: int = 0) -> None:
        """Collective: `save_state` of the parts and the loop's facts (`interrupted`: the signal
        that stopped the run here, 0 for a regular snapshot). A sharded engine's model and
        optimizer go to one shard file per rank, nothing gathered; every rank's RNG streams
        are captured by save_state; rank 0 writes the manifest, then prunes."""
        directory, config = self.run_dir / "snapshots", to_dict(self.config)
        path = snapshot.snapshot_path(directory, self.step)
        train = {"step": self.step, "epoch": self.sampler.epoch, "config": config, "run_id": self.run_id,
                 "fingerprint": rundir.fingerprint(config), "world_size": self.env.world_size,
                 "interrupted": interrupted, "loss_finite": self._last_step_finite, **self._loop_facts()}  # fmt: skip
        user_state.save_objects(path, {**self._parts(), snapshot.TRAIN: train})
        if self._last_step_finite:
            self._newest_finite_snapshot = self.step
        if self.is_master:
            snapshot.prune(directory, self.config.keep_snapshots, protect=self._newest_finite_snapshot)
            logger.debug("snapshot %s", path)

    def _loop_facts(self) -> dict[str, Any]:
        """What the loop itself keeps in a snapshot's `train` entry besides the common facts."""
        return {}

    def _load_snapshot(self, path: Path, state: dict[str, Any]) -> None:
        """Collective, once the engine is built: every part the snapshot `state` (read from
        `path`) holds, then the schedule stretched to a changed --steps and the RNG streams
        (re-seeded at another world size: the data order stays exact)."""
        train = snapshot.train_state(state, path)
        parts = {name: part for name, part in self._parts().items() if name in state["objects"]}
        user_state.load_objects(path, parts, restore_rng=False, manifest=state)
        self.step = int(train["step"])
        self.run_id = train.get("run_id") or self._fresh_run_id()
        self._newest_finite_snapshot = self.step if train.get("loss_finite", True) else None
        saved_steps = int(train["config"].get("steps", self.config.steps))
        note = follow_steps_on_resume(self.scheduler, saved_steps, self.config.steps, self.step)
        if note and self.env.is_master:
            logger.warning("%s", note)
        self._load_loop_state(train, state["rng"])

    def _load_loop_state(self, train: dict[str, Any], saved: list[Any]) -> None:
        """The loop's own state from a snapshot's `train` entry and every rank's RNG streams
        `saved`: this rank's streams (re-seeded at another world size: the data order stays exact)."""
        if len(saved) == self.env.world_size:
            restore_rng_state(saved[self.env.rank])
        else:
            if self.env.is_master:
                logger.warning(
                    "world size changed from %d to %d: RNG states re-seeded", len(saved), self.env.world_size
                )
            seed_everything(self.config.seed + self.step, self.env.rank)

    # --- the loop ---------------------------------------------------------------------------

    def _batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Micro-batches forever, epoch after epoch, starting at the sampler's position."""
        while True:
            self.sampler.set_epoch(self.sampler.epoch)  # keeps a resumed mid-epoch position
            yield from self.loader
            self.sampler.set_epoch(self.sampler.epoch + 1)

    def _autocast(self):
        dtype = torch.float16 if self.config.amp == "fp16" else torch.bfloat16
        return torch.autocast(self.env.device.type, dtype=dtype, enabled=self.config.amp != "off")

    def _run_batch(self, batch: Any, sync: bool, weight: float = 1.0) -> torch.Tensor:
        """Forward and backward of one micro-batch; gradients averaged over ranks iff `sync`.
        fp16: the loss is scaled so that small gradients survive the half-precision backward.
        `weight`: the micro-batch's size over the mean micro-batch's (1: of one size)."""
        with self.engine.micro_step(sync):
            with region("forward"), self._autocast():
                loss = self.batch_loss(self.model, batch)
            with region("backward"):
                weighted = loss if weight == 1.0 else loss * weight
                self.scaler.scale(weighted / self.config.grad_accum).backward()
        self.sampler.advance(self.micro_batch)
        return loss.detach().float()

    def _run_step(self, batches: Iterator) -> torch.Tensor | None:
        """One optimizer step over `grad_accum` micro-batches; returns this rank's mean loss, or
        None when a non-finite loss on some rank made every rank skip the update (`--on-nan skip`)."""
        sent_before = transport.sent_bytes()
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.env.device)
        for micro in range(self.config.grad_accum):
            batch = move_to(next(batches), self.env.device, non_blocking=True)
            total += self._run_batch(batch, sync=micro == self.config.grad_accum - 1)
        verdict = step_check.agree(total, signals.pending(), self.env)  # the step's one agreement
        self._signum, self._last_step_finite = verdict.signum, not verdict.nonfinite_ranks
        if verdict.nonfinite_ranks:
            self._skip_nonfinite(verdict.nonfinite_ranks)
        else:
            self._apply_update()
        if self.scheduler is not None:
            self.scheduler.step()
        self.engine.end_step()
        self._step_comm_bytes = self.engine.step_comm_bytes(transport.sent_bytes() - sent_before)
        self.step += 1
        return None if verdict.nonfinite_ranks else total / self.config.grad_accum

    def _apply_update(self) -> None:
        """Clip the averaged gradients and step the optimizer (through the GradScaler)."""
        if self.config.grad_clip > 0:  # on the averaged gradients (local_gradients: this rank's)
            self.scaler.unscale_(self.optimizer)  # fp16: clip the true gradients (else a no-op)
            self.engine.clip_grad_norm_(self.config.grad_clip)
        with region("optimizer step"):
            self.scaler.step(self.optimizer)  # fp16: skipped when a gradient overflowed
            self.scaler.update()

    def _skip_nonfinite(self, ranks: tuple[int, ...]) -> None:
        """A NaN/inf loss on `ranks`: stop on every rank (`--on-nan stop`), or log and skip the update."""
        if self.config.on_nan == "stop":
            raise step_check.NonFiniteLoss(step_check.stop_line(self.step + 1, ranks))
        if self.metrics is not None:
            logger.warning("%s", step_check.skip_line(self.step + 1, ranks))
            event = {"event": "nonfinite_loss", "step": self.step + 1, "ranks": list(ranks), "action": "skipped"}
            self.metrics.write({**event, "world_size": self.world_size})

    def fit(self) -> dict[str, Any]:
        """Train to `steps`, resuming first if the run directory holds a snapshot; returns the
        last logged metrics record. Under torchrun, SIGTERM/SIGINT stop every rank at one step
        with a snapshot there, and the process exits 128 + signal (rerun to continue)."""
        under_agent = self.env.torchrun and threading.current_thread() is threading.main_thread()
        if under_agent:
            signals.install()
        try:
            return self.train()
        except signals.Interrupted as exc:
            logger.warning("%s", exc)
            raise SystemExit(exc.exit_code) from None
        finally:
            if under_agent:
                signals.uninstall()
            release_run_dir(self._lock_fd, failed=sys.exc_info()[0] is not None)
            self._lock_fd = None

    def train(self, stop_after: int | None = None) -> dict[str, Any]:
        """Train to `config.steps` (or stop early after `stop_after`, with a snapshot there).

        Returns the last logged metrics record (useful in tests and notebooks). `fit()` is the
        public entry; this one leaves signal handling to the caller (`nanoddp train`'s worker).
        """
        cfg, last = self.config, {}
        end = cfg.steps if stop_after is None else min(stop_after, cfg.steps)
        batches = self._batches()
        self.module.train()
        progress = self._progress_bar(end)
        logger.info("training %s on %d rank(s), engine %s, %d CPU thread(s) per rank, steps %d-%d",
                    cfg.model, self.env.world_size, cfg.engine, self.threads, self.step, end)  # fmt: skip
        window = Window(self.step)
        with redirect_logging(progress), TraceSession(cfg.trace, self.env.rank) as tracer:
            while self.step < end:
                window.add_loss(self._run_step(batches), self._step_comm_bytes)
                tracer.step()
                progress.update(1)
                final = self.step == end
                val_loss = None
                if final or _every(self.step, cfg.eval_every):
                    with window.paused():  # throughput figures count training time only
                        val_loss = self.evaluate()
                if val_loss is not None or final or self.step == 1 or _every(self.step, cfg.log_every):
                    last = self._log(window, val_loss)
                    window = Window(self.step)
                if final or _every(self.step, cfg.snapshot_every):
                    with window.paused():
                        self._save_snapshot()
                if self._signum and not final:  # agreed by every rank in the step's check
                    self._stop_interrupted(self._signum)
            progress.close()
        if self.step >= cfg.steps:
            self._export_final_model()
        if self.metrics is not None:
            self.metrics.close()
        return last

    def _stop_interrupted(self, signum: int) -> None:
        """Every rank agreed to stop after this step: snapshot it (collective), then raise."""
        self._save_snapshot(interrupted=signum)
        if self.metrics is not None:
            self.metrics.close()
        raise signals.Interrupted(self.step, signum)

    def _progress_bar(self, end: int):
        from tqdm import tqdm

        enabled = self.env.is_master and self.config.progress and sys.stderr.isatty()
        return tqdm(total=end, initial=self.step, disable=not enabled, dynamic_ncols=True, leave=False)

    def _log(self, window: Window, val_loss: float | None) -> dict[str, Any]:
        """Global mean loss and throughput over the steps since the last log (a collective)."""
        stats = torch.stack([window.loss_sum, torch.tensor(float(window.loss_steps), device=self.env.device)])
        all_reduce_sum(stats)
        steps, tokens = max(window.steps, 1), self._tokens_per_sample
        comm_s, exposed_s = self.engine.comm.pop() if self.engine.comm is not None else (None, None)
        step_time = window.elapsed_s() / steps
        record = {
            "step": self.step,
            "loss": (stats[0] / stats[1]).item() if stats[1] > 0 else None,  # None: every step skipped
            "lr": self.optimizer.param_groups[0]["lr"],
            "step_time_s": step_time,
            "samples_per_s": self.config.batch_size / step_time,
            "tokens_per_s": None if tokens is None else self.config.batch_size * tokens / step_time,
            "comm_time_s": None if comm_s is None else comm_s / steps,
            "comm_exposed_s": None if exposed_s is None else exposed_s / steps,  # backward waited on it
            "comm_bytes": window.comm_bytes,  # sent by this rank's step collectives since the last record
            "world_size": self.env.world_size,
        }
        if val_loss is not None:
            record["val_loss"] = val_loss
        if self.metrics is not None:
            self.metrics.write(record)
            logger.info(format_log_line(record))
        return record

    # --- evaluation and export --------------------------------------------------------------

    def evaluate(self) -> float | None:
        """Mean validation loss over every rank's shard (a collective, `evaluation.mean_loss`). None: no eval set."""
        if self.val_set is None:
            return None
        dataset, limit = self.val_set, self.config.eval_samples
        if limit:
            dataset = Subset(dataset, range(min(limit, len(dataset))))
        return evaluation.mean_loss(
            self.module, dataset, self.env, batch_size=max(self.micro_batch, 16), batch_loss=self.batch_loss,
            collate_fn=self.collate_fn, autocast=self._autocast, sharded=self.engine.sharded, group=self._group_across()
        )  # fmt: skip

    def _export_final_model(self) -> None:
        """`model.pt`: a plain state_dict of the bare model (no `module.` prefix), written by rank 0
        (every rank takes part in gathering it for sharded engines)."""
        model_state = self.engine.state_dict()
        step_check.refuse_nonfinite_export(model_state, self.step, self.env)  # same error on every rank
        if not self.is_master:
            return
        files.atomic_torch_save(self.run_dir / "model.pt", model_state)
        logger.info("saved %s", self.run_dir / "model.pt")


def _every(step: int, interval: int) -> bool:
    return interval > 0 and step % interval == 0
