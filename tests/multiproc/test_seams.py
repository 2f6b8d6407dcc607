"""Where a user's own code meets nanoddp: clipping, ZeRO-2's state_dict, meta-device init,
srun's variables, and our collectives outside their group or after the group is gone.

Each case compares against a real reference: a one-process run on the whole batch (the grads
every data-parallel layout must reproduce), an unsharded init with the same seed, or what
torch.distributed itself does in the same situation. One launch per world size runs every
case (ws 3 only where an uneven split matters: ZeRO-2's pieces and FSDP's rows).

Tolerances: against the one-process run, assert_close's float32 defaults, because that run sums
the whole batch in one matmul while the ranks sum their halves and then add (another order).
Meta init and what torch raises or warns are compared exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from helpers import run_cases, suites_by_world_size
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.testing import assert_close

import nanoddp
from nanoddp import comm
from nanoddp.env import free_port
from nanoddp.fsdp import fully_shard
from nanoddp.parallel.zero.stage2 import zero2

ROWS, MAX_NORM = 4, 0.05  # per-rank batch; a clip that fires (the true norm is ~0.5)


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5))  # dims indivisible by 2 and 3


def global_batch(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randn(ROWS * world_size, 6, generator=g), torch.randn(ROWS * world_size, 5, generator=g)


def my_batch(env) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(env.world_size)
    return x[env.rank * ROWS : (env.rank + 1) * ROWS], y[env.rank * ROWS : (env.rank + 1) * ROWS]


def loss_of(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return (model(x) - y).pow(2).mean()


def reference(env) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, the whole batch: the total norm, the clipped grads, the weights after SGD(lr=1)."""
    model = build()
    loss_of(model, global_batch(env.world_size)).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return norm, grads, {k: v.clone() for k, v in model.state_dict().items()}


def check_clip(env, model: nn.Module, grads_of) -> None:
    """nanoddp.clip_grad_norm_ on `model` after backward on this rank's rows: the one-process
    run's norm, and grads (`grads_of(model)`, whole tensors by name) clipped by its factor."""
    want_norm, want_grads, _ = reference(env)
    norm = nanoddp.clip_grad_norm_(model, MAX_NORM)
    assert_close(norm, want_norm)
    got = grads_of(model)
    for name, want in want_grads.items():
        assert_close(got[name], want, msg=lambda m, name=name: f"{name}: {m}")


def plain_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n.removeprefix("module."): p.grad for n, p in model.named_parameters()}


def case_clip_plain(env) -> None:
    """A replicated module, every rank on the whole batch: torch's own result, bitwise."""
    ours, theirs = build(), build()
    for model in (ours, theirs):
        loss_of(model, global_batch(env.world_size)).backward()
    assert torch.equal(nanoddp.clip_grad_norm_(ours.parameters(), MAX_NORM),
                       torch.nn.utils.clip_grad_norm_(theirs.parameters(), MAX_NORM))  # fmt: skip
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ours.parameters(), theirs.parameters(), strict=True))


def case_clip_ddp(env) -> None:
    for wrap in (nanoddp.DistributedDataParallel, TorchDDP):
        model = wrap(build())
        loss_of(model, my_batch(env)).backward()
        check_clip(env, model, plain_grads)


def case_clip_fsdp(env) -> None:
    model = fully_shard(build())
    loss_of(model, my_batch(env)).backward()
    check_clip(env, model, lambda m: {n: p.grad.full_tensor() for n, p in m.named_parameters()})


def case_clip_mixed_kinds(env) -> None:
    """DTensor gradients (the sharded layer) and plain ones (`ignored_params`: the head stays whole
    and unreduced) in one clip, every rank on the whole batch: the one-process norm of all of
    them together, and every gradient clipped by its factor."""
    model = build()
    fully_shard(model, ignored_params=set(model[2].parameters()))
    loss_of(model, global_batch(env.world_size)).backward()
    kinds = {type(p.grad).__name__ for p in model.parameters()}
    assert kinds == {"DTensor", "Tensor"}, kinds
    check_clip(
        env, model, lambda m: {n: getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for n, p in m.named_parameters()}
    )


def zero2_model() -> nn.Module:
    return zero2(build(), bucket_cap_mb=1e-5)  # a small cap: several buckets, pieces split unevenly


def case_clip_zero2(env) -> None:
    """The norm over every rank's pieces; then SGD(lr=1): the one-process weights, whole, from state_dict()."""
    model = zero2_model()
    loss_of(model, my_batch(env)).backward()
    want_norm, _, want_state = reference(env)
    assert_close(nanoddp.clip_grad_norm_(model, MAX_NORM), want_norm)
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    state = model.state_dict()  # collective after the step: the shards are gathered first
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in want_state.items()}
    for k, v in want_state.items():
        assert_close(state[k], v, msg=lambda m, k=k: f"{k}: {m}")


