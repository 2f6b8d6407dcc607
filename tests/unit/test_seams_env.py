"""srun's and mpirun's variables become one job of N ranks or one clear refusal; the Trainer does
not clip unless asked; our collectives after the group is gone raise torch's error under -O too.
The variables are set in this process's real `os.environ`, which refuses lookups a dict allows.
(Each scheduler's processes joining one group are in tests/multiproc/test_seams.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import nanoddp
from nanoddp.env import DistEnv

ADDR = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29511"}
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "MPI_", "MASTER_", "TORCHELASTIC_")
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def from_real_environ(monkeypatch, variables: dict[str, str]) -> DistEnv:
    """`DistEnv.from_environ()` reading os.environ holding exactly `variables` of any launcher."""
    for name in list(os.environ):
        if name.startswith(LAUNCHER_PREFIXES) or name in LAUNCHER_VARS:
            monkeypatch.delenv(name)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    return DistEnv.from_environ(backend="gloo")


@pytest.mark.parametrize(
    ("environ", "want"),
    [
        ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
          "SLURM_TASKS_PER_NODE": "2(x2)"}, (3, 4, 1, 2, 1)),
        ({"SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
          "SLURM_TASKS_PER_NODE": "3,2"}, (4, 5, 1, 2, 1)),
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, (1, 2, 1, 2, 0)),
        ({"PMI_RANK": "2", "PMI_SIZE": "3"}, (2, 3, 2, 3, 0)),  # no local layout: one node, as torchrun's default
        ({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, (3, 4, 1, 2, 1)),
    ],
)  # fmt: skip
def test_scheduler_vars_make_one_job(monkeypatch, environ, want):
    env = from_real_environ(monkeypatch, {**environ, **ADDR})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == want
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 29511)


@pytest.mark.parametrize(
    ("environ", "launcher"),
    [
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, "srun (SLURM)"),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, "mpirun (Open MPI)"),
        ({"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_PORT": "1"}, "mpirun (MPICH/PMI)"),
    ],
)
def test_scheduler_without_rendezvous_is_refused_in_one_line(monkeypatch, environ, launcher):
    with pytest.raises(ValueError) as raised:
        from_real_environ(monkeypatch, environ)
    message = str(raised.value)
    assert message.startswith(f"{launcher} started 2 processes but MASTER_ADDR")
    assert "export MASTER_ADDR=" in message and "\n" not in message


def test_one_task_and_torchrun_keep_their_meaning(monkeypatch):
    single = from_real_environ(monkeypatch, {"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert single.world_size == 1  # `srun -n 1`: needs no rendezvous
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "8", **ADDR}
    env = from_real_environ(monkeypatch, torchrun)  # `srun torchrun ...`: torchrun's ranks
    assert (env.rank, env.world_size) == (1, 2)


def test_trainer_does_not_clip_unless_asked(tmp_path):
    """One step of a loss whose gradient norm is far above 1: plain SGD's step, as a torch loop."""
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))  # (8, 3)
    data = TensorDataset(x, (x.sum(1) > 0).long())

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Linear(3, 2)

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return 100 * F.cross_entropy(out, y)

    net = model()
    trainer = nanoddp.Trainer(
        net, torch.optim.SGD(net.parameters(), lr=1e-3), data, loss_fn=loss_fn, out=str(tmp_path / "run"),
        env=DistEnv.single_process("gloo"), steps=1, batch_size=8, engine="single", progress=False,
    )  # fmt: skip
    assert trainer.config.grad_clip == 0.0
    trainer.fit()
    ref = model()
    loss_fn(ref(x), data.tensors[1]).backward()
    assert torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]) > 10  # a clip at 1.0 would fire
    torch.optim.SGD(ref.parameters(), lr=1e-3).step()
    for p, q in zip(trainer.module.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q)  # the whole dataset in one batch: the same mean, in another order


AFTER_DESTROY = """
import torch, torch.distributed as dist, nanoddp
from nanoddp import comm
nanoddp.init()
dist.destroy_process_group()
try:
    comm.all_reduce(torch.ones(2))
except ValueError as exc:
    print(exc)
"""


def test_collective_after_destroy_raises_under_python_O():
    out = subprocess.run([sys.executable, "-O", "-c", AFTER_DESTROY], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    want = "Default process group has not been initialized, please make sure to call init_process_group."
    assert out.stdout.strip() == want
