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

Streaming DiLoCo (`--fragments F --mix a`): the model is cut into F fragments, and a sync is one
fragment's, on the restart path's schedule (fragment (k - 1) mod F after inner step k H/F), with
its own quorum: the same steps as above, for that fragment's pseudo-gradient, weighted by the
samples each replica trained since that fragment's last sync, and its outer step, after which
the replica keeps `mix` of its local progress on that fragment. A joiner heals from a peer and
then starts from the last-synced weights of every fragment (a peer's unsynced progress is the
peer's: counted again in the joiner's pseudo-gradients, it would weigh twice). After the last
step every fragment syncs once more, in order, and takes the global weights whole (no mix), so
the replicas end equal and `model.pt` is the same whoever writes it. `--sync-delay` stays 0
here: a sync's quorum decides who is present and who heals, so it cannot run behind the inner
steps; the restart path overlaps it (`nanoddp.parallel.lowcomm.fragments`).

Every sync writes `{"event": "sync", "step", "fragment", "world_size", "replicas", "samples",
"healed_from", "nonfinite_steps"}` (per rank of the quorum: replica, samples trained since the
fragment's last sync, the replica a joiner healed from or -1, its inner steps with a NaN or inf
loss since the last sync): the membership schedule a replay follows, and where a replica skipped
updates alone.
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
from nanoddp.parallel.lowcomm.fragments import fragment_finishing
from nanoddp.parallel.lowcomm.periodic import PeriodicSync
from nanoddp.parallel.lowcomm.pseudo_grad_mean import sum_in_rank_order

logger = logging.getLogger(__name__)
# The slots each rank fills after the contribution: replica, samples, healed from, and the inner
# steps whose loss was NaN or inf (their updates skipped under --on-nan skip) since the last sync.
FACTS_PER_RANK = 4