def case_torch_clip_on_zero2_refused(env) -> None:
    """torch's clip would clip each rank by the norm of its own pieces: it is refused, on every rank."""
    model = zero2_model()
    loss_of(model, my_batch(env)).backward()
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"use nanoddp\.clip_grad_norm_\(model, max_norm\)"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))


def case_zero2_state_dict_round_trip(env, tmp: str) -> None:
    """Rank 0's torch.save of state_dict() loads into the plain model; a whole state dict loads
    into a fresh ZeRO-2 model, which then computes what the plain model does."""
    model, plain = zero2_model(), build()
    path = os.path.join(tmp, "zero2.pt")
    state = model.state_dict()  # every rank (it may gather)
    if env.rank == 0:
        torch.save(state, path)
    dist.barrier()
    plain.load_state_dict(torch.load(path))
    assert all(torch.equal(v, build().state_dict()[k]) for k, v in plain.state_dict().items())
    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(-2.0)  # values the fresh model cannot have by chance
    fresh = zero2_model()
    fresh.load_state_dict(plain.state_dict())
    x, _ = my_batch(env)
    with torch.no_grad():
        assert torch.equal(fresh(x), plain(x))
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in plain.state_dict().items())


class InitNet(nn.Module):
    """Linear, Embedding, LayerNorm and two custom inits; dim 0s indivisible by 2 and 3."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.lin = nn.Linear(4, 7)
        self.norm = nn.LayerNorm(7)
        self.extra = nn.Parameter(torch.empty(5, 3))
        self.scale = nn.Parameter(torch.empty(7))

    def reset_parameters(self) -> None:
        for m in (self.emb, self.lin, self.norm):
            m.reset_parameters()
        nn.init.trunc_normal_(self.extra, std=0.02)
        nn.init.normal_(self.scale, mean=1.0, std=0.1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(self.emb(idx))) * self.scale  # (B, T, 7)


def case_meta_init(env) -> None:
    """Meta build, shard, to_empty, reset_parameters with a seed: full_tensor() is the unsharded
    init with that seed, bitwise; and the generator ends where the unsharded init leaves it."""
    for fsdp in (fully_shard, torch_fsdp.fully_shard):  # torch's on a CPU mesh, in this process, too
        with torch.device("meta"):
            model = InitNet()
        fsdp(model)
        model.to_empty(device="cpu")
        torch.manual_seed(5)
        model.reset_parameters()
        after_sharded = torch.rand(3)
        plain = InitNet()
        torch.manual_seed(5)
        plain.reset_parameters()
        assert torch.equal(after_sharded, torch.rand(3))
        for name, p in model.named_parameters():
            assert torch.equal(p.full_tensor(), plain.get_parameter(name)), f"{fsdp.__module__}: {name}"


def case_not_a_member_warns_as_torch(env) -> None:
    """A rank outside the group: torch's warning word for word, None back, the tensor untouched."""
    group = dist.new_group([0])  # every rank calls new_group, as torch requires
    if env.rank == 0:
        return
    for ours, theirs, args in (
        (comm.all_reduce, dist.all_reduce, lambda t: (t,)),
        (comm.broadcast, dist.broadcast, lambda t: (t, 0)),
        (comm.all_gather_into_tensor, dist.all_gather_single, lambda t: (torch.zeros(6), t)),
        (comm.reduce_scatter_tensor, dist.reduce_scatter_single, lambda t: (t[:1], t)),
    ):
        said = []
        for fn in (ours, theirs):
            t = torch.ones(3)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert fn(*args(t), group=group) is None
            assert torch.equal(t, torch.ones(3))
            said.append([(type(w.message), str(w.message)) for w in caught])
        assert said[0] == said[1] and len(said[0]) == 1, said


def case_after_destroy_raises_as_torch(env) -> None:
    """Run last: the default group is gone; ours raise torch's ValueError, word for word."""
    dist.barrier()
    dist.destroy_process_group()
    calls = (
        (lambda t: comm.all_reduce(t), lambda t: dist.all_reduce(t)),
        (lambda t: comm.broadcast(t, 0), lambda t: dist.broadcast(t, 0)),
    )
    for pair in calls:
        said = []
        for fn in pair:
            with pytest.raises(ValueError) as raised:
                fn(torch.ones(2))
            said.append(str(raised.value))
        assert said[0] == said[1], said


