"""Private temp dirs that a killed process does not leave behind for good.

A process removes its own temp dir in a `finally`, but SIGKILL skips that. So each dir is named
`<prefix><pid>-<random>` and the next process that makes one with the same prefix first removes
those whose pid is gone (and that belong to this user): a crash leaves at most one dir, until the
next run.
"""

from __future__ import annotations

import getpass
import os
import shutil
import tempfile
from pathlib import Path

import psutil


def make_private_dir(prefix: str, parent: str | None = None) -> str:
    """A new mode-0700 temp dir named after this process, after removing dead processes' ones."""
    remove_stale_dirs(prefix, parent)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent)


def remove_stale_dirs(prefix: str, parent: str | None = None) -> None:
    """Remove `<prefix><pid>-*` dirs in `parent` (default: the temp dir) whose process is gone."""
    for path in Path(parent or tempfile.gettempdir()).glob(f"{prefix}*"):
        pid = path.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)) and path.owner() == getpass.getuser():
            shutil.rmtree(path, ignore_errors=True)
