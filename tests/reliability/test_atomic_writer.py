"""The atomic writer's two promises beyond links: durable before visible, and whole or nothing.

- The temporary file's bytes reach the disk (`os.fsync` on its descriptor) before `os.replace`
  makes them the target, and the directory is fsynced after the rename: the real `os.fsync` and
  `os.replace` are wrapped in this process and the order of the calls recorded, each fsync by
  the inode of the descriptor it was given (the temporary file's inode is the target's after the
  rename).
- A write that fails (an error raised between two chunks, a disk that reports EIO on fsync)
  leaves the directory as it was: the listing after equals the listing before, and a target
  that existed keeps its old bytes.
"""

from __future__ import annotations

import errno
import os

import pytest

from nanoddp.base import files

OLD = b"the previous snapshot\n"


@pytest.fixture
def calls(monkeypatch) -> list[tuple[str, int | str]]:
    """Every `os.fsync` (by inode) and `os.replace` (by target name) made, in order; both still run."""
    seen: list[tuple[str, int | str]] = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd: int) -> None:
        seen.append(("fsync", os.fstat(fd).st_ino))
        fsync(fd)

    def recording_replace(src, dst, **kwargs) -> None:
        seen.append(("replace", os.fspath(dst)))
        replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    return seen


def test_the_temp_file_is_fsynced_before_the_rename_and_the_directory_after(tmp_path, calls):
    target = tmp_path / "ckpt" / "state.pt"
    files.atomic_write_bytes(target, [b"chunk one ", b"chunk two"])
    assert target.read_bytes() == b"chunk one chunk two"
    file_inode, dir_inode = target.stat().st_ino, target.parent.stat().st_ino
    assert calls == [("fsync", file_inode), ("replace", "state.pt"), ("fsync", dir_inode)], calls


class Interrupted(Exception):
    """Raised between two chunks of a write."""


def chunks_then_failure():
    """Chunks made as they are written (a serializer), the second failing: the temporary file
    then holds the first chunk, not the whole data."""
    yield b"first half "
    raise Interrupted("the serializer failed between two chunks")


def _fsync_fails(monkeypatch) -> None:
    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing)


@pytest.mark.parametrize("existing", [False, True])
@pytest.mark.parametrize("failure", ["between_chunks", "fsync_eio"])
def test_a_failed_write_leaves_the_directory_as_it_was(tmp_path, monkeypatch, failure, existing):
    target = tmp_path / "state.pt"
    if existing:
        target.write_bytes(OLD)
    (tmp_path / "notes.txt").write_text("the user's own file\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    if failure == "fsync_eio":
        _fsync_fails(monkeypatch)
        with pytest.raises(OSError, match=r"cannot write .*state\.pt: Input/output error"):
            files.atomic_write_bytes(target, b"new bytes")
    else:
        with pytest.raises(Interrupted):
            files.atomic_write_bytes(target, chunks_then_failure())  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temporary file left behind
    if existing:
        assert target.read_bytes() == OLD
