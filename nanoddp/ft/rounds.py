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
   narrow format (`_mean`), summed in rank order all the same.
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

import concurrent.futures
import dataclasses
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
from nanoddp.parallel.lowcomm.fragments import fragment_finishing, fragment_starting
from nanoddp.parallel.lowcomm.periodic import PeriodicSync
from nanoddp.parallel.lowcomm.pseudo_grad_mean import sum_in_rank_order

logger = logging.getLogger(__name__)
# The slots each rank fills after the contribution: replica, samples, healed from, and the inner
# steps whose loss was NaN or inf (their updates skipped under --on-nan skip) since the last sync.
FACTS_PER_RANK = 4


@dataclasses.dataclass
class Taken:
    """What a replica brings to one fragment's sync, taken once and sent again by every retry."""

    contribution: torch.Tensor  # (N,) fp32: `PeriodicSync.sync_contribution(fragment)`
    samples: int  # trained since the fragment's last sync
    nonfinite_steps: int  # inner steps with a NaN or inf loss since the last sync


@dataclasses.dataclass
class InFlight:
    """A fragment's sum running behind the inner steps (`--sync-delay`), started at its quorum."""

    fragment: int
    taken: Taken
    facts: torch.Tensor | None  # (world size, FACTS_PER_RANK): the start's, recorded there
    future: concurrent.futures.Future | None  # the mean (None: nobody trained) or the error; None: failed
    residual: torch.Tensor | None  # int8's error feedback before the sum: put back if it fails


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
        self.fragments, self.delay = wrapper.fragment_count(), wrapper.sync_delay
        self.samples = [0] * self.fragments  # per fragment: trained since its last committed sync
        self.nonfinite_steps = 0  # inner steps since the last committed sync whose loss was NaN or inf
        self._healed_from = -1
        self._residuals: dict[int, torch.Tensor] = {}  # int8's error feedback, per fragment (`_mean`)
        self._syncing: int | None = None  # the fragment whose sync is under way (a joiner's heal tells it)
        self._in_flight: InFlight | None = None
        self._taken: Taken | None = None  # what the sync under way sends, every try alike
        # one worker: a fragment's sum behind the inner steps (at most one is in flight)
        self._behind = concurrent.futures.ThreadPoolExecutor(1, "nanoddp-fragment-sum") if self.delay else None
        self._total_steps = 0
        self._finals_done = 0  # the fragments whose final sync (after the last step) committed
        self._heals = 0  # times this process took a peer's state
        self._sync_s: float | None = None

    def _take_extra(self, take: Callable[[], Any]) -> Callable[[], Any]:
        return lambda: {"source": self.env.replica, "fragment": self._syncing, "extra": take()}

    def _put_extra(self, put: Callable[[Any], None]) -> Callable[[Any], None]:
        def put_and_note(state: Any) -> None:
            # what this process trained since the last sync was from a state it no longer holds
            self._healed_from, self._residuals = int(state["source"]), {}
            self.samples, self._taken = [0] * self.fragments, None
            self._syncing, self._heals = state["fragment"], self._heals + 1
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
        if self.step >= total_steps:  # a joiner in the final syncs goes on with them
            self._final_syncs()
        while self.step < total_steps:
            step, heals = self.step, self._heals
            self._step_started, self._bytes_at_start, self._sync_s = time.monotonic(), sent_bytes(), None
            yield step
            # [Note: a straggler] A replica that came to a sync's quorum later than the join
            # timeout was left out of it; its peers went on, and at their next quorum it is behind
            # and heals from one of them: its step jumps to theirs (its round's samples are lost).
            if self.step != step + 1 and self._heals == heals:
                raise RuntimeError("call rounds.end_step() once in every iteration of rounds.steps()")

    def end_step(self, loss: float, samples: int, total_steps: int) -> None:
        """This replica's inner step is done: count it; sync if one is due; write its record."""
        world_size = self.world_size
        self.history.append(world_size)
        self.samples = [done + samples for done in self.samples]
        self.nonfinite_steps += not math.isfinite(loss)
        self._loss = loss
        if self.step < total_steps:
            finishing = fragment_finishing(self.step, self.wrapper.sync_every, self.fragments)
            if finishing is not None:  # with a delay: the sum started `delay` steps ago lands
                in_flight, self._in_flight = self._in_flight, None
                self._sync(finishing, in_flight)
            elif self._starts_here():  # never at a finish: a delay is below a fragment's period
                self._sync(fragment_starting(self.step, self.wrapper.sync_every, self.fragments, self.delay))
        if self.step >= total_steps:  # the last step (or a straggler healed into the final syncs)
            self._final_syncs()
        self._comm_s = self._sync_s
        self.last_record = self._step_record(self.step - 1, world_size)
        if self.is_master:
            self.metrics.write(self.last_record)

    def _final_syncs(self) -> None:
        """After the last step: every fragment not synced yet syncs and takes the global weights
        (a joiner or a straggler healed into them goes on from its peers' fragment). A sum still
        in flight is waited for and dropped: the final syncs send every fragment's progress afresh."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            self._landed(in_flight)
            self._put_back(in_flight.fragment, in_flight.residual)  # its rounding was never sent
            self.manager.should_commit()  # every member votes on it alike: the Manager's calls stay paired
        while self._finals_done < self.fragments:
            self._sync(self._finals_done)

    def _starts_here(self) -> bool:
        """Whether this step's sync is a start: a quorum and a sum left to run behind the inner steps."""
        step = self.step
        if not self.delay or step >= self._total_steps:
            return False
        return fragment_starting(step, self.wrapper.sync_every, self.fragments, self.delay) is not None

    def _sync(self, fragment: int | None, in_flight: InFlight | None = None) -> None:
        """Quorum, weighted mean, commit, boundary: again among the survivors until all succeed.
        `fragment` None: the first quorum (a joiner learns there which fragment its peers sync).
        After the last step it is one of the final syncs (module doc). With `--sync-delay` a
        sync at a start is the quorum and the sum left behind (`_start`), and the sync at the
        finish `in_flight`'s landing, then its commit (or, failed, a retry among the survivors
        of what was taken at the start)."""
        started = time.monotonic()
        self._syncing = fragment
        self._taken = None if in_flight is None else in_flight.taken
        mean: Any  # the mean and facts, (None, facts) when nobody trained, or False: the try failed
        while True:
            if in_flight is not None:  # a finish's first try: the sum started at the start
                residual, landed = in_flight.residual, self._landed(in_flight)
                mean = False if landed is False else (landed, in_flight.facts)
                record, in_flight = False, None  # recorded at the start
            else:
                self._quorum()
                fragment = self._syncing  # a joiner's: its source's
                if fragment is not None and self._starts_here():
                    if not self._run_boundary(self.step, work=False):  # a new group's check failed
                        continue
                    if self._starts_here():  # (a group that held no state resumed elsewhere)
                        self._start(fragment)
                    break
                residual = self._residual_copy(fragment)
                mean, record = None, True
                if fragment is not None:
                    self._taken = self._taken or self._take(fragment)
                    mean = self._average(fragment, self._taken)
            final = self.step >= self._total_steps
            committed = self.manager.should_commit()  # False on every member if any failed
            if mean is False or not committed:
                self._put_back(fragment, residual)  # the retry sends from the same state
                continue  # a lost member: the next quorum is among the survivors
            if isinstance(mean, tuple):
                self._commit(fragment, mean[0], mean[1], final=final, record=record)  # type: ignore[arg-type]
                if final:
                    self._finals_done = fragment + 1  # type: ignore[operator]
                self.samples[fragment] = 0  # type: ignore[index]
                assert self._taken is not None
                self.nonfinite_steps -= self._taken.nonfinite_steps  # those after the take: the next sync's
            self._healed_from, self._taken, self._same_failure = -1, None, ((), 0)
            # [Note: the Manager's step] torchft heals a member whose step is below the quorum's
            # highest: make it the inner steps synced (+1: 0 is a fresh run, which torchft heals
            # from replica rank 0), so a member that missed a commit its peers made is behind at
            # their next sync and heals there, rather than joining it from an older round.
            self.manager.load_state_dict({"step": self.step + 1, "batches_committed": self.step})
            work = not final or fragment in (None, self.fragments - 1)  # the final syncs': after them all
            if self._run_boundary(self.step, work):
                break
        self._sync_s = (self._sync_s or 0.0) + time.monotonic() - started

    def _take(self, fragment: int) -> Taken:
        return Taken(self.wrapper.sync_contribution(fragment), self.samples[fragment], self.nonfinite_steps)

    @torch.no_grad()
    def _average(self, fragment: int, taken: Taken) -> tuple[torch.Tensor | None, torch.Tensor] | bool:
        """The replicas' sample-weighted mean of what they took for `fragment` (None when no one
        trained since its last sync) and every rank's facts; False when the sync failed (a member
        was lost)."""
        if not self._quorum_ok():
            return False
        compress = getattr(self.wrapper, "compress", "fp32")
        try:
            with self.world.guarded():  # on nccl: aborted past the timeout (`ReplicaGroup`'s note)
                if compress == "fp32":  # the facts ride along with the contribution
                    numel = taken.contribution.numel()
                    flat = self._facts_in(taken, numel)
                    torch.mul(taken.contribution, float(taken.samples), out=flat[:numel])
                    all_reduce_in_rank_order(flat, self.group)
                    facts, total = self._facts_of(flat[numel:])
                    return (None if total == 0 else flat[:numel].div_(total)), facts
                facts, total = self._exchange_facts(taken)
                return self._mean(fragment, taken, total, self.group), facts
        except Exception as exc:  # a lost peer: gloo's error or timeout
            self._fail(exc, f"the sync at step {self.step}")
            return False

    def _start(self, fragment: int) -> None:
        """A start (`--sync-delay`), after its quorum: the facts (blocking: the samples' total,
        recorded now), then the mean left to run behind the inner steps until the finish. A start
        that fails is in flight all the same, as a failed one: every member steps on to the
        finish in the start's group (the same split of the data), and there all vote, so the
        retry is every survivor's (`_sync`), never some members' at the start and others' at the
        finish."""
        taken, residual = self._take(fragment), self._residual_copy(fragment)
        self._in_flight = InFlight(fragment, taken, None, None, residual)  # failed, unless it starts
        if not self._quorum_ok():
            return
        try:
            with self.world.guarded():
                facts, total = self._exchange_facts(taken)
        except Exception as exc:  # a lost peer
            self._fail(exc, f"the start of the sync at step {self.step}")
            return
        self._record(fragment, facts)
        self._healed_from = -1  # recorded: a retry at the finish heals nobody again
        assert self._behind is not None
        future = self._behind.submit(self._mean_guarded, fragment, taken, total, self.group)
        self._in_flight = InFlight(fragment, taken, facts, future, residual)

    def _landed(self, in_flight: InFlight) -> torch.Tensor | None | bool:
        """The in-flight sum's mean once it lands; False if it failed (a member was lost), or
        never started (the failure was counted at the start)."""
        if in_flight.future is None:
            return False
        try:
            return in_flight.future.result()
        except Exception as exc:
            self._fail(exc, f"the sync at step {self.step}")
            return False

    def _residual_copy(self, fragment: int | None) -> torch.Tensor | None:
        """int8's error feedback for `fragment` before a try (None: none yet)."""
        residual = self._residuals.get(fragment)  # type: ignore[arg-type]
        return None if residual is None else residual.clone()

    def _put_back(self, fragment: int | None, residual: torch.Tensor | None) -> None:
        """A try that was never applied: its error feedback as it was before (none: none again)."""
        if residual is None:
            self._residuals.pop(fragment, None)  # type: ignore[arg-type]
        else:
            self._residuals[fragment] = residual  # type: ignore[index]

    def _quorum_ok(self) -> bool:
        error = self.manager.errored()
        if error is not None:  # the quorum or the heal failed
            self._count_failure(f"the sync at step {self.step}", first_line(error.original_exception))
        return error is None

    def _facts_in(self, taken: Taken, numel: int) -> torch.Tensor:
        """A flat buffer of `numel` zeros, then every rank's facts: this rank's filled in."""
        world_size = self.world_size
        flat = torch.zeros(numel + FACTS_PER_RANK * world_size, device=taken.contribution.device)
        at = numel + FACTS_PER_RANK * self.rank
        mine = [self.env.replica, taken.samples, self._healed_from, taken.nonfinite_steps]
        flat[at : at + FACTS_PER_RANK] = torch.tensor(mine, dtype=flat.dtype, device=flat.device)
        return flat

    def _facts_of(self, flat: torch.Tensor) -> tuple[torch.Tensor, float]:
        facts = flat.view(self.world_size, FACTS_PER_RANK)
        return facts, float(facts[:, 1].sum())  # whole numbers: exact in any order

    def _exchange_facts(self, taken: Taken) -> tuple[torch.Tensor, float]:
        """Every rank's facts and the samples' total, by a small sum of their own (collective)."""
        flat = self._facts_in(taken, 0)
        all_reduce_in_rank_order(flat, self.group)
        return self._facts_of(flat)

    def _mean_guarded(self, fragment: int, taken: Taken, total: float, group: Any) -> torch.Tensor | None:
        """`_mean` behind the inner steps, aborted on nccl past the timeout as a blocking sync is."""
        with self.world.guarded():
            return self._mean(fragment, taken, total, group)

    @torch.no_grad()
    def _mean(self, fragment: int, taken: Taken, total: float, group: Any) -> torch.Tensor | None:
        """The mean of the members' contributions over `group`, weighted by their samples out of
        `total` (None when it is 0), sent in the wrapper's wire format (collective; runs behind
        the inner steps at a start). fp32: each contribution times its samples, summed in rank
        order, divided by the total. bf16|fp16|int8: each replica sends its contribution times
        its share of the samples (the shares sum to 1, so the sum is the mean, and a narrow wire
        format holds it as it holds `start_mean`'s divided values), summed in rank order. int8's
        error feedback is this process's own, per fragment (`_residuals`): zeros at its start and
        after a heal (what rounding lost belonged to a trajectory it left), put back when a sync
        fails."""
        if total == 0:
            return None
        compress = getattr(self.wrapper, "compress", "fp32")
        if compress == "fp32":
            flat = taken.contribution * float(taken.samples)
            all_reduce_in_rank_order(flat, group)
            return flat.div_(total)
        residual = None
        if compress == "int8":
            residual = self._residuals.setdefault(fragment, torch.zeros_like(taken.contribution))
        return sum_in_rank_order(taken.contribution * (float(taken.samples) / total), compress, group, residual)

    def _commit(self, fragment: int, mean: torch.Tensor | None, facts: torch.Tensor, final: bool, record: bool) -> None:
        if mean is not None or final:
            # after the last step every replica takes the global weights whole: no local share kept
            self.wrapper.take_mean(mean, fragment, keep_local=not final)
        if record:
            self._record(fragment, facts)
        if self.is_master:
            logger.info(
                "sync at step %d%s: %d samples from replicas %s",
                self.step, f" (fragment {fragment})" if self.fragments > 1 else "", int(facts[:, 1].sum()),
                facts[:, 0].long().tolist(),
            )  # fmt: skip

    def _record(self, fragment: int, facts: torch.Tensor) -> None:
        """The sync record (module doc), from the group's rank 0."""
        if self.is_master:
            replicas, samples, sources, nonfinite = (facts[:, i].long().tolist() for i in range(FACTS_PER_RANK))
            record = {"event": "sync", "step": self.step, "fragment": fragment, "world_size": self.world_size,
                      "replicas": replicas, "samples": samples, "healed_from": sources,
                      "nonfinite_steps": nonfinite}  # fmt: skip
            self.metrics.write(record)

    def close(self) -> None:
        if self._behind is not None:
            self._behind.shutdown(wait=False, cancel_futures=True)
        super().close()
