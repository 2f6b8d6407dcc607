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

import glob
import logging
import secrets
from pathlib import Path
from typing import Any

import torch.distributed as dist

from nanoddp.train.checkpoint import snapshot
from nanoddp.train.ranks import distributed

logger = logging.getLogger(__name__)

# An error raised on one rank is raised as the same class on the others (else RuntimeError).
SAME_ON_EVERY_RANK = {
    kind.__name__: kind
    for kind in (TypeError, ValueError, KeyError, OSError, FileNotFoundError, RuntimeError, snapshot.SnapshotError)
}


def new_token() -> str:
    """A token naming this save's shard files, the same on every rank (rank 0's; collective)."""
    box = [secrets.token_hex(4)]
    if distributed():
        dist.broadcast_object_list(box, src=0)
    return box[0]


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
    the manifest it replaced, or of a save that failed. Best effort: a leftover costs space only."""
    for path in target.parent.glob(f"{glob.escape(target.name)}.*.rank*-of-*"):
        if path.name not in keep:
            try:
                path.unlink()
            except OSError as exc:
                logger.warning("could not remove old shard file %s: %s", path, exc)
