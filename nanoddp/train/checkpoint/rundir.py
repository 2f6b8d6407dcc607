"""The run directory: its name, its single owner, its identity, and never losing what it holds.

A run directory (`--out`) collects one training run's snapshots, metrics and model. Work is lost
silently when two runs write into one directory (each prunes the other's snapshots), when a
fresh run lands in an old run's directory (`--resume never` pruned the *new* snapshots, since
the old ones had higher step numbers), or when a run resumes from a snapshot written by a
different configuration. This module prevents each of those:

- `lock_run_dir`: an exclusive `flock` on OUT/.lock held by the launcher for the run's life. The
  kernel releases it when the holder dies, however it dies, so a stale lock cannot exist;
- `default_run_dir`: timestamp plus a random suffix, so two runs started in one second differ;
- `fingerprint` / `config_differences`: the config fields that define the math of a run
  (model, data, optimizer, seed). Snapshots store them; resuming with other values refuses and
  names the fields. Fields that may change on resume (how long, how often to log or snapshot,
  engine and world size, which give the same math) are left out;
- `move_aside`: `--overwrite` renames earlier outputs into a dated folder; nothing is deleted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
from datetime import datetime
from pathlib import Path
from typing import Any

from nanoddp.base import records
from nanoddp.base.files import try_lock
from nanoddp.train.checkpoint import snapshot

logger = logging.getLogger(__name__)

LOCK_NAME = ".lock"
# Outputs of a run, moved aside together by --overwrite.
RUN_OUTPUTS = ("snapshots", records.FILE_NAME, "model.pt", "config.json", "tensorboard", "logs")
# Config fields that may differ between a snapshot and the run resuming it: run length, logging,
# output and launch details, and engines (and hsdp's group size), which compute the same math; what a
# lost rank costs (a continue run's snapshot resumes under restart, and the other way round).
MAY_CHANGE_ON_RESUME = frozenset(
    {
        "steps",
        "log_every",
        "eval_every",
        "eval_samples",
        "snapshot_every",
        "keep_snapshots",
        "progress",
        "collective_timeout",
        "threads",
        "out",
        "resume",
        "metrics",
        "trace",
        "engine",
        "group_size",
        "compile",
        "grad_accum",
        "on_nan",
        "on_failure",
        "warm_spare",
    }
)


class RunDirBusy(ValueError):
    """Another live process holds the run directory's lock."""


def default_run_dir() -> str:
    """runs/<timestamp>-<6 hex>: unique even for runs started in the same second."""
    return str(Path("runs") / f"{datetime.now().strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}")


def new_run_id() -> str:
    return secrets.token_hex(6)


def lock_run_dir(out: str | Path) -> int:
    """Take OUT/.lock exclusively for this process's life; return the open descriptor.

    Keep the descriptor open while the run lasts; closing it, or the process dying, releases the
    lock. A second run on the same directory gets `RunDirBusy` naming the holder's pid at once;
    a `.lock` that is a symlink or not a regular file is a ValueError (`files.open_private`: a
    planted `.lock -> ~/.bashrc` would otherwise be truncated and overwritten with our pid).
    """
    fd, holder = try_lock(Path(out) / LOCK_NAME)
    if fd is None:
        raise RunDirBusy(
            f"run directory {out} is in use by another run ({holder}); wait for it to finish, "
            "stop it, or choose another --out"
        )
    return fd


def fingerprint_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The fields of a config dict that define a run's math."""
    return {key: value for key, value in config.items() if key not in MAY_CHANGE_ON_RESUME}


