"""Atomic, checksummed training snapshots, keep-last-K, and finding the newest valid one.

Every file nanoddp saves state in (`save_state`'s manifest and shard files, a Trainer
snapshot, which is a `save_state` file with fixed names) is a short text header followed by a
`torch.save` payload::

    NANODDP-SNAPSHOT 1\\n
    <sha256 of payload> <payload length>\\n
    <payload bytes>

Written by `files.atomic_write_bytes` (a fresh temp file, fsynced, renamed over the final name),
so a reader sees either the old file or the complete new one, never half of one. The
header lets `load` reject a truncated or corrupted file before unpickling anything, which is
what lets `--resume auto` skip a bad snapshot (a job killed mid-write, a full disk) and fall
back to the previous one instead of crashing or, worse, resuming from garbage; a sharded
snapshot whose shard files are not all there, or not the ones it lists, is skipped the same way.
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
from pathlib import Path
from typing import Any

import torch

from nanoddp.base import files

logger = logging.getLogger(__name__)

MAGIC = b"NANODDP-SNAPSHOT 1\n"
SNAPSHOT_RE = re.compile(r"^step-(\d+)\.pt$")
# a snapshot, or one of the shard files its manifest lists (`shard_files.shard_name`)
STEP_FILE_RE = re.compile(r"^step-(\d+)\.pt(\.[0-9a-f]+\.rank\d+-of-\d+)?$")
TRAIN = "train"  # a Trainer snapshot's entry for the loop's own facts (step, epoch, config, ...)


class SnapshotError(RuntimeError):
    """A snapshot file is missing, truncated, corrupted, or not a snapshot."""


def snapshot_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}.pt"


def save(path: str | Path, state: dict[str, Any]) -> Path:
    """Serialise `state` with a checksum header and write it atomically."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    header = MAGIC + f"{hashlib.sha256(payload).hexdigest()} {len(payload)}\n".encode()
    files.atomic_write_bytes(path, [header, payload])
    return Path(path)


def load(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read and verify a snapshot; raise `SnapshotError` saying what is wrong with it."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SnapshotError(f"cannot read snapshot {path}: {exc}") from exc
    if not raw.startswith(MAGIC):
        raise SnapshotError(f"{path} is not a nanoddp snapshot (bad header)")
    header_end = raw.find(b"\n", len(MAGIC))
    try:
        digest, length_text = raw[len(MAGIC) : header_end].decode().split()
        length = int(length_text)
    except ValueError:
        raise SnapshotError(f"{path} has a damaged header") from None
    payload = raw[header_end + 1 :]
    if len(payload) != length:
        raise SnapshotError(f"{path} is truncated: {len(payload)} of {length} payload bytes")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise SnapshotError(f"{path} is corrupted: checksum mismatch")
    try:
        return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)
    except Exception as exc:  # intact bytes that are not ours to unpickle: another program or torch
        raise SnapshotError(
            f"{path} cannot be loaded with weights_only=True ({unpickling_reason(exc)}); it was written by "
            "another program or torch version, or by a save_state that did not check its values"
        ) from None


def payload_digest(path: str | Path) -> str:
    """The payload checksum a snapshot file's header records (reads the header only)."""
    try:
        with open(path, "rb") as fh:
            magic, line = fh.readline(), fh.readline()
    except OSError as exc:
        raise SnapshotError(f"cannot read shard file {path}: {exc.strerror or exc}") from None
    if magic != MAGIC or not line.split():
        raise SnapshotError(f"{path} is not a nanoddp snapshot (bad header)")
    return line.split()[0].decode(errors="replace")


def check_shards(path: str | Path, state: Any) -> None:
    """Raise SnapshotError unless every shard file the manifest `state` lists (a sharded
    `save_state`: each rank's pieces in its own file beside it) is there and is the one it was
    written with (its header's checksum), so that resume falls back to an older snapshot rather
    than fail on a missing shard. Reads the shard files' headers only."""
    for entry in state.get("shards", []) if isinstance(state, dict) else []:
        shard = Path(path).with_name(entry["file"])
        if payload_digest(shard) != entry["sha256"]:
            raise SnapshotError(f"{shard} is not the shard file {path} lists")


def load_checked(path: str | Path) -> dict[str, Any]:
    """`load`, and `check_shards`: a snapshot whose every file is there and intact."""
    state = load(path)
    check_shards(path, state)
    return state


def unpickling_reason(exc: BaseException) -> str:
    """One line saying why a payload did not unpickle (weights_only's own message spans a page)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    reason = next((line for line in lines if "WeightsUnpickler error" in line), lines[0] if lines else "")
    return f"{type(exc).__name__}: {reason.replace('WeightsUnpickler error: ', '')}"


def list_snapshots(directory: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every snapshot file in `directory`, newest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = SNAPSHOT_RE.match(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found, reverse=True)


def find_latest_valid(directory: str | Path, skipped: list[str] | None = None) -> tuple[Path, dict[str, Any]] | None:
    """The newest snapshot that verifies, with its state. Bad ones are skipped: why, appended to
    `skipped` when given (the caller reports it, e.g. inside its one error line), else logged."""
    for _, path in list_snapshots(directory):
        try:
            return path, load_checked(path)
        except SnapshotError as exc:
            if skipped is None:
                logger.warning("skipping snapshot: %s", exc)
            else:
                skipped.append(str(exc))
    return None


def prune(directory: str | Path, keep: int, protect: int | None = None) -> list[Path]:
    """Delete all but the newest `keep` snapshots and snapshot `protect` (the newest whose loss was
    finite: newer ones may all hold a skipped, non-finite stretch), with their shard files (and
    those of a sharded save whose manifest was never written); return the deleted paths."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    directory = Path(directory)
    kept = {step for step, _ in list_snapshots(directory)[:keep]} | ({protect} if protect is not None else set())
    removed = []
    for path in sorted(directory.glob("step-*.*")) if directory.is_dir() else []:
        step = STEP_FILE_RE.match(path.name)
        if step and int(step.group(1)) not in kept:
            path.unlink(missing_ok=True)
            removed.append(path)
    for tmp in directory.glob(f".step-*.pt*{files.TEMP_MARK}*"):
        if files.is_stale_temp(tmp):  # left by a writer killed mid-write
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


# --- what a Trainer snapshot holds, read from its manifest alone ------------------------------


def train_state(state: Any, path: str | Path) -> dict[str, Any]:
    """The loop's own facts in a Trainer snapshot (`nanoddp.Trainer._save_snapshot`): step, epoch,
    config, run_id, fingerprint, world_size, interrupted, loss_finite. SnapshotError when `state`
    (a loaded file) is not a Trainer snapshot."""
    try:
        return state["objects"][TRAIN]["state"]
    except (KeyError, TypeError, IndexError):
        raise SnapshotError(
            f"{path} is not a Trainer snapshot (no {TRAIN!r} entry); resume from a step-<N>.pt the Trainer wrote"
        ) from None


def model_shapes(state: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The whole shape of every model tensor of a Trainer snapshot, with no shard file read: what
    the launcher checks against the model a config builds before resuming."""
    entry = state["objects"]["model"]
    if entry["kind"] == "module":  # saved whole, from rank 0
        return {key: tuple(value.shape) for key, value in entry["state"].items()}
    layout = entry["state"]  # sharded: the manifest records each tensor's whole shape
    shapes = {key: tuple(spec["shape"]) for key, spec in layout["specs"].items()}
    return shapes | {key: tuple(value.shape) for key, value in layout["whole"].items()}
