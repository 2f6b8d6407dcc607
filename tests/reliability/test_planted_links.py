"""No write follows a link another user planted, and a failed write names its path.

In a group-writable run or checkpoint directory, another user can plant a symlink where nanoddp
is about to write: at a temporary name (the old writer's `.state.pt.tmp-<pid>` was predictable and
opened through a link, overwriting the link's target), at the destination, at `metrics.jsonl`,
or in place of the directory itself. Each case here plants one and checks that the link's
target (the "victim", a file outside the directory) is untouched.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import nanoddp
from nanoddp.base import files
from nanoddp.base.records import STEP_FIELDS
from nanoddp.env import DistEnv
from nanoddp.train.checkpoint import snapshot
from nanoddp.train.launcher import agent
from nanoddp.train.launcher import cli as launcher_cli
from nanoddp.train.metrics import MetricsLogger

VICTIM_TEXT = "export PATH=$HOME/bin:$PATH  # the victim's own file\n"
OTHER_UID = 4242  # the "other user" who planted a link (we are root in CI: lchown can give it away)


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    home = tmp_path / "victim-home"
    home.mkdir()
    path = home / ".bashrc"
    path.write_text(VICTIM_TEXT)
    return path


def _plant(link: Path, target: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


def test_save_state_ignores_a_link_at_the_old_predictable_temp_name(tmp_path, victim):
    """The attack as reported: `.state.pt.tmp-<pid>` -> ~/.bashrc. The old writer opened it
    (following the link), wrote the snapshot into .bashrc and renamed the link to state.pt."""
    out = tmp_path / "shared"
    planted = _plant(out / f".state.pt.tmp-{os.getpid()}", victim)
    nanoddp.save_state(out / "state.pt", step=3, weights=torch.arange(4.0))
    assert victim.read_text() == VICTIM_TEXT
    assert not (out / "state.pt").is_symlink() and (out / "state.pt").is_file()
    assert planted.is_symlink(), "the planted link is the other user's: left alone, not deleted"
    assert torch.equal(snapshot.load(out / "state.pt")["objects"]["weights"]["state"], torch.arange(4.0))


def test_a_planted_name_we_draw_is_never_opened(tmp_path, victim, monkeypatch):
    """Even a correctly guessed random name is refused by O_EXCL|O_NOFOLLOW; another is drawn."""
    names = iter(["guessed", "fresh"])
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: next(names))
    out = tmp_path / "shared"
    _plant(out / f".model.pt{files.TEMP_MARK}{os.getpid()}-guessed", victim)
    files.atomic_torch_save(out / "model.pt", {"w": torch.ones(2)})
    assert victim.read_text() == VICTIM_TEXT
    assert torch.equal(torch.load(out / "model.pt")["w"], torch.ones(2))
    assert sorted(p.name for p in out.iterdir()) == [f".model.pt{files.TEMP_MARK}{os.getpid()}-guessed", "model.pt"]


def test_a_link_at_the_destination_is_replaced_not_written_through(tmp_path, victim):
    out = tmp_path / "shared"
    _plant(out / "state.pt", victim)
    nanoddp.save_state(out / "state.pt", step=1)
    assert victim.read_text() == VICTIM_TEXT
    assert not (out / "state.pt").is_symlink()
    assert snapshot.load(out / "state.pt")["objects"]["step"]["state"] == 1


def test_metrics_jsonl_planted_as_a_link_is_refused(tmp_path, victim):
    run = tmp_path / "run"
    _plant(run / "metrics.jsonl", victim)
    logger = MetricsLogger(run)
    with pytest.raises(ValueError, match=r"metrics\.jsonl is a symbolic link, not a regular file.*never followed"):
        logger.write({**dict.fromkeys(STEP_FIELDS), "step": 1, "loss": 2.0})
    assert victim.read_text() == VICTIM_TEXT


@pytest.mark.skipif(os.geteuid() != 0, reason="planting a link owned by another user needs root (lchown)")
def test_a_directory_link_of_another_user_is_refused_ours_is_followed(tmp_path, victim):
    elsewhere = victim.parent / "snapshots-elsewhere"
    elsewhere.mkdir()
    foreign = _plant(tmp_path / "run" / "snapshots", elsewhere)
    os.lchown(foreign, OTHER_UID, OTHER_UID)
    with pytest.raises(ValueError, match=r"snapshots is a symbolic link owned by another user \(uid 4242\)"):
        snapshot.save(foreign / "step-00000001.pt", {"step": 1})
    assert list(elsewhere.iterdir()) == []
    os.lchown(foreign, os.getuid(), os.getgid())  # the user's own link (e.g. runs -> /scratch/runs)
    snapshot.save(foreign / "step-00000001.pt", {"step": 1})
    assert snapshot.load(elsewhere / "step-00000001.pt") == {"step": 1}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


@pytest.mark.timeout(120)
def test_trainer_writes_through_no_planted_link(tmp_path, victim):
    """The Trainer's snapshots, config.json and model.pt, with links planted at every temporary
    name the old writer would have used for them."""
    out = tmp_path / "run"
    names = [f".step-{step:08d}.pt" for step in (1, 2, 3, 4)] + [".model.pt", ".config.json"]
    for name in names:
        _plant((out / "snapshots" if name.startswith(".step") else out) / f"{name}.tmp-{os.getpid()}", victim)
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(0))
    model = _model()
    trainer = nanoddp.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), TensorDataset(x, (x.sum(1) > 0).long()),
        loss_fn=F.cross_entropy, out=str(out), steps=4, batch_size=8, snapshot_every=2, engine="single",
        env=DistEnv.single_process("gloo"), progress=False,
    )  # fmt: skip
    trainer.fit()
    assert victim.read_text() == VICTIM_TEXT
    final = torch.load(out / "model.pt")
    assert all(torch.equal(final[k], v) for k, v in model.state_dict().items())
    assert [step for step, _ in snapshot.list_snapshots(out / "snapshots")] == [4, 2]


# ---- a full disk and a read-only directory name the path ---------------------------------------

_WRITE = """
import sys, torch
from nanoddp.train.checkpoint import snapshot
try:
    snapshot.save(sys.argv[1], {"w": torch.zeros(int(sys.argv[2]))})
