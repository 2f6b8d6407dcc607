"""A run's record, `metrics.jsonl`: what it holds, the one writer and the one reader.

Every mode writes the same file (the trainer, `nanoddp.ft`'s loop, the torchft worker), and the
benchmarks, the tests and users' own tools read it. Each used to build, write and parse it by
hand; one module keeps the format one format. It sits on the ground floor so that `nanoddp.ft`
can drop the records of redone steps exactly as a resumed trainer does.

The format: one JSON object per line (`json.dumps`, keys in the writer's order), appended with
one write per line, so lines of different processes never interleave. Two kinds of record:

- a *step record*, `{"step", "loss", "lr", ...}` (`STEP_FIELDS`, plus `OPTIONAL_STEP_FIELDS`),
  one per logged step; `step` counts from 1;
- an *event record*, `{"event": <kind>, "step", ...}` (`EVENT_FIELDS` names each kind's fields),
  written before the step it concerns.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from nanoddp.base.files import append_text, atomic_write_bytes, open_private

FILE_NAME = "metrics.jsonl"

Record = dict[str, Any]

# Every step record has these (the trainer's, fault tolerance's and the torchft worker's alike).
STEP_FIELDS = (
    "step",
    "loss",  # the global mean over the steps since the previous record; None: every step skipped
    "lr",
    "step_time_s",
    "samples_per_s",
    "tokens_per_s",  # None: the dataset does not say what a token is
    "comm_time_s",
    "comm_bytes",  # what this rank sent in the step collectives since the previous record
    "world_size",  # the world size the step really had
)
OPTIONAL_STEP_FIELDS = {
    "comm_exposed_s": "the trainer's: the part of comm_time_s the step waited for after backward",
    "val_loss": "the trainer's, on an evaluation step",
    "time": "fault tolerance's: wall clock when the step committed",
}
# The trainer's step records have `comm_exposed_s` too (None where it is not measured).
TRAINER_STEP_FIELDS = (*STEP_FIELDS, "comm_exposed_s")

EVENT_FIELDS: dict[str, tuple[str, ...]] = {
    "rank_lost": ("step", "world_size", "replicas"),
    "rank_joined": ("step", "world_size", "replicas"),
    "eval": ("step", "val_loss", "world_size", "eval_time_s"),
    "nonfinite_loss": ("step", "ranks", "action", "world_size"),
    "resumed_from_snapshot": ("step", "snapshot_step", "world_size"),
    # localsgd/diloco under continue: the fragment synced (0: the whole model unless --fragments),
    # and per rank of the sync's quorum its replica, the samples it trained since that fragment's
    # last sync, the replica it healed from (-1: none) and its inner steps with a NaN or inf loss
    # since the last sync (`nanoddp.ft.rounds`)
    "sync": ("step", "fragment", "world_size", "replicas", "samples", "healed_from", "nonfinite_steps"),
}


def records_path(run_dir_or_path: str | Path) -> Path:
    """`DIR/metrics.jsonl` for a run directory; a path that names the file itself, as it is."""
    path = Path(run_dir_or_path)
    return path if path.name == FILE_NAME else path / FILE_NAME


def check_record(record: Record) -> None:
    """Raise ValueError unless `record` is a step record with every `STEP_FIELDS` key, or an event
    of a known kind with exactly its `EVENT_FIELDS`: a new field or kind is added here first."""
    kind = record.get("event")
    if kind is None:
        missing = [key for key in STEP_FIELDS if key not in record]
        unknown = [key for key in record if key not in STEP_FIELDS and key not in OPTIONAL_STEP_FIELDS]
        if missing or unknown:
            raise ValueError(
                f"a step record needs {STEP_FIELDS} (optional: {tuple(OPTIONAL_STEP_FIELDS)}); missing {missing}, "
                f"unknown {unknown}: a new field is added to nanoddp/base/records.py first"
            )
        return
    if kind not in EVENT_FIELDS:
        raise ValueError(f"unknown event {kind!r}: the kinds are {sorted(EVENT_FIELDS)} (nanoddp/base/records.py)")
    fields = tuple(key for key in record if key != "event")
    if sorted(fields) != sorted(EVENT_FIELDS[kind]):
        raise ValueError(f"a {kind!r} event has the fields {EVENT_FIELDS[kind]}, got {fields}")


class RecordWriter:
    """Appends records to `run_dir/metrics.jsonl` (nothing when `run_dir` is None), one line and
    one write each, never through a planted link (`files.append_text`)."""

    def __init__(self, run_dir: str | Path | None) -> None:
        self.path = None if run_dir is None else records_path(run_dir)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: Record) -> None:
        """Append `record` (checked by `check_record`)."""
        check_record(record)
        if self.path is not None:
            append_text(self.path, json.dumps(record) + "\n")

    def truncate_after(self, step: int) -> None:
        """Drop the records past `step` (see `truncate_after`)."""
        if self.path is not None:
            truncate_after(self.path, step)


def _parse(text: str) -> list[Record]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def truncate_after(run_dir_or_path: str | Path, step: int) -> None:
    """Drop the records past `step`, events included: a run that goes on from the snapshot of
    `step` redoes the steps after it and records them again, so each step is recorded once.
    The file is rewritten whole or not at all; a missing file is left missing."""
    path = records_path(run_dir_or_path)
    if not path.exists() and not path.is_symlink():
        return
    fd = open_private(path, os.O_RDONLY)  # a planted link is refused, not read
    with os.fdopen(fd) as fh:
        lines = fh.read().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
    if len(kept) != len(lines):
        atomic_write_bytes(path, "".join(kept).encode())


def read_records(run_dir_or_path: str | Path, *, missing_ok: bool = False) -> list[Record]:
    """Every record of a run's `metrics.jsonl` (a run directory or the file), in order. A missing
    file raises FileNotFoundError, or gives [] with `missing_ok` (a run that has logged nothing yet)."""
    path = records_path(run_dir_or_path)
    if missing_ok and not path.exists():
        return []
    return _parse(path.read_text())


def step_records(records: list[Record]) -> list[Record]:
    """The step records of `records` (events left out)."""
    return [record for record in records if "event" not in record]


def events(records: list[Record], kind: str | None = None) -> list[Record]:
    """The event records of `records`, or those of one `kind` (`EVENT_FIELDS`)."""
    if kind is not None and kind not in EVENT_FIELDS:
        raise ValueError(f"unknown event {kind!r}: the kinds are {sorted(EVENT_FIELDS)}")
    return [record for record in records if "event" in record and kind in (None, record["event"])]


def last_step(run_dir_or_path: str | Path) -> int:
    """The newest step record's step in a run's `metrics.jsonl`; 0 before the first (or no file)."""
    return max((record["step"] for record in step_records(read_records(run_dir_or_path, missing_ok=True))), default=0)
