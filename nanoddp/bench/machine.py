"""What a benchmark was measured on, and how its memory is read: the machine description, the
command line and commit that go into every JSON, and the per-process memory probe."""

from __future__ import annotations

import ctypes
import os
import platform
import shlex
import subprocess
import sys

import psutil
import torch

import nanoddp


def tune_malloc() -> None:
    """Ask glibc to unmap freed blocks >= 128 KiB at once, so RSS tracks tensors (Linux only)."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: fixed, so it stops growing on its own
        libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


class Memory:
    """Resident bytes now and the high-water mark since `reset()`, on the CPU or the GPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def now(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.cuda else psutil.Process().memory_info().rss

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        except OSError:
            pass

    def peak(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device)
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return self.now()


def machine_description() -> dict:
    """What the numbers were measured on (goes into the JSON and the README table's caption)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"host": platform.node(), "cpu": cpu, "cpus": os.cpu_count(), "gpu": gpu,
            "memory_gb": round(psutil.virtual_memory().total / 2**30, 1), "os": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "nanoddp": nanoddp.__version__}  # fmt: skip


def command_line() -> str:
    """How this process was started, as a user would type it (`nanoddp bench train ...`)."""
    argv = list(sys.argv)
    if argv and os.path.basename(argv[0]) in ("nanoddp", "__main__.py", "cli.py"):
        argv[0] = "nanoddp"
    return shlex.join(argv)


def git_commit() -> str | None:
    """The checkout's commit (with `+dirty` for local changes), or None outside a git checkout."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")
