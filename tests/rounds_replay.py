"""The reference for `--on-failure continue --engine localsgd|diloco` (`nanoddp.ft.rounds`): its
membership schedule replayed in one process, one model per replica, without `nanoddp.ft`.

`replay_rounds_run(env, syncs, engine, ...)` follows the run's `sync` records in order (each is
one quorum: the replicas present in group-rank order, the samples each brought, whom a joiner
healed from):

- the `replicas` start together; between records every replica of the last quorum trains its
  piece of each step's global batch, split over that quorum (its rank there), alone: the
  engine's clip, the inner AdamW through the held wrapper, its own schedule;
- a joiner is a new replica loaded with the state of the replica it healed from, as that one
  held it at the quorum, then (DiLoCo) set back to the last-synced weights;
- a sync's fragment (DiLoCo's `fragments`: the wrapper's cut; LocalSGD: the whole model) is
  averaged from each member's contribution (LocalSGD: its weights; DiLoCo: last-sync weights
  minus its weights) times the samples it trained since that fragment's last sync, added in
  rank order and divided by the samples summed; with `compress` other than fp32, each
  contribution times its share of the samples cast to the wire dtype (int8: quantized with the
  replica's own error feedback for that fragment, zeros for a new one), added in rank order in
  fp32. The mean is taken (LocalSGD: the weights; DiLoCo: the outer step on the last-sync
  weights, then weights = global + `mix` (local - global); no mix after the last step);
- with `sync_delay` (tau), a record at a start is the quorum there: the contributions are taken
  then, and the mean is taken tau steps later, after the inner steps between. A record at the
  finish instead is a retry (the sum behind the steps failed): the mean from the start is
  dropped (int8's rounding with it), and the retry's members send what they took at the start
  (a joiner of the retry: nothing, as it brings no samples). A start whose finish would fall at
  or past the last step is dropped too: the final syncs send every fragment afresh.

Returns the final model's state (the same on every replica after the final syncs).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from nanoddp.env import DistEnv
from nanoddp.ft.global_batches import GlobalBatches, share
from nanoddp.parallel.lowcomm.fragments import fragment_finishing, fragment_starting
from nanoddp.parallel.lowcomm.pseudo_grad_mean import WIRE_DTYPES, dequantize_int8, quantize_int8
from nanoddp.train.config import TrainConfig, threads_per_rank
from nanoddp.train.engines import build_engine
from nanoddp.train.recipe import build_job

BATCH = 12  # the tests' global batch (FT_TINY_GPT)


@dataclasses.dataclass
class Pending:
    """A start's mean, to be taken at `apply_step` unless a retry or the final syncs drop it."""

    fragment: int
    apply_step: int
    mean: torch.Tensor | None
    members: list[int]
    taken: dict[int, tuple[torch.Tensor, int]]  # per member: its contribution and samples at the start
    residuals: dict[tuple[int, int], torch.Tensor]  # int8's error feedback before the start's sum


