"""What a probe looks at besides exit codes and output: files on disk, listening sockets, and
what is left in a TMPDIR.

Kept apart from the probes so "unchanged", "loopback only" and "nothing left" mean the same
in every probe that checks them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import psutil

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def digests(folder: Path, skip: tuple[str, ...] = (".lock",)) -> dict[str, str]:
    """sha256 of every file under `folder` (relative names), `skip` names left out."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name not in skip
    }


def listening(proc: psutil.Process) -> list[str]:
    """'ip:port' of every listening TCP socket of `proc`."""
    connections = proc.net_connections(kind="tcp") if hasattr(proc, "net_connections") else proc.connections("tcp")
    return [f"{c.laddr.ip}:{c.laddr.port}" for c in connections if c.status == psutil.CONN_LISTEN]


def ip_of(address: str) -> str:
    return address.rsplit(":", 1)[0]


def leftovers(folder: Path) -> list[str]:
    """What is left in a TMPDIR; torchinductor_<user> is torch's shared kernel cache, meant to stay."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("torchinductor_"))
