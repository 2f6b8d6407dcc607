"""`FaultTolerantRounds`: the fault-tolerant loop of the low-communication engines (LocalSGD, DiLoCo).

Why not `FaultTolerant`'s step: it takes a quorum and sums gradients every step, a round trip to
the quorum service and a collective per step, which is what low-communication training avoids.
Here the unit of agreement is the round (torchft's LocalSGD and DiLoCo with a Manager do the same):

1. Between syncs each replica steps alone (no quorum, no collective): inner step s trains this
   replica's piece of step s's global batch (`GlobalBatches`), split over the replicas of the
   round's quorum, and counts the samples it trained since the last sync.
2. At a sync (every `sync_every` steps, and after the last) one quorum: the replicas present.
   A replica lost since the last quorum is left out (its unsynced samples are lost); a joiner
   (a replacement) receives from a peer the last-synced weights, the outer optimizer's state and
   its inner state (the inner optimizer, the step count), and brings no samples this time.
3. Each replica's contribution (`PeriodicSync.sync_contribution`: LocalSGD's weights, DiLoCo's
   pseudo-gradient), times its sample count, is summed in rank order over the quorum's group
   (`all_reduce_in_rank_order`, as `ft.gradients` sums: the same bits whatever the world size) and
   divided by the samples summed: the mean over the samples the replicas present trained. With
   `--pseudo-grad-dtype bf16|fp16|int8` (DiLoCo) the sample counts go first, in a small sum of
   their own, and each replica sends its contribution times its share of the samples in the
   narrow format (`_compressed_mean`), summed in rank order all the same.
4. The mean is applied (`take_mean`: LocalSGD's weights, DiLoCo's outer step) only once the
   Manager says the sync commits. A sync that fails (a member lost during it) changes nothing:
   the contributions are taken again from the same pre-sync state, after a new quorum among the
   survivors. Then the boundary work (snapshot, evaluation) of `FaultTolerant`.

Every sync writes `{"event": "sync", "step", "world_size", "replicas", "samples", "healed_from",
"nonfinite_steps"}` (per rank of the quorum: replica, samples trained since the last sync, the
replica a joiner healed from or -1, its inner steps with a NaN or inf loss since the last sync):
the membership schedule a replay follows, and where a replica skipped updates alone.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nanoddp.comm.api.rank_order import all_reduce_in_rank_order
from nanoddp.comm.transport.transport import sent_bytes
from nanoddp.ft.fault_tolerant import FaultTolerant
from nanoddp.ft.stopped import first_line
from nanoddp.parallel.lowcomm.periodic import PeriodicSync
from nanoddp.parallel.lowcomm.pseudo_grad_mean import sum_in_rank_order

logger = logging.getLogger(__name__)
# The slots each rank fills after the contribution: replica, samples, healed from, and the inner
# steps whose loss was NaN or inf (their updates skipped under --on-nan skip) since the last sync.
FACTS_PER_RANK = 4


class FaultTolerantRounds(FaultTolerant):
    """`FaultTolerant` with a quorum per round of `wrapper.sync_every` inner steps (module doc).

    The loop: `for step in rounds.steps(n)`: train this replica's piece (`batch_for(step)`), the
    inner step (`wrapper.step()`, held: no sync of its own), then `end_step(loss, samples,
    n)`, which syncs when one is due."""

    def __init__(self, model: torch.nn.Module, wrapper: PeriodicSync, **kwargs: Any) -> None:
        take, put = kwargs.pop("extra_state", None) or (lambda: None, lambda state: None)
        # A joiner learns which replica it healed from: the sync record names it, for a replay.
        kwargs["extra_state"] = (lambda: {"source": self.env.replica, "extra": take()}, self._put_extra(put))
        super().__init__(model, wrapper, **kwargs)
        self.wrapper = wrapper
        self.samples = 0  # trained since the last committed sync
        self.nonfinite_steps = 0  # inner steps since the last committed sync whose loss was NaN or inf
        self._healed_from = -1
        self._residual: torch.Tensor | None = None  # int8's error feedback (`_compressed_mean`)
        self._sync_s: float | None = None

    def _put_extra(self, put: Callable[[Any], None]) -> Callable[[Any], None]:
        def put_and_note(state: Any) -> None:
            # what this process trained since the last sync was from a state it no longer holds
            self._healed_from, self.samples, self._residual = int(state["source"]), 0, None
            put(state["extra"])

        return put_and_note

    @property
    def step(self) -> int:
        """Inner steps done (a joiner's: its source's, once healed)."""
        return len(self.history)

    def _steps_done(self) -> int:
        return self.step  # the Manager counts syncs

    def steps(self, total_steps: int) -> Iterator[int]:
        """The first quorum (a joiner heals there, at its peers' next sync), then inner steps
        until `total_steps`, with a sync every `sync_every` of them and after the last."""
        self._sync()
        while self.step < total_steps:
            step = self.step
            self._step_started, self._bytes_at_start, self._sync_s = time.monotonic(), sent_bytes(), None
            yield step
            if self.step != step + 1:
                raise RuntimeError("call rounds.end_step() once in every iteration of rounds.steps()")

    def end_step(self, loss: float, samples: int, total_steps: int) -> None:
        """This replica's inner step is done: count it; sync if one is due; write its record."""
        world_size = self.world_size
        self.history.append(world_size)
        self.samples += samples
        self.nonfinite_steps += not math.isfinite(loss)
        self._loss = loss
        if self.step % self.wrapper.sync_every == 0 or self.step >= total_steps:
            self._sync()
        self._comm_s = self._sync_s
        self.last_record = self._step_record(self.step - 1, world_size)
        if self.is_master:
            self.metrics.write(self.last_record)

    def _sync(self) -> None:
        """Quorum, weighted mean, commit, boundary: again among the survivors until all succeed."""
        started = time.monotonic()
        while True:
            self._quorum()
            residual = None if self._residual is None else self._residual.clone()
            mean = self._average() if self.step > 0 else None  # step 0: nothing trained yet
            committed = self.manager.should_commit()  # False on every member if any failed
            if mean is False or not committed:
                self._residual = residual  # the retry sends from the same pre-sync state
                continue  # a lost member: the next quorum is among the survivors
            if isinstance(mean, tuple):
                self._commit(*mean)
            self.samples, self.nonfinite_steps, self._healed_from, self._same_failure = 0, 0, -1, ((), 0)
            # [Note: the Manager's step] torchft heals a member whose step is below the quorum's
            # highest: make it the inner steps synced (+1: 0 is a fresh run, which torchft heals
            # from replica rank 0), so a member that missed a commit its peers made is behind at
            # their next sync and heals there, rather than joining it from an older round.
            self.manager.load_state_dict({"step": self.step + 1, "batches_committed": self.step})
            if self._run_boundary(self.step):
                break
        self._sync_s = time.monotonic() - started

    @torch.no_grad()
    def _average(self) -> tuple[torch.Tensor | None, torch.Tensor] | bool:
        """The replicas' sample-weighted mean contribution (None when no one trained since the
        last sync) and every rank's facts; False when the sync failed (a member was lost)."""
        error = self.manager.errored()
        if error is not None:  # the quorum or the heal failed
            self._count_failure(f"the sync at step {self.step}", first_line(error.original_exception))
            return False
        rank, world_size = self.rank, self.world_size
        compress = getattr(self.wrapper, "compress", "fp32")
        try:
            contribution = self.wrapper.sync_contribution()
            numel = 0 if compress != "fp32" else contribution.numel()  # fp32: the facts ride along
            flat = torch.zeros(numel + FACTS_PER_RANK * world_size, dtype=contribution.dtype)
            if numel:
                torch.mul(contribution, float(self.samples), out=flat[:numel])
            at = numel + FACTS_PER_RANK * rank
            mine = [self.env.replica, self.samples, self._healed_from, self.nonfinite_steps]
            flat[at : at + FACTS_PER_RANK] = torch.tensor(mine)
            all_reduce_in_rank_order(flat, self.group)
            facts = flat[numel:].view(world_size, FACTS_PER_RANK)
            total = float(facts[:, 1].sum())  # whole numbers: exact in any order
            if total == 0:
                return None, facts
            if numel:
                return flat[:numel].div_(total), facts
            return self._compressed_mean(contribution, float(self.samples) / total, compress), facts
        except Exception as exc:  # a lost peer: gloo's error or timeout
            self._fail(exc, f"the sync at step {self.step}")
            return False

    def _compressed_mean(self, contribution: torch.Tensor, share: float, compress: str) -> torch.Tensor:
        """`--pseudo-grad-dtype bf16|fp16|int8`: each replica sends its contribution times its share
        of the samples (the shares sum to 1, so the sum is the mean, and a narrow wire format
        holds it as it holds `start_mean`'s divided values), summed in rank order. int8's error
        feedback is this process's own (`_residual`): zeros at its start and after a heal (what
        rounding lost belonged to a trajectory it left), put back when a sync fails."""
        if compress == "int8" and self._residual is None:
            self._residual = torch.zeros_like(contribution)
        return sum_in_rank_order(contribution.mul_(share), compress, self.group, self._residual)

    def _commit(self, mean: torch.Tensor | None, facts: torch.Tensor) -> None:
        if mean is not None:
            self.wrapper.take_mean(mean)
        if self.is_master:
            replicas, samples, sources, nonfinite = (facts[:, i].long().tolist() for i in range(FACTS_PER_RANK))
            record = {"event": "sync", "step": self.step, "world_size": self.world_size, "replicas": replicas,
                      "samples": samples, "healed_from": sources, "nonfinite_steps": nonfinite}  # fmt: skip
            self.metrics.write(record)
            logger.info("sync at step %d: %d samples from replicas %s", self.step, sum(samples), replicas)