def seams_suite(env, out_dir: str) -> None:
    torch.manual_seed(0)
    cases = [("clip_zero2", case_clip_zero2), ("clip_mixed_kinds", case_clip_mixed_kinds)]
    cases += [("meta_init", case_meta_init)]  # uneven pieces and rows at ws 3
    if env.world_size == 2:
        cases = [
            ("clip_plain", case_clip_plain),
            ("clip_ddp", case_clip_ddp),
            ("clip_fsdp", case_clip_fsdp),
            ("torch_clip_on_zero2", case_torch_clip_on_zero2_refused),
            *cases,
            ("zero2_state_dict", lambda e: case_zero2_state_dict_round_trip(e, out_dir)),
            ("not_a_member", case_not_a_member_warns_as_torch),
            ("after_destroy", case_after_destroy_raises_as_torch),  # last: it ends the group
        ]
    run_cases(env, cases, out_dir)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return suites_by_world_size(seams_suite, tmp_path_factory, "seams", timeout=180)


WS2 = ["clip_plain", "clip_ddp", "clip_fsdp", "torch_clip_on_zero2", "zero2_state_dict", "not_a_member"]
WS2 += ["after_destroy"]
BOTH = ["clip_zero2", "clip_mixed_kinds", "meta_init"]


@pytest.mark.parametrize(("world_size", "case"), [(2, c) for c in WS2 + BOTH] + [(3, c) for c in BOTH])
def test_seam(suite, world_size, case):
    suite(world_size).check(case)


SRUN_RANK = """
import torch, torch.distributed as dist, nanoddp
env = nanoddp.init()
t = torch.tensor([float(env.rank + 1)])
dist.all_reduce(t)
print(env.rank, env.world_size, env.local_rank, dist.get_world_size(), t.item(), flush=True)
nanoddp.cleanup()
"""


# Each launcher's variables for rank r of n on one node (MASTER_ADDR/PORT added by the test);
# torchrun's own are read by every run of tests/multiproc/test_torchrun.py.
SCHEDULER_VARS = {
    "srun": lambda r, n: {"SLURM_PROCID": str(r), "SLURM_NTASKS": str(n), "SLURM_LOCALID": str(r),
                          "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": str(n)},
    "mpirun (Open MPI)": lambda r, n: {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": str(n),
                                       "OMPI_COMM_WORLD_LOCAL_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_SIZE": str(n)},
    "mpirun (MPICH/PMI)": lambda r, n: {"PMI_RANK": str(r), "PMI_SIZE": str(n)},
}  # fmt: skip


def _start_ranks(variables: list[dict[str, str]]) -> list[subprocess.Popen]:
    """One `python -c SRUN_RANK` per entry, its os.environ this one's without any launcher's
    variables, plus the entry's."""
    launcher_prefixes = ("SLURM_", "OMPI_", "PMI_", "MPI_", "MASTER_", "TORCHELASTIC_")
    torchrun = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"}
    base = {k: v for k, v in os.environ.items() if k not in torchrun and not k.startswith(launcher_prefixes)}
    base["OMP_NUM_THREADS"] = "1"
    return [
        subprocess.Popen([sys.executable, "-c", SRUN_RANK], env={**base, **extra}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        for extra in variables
    ]  # fmt: skip


def _outputs(procs: list[subprocess.Popen]) -> list[str]:
    try:
        return [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.parametrize(("launcher", "world_size"), [("srun", 2), ("mpirun (Open MPI)", 2), ("mpirun (MPICH/PMI)", 3)])
def test_scheduler_tasks_join_one_job(launcher, world_size):
    """Processes holding only a launcher's variables and a rendezvous address in their real
    environment: one group of N that all-reduces, not N groups of 1."""
    addr = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = _start_ranks([{**SCHEDULER_VARS[launcher](r, world_size), **addr} for r in range(world_size)])
    outs = _outputs(procs)
    assert [p.returncode for p in procs] == [0] * world_size, outs
    total = float(sum(range(1, world_size + 1)))
    want = [f"{r} {world_size} {r} {world_size} {total}" for r in range(world_size)]
    assert [o.strip().splitlines()[-1] for o in outs] == want, outs


def test_mpich_task_without_rendezvous_is_refused_in_one_line():
    """mpirun's MPICH/Intel MPI variables and no MASTER_ADDR: `nanoddp.init()` stops in one line
    (the rank plays no part in it, so every rank prints the same)."""
    (out,) = _outputs(procs := _start_ranks([SCHEDULER_VARS["mpirun (MPICH/PMI)"](1, 2)]))
    assert procs[0].returncode == 1, out
    assert (
        out.strip()
        .splitlines()[-1]
        .startswith("ValueError: mpirun (MPICH/PMI) started 2 processes but MASTER_ADDR and MASTER_PORT are not set")
    ), out
