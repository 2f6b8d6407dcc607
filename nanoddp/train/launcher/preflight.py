"""Checks `nanoddp train` runs in the launcher, before any worker or process group exists.

A bad value found by the workers costs seconds of start-up and ends in one traceback per rank;
found here it is one line and exit code 2. Everything that needs no process group belongs here:
the output directory, the snapshot to resume (readable, same run definition, same shapes), what
to do with an earlier run's outputs, and the settings every worker reads from the environment
(`NANODDP_LINK_*`), for both `--on-failure` modes and for `nanoddp run`. The workers repeat the
resume decision (rank 0 decides for all), so `torchrun -m nanoddp.train` and the `Trainer` API
stay safe without this module.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import torch

from nanoddp.base import files, records
from nanoddp.comm.transport.link import link_from_environ
from nanoddp.dataclass_cli import to_dict
from nanoddp.train.checkpoint import rundir, snapshot
from nanoddp.train.config import TrainConfig, build_model, filled
from nanoddp.train.data.datasets import DataSpec

logger = logging.getLogger(__name__)


def check_out_dir(out: str | Path) -> None:
    """OUT must be (or become) a directory this user can write; raise ValueError otherwise."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory; choose a directory path")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise ValueError(f"--out {out} is not writable ({exc.strerror}); choose another directory") from None
    # appended to in place (everything else is written by an atomic rename, never through a link)
    for appended in [records.records_path(out), *sorted((out / "logs").glob("rank*.log"))]:
        files.refuse_planted(appended)


def check_worker_environ() -> None:
    """The `NANODDP_LINK_*` values every worker will read must parse (`link_from_environ`, the one
    parser): a bad one is the same error on every worker at its first collective, which under
    `--on-failure continue` each replica would otherwise retry."""
    link_from_environ()


def check_shapes(state: dict[str, Any], model: torch.nn.Module, path: str | Path) -> None:
    """The snapshot's model tensors must match the model the config builds, name for name."""
    saved = snapshot.model_shapes(state)  # a sharded run's from its manifest, no shard file read
    wanted = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    problems = [f"{n}: missing" for n in sorted(set(wanted) - set(saved))]
    problems += [f"{n}: unexpected" for n in sorted(set(saved) - set(wanted))]
    problems += [f"{n}: {saved[n]} vs {wanted[n]}" for n in sorted(set(saved) & set(wanted)) if saved[n] != wanted[n]]
    if problems:
        shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
        raise ValueError(
            f"snapshot {path} does not fit this model ({shown}); resume with the model it was trained with"
        )


def prepare_run_dir(config: TrainConfig, spec: DataSpec, overwrite: bool) -> str:
    """Settle what the run does with OUT (call while holding OUT's lock); return a status line.

    --overwrite moves earlier outputs aside (never deletes them); then the resume decision the
    workers will take is made here too, so a refusal happens before they start.
    """
    out = Path(filled(config.out))
    note = ""
    if overwrite and rundir.has_outputs(out):
        note = f"earlier outputs moved to {rundir.move_aside(out)}; "
    found = rundir.resolve_resume(config.resume, out, to_dict(config), quiet=True)  # the workers say what they skip
    if found is None:
        fresh = "starting fresh at step 0" if config.resume == "never" else "no snapshot to resume: starting fresh"
        return f"{note}{fresh}"
    path, state = found
    check_shapes(state, build_model(config, spec), path)
    return f"{note}resuming from {path} (step {snapshot.train_state(state, path)['step']})"