def fingerprint(config: dict[str, Any]) -> str:
    """A short hash of `fingerprint_fields`: equal fingerprints, same run definition."""
    text = json.dumps(fingerprint_fields(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def config_json(config: dict[str, Any], run_id: str) -> bytes:
    """config.json: the run's id and fingerprint, then every config field."""
    record = {"run_id": run_id, "fingerprint": fingerprint(config), **config}
    return (json.dumps(record, indent=2) + "\n").encode()


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'name: saved -> current' for every fingerprint field that differs."""
    old, new = fingerprint_fields(saved), fingerprint_fields(current)
    return [
        f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
        for key in sorted(set(old) | set(new))
        if old.get(key) != new.get(key)
    ]


def check_resumable(state: dict[str, Any], current: dict[str, Any], path: str | Path) -> None:
    """Raise ValueError if the snapshot `state` is not a Trainer snapshot or was written by a
    different run definition."""
    try:
        saved = snapshot.train_state(state, path).get("config", {})
    except snapshot.SnapshotError as exc:
        raise ValueError(str(exc)) from None
    differences = config_differences(saved, current)
    if differences:
        raise ValueError(
            f"snapshot {path} belongs to a different configuration ({'; '.join(differences)}); only "
            f"{', '.join(sorted(MAY_CHANGE_ON_RESUME))} may change on resume. Use the snapshot's "
            "values, or start a new run (another --out, or --resume never --overwrite)"
        )


def has_outputs(out: str | Path) -> bool:
    return any((Path(out) / name).exists() for name in RUN_OUTPUTS)


def move_aside(out: str | Path) -> Path:
    """Rename earlier outputs of OUT into OUT/previous-<timestamp>/; return that folder."""
    out = Path(out)
    target = out / f"previous-{datetime.now().strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    target.mkdir()
    for name in RUN_OUTPUTS:
        if (out / name).exists():
            os.replace(out / name, target / name)
    return target


def remove_if_empty(out: str | Path, also: frozenset[str] = frozenset()) -> bool:
    """Remove OUT if it holds nothing but its lock file and the `also` names (a run refused or
    failed before it wrote anything worth keeping); return whether it did. Anything else in it,
    a snapshot or a file of the user's, keeps the whole directory."""
    out = Path(out)
    if not out.is_dir() or out.is_symlink():
        return False
    names = {p.name for p in out.iterdir()}
    if not names <= {LOCK_NAME} | also or any(not (out / name).is_file() for name in names - {LOCK_NAME}):
        return False
    for name in names:
        (out / name).unlink(missing_ok=True)
    out.rmdir()
    return True


def has_snapshots(out: str | Path) -> bool:
    return bool(snapshot.list_snapshots(Path(out) / "snapshots"))


def find_resume_snapshot(mode: str, out: str | Path, quiet: bool = False) -> tuple[Path, dict[str, Any]] | None:
    """The snapshot `--resume mode` names, verified and loaded; None when there is nothing to resume.

    `auto` looks in OUT/snapshots and may find nothing (a fresh run). A PATH (a snapshot file, a
    snapshots folder, or a run directory) must yield a valid snapshot: a PATH that yields none is
    an error, never a silent start from step 0. `never` returns None. A snapshot skipped on the
    way is one warning line each, unless `quiet` (the launcher: its workers decide again and say it).
    """
    if mode == "never":
        return None
    if mode == "auto":
        return snapshot.find_latest_valid(Path(out) / "snapshots", [] if quiet else None)
    path = Path(mode)
    if path.is_dir():
        directory = path / "snapshots" if (path / "snapshots").is_dir() else path
        skipped: list[str] = []
        found = snapshot.find_latest_valid(directory, skipped)
        if found is None:  # one line, the reasons included: the launcher prints just this
            why = f" ({len(skipped)} did not verify: {'; '.join(skipped)})" if skipped else ""
            raise ValueError(f"--resume {mode}: no valid snapshot (step-*.pt) in {directory}{why}")
        for reason in [] if quiet else skipped:
            logger.warning("skipping snapshot: %s", reason)
        return found
    try:
        return path, snapshot.load_checked(path)
    except snapshot.SnapshotError as exc:
        raise ValueError(f"--resume {mode}: {exc}") from None


def resolve_resume(mode: str, out: str | Path, current: dict[str, Any], restart_count: int = 0, quiet: bool = False):
    """Apply `--resume mode` to run directory `out` for config dict `current`.

    Returns (path, state) of the snapshot to resume, or None to start at step 0; raises
    ValueError when resuming would lose or mix work. After a torchrun restart the mode is always
    `auto`: the restarted workers continue this run's own snapshots.
    """
    if restart_count > 0:
        mode = "auto"
    elif mode == "never" and has_snapshots(out):
        raise ValueError(
            f"{out} already holds snapshots of an earlier run, and --resume never would mix the two "
            "runs (pruning deletes the newer run's snapshots). Continue it with --resume auto, move "
            "its outputs aside with --overwrite, or choose another --out"
        )
    found = find_resume_snapshot(mode, out, quiet)
    if found is not None:
        check_resumable(found[1], current, found[0])
    return found
