"""`FaultTolerant`: the step loop that survives a lost rank, for a user's own training loop.

The life of one step, in the order a loop calls it:

1. `steps(n)` asks the quorum service who is present (torchft's Lighthouse, through its
   Manager). If that changed, the group across the replicas was rebuilt among the present ones
   (`ReplicaGroup`; each replica's default group is its own and never changes),
   one log line and one metrics record say so, and a joiner has received its state from a peer
   (`LiveState`). It then yields the step number; a redone step is yielded again.
2. `batch_for(step)` gives this rank's piece of the step's global batch: the same samples for a
   given step whatever the world size (`GlobalBatches`), split over the ranks present.
3. The loop runs forward and backward on that piece (mean loss over the piece).
4. `average_gradients(loss)` weights each rank's gradient by its share and sums them in rank
   order on every rank, over the group across the replicas (`WeightedPieceSum` on `ft.group`;
   `buffers=` sums an engine's own gradient buffers instead of the parameters' gradients). A
   peer lost meanwhile (dead: its socket closes; hung: the collective times out) makes it
   return None and marks the step failed.
5. `commit()` steps the optimizer (or runs `apply`, the caller's update: a GradScaler's step,
   say) only if the Manager says the step may commit; otherwise the gradients are dropped and
   `steps` redoes the step in the next quorum. No update is ever half-applied: a replica either
   applies the whole step or, if its peers moved on without it, receives their state at the next
   quorum.

`boundary(step)`, if given, is work the whole group does together at a step boundary (a
snapshot, an evaluation): it runs on every member right after each quorum, with `step` the
number of steps committed so far, and once more after the last step. The group is then the
one that will run the next step, every member at the same step (a joiner has received its
state), so a collective over it (`group=ft.group`) is safe; a failure inside is handled like a
failed step (the group is rebuilt and the boundary runs again), so it must be work that may be
redone.

The run never starts over. A group whose members all started empty (every replica that held the
committed state was lost: both of two at once, or the source while its joiner healed) resumes
from the newest snapshot (`restore`; the records past it are dropped), with a WARNING line and a
`resumed_from_snapshot` record, or stops (`RunStopped`) when there is none; so does a step or
boundary that fails the same way try after try. The supervisor replaces no replica that
stopped so (`nanoddp.ft.stopped`).

    ft = FaultTolerant(model, optimizer, dataset_len=len(data), batch_size=48)
    for step in ft.steps(1000):
        x, y = data[ft.batch_for(step)]
        loss = loss_fn(model(x), y)
        loss.backward()
        ft.average_gradients(loss)
        ft.commit()
    ft.close()
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nanoddp.base.records import RecordWriter
from nanoddp.comm.transport.transport import sent_bytes
from nanoddp.env import bound_store
from nanoddp.ft.events import describe, membership_events
from nanoddp.ft.global_batches import GlobalBatches, piece_weight, share
from nanoddp.ft.gradients import WeightedPieceSum, grad_buffers
from nanoddp.ft.live_state import LiveState
from nanoddp.ft.manager import STARTUP_WAIT_S, make_manager, torchft_modules
from nanoddp.ft.replica_env import ReplicaEnv
from nanoddp.ft.replica_group import ReplicaGroup, own_world
from nanoddp.ft.replica_members import group_store
from nanoddp.ft.stopped import RunStopped, failure_text, first_line

logger = logging.getLogger(__name__)

Restore = Callable[[], tuple[int, list[int]] | None]  # the newest snapshot loaded: its (step, history)
BOUNDARY_TRIES = 3  # boundary work that fails this many times in a row is an error, not a lost peer
SAME_FAILURE_TRIES = 3  # a step that fails this many times in a row the same way, in the same group


class FaultTolerant:
    """A fault-tolerant data-parallel step loop over `model` and `optimizer` (see the module
    docstring). `extra_state` is an optional (take, put) pair of the loop's own state that a
    joiner must receive too (a scheduler's, say); `tokens_per_sample`, if the data has tokens,
    gives the step records their `tokens_per_s`; `restore` loads the newest snapshot (returning
    its step and history, or None when there is none), for a group in which nobody holds the
    state any more; rank 0 then drops the records past that step from `metrics.jsonl`, as a
    resumed run does, so each redone step is recorded once, and writes `resumed_from_snapshot`."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        dataset_len: int,
        batch_size: int,
        seed: int = 0,
        env: ReplicaEnv | None = None,
        extra_state: tuple[Callable[[], Any], Callable[[Any], None]] | None = None,
        tokens_per_sample: int | None = None,
        boundary: Callable[[int], None] | None = None,
        restore: Restore | None = None,
    ) -> None:
        self.tokens_per_sample = tokens_per_sample  # for `tokens_per_s` in the step records
        self.env = env or ReplicaEnv.from_environ()
        self.model, self.optimizer = model, optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._sum_pieces = WeightedPieceSum()
        self.batches = GlobalBatches(dataset_len, batch_size, seed)
        self.history: list[int] = []  # world size of each committed step: the run's schedule
        own_world(self.env)  # the replica's default group, if none yet
        self.device = self.env.device  # a GPU of its own under nccl, or the CPU (`replica_group`'s note)
        self.world = ReplicaGroup(self.env.timeout_s, self.env.backend)
        # torchft keeps a replica group's own address book in a store, on the address the run gave
        # this replica (the quorum hands it to the others: `ReplicaEnv.address`): a group of one's
        # own, or the one its G members share (`replica_members`).
        if self.env.group_size == 1:
            self._store = bound_store(self.env.address, 0, rank=0, world_size=1)
        else:
            self._store = group_store(self.env)
        self.metrics = RecordWriter(self.env.out)
        state = LiveState(model, optimizer, self.history, extra_state)
        state.holds_state = not self.env.joiner  # a first process built or resumed it; a joiner has nothing yet
        state.before_send = self._note_membership  # a heal's source may be lost while it sends
        self._live, self._restore = state, restore
        # A joiner's state travels over the group across the replicas (`ReplicaGroup.send/recv`); at
        # step 0 every replica takes replica rank 0's weights (init_sync).
        self.manager = make_manager(torchft_modules(), self.env, self.world, (state.take, state.put), self._store.port,
                                    init_sync=True, use_async_quorum=False, device=self.device)  # fmt: skip
        self._members: tuple[str, ...] = ()  # the group this process last stepped in (its processes)
        self._noted = 0  # the generation of the group whose change was last noted
        self._started = self.env.joiner  # a joiner never waits for the run's first full group
        self._step_started = 0.0
        self._bytes_at_start = 0
        self._loss: float | None = None
        self._comm_s: float | None = None  # the last average's wall time
        self._committed: bool | None = None
        self.last_record: dict[str, Any] = {}  # the last committed step's metrics record
        self._beat_path = self.env.beat_path()
        self._boundary = boundary
        self._boundary_failures = 0  # in a row
        self._holders_checked = -1  # the group generation whose members were asked who holds the state
        self._same_failure: tuple[tuple[Any, ...], int] = ((), 0)  # the last failure, and how often in a row
        # A replica group's vote is counted once all its members voted; one may be a collective timeout
        # behind (its sum with a hung peer timing out while a sibling's completed): wait for it.
        self._vote_wait = timedelta(seconds=2 * self.env.timeout_s)

    # -- 1. the quorum ------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This replica's rank in the current group."""
        rank = self.manager.participating_rank()
        assert rank is not None  # a group of one replica per process: every member participates
        return rank

    @property
    def world_size(self) -> int:
        """Replicas in the current group."""
        return self.manager.num_participants()

    @property
    def group(self) -> dist.ProcessGroup:
        """The current group across the replicas, for a collective of the loop's own over them
        (`group=ft.group`; torch's registry does not know it: use `nanoddp.comm`'s collectives)."""
        return self.world.group()

    @property
    def first_replica(self) -> bool:
        """This process is in the replica of rank 0 in the current group (every member of it, with
        `--group-size`): the replica that writes the run's files (a sharded snapshot is theirs)."""
        return self.rank == 0

    @property
    def is_master(self) -> bool:
        """The first replica's rank 0: the one process that writes step records and says the lines."""
        return self.rank == 0 and self.env.group_rank == 0

    def replica_piece(self, step: int) -> torch.Tensor:
        """The dataset indices of this replica's piece of step `step`'s global batch (all its
        members', with `--group-size`: the trainer splits it among them)."""
        return self.batches.indices(step)[share(self.batches.batch_size, self.rank, self.world_size)]

    def resume_at(self, step: int, history: list[int]) -> None:
        """Start at `step` (a snapshot's): `history` is the world size of each step before it.
        Call before `steps`, on every replica the run starts with (a joiner heals instead)."""
        if len(history) != step:
            raise ValueError(f"history must hold the world size of each of the {step} steps, got {len(history)}")
        self.manager.load_state_dict({"step": step, "batches_committed": sum(history)})
        self.history[:] = history

    def steps(self, total_steps: int) -> Iterator[int]:
        """Yield step numbers until `total_steps` are committed; a failed step comes again."""
        while self._boundary is not None or self.manager.current_step() < total_steps:
            self._quorum()
            step = self.manager.current_step()
            if not self._run_boundary(step):
                continue  # handled like a failed step: the next quorum rebuilds, the boundary runs again
            step = self.manager.current_step()  # a resume from a snapshot at the boundary moved it
            if step >= total_steps:  # the last boundary is done, or a joiner healed to the end
                return
            self._committed = None
            self._bytes_at_start = sent_bytes()  # the step's own collectives, not the boundary's
            yield step
            if self._committed is None:
                raise RuntimeError("call ft.commit() once in every iteration of ft.steps(), after average_gradients")

    def _quorum(self) -> None:
        generation = self.world.generation
        self._step_started = time.monotonic()
        self.manager.start_quorum()
        if not self._started:
            self._wait_for_everyone()
        elif self._alone_on_arrival():
            raise RuntimeError(
                f"{self.env.who} found no running replica "
                "to join (the others have finished or are gone): nothing to take its state from"
            )
        elif self.world.generation != generation:
            self._note_membership()
        self._members = self.world.processes
        self._beat()

    def _alone_on_arrival(self) -> bool:
        """This process came to take the state (a replacement, a grower), has been in no group yet,
        and is alone: nobody to take it from. A process that holds the state is never that, even
        with no group behind it (its first group's setup failed): it may be the last holder."""
        came_to_take = self.env.replicas > 1 or self.env.grower
        return not self._members and not self._live.holds_state and self.world_size == 1 and came_to_take

    def _run_boundary(self, step: int, work: bool = True) -> bool:
        """The boundary work at `step` on every member (see the module docstring; `work=False`:
        only the check a new group needs); False if it failed and must run again after the next
        quorum."""
        if (self._boundary is None or not work) and self._holders_checked == self.world.generation:
            return True
        try:
            if self._holders_checked != self.world.generation:
                self._check_holders(step)
                step = self._steps_done()  # a resume from the newest snapshot moved it
            if work and self._boundary is not None:
                self._boundary(step)
        except RunStopped as stop:  # the same on every member (e.g. StateLost): nothing to go on from
            stop.speaker = self.is_master
            raise
        except Exception as exc:  # a lost peer in its collectives, or an error of its own
            self._boundary_failures += 1
            if self._boundary_failures >= BOUNDARY_TRIES:
                raise RunStopped(
                    f"the boundary after step {step} (snapshot, evaluation) failed {BOUNDARY_TRIES} times in a row, "
                    f"the last with {first_line(exc)}: stopped rather than retry it; fix that and rerun with "
                    "--resume auto", self.is_master,
                ) from exc  # fmt: skip
            self._fail(exc, f"the boundary after step {step}")
            self.manager.should_commit(self._vote_wait)  # False: a failed commit, so the next quorum makes a new group
            return False
        self._boundary_failures = 0
        return True

    def _check_holders(self, step: int) -> None:
        """Collective over a new group: does any member hold the committed state? If not, every
        member loads the newest snapshot, or the run stops.

        [Note: nobody holds the state] torchft heals a member that is behind from the one at the highest step; a
        replica that started empty is at step 0. When every replica that held the state is gone (two of two lost
        at once, a source lost while its joiner healed, a survivor crashed), the members left are all at step 0
        and torchft would let them train the run again from its start, writing its records twice. Each member
        knows whether it holds state (a first process built or resumed it; a joiner received it, with its
        source's answer), so one MAX over the group tells them all alike."""
        held = torch.tensor([int(self._live.holds_state)], dtype=torch.int32, device=self.device)
        # The group's own all-reduce (torch's), not nanoddp's collectives: a setting that breaks those for one
        # replica alone (a loop's own simulated link) must fail its steps, where the same-failure rule stops it alone,
        # not this boundary for the holders (`BOUNDARY_TRIES`).
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
        with self.world.guarded():
            self.group.allreduce([held], options).wait()
            holds = held.item()
        if holds:
            self._live.holds_state = True  # a member at step 0 without healing holds the step-0 state
            self._holders_checked = self.world.generation
            return
        restored = None if self._restore is None else self._restore()
        if restored is None:
            raise RunStopped(
                "every replica that held the run's state was lost (those running now started empty) and there is "
                "no snapshot to resume from: stopped rather than start over from step 0; to resume after such a "
                "loss, take snapshots (nanoddp train: --snapshot-every N; a loop of your own: FaultTolerant(restore=))",
                self.is_master,
            )  # fmt: skip
        snapshot_step, history = restored
        self.resume_at(snapshot_step, history)
        self._live.holds_state = True
        self._holders_checked = self.world.generation
        if self.is_master:
            logger.warning(
                "nanoddp.ft: every replica that held the run's state was lost: the %d replicas left resume from the "
                "snapshot of step %d (the steps after it are redone)",
                self.world_size, snapshot_step,
            )  # fmt: skip
            self.metrics.truncate_after(snapshot_step)  # the steps after it are redone and recorded again
            self.metrics.write({"event": "resumed_from_snapshot", "step": snapshot_step + 1,
                                "snapshot_step": snapshot_step, "world_size": self.world_size})  # fmt: skip

    def _fail(self, exc: Exception, what: str) -> None:
        """A collective of this step failed: tell the Manager (no commit), close the group (`ReplicaGroup.close`)."""
        logger.info("%s failed: %s", what, first_line(exc))
        self._count_failure(what, first_line(exc))
        self.manager.report_error(exc)  # (torchft keeps the traceback as text)
        # [Note: a failed collective's traceback] Its frames posted the call's sends and receives, and the traceback
        # keeps them: gloo's buffers, hence the group's sockets, would stay open after the abort, and a peer waiting
        # on this rank would wait out its whole timeout (a sum behind the inner steps fails on a worker thread and is
        # reported later, at its finish, while its Future still holds the error). Once reported, the frames go.
        exc.__traceback__ = None
        self.world.close()

    def _count_failure(self, what: str, line: str) -> None:
        """Raise `RunStopped` once `what` has failed SAME_FAILURE_TRIES times in a row with the same
        error in the same group: a lost peer changes the group, a bad setting fails alike forever."""
        key = (what, failure_text(line), self.world.processes)
        count = self._same_failure[1] + 1 if self._same_failure[0] == key else 1
        self._same_failure = (key, count)
        if count >= SAME_FAILURE_TRIES:
            raise RunStopped(
                f"{what} failed {count} times in a row the same way, with no replica lost: {line}; stopped rather "
                "than retry it forever", self.is_master,
            )  # fmt: skip

    def _beat(self) -> None:
        """Mark this step boundary for the launcher, which ends a replica that stops marking (a hang)."""
        if self._beat_path is not None:
            with open(self._beat_path, "a"):
                os.utime(self._beat_path)

    def _wait_for_everyone(self) -> None:
        """The run's first step waits for all its replicas (they start one by one): re-ask for a
        quorum until it holds them all, or until STARTUP_WAIT_S, then go on with who is there."""
        deadline = time.monotonic() + STARTUP_WAIT_S
        while self.world_size < self.env.replicas and not self._members_agree(time.monotonic() >= deadline):
            time.sleep(0.05)
            self.manager.start_quorum()
        self._started = True
        if self.env.group_rank == 0:
            logger.info("group of %d replicas formed", self.world_size)

    def _members_agree(self, late: bool) -> bool:
        """`late` on any member of this replica group: all ask for the next quorum or none does."""
        if self.env.group_size == 1:
            return late
        flag = torch.tensor([int(late)], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _note_membership(self) -> None:
        """One log line and one record per change, from the first survivor (a joiner knows no
        previous group, so it never writes): after the quorum, or before sending a joiner its state
        inside it (`LiveState.before_send`): a source lost while sending keeps no record back."""
        if self.env.group_rank or self._noted == self.world.generation:  # each member sees it in its own group
            return
        self._noted = self.world.generation
        now = self.world.processes
        survivors = [p for p in now if p in self._members]
        if not survivors or survivors[0] != self.world.process:
            return
        # Numbered as the trainer numbers steps in metrics.jsonl: from 1 (the loop's index + 1).
        for event in membership_events(self._members, now, self._steps_done() + 1):
            logger.warning("nanoddp.ft: %s", describe(event))
            self.metrics.write(event)

    def _steps_done(self) -> int:
        """Steps committed so far: the Manager's count (one commit per step here)."""
        return self.manager.current_step()

    # -- 2. the data --------------------------------------------------------------------------
    def batch_for(self, step: int) -> torch.Tensor:
        """The dataset indices of this rank's piece of step `step`'s global batch."""
        return self.replica_piece(step)

    # -- 4. the average -----------------------------------------------------------------------
    def average_gradients(self, loss: torch.Tensor, buffers: list[torch.Tensor] | None = None) -> float | None:
        """Make every rank's gradients the global batch's (see the module docstring); return the
        global batch's mean loss, or None when a peer was lost and the step will be redone.
        `loss` is the mean loss over this rank's piece; `buffers`, 1-D gradient buffers to sum in
        place (an engine's `cross_replica_grads()`; default: the model's parameters' gradients)."""
        error = self.manager.errored()
        if error is not None:  # the quorum or the heal failed: the step will not commit
            self._count_failure(f"step {self.manager.current_step() + 1}", first_line(error.original_exception))
            return None
        weight = piece_weight(self.batches.batch_size, self.rank, self.world_size)
        try:
            started = time.monotonic()
            grads = grad_buffers(self.params) if buffers is None else buffers
            with self.world.guarded():
                self._loss = self._sum_pieces(grads, weight, loss, self.group)
            self._comm_s = time.monotonic() - started
        except Exception as exc:  # a lost peer: gloo's error or timeout, on this step's group
            self._fail(exc, f"step {self.manager.current_step() + 1}")
            return None
        return self._loss

    @property
    def nonfinite_ranks(self) -> tuple[int, ...]:
        """The group ranks whose loss was NaN or inf in the last average (for `--on-nan`)."""
        return self._sum_pieces.nonfinite_ranks

    # -- 5. the commit ------------------------------------------------------------------------
    def commit(self, update: bool = True, apply: Callable[[], None] | None = None) -> bool:
        """Step the optimizer if every replica's step may commit; drop the gradients either way.
        Returns whether the step was committed (False: `steps` will yield it again).
        `update=False` commits the step without changing a weight (`--on-nan skip`); every member
        must pass the same. `apply`: the update to run instead of `optimizer.step()` (clipping and
        a GradScaler's step, say); it runs only once the step may commit, so a step that does not
        leaves no trace in the optimizer."""
        step, world_size = self.manager.current_step(), self.world_size
        committed = self.manager.should_commit(self._vote_wait)
        if committed and update:
            (apply or self.optimizer.step)()
        if committed:
            self._same_failure = ((), 0)
            self.history.append(world_size)
            self.last_record = self._step_record(step, world_size)
            if self.is_master:
                self.metrics.write(self.last_record)
        self.optimizer.zero_grad(set_to_none=True)
        self._committed = committed
        return committed

    def _step_record(self, step: int, world_size: int) -> dict[str, Any]:
        """The trainer's step record (`metrics.jsonl`), with the world size the step really had;
        `step` counts from 1, as the trainer's records do (the loop's index + 1)."""
        elapsed = time.monotonic() - self._step_started
        samples_per_s = self.batches.batch_size / elapsed if elapsed > 0 else None
        tokens = self.tokens_per_sample
        return {
            "step": step + 1,
            "loss": self._loss if self._loss is None or math.isfinite(self._loss) else None,  # JSON has no NaN
            "lr": self.optimizer.param_groups[0]["lr"],
            "step_time_s": elapsed,
            "samples_per_s": samples_per_s,
            "tokens_per_s": None if samples_per_s is None or tokens is None else samples_per_s * tokens,
            "comm_time_s": self._comm_s,  # the gradient average: not overlapped with backward
            "comm_bytes": sent_bytes() - self._bytes_at_start,
            "world_size": world_size,
            "time": time.time(),  # wall clock: when a step committed, to measure what a failure cost
        }

    def close(self) -> None:
        """Leave the run: stop the Manager's servers and destroy the group."""
        self.manager.shutdown(wait=False)
        self.world.close()