class RoundsReplay:
    """The replicas of one run and the schedule's state (the module doc)."""

    def __init__(self, env: DistEnv, engine: str, config: TrainConfig, replicas: int, compress: str) -> None:
        self.env, self.engine, self.config, self.compress = env, engine, config, compress
        self.members = {r: self._new_replica() for r in range(replicas)}
        wrapper = self.members[0][1]
        self.cut = wrapper.fragments if engine == "diloco" else [range(len(_params(wrapper)))]
        self.train_set = self.members[0][2].train_set
        self.batches = GlobalBatches(len(self.train_set), BATCH, 0)
        self.trained = {r: [0] * len(self.cut) for r in self.members}  # per fragment: samples since its sync
        self.residuals: dict[tuple[int, int], torch.Tensor] = {}  # int8's error feedback, per (replica, fragment)
        self.order, self.at_step = list(range(replicas)), 0
        self.pending: Pending | None = None

    def _new_replica(self):
        job = build_job(self.config)  # identical weights, as every replica's
        built = build_engine(self.engine, job.module, self.env)
        wrapper = built.wrap_optimizer(job.optimizer, self.config)
        built.use_cross_replica()
        return built, wrapper, job

    # -- the inner steps ------------------------------------------------------------------------
    def train_to(self, step_to: int) -> None:
        """Every replica of the last quorum trains the steps up to `step_to`; a start's mean is
        taken after its step, if that comes before `step_to` (at `step_to`: a retry or the final
        syncs decide)."""
        for step in range(self.at_step, step_to):
            for rank, replica in enumerate(self.order):
                self._inner_step(replica, step, rank)
            pending = self.pending
            if pending is not None and pending.apply_step == step + 1 < step_to:
                self._take_mean(pending.fragment, pending.mean, pending.members, final=False)
                self.pending = None
        self.at_step = max(self.at_step, step_to)

    def _inner_step(self, replica: int, step: int, rank: int) -> None:
        built, wrapper, job = self.members[replica]
        piece = self.batches.indices(step)[share(BATCH, rank, len(self.order))]
        wrapper.zero_grad(set_to_none=True)
        batch = torch.utils.data.default_collate([self.train_set[i] for i in piece.tolist()])
        built.model(*batch)[-1].backward()  # GPT returns (logits, loss)
        built.clip_grad_norm_(1.0)
        wrapper.step()
        job.scheduler.step()
        self.trained[replica] = [done + len(piece) for done in self.trained[replica]]

    # -- a quorum ------------------------------------------------------------------------------
    def sync(self, record: dict[str, Any], steps: int, delay: int) -> None:
        """One `sync` record: heal its joiners, average its fragment, take or hold the mean."""
        step, fragment = record["step"], record["fragment"]
        every, count = self.config.sync_every, len(self.cut)
        starts = delay > 0 and step < steps and fragment_starting(step, every, count, delay) == fragment
        retry = delay > 0 and step < steps and fragment_finishing(step, every, count) == fragment
        self.train_to(step)
        dropped, self.pending = self.pending, None  # a retry's or the final syncs' start: its mean never taken
        if dropped is not None:
            self.residuals = dropped.residuals  # as they were before its sum
        counted = dict(zip(record["replicas"], record["samples"], strict=True))
        for replica, source in zip(record["replicas"], record["healed_from"], strict=True):
            if source >= 0:
                self._heal(replica, source)
        taken = {}
        for replica in record["replicas"]:
            if retry and dropped is not None and replica in dropped.taken:
                taken[replica] = dropped.taken[replica]
            else:
                taken[replica] = (self._contribution(replica, fragment), self.trained[replica][fragment])
            assert counted[replica] == taken[replica][1], (record, replica, taken[replica][1])
        residuals = {key: value.clone() for key, value in self.residuals.items()}
        mean = self._mean(record["replicas"], taken, fragment)
        if starts:
            self.pending = Pending(fragment, step + delay, mean, list(record["replicas"]), taken, residuals)
        else:
            self._take_mean(fragment, mean, record["replicas"], final=step >= steps)
        self.order = list(record["replicas"])

    def _heal(self, replica: int, source: int) -> None:
        """A joiner: the source's state as it holds it now (a copy, as the heal's transfer is), its
        error feedback and counts started again, and (DiLoCo) back to the last-synced weights."""
        for fragment in range(len(self.cut)):
            self.residuals.pop((replica, fragment), None)
        self.members[replica] = joiner = self._new_replica()
        built, wrapper, job = self.members[source]
        joiner[0].module.load_state_dict(built.module.state_dict())
        joiner[1].load_state_dict(copy.deepcopy(wrapper.state_dict()))
        joiner[2].scheduler.load_state_dict(job.scheduler.state_dict())
        self.trained[replica] = [0] * len(self.cut)
        if self.engine == "diloco":
            with torch.no_grad():
                for p, synced in zip(_params(joiner[1]), joiner[1].last_sync, strict=True):
                    p.copy_(synced)

    def _contribution(self, replica: int, fragment: int) -> torch.Tensor:
        wrapper = self.members[replica][1]
        params = [p for i, p in enumerate(_params(wrapper)) if i in self.cut[fragment]]
        if self.engine == "localsgd":
            return torch.cat([p.detach().reshape(-1) for p in params])
        synced = [wrapper.last_sync[i] for i in self.cut[fragment]]
        return torch.cat([(s - p.detach()).reshape(-1) for s, p in zip(synced, params, strict=True)])

    def _mean(self, replicas: list[int], taken: dict, fragment: int) -> torch.Tensor | None:
        total = float(sum(samples for _, samples in taken.values()))
        if total == 0:
            return None
        mean = None
        for replica in replicas:
            flat, samples = taken[replica]
            if self.compress == "fp32":
                sent = flat * float(samples)
            else:
                sent = self._sent_compressed(flat * (float(samples) / total), (replica, fragment))
            mean = sent if mean is None else mean + sent
        assert mean is not None
        if self.compress == "fp32":
            return mean / total
        if self.compress != "int8":  # added in fp32, rounded to the wire dtype once (rank_order)
            return mean.to(WIRE_DTYPES[self.compress]).to(torch.float32)
        return mean

    def _sent_compressed(self, x: torch.Tensor, key: tuple[int, int]) -> torch.Tensor:
        """What one replica's `x` (N,) fp32 is once sent as `compress`, back in fp32 (int8: blockwise
        absmax of x plus the replica's residual, which becomes what the rounding lost)."""
        if self.compress != "int8":
            return x.to(WIRE_DTYPES[self.compress]).to(torch.float32)
        x = x + self.residuals.get(key, torch.zeros_like(x))
        q, scales = quantize_int8(x)
        self.residuals[key] = x - dequantize_int8(q, scales)
        return dequantize_int8(q, scales)

    @torch.no_grad()
    def _take_mean(self, fragment: int, mean: torch.Tensor | None, replicas: list[int], final: bool) -> None:
        for replica in replicas:
            self.trained[replica][fragment] = 0
            if mean is None and not final:
                continue
            wrapper = self.members[replica][1]
            params, offset = _params(wrapper), 0
            if self.engine == "localsgd":
                for p in params if mean is not None else ():
                    p.copy_(mean[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
                continue
            if mean is not None:
                for i in self.cut[fragment]:
                    wrapper.last_sync[i].grad = mean[offset : offset + params[i].numel()].view_as(params[i]).clone()
                    offset += params[i].numel()
                wrapper.outer.step()
            kept = 0.0 if final else self.config.mix
            for i in self.cut[fragment]:
                local = params[i].detach().clone()
                params[i].copy_(wrapper.last_sync[i])
                if kept:
                    params[i].lerp_(local, kept)
                wrapper.last_sync[i].grad = None


def _params(wrapper) -> list[torch.Tensor]:
    return [p for g in wrapper.param_groups for p in g["params"]]


def replay_rounds_run(
    env: DistEnv,
    syncs: list[dict],
    engine: str,
    *,
    replicas: int,
    steps: int,
    sync_every: int,
    compress: str = "fp32",
    fragments: int = 1,
    mix: float = 0.0,
    sync_delay: int = 0,
    model: dict | None = None,
) -> dict[str, torch.Tensor]:
    """Run on one gloo rank: the run whose `sync` records are `syncs` (the module doc), for the
    tiny GPT of `FT_TINY_GPT` (`model` overrides its fields, as flags after it do) with the run's
    engine options. Returns the final model's state."""
    streaming = {"fragments": fragments, "mix": mix, "sync_delay": sync_delay} if engine == "diloco" else {}
    tiny = {"text_max_bytes": 1900, "seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64}
    config = TrainConfig(engine=engine, sync_every=sync_every, **{**tiny, **(model or {})}, batch_size=BATCH,
                         warmup_steps=2, seed=0, steps=steps, **streaming)  # fmt: skip
    torch.set_num_threads(threads_per_rank(config, replicas))  # what the replicas ran with: matmuls split by it
    replay = RoundsReplay(env, engine, config, replicas, compress)
    for record in syncs:
        replay.sync(record, steps, sync_delay)
    return replay.members[replay.order[0]][0].module.state_dict()
