"""The one way nanoddp writes a file: whole or not at all, and never through a planted link.

Snapshots, manifests, shard files, `model.pt`, `config.json`, `metrics.jsonl` and locks live in
run and checkpoint directories that are often shared (a lab's group-writable disk). A writer
that opens a predictable temporary name (`.state.pt.tmp-<pid>`) follows a symlink another user
planted there and overwrites whatever it points to (`~/.bashrc`) with our bytes. So here:

- the parent directory is opened once and every step is made relative to that descriptor, so a
  directory swapped in between creating the temporary file and renaming it changes nothing;
- a symlinked parent directory is followed only when the link is ours (or root's): the rule
  Linux's `fs.protected_symlinks` applies in sticky directories. Another user's link is refused;
- the temporary file has an unpredictable name and is created with `O_CREAT|O_EXCL|O_NOFOLLOW`:
  an existing name (a planted file or link) is never opened, another name is drawn instead;
- it is written, fsynced and renamed over the target. A rename replaces a link planted at the
  target itself and never writes through it; the directory is fsynced so the rename is durable;
- an `OSError` (a full disk, a read-only directory) is re-raised with the target's path in it.

`open_private` is the same discipline for the files nanoddp appends to or locks in place.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import torch

TEMP_MARK = ".tmp-"  # `.<name>.tmp-<pid>-<random>`: the pid lets a later run remove a dead writer's
NAME_TRIES = 16


class UnsafePath(ValueError):
    """A path nanoddp would have to write through a link or into something not a regular file."""


def _trusted_owner(uid: int) -> bool:
    return uid in (os.getuid(), 0)


@contextlib.contextmanager
def open_directory(directory: Path) -> Iterator[int]:
    """A descriptor of `directory` (created if missing), refusing another user's symlink to it."""
    directory.mkdir(parents=True, exist_ok=True)
    info = os.lstat(directory)
    if stat.S_ISLNK(info.st_mode) and not _trusted_owner(info.st_uid):
        raise UnsafePath(
            f"{directory} is a symbolic link owned by another user (uid {info.st_uid}), and is never followed "
            "or written through: remove the link or choose another location"
        )
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def _named(exc: OSError, path: Path, doing: str) -> OSError:
    """`exc` as the same class, its message naming `path` (OSError's own names the temp file)."""
    reason = exc.strerror or str(exc)
    return type(exc)(exc.errno or errno.EIO, f"cannot {doing} {path}: {reason}")


def _create_temp(dir_fd: int, name: str) -> tuple[int, str]:
    """A new, empty temporary file beside `name`, opened for writing: (descriptor, its name)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(NAME_TRIES):
        temp = f".{name}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(8)}"
        try:
            return os.open(temp, flags, 0o666, dir_fd=dir_fd), temp
        except FileExistsError:  # planted, or a one-in-2**64 clash: never opened, draw again
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary name beside {name} after {NAME_TRIES} tries")


def atomic_write_bytes(path: str | Path, data: bytes | list[bytes]) -> None:
    """Write `data` (bytes, or chunks of it) to `path` atomically; see the module docstring."""
    path = Path(path)
    try:
        with open_directory(path.parent) as dir_fd:
            fd, temp = _create_temp(dir_fd, path.name)
            try:
                with os.fdopen(fd, "wb") as fh:
                    for chunk in [data] if isinstance(data, bytes) else data:
                        fh.write(chunk)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(temp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=dir_fd)
                raise
            with contextlib.suppress(OSError):  # durability of the rename; not every filesystem can
                os.fsync(dir_fd)
    except OSError as exc:
        if str(path) in str(exc):
            raise
        raise _named(exc, path, "write") from None


def atomic_torch_save(path: str | Path, obj: Any) -> None:
    """`torch.save(obj, path)`, atomically: a plain file (no header) that `torch.load` reads."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def open_private(path: str | Path, flags: int) -> int:
    """Open (creating it if missing) the regular file `path` itself with `flags` added: never
    through a symlink, never a FIFO, device or directory in its place. Returns the descriptor."""
    path = Path(path)
    base = os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK  # NONBLOCK: a planted FIFO can't block us
    fd, kind = None, None
    try:
        with open_directory(path.parent) as dir_fd:
            fd = os.open(path.name, flags | base, 0o666, dir_fd=dir_fd)
    except OSError as exc:
        kinds = {errno.ELOOP: "a symbolic link", errno.ENXIO: "a FIFO", errno.EISDIR: "a directory"}
        if exc.errno not in kinds:
            raise _named(exc, path, "open") from None
        kind = kinds[exc.errno]
    kind = kind if fd is None else file_kind(os.fstat(fd).st_mode)
    if kind is not None:
        if fd is not None:
            os.close(fd)
        raise _unsafe(path, kind)
    assert fd is not None  # every other outcome raised above
    os.set_blocking(fd, True)
    return fd


def try_lock(path: str | Path) -> tuple[int | None, str]:
    """Take an exclusive `flock` on the lock file `path` (created through no link) for as long as
    the returned descriptor stays open, or the holder's own process dies: (descriptor, "").
    Held by another process: (None, what the holder wrote in it, "pid <n>")."""
    fd = open_private(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        return None, f"pid {holder}"
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd, ""


def _unsafe(path: Path, kind: str) -> UnsafePath:
    return UnsafePath(
        f"{path} is {kind}, not a regular file, and is never followed or written through: remove it "
        "(nanoddp creates it) or choose another location"
    )


def refuse_planted(path: str | Path) -> None:
    """Raise `UnsafePath` if `path` exists as anything but a regular file (a link included): the
    launcher's early look at the files a run appends to in place, before any worker starts."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    kind = "a symbolic link" if stat.S_ISLNK(mode) else file_kind(mode)
    if kind is not None:
        raise _unsafe(Path(path), kind)


def append_text(path: str | Path, text: str) -> None:
    """Append `text` to `path` (created if missing) with one write, through no link."""
    fd = open_private(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, text.encode())
    except OSError as exc:
        raise _named(exc, Path(path), "append to") from None
    finally:
        os.close(fd)


def file_kind(mode: int) -> str | None:
    """None for a regular file, else what it is."""
    if stat.S_ISREG(mode):
        return None
    kinds = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket", stat.S_ISCHR: "a device"}
    return next((name for test, name in kinds.items() if test(mode)), "not a regular file")


def is_stale_temp(path: Path) -> bool:
    """A temporary file of ours whose writer is dead (killed mid-write): safe to remove."""
    pid = path.name.rsplit(TEMP_MARK, 1)[-1].split("-", 1)[0]
    if not pid.isdigit() or psutil.pid_exists(int(pid)):
        return False
    try:
        return os.lstat(path).st_uid == os.getuid()
    except OSError:
        return False
