"""`--on-failure continue` runs the Trainer: `FaultTolerantTrainer` is a subclass that overrides
start-up and the step only, so the snapshot, evaluation, resume, log and export code a continue
run executes is the restart path's own, not a copy that could drift from it.

That the replicas of a `nanoddp train --on-failure continue` launch run this class is checked
where they are launched: `tests/helpers.replica_pid` finds them by `WORKER_MODULE` in their
command line (test_ft.py's kill tests need that pid).
"""

from __future__ import annotations

from nanoddp.train import ft_trainer
from nanoddp.train.ft_trainer import FaultTolerantTrainer
from nanoddp.train.trainer import Trainer

# The Trainer's methods a continue run calls as they are.
SHARED = ("_maybe_resume", "_load_snapshot", "_save_snapshot", "evaluate", "_log", "_skip_nonfinite",
          "_export_final_model", "_run_batch", "_autocast", "fit", "_build_engine", "_apply_update")  # fmt: skip

# Start-up (with its seams: the run's id, a snapshot's history and RNG), who writes the run's
# files, how many train and what the evaluation splits over (the group across the replicas), and
# the step (with its loop, which `FaultTolerant.steps` drives).
OVERRIDDEN = {"for_replica", "_setup", "_fresh_run_id", "_loop_facts", "_load_loop_state", "is_master",
              "world_size", "_group_across", "train", "_run_step"}  # fmt: skip


def test_the_continue_trainer_is_the_trainer_with_startup_and_step_overridden():
    assert issubclass(FaultTolerantTrainer, Trainer)
    for name in SHARED:
        assert getattr(FaultTolerantTrainer, name) is getattr(Trainer, name), name
    named = {name for name in vars(FaultTolerantTrainer) if not name.startswith("__")}
    overrides = {name for name in named if hasattr(Trainer, name) or name == "for_replica"}
    assert overrides == OVERRIDDEN
    # the supervisor launches `python -m WORKER_MODULE`, whose `main` runs this class
    assert FaultTolerantTrainer.__module__ == ft_trainer.WORKER_MODULE


def test_the_first_run_id_is_the_same_on_every_host_and_new_per_quorum_service():
    from nanoddp.ft import ReplicaEnv

    def replica(lighthouse: str, replica: int, launcher_pid: int) -> ReplicaEnv:
        return ReplicaEnv(lighthouse=lighthouse, replica=replica, replicas=2, launcher_pid=launcher_pid)

    host0, host1 = replica("http://10.0.0.1:29500", 0, 111), replica("http://10.0.0.1:29500", 1, 222)
    assert ft_trainer.first_run_id(host0, "/shared/run") == ft_trainer.first_run_id(host1, "/shared/run")
    other = replica("http://127.0.0.1:40001", 0, 111)  # another launch: its own quorum service
    assert ft_trainer.first_run_id(other, "/shared/run") != ft_trainer.first_run_id(host0, "/shared/run")
    assert ft_trainer.first_run_id(host0, "/other") != ft_trainer.first_run_id(host0, "/shared/run")


def test_a_failure_that_names_a_new_object_each_try_is_still_the_same_failure():
    """A retry's group is a new object, so an error that prints it (torch's "Group <... at 0x7f..>
    is not registered") differs in its address alone; the same-failure rule must still see one
    failure (before: it retried such a sync forever)."""
    from nanoddp.ft.stopped import failure_text

    first = "Group <torch.distributed.distributed_c10d.ProcessGroup object at 0x7f4f60151bb0> is not registered"
    again = "Group <torch.distributed.distributed_c10d.ProcessGroup object at 0x7f4f60c276f0> is not registered"
    assert failure_text(first) == failure_text(again)
    assert failure_text("peer 1 lost") != failure_text("peer 2 lost")  # the rest of the text still counts