except OSError as exc:
    print(f"{type(exc).__name__}: {exc}")
"""


def _in_private_tmpfs(options: str, size_floats: int, tmp_path: Path) -> str:
    """Run the writer in a private mount namespace on a tmpfs mounted with `options`."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    script = tmp_path / "write.py"
    script.write_text(textwrap.dedent(_WRITE))
    target = mount / "ckpt" / "state.pt"
    setup = f"mount -t tmpfs -o {options} tmpfs {mount}"
    if "ro" in options.split(","):  # the directory must exist before the filesystem goes read-only
        setup = f"mount -t tmpfs tmpfs {mount} && mkdir {mount}/ckpt && mount -o remount,ro {mount}"
    command = f"{setup} && {sys.executable} {script} {target} {size_floats}"
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", command],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


needs_mount_namespace = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="a private tmpfs (full or read-only) needs root and unshare --mount",
)


@needs_mount_namespace
@pytest.mark.timeout(120)
def test_a_full_disk_names_the_file(tmp_path):
    line = _in_private_tmpfs("size=256k", 1 << 20, tmp_path)  # 4 MB into 256 kB
    assert line.startswith("OSError: [Errno 28] cannot write ") and "ckpt/state.pt: No space left" in line, line


@needs_mount_namespace
@pytest.mark.timeout(120)
def test_a_read_only_directory_names_the_file(tmp_path):
    line = _in_private_tmpfs("ro", 4, tmp_path)
    assert line.startswith("OSError: [Errno 30] cannot write ") and "ckpt/state.pt: Read-only" in line, line


def test_a_workers_log_planted_as_a_link_is_refused(tmp_path, victim):
    """OUT/logs/rank<r>.log, where `nanoddp train`'s workers log everything: appended through no link."""
    out = tmp_path / "run"
    _plant(agent.rank_log(out, 0), victim)
    root_handlers = logging.getLogger().handlers[:]
    try:
        with pytest.raises(ValueError, match=r"rank0\.log is a symbolic link, not a regular file.*never followed"):
            launcher_cli._setup_worker_logging(0, str(out))
    finally:
        logging.getLogger().handlers[:] = root_handlers
    assert victim.read_text() == VICTIM_TEXT