class FaultTolerantRounds(FaultTolerant):
    """`FaultTolerant` with a quorum per sync, every `wrapper.sync_every` inner steps or, with
    DiLoCo's fragments, one fragment's every `sync_every / fragments` (module doc).

    The loop: `for step in rounds.steps(n)`: train this replica's piece (`batch_for(step)`), the
    inner step (`wrapper.step()`, held: no sync of its own), then `end_step(loss, samples,
    n)`, which syncs when one is due."""

    def __init__(self, model: torch.nn.Module, wrapper: PeriodicSync, **kwargs: Any) -> None:
        take, put = kwargs.pop("extra_state", None) or (lambda: None, lambda state: None)
        # A joiner learns which replica it healed from (the sync record names it, for a replay)
        # and which fragment its peers are syncing (in the final syncs it goes on from there).
        kwargs["extra_state"] = (self._take_extra(take), self._put_extra(put))
        super().__init__(model, wrapper, **kwargs)
        self.wrapper = wrapper
        if wrapper.sync_delay:
            raise ValueError(
                f"FaultTolerantRounds syncs a fragment where its quorum is taken, so it cannot run behind the "
                f"inner steps: build the wrapper with sync_delay=0, got {wrapper.sync_delay}"
            )
        self.fragments = wrapper.fragment_count()
        self.samples = [0] * self.fragments  # per fragment: trained since its last committed sync
        self.nonfinite_steps = 0  # inner steps since the last committed sync whose loss was NaN or inf
        self._healed_from = -1
        self._residuals: dict[int, torch.Tensor] = {}  # int8's error feedback, per fragment (`_compressed_mean`)
        self._syncing: int | None = None  # the fragment whose sync is under way (a joiner's heal tells it)
        self._total_steps = 0
        self._sync_s: float | None = None

    def _take_extra(self, take: Callable[[], Any]) -> Callable[[], Any]:
        return lambda: {"source": self.env.replica, "fragment": self._syncing, "extra": take()}

    def _put_extra(self, put: Callable[[Any], None]) -> Callable[[Any], None]:
        def put_and_note(state: Any) -> None:
            # what this process trained since the last sync was from a state it no longer holds
            self._healed_from, self._residuals = int(state["source"]), {}
            self.samples = [0] * self.fragments
            self._syncing = state["fragment"]
            put(state["extra"])
            self.wrapper.forget_local_progress()  # its pseudo-gradients count its own steps alone

        return put_and_note

    @property
    def step(self) -> int:
        """Inner steps done (a joiner's: its source's, once healed)."""
        return len(self.history)

    def _steps_done(self) -> int:
        return self.step  # the Manager counts syncs

    def steps(self, total_steps: int) -> Iterator[int]:
        """The first quorum (a joiner heals there, at its peers' next sync), then inner steps
        until `total_steps`, with a sync when one is due and every fragment's after the last."""
        self._total_steps = total_steps
        self._sync(None)
        if self.step >= total_steps and self._syncing is not None:  # a joiner in the final syncs
            self._final_syncs(self._syncing + 1)
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
        self.samples = [done + samples for done in self.samples]
        self.nonfinite_steps += not math.isfinite(loss)
        self._loss = loss
        if self.step >= total_steps:
            self._final_syncs(0)
        else:
            fragment = fragment_finishing(self.step, self.wrapper.sync_every, self.fragments)
            if fragment is not None:
                self._sync(fragment)
        self._comm_s = self._sync_s
        self.last_record = self._step_record(self.step - 1, world_size)
        if self.is_master:
            self.metrics.write(self.last_record)

    def _final_syncs(self, first: int) -> None:
        """After the last step: every fragment from `first` on syncs and takes the global weights."""
        for fragment in range(first, self.fragments):
            self._sync(fragment)

    def _sync(self, fragment: int | None) -> None:
        """Quorum, weighted mean, commit, boundary: again among the survivors until all succeed.
        `fragment` None: the first quorum (a joiner learns there which fragment its peers sync).
        After the last step it is one of the final syncs (module doc)."""
        started = time.monotonic()
        self._syncing = fragment
        while True:
            self._quorum()
            fragment = self._syncing  # a joiner's: its source's
            final = self.step >= self._total_steps
            residual = self._residuals.get(fragment)  # type: ignore[arg-type]
            residual = None if residual is None else residual.clone()
            mean = None if fragment is None else self._average(fragment)
            committed = self.manager.should_commit()  # False on every member if any failed
            if mean is False or not committed:
                if residual is not None:
                    self._residuals[fragment] = residual  # type: ignore[index]  # the retry sends from the same state
                continue  # a lost member: the next quorum is among the survivors
            if isinstance(mean, tuple):
                self._commit(fragment, *mean, final=final)  # type: ignore[arg-type]
                self.samples[fragment] = 0  # type: ignore[index]
            self.nonfinite_steps, self._healed_from, self._same_failure = 0, -1, ((), 0)
            # [Note: the Manager's step] torchft heals a member whose step is below the quorum's
            # highest: make it the inner steps synced (+1: 0 is a fresh run, which torchft heals
            # from replica rank 0), so a member that missed a commit its peers made is behind at
            # their next sync and heals there, rather than joining it from an older round.
            self.manager.load_state_dict({"step": self.step + 1, "batches_committed": self.step})
            work = not final or fragment in (None, self.fragments - 1)  # the final syncs': after them all
            if self._run_boundary(self.step, work):
                break
        self._sync_s = (self._sync_s or 0.0) + time.monotonic() - started

    @torch.no_grad()
    def _average(self, fragment: int) -> tuple[torch.Tensor | None, torch.Tensor] | bool:
        """The replicas' sample-weighted mean contribution to `fragment` (None when no one trained
        since its last sync) and every rank's facts; False when the sync failed (a member was lost)."""
        error = self.manager.errored()
        if error is not None:  # the quorum or the heal failed
            self._count_failure(f"the sync at step {self.step}", first_line(error.original_exception))
            return False
        rank, world_size = self.rank, self.world_size
        compress = getattr(self.wrapper, "compress", "fp32")
        samples = self.samples[fragment]
        try:
            contribution = self.wrapper.sync_contribution(fragment)
            numel = 0 if compress != "fp32" else contribution.numel()  # fp32: the facts ride along
            flat = torch.zeros(numel + FACTS_PER_RANK * world_size, dtype=contribution.dtype)
            if numel:
                torch.mul(contribution, float(samples), out=flat[:numel])
            at = numel + FACTS_PER_RANK * rank
            mine = [self.env.replica, samples, self._healed_from, self.nonfinite_steps]
            flat[at : at + FACTS_PER_RANK] = torch.tensor(mine)
            all_reduce_in_rank_order(flat, self.group)
            facts = flat[numel:].view(world_size, FACTS_PER_RANK)
            total = float(facts[:, 1].sum())  # whole numbers: exact in any order
            if total == 0:
                return None, facts
            if numel:
                return flat[:numel].div_(total), facts
            return self._compressed_mean(fragment, contribution, float(samples) / total, compress), facts
        except Exception as exc:  # a lost peer: gloo's error or timeout
            self._fail(exc, f"the sync at step {self.step}")
            return False

    def _compressed_mean(self, fragment: int, contribution: torch.Tensor, share: float, compress: str) -> torch.Tensor:
        """`--pseudo-grad-dtype bf16|fp16|int8`: each replica sends its contribution times its share
        of the samples (the shares sum to 1, so the sum is the mean, and a narrow wire format
        holds it as it holds `start_mean`'s divided values), summed in rank order. int8's error
        feedback is this process's own, per fragment (`_residuals`): zeros at its start and after
        a heal (what rounding lost belonged to a trajectory it left), put back when a sync fails."""
        residual = None
        if compress == "int8":
            residual = self._residuals.setdefault(fragment, torch.zeros_like(contribution))
        return sum_in_rank_order(contribution.mul_(share), compress, self.group, residual)

    def _commit(self, fragment: int, mean: torch.Tensor | None, facts: torch.Tensor, final: bool) -> None:
        if mean is not None or final:
            # after the last step every replica takes the global weights whole: no local share kept
            self.wrapper.take_mean(mean, fragment, keep_local=not final)
        if self.is_master:
            replicas, samples, sources, nonfinite = (facts[:, i].long().tolist() for i in range(FACTS_PER_RANK))
            record = {"event": "sync", "step": self.step, "fragment": fragment, "world_size": self.world_size,
                      "replicas": replicas, "samples": samples, "healed_from": sources,
                      "nonfinite_steps": nonfinite}  # fmt: skip
            self.metrics.write(record)
            logger.info(
                "sync at step %d%s: %d samples from replicas %s",
                self.step, f" (fragment {fragment})" if self.fragments > 1 else "", sum(samples), replicas,
            )  # fmt: skip
