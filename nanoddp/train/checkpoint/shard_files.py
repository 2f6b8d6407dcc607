"""One file per rank for sharded state, the manifest that makes them one checkpoint, and the
collective that makes every rank agree on success or failure.

Why per rank: gathering a sharded model or optimizer onto rank 0 costs rank 0 the memory of the
whole state and writes it serially; instead every rank writes its own shard file, in parallel.
Why a manifest written last, by rank 0, only once every rank reported its file in place: a job
killed mid-save leaves shard files but no manifest, so a loader never sees a checkpoint
pointing at missing files. File names carry a per-save token, so saving over `state.pt` never
replaces the files the existing manifest points to; those are removed only after the new
manifest is in place.

Every shard file is a `snapshot` file (atomic write, checksummed payload), and the manifest
records each file's payload checksum: a damaged file, or a valid file from another save, is
refused with one line naming it.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from nanoddp.base import files
from nanoddp.train.checkpoint import snapshot
from nanoddp.train.ranks import distributed

logger = logging.getLogger(__name__)


class SaveInProgress(RuntimeError):
    """Another sharded save to the same path holds its lock."""


# An error raised on one rank is raised as the same class on the others (else RuntimeError).
SAME_ON_EVERY_RANK = {
    kind.__name__: kind
    for kind in (TypeError, ValueError, KeyError, OSError, FileNotFoundError, RuntimeError, snapshot.SnapshotError)
    + (SaveInProgress, files.UnsafePath)
}


def lock_name(target: Path) -> Path:
    return target.with_name(f".{target.name}.lock")


def _busy(target: Path, holder: str) -> SaveInProgress:
    return SaveInProgress(
        f"another save to {target} is in progress ({holder}, holding {lock_name(target).name}); two jobs "
        "saving to one path would delete each other's shard files: wait for it, or save to another path"
    )


def begin_save(target: Path) -> tuple[str, int | None]:
    """Collective: (the token naming this save's shard files, the same on every rank; rank 0's
    descriptor of the save lock, None elsewhere), or the same error on every rank.

    [Note: one sharded writer per path] Each save removes the shard files of `target` that its
    manifest does not list (the replaced manifest's, a killed save's). Two jobs saving to one path
    at once would remove each other's fresh files and both report success for checkpoints that no
    longer load, so rank 0 holds `.<name>.lock` beside `target` from here to `end_save`, and a
    second job's save is refused at once instead. The lock file stays: removing it would let a
    waiter and a newcomer hold two different files' locks."""
    fd, refusal = None, None
    if not distributed() or dist.get_rank() == 0:
        try:
            fd, holder = files.try_lock(lock_name(target))
            if fd is None:
                refusal = (SaveInProgress.__name__, str(_busy(target, holder)))
        except (ValueError, OSError) as exc:  # a planted link as the lock file; a read-only directory
            refusal = (type(exc).__name__, str(exc))
    box = [(secrets.token_hex(4), refusal)]
    if distributed():
        dist.broadcast_object_list(box, src=0)
    token, refusal = box[0]
    if refusal is not None:
        raise SAME_ON_EVERY_RANK.get(refusal[0], RuntimeError)(refusal[1])
    return token, fd


@contextlib.contextmanager
def replacing_sharded(target: Path) -> Iterator[None]:
    """Around rank 0's write of an unsharded save: where `target` has shard files (it was saved
    sharded, or a sharded save was killed), hold the save lock and remove them after the write."""
    if not any(target.parent.glob(f"{glob.escape(target.name)}.*.rank*-of-*")):
        yield
        return
    fd, holder = files.try_lock(lock_name(target))
    if fd is None:
        raise _busy(target, holder)
    try:
        yield
        remove_unlisted(target, set())
    finally:
        end_save(fd)


def end_save(lock_fd: int | None) -> None:
    """Release the save lock `begin_save` took (rank 0; a no-op elsewhere)."""
    if lock_fd is not None:
        os.close(lock_fd)


def shard_name(target: Path, token: str, rank: int, world_size: int) -> str:
    return f"{target.name}.{token}.rank{rank}-of-{world_size}"


def write_shard(path: Path, payload: dict[str, Any]) -> str:
    """Write one rank's shard file atomically; return its payload checksum for the manifest."""
    snapshot.save(path, payload)
    return payload_digest(path)


payload_digest = snapshot.payload_digest


class ShardReader:
    """The shard files a manifest lists, each read and verified at most once, when first needed."""

    def __init__(self, manifest: Path, shards: list[dict[str, str]]):
        self.manifest = manifest
        self.shards = shards
        self._loaded: dict[int, dict[str, Any]] = {}

    def get(self, rank: int) -> dict[str, Any]:
        if rank not in self._loaded:
            entry = self.shards[rank]
            path = self.manifest.parent / entry["file"]
            if not path.exists():
                raise snapshot.SnapshotError(f"{path} is missing: manifest {self.manifest} lists it as rank {rank}'s")
            if payload_digest(path) != entry["sha256"]:
                raise snapshot.SnapshotError(
                    f"{path} is not the file manifest {self.manifest} was written with (checksum differs)"
                )
            self._loaded[rank] = snapshot.load(path)
        return self._loaded[rank]


def agree(error: BaseException | None) -> None:
    """Raise on every rank if any rank failed: the lowest failing rank's error, same class and
    message everywhere. Collective; a no-op when every rank succeeded."""
    if not distributed():
        if error is not None:
            raise error
        return
    mine = None if error is None else (type(error).__name__, str(error))
    outcomes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, mine)
    first = next((o for o in outcomes if o is not None), None)
    if first is None:
        return
    if error is not None and mine == first:
        raise error
    raise SAME_ON_EVERY_RANK.get(first[0], RuntimeError)(first[1])


def remove_unlisted(target: Path, keep: set[str]) -> None:
    """Delete `target`'s shard files that `keep` (the new manifest's) does not list: those of
    the manifest it replaced, or of a save that failed or was killed, and the temporary files of
    a killed save. Called under the save lock (`begin_save`), so no other save's files are live.
    Best effort: a leftover costs space only."""
    name = glob.escape(target.name)
    leftovers = [p for p in target.parent.glob(f"{name}.*.rank*-of-*") if p.name not in keep]
    leftovers += target.parent.glob(f".{name}.*.rank*-of-*{files.TEMP_MARK}*")  # a killed rank's shard
    leftovers += [p for p in target.parent.glob(f".{name}{files.TEMP_MARK}*") if files.is_stale_temp(p)]
    for path in leftovers:
        try:
            path.unlink()
        except OSError as exc:
            logger.warning("could not remove old shard file %s: %s", path, exc)
