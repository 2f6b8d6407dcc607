"""nanoddp.DistributedDataParallel against real references: a single process on the full batch,
torch's own DDP, and torch's comm hooks.

All multi-process checks of one world size run in ONE launch (start-up costs seconds); each
check is still reported as its own pytest case (see suite_runner). Both comm backends run in
that launch, torch's first, so a failure in `nanoddp.comm` cannot hide the engine's results.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import (
    BACKENDS,
    CHECKED_STEPS,
    STEPS,
    TIGHT,
    B,
    Branchy,
    assert_same_grads,
    assert_same_params,
    branchy_reference,
    build,
    global_batch,
    run_cases,
    sgd,
    shard,
    single_process_params,
    suites_by_world_size,
)
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.testing import assert_close

import nanoddp
from nanoddp import DistributedDataParallel, hooks, verify_replicas
from nanoddp.models import MLPClassifier

CAPS_MB = (0.001, 1, 25)


# ---- models and data (identical on every rank unless a seed says otherwise) --------------------


# ---- cases: each runs on every rank; fn(env, backend, ...) -----------------------------------


def case_matches_single_process(env, backend, kind, cap_mb, as_view):
    """ws ranks x batch B == one process x batch ws*B, after 1 and 3 SGD steps."""
    expected = single_process_params(kind, env.world_size)
    model = build(kind, seed=env.rank)  # different init per rank: construction must broadcast rank 0's
    ddp = DistributedDataParallel(model, bucket_cap_mb=cap_mb, gradient_as_bucket_view=as_view, comm_backend=backend)
    opt = sgd(ddp.parameters())
    for step in range(1, STEPS + 1):
        x, y = global_batch(kind, B * env.world_size, step)
        ddp(shard(x, env.rank), shard(y, env.rank))[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)  # exercise both: zeroed views and fresh grads
        if step in CHECKED_STEPS:
            assert_same_params(model, expected[step], f"step {step}")


def case_bucket_view_grads_live_in_buckets(env, backend):
    ddp = DistributedDataParallel(build("mlp"), bucket_cap_mb=0.01, gradient_as_bucket_view=True, comm_backend=backend)
    for _ in range(2):  # second iteration: after the bucket rebuild
        x, y = global_batch("mlp", B * env.world_size, 0)
        ddp(shard(x, env.rank), shard(y, env.rank))[1].backward()
        spans = [(b.buffer.data_ptr(), b.buffer.data_ptr() + b.nbytes) for b in ddp.reducer.buckets]
        for name, p in ddp.module.named_parameters():
            inside = [lo for lo, hi in spans if lo <= p.grad.data_ptr() < hi]
            assert len(inside) == 1, f"{name}.grad is not a view into a bucket buffer"
        ddp.zero_grad(set_to_none=False)


def case_same_grads_as_torch_ddp(env, backend, kind):
    ours = DistributedDataParallel(build(kind, seed=env.rank), comm_backend=backend)
    theirs = TorchDDP(build(kind, seed=env.rank))
    for step in range(2):  # the second step runs on rebuilt buckets in both engines
        x, y = global_batch(kind, B * env.world_size, step)
        for engine in (ours, theirs):
            engine.zero_grad()
            engine(shard(x, env.rank), shard(y, env.rank))[1].backward()
        assert_same_grads(ours.module, theirs.module, f"step {step}")


def _doubling_hook(state, bucket):
    """A user hook in torch's contract that returns a NEW tensor: twice the average."""
    world_size = dist.get_world_size()
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0] * (2.0 / world_size))


def _torch_bf16_hook(state, bucket):
    """torch's bf16 hook under another name: torch DDP refuses the name without NCCL."""
    return default_hooks.bf16_compress_hook(state, bucket)


def case_comm_hooks_match_torch(env, backend):
    pairs = [
        (hooks.allreduce_hook, default_hooks.allreduce_hook, TIGHT),
        (hooks.fp16_compress_hook, default_hooks.fp16_compress_hook, {"rtol": 2e-3, "atol": 1e-5}),
        (hooks.bf16_compress_hook, _torch_bf16_hook, {"rtol": 2e-2, "atol": 1e-4}),
    ]
    x, y = global_batch("mlp", B * env.world_size, 0)
    plain = DistributedDataParallel(build("mlp"), bucket_cap_mb=0.01, comm_backend=backend)
    plain(shard(x, env.rank), shard(y, env.rank))[1].backward()
    for ours_hook, torch_hook, tol in pairs:
        ours = DistributedDataParallel(build("mlp"), bucket_cap_mb=0.01, comm_backend=backend)
        ours.register_comm_hook(None, ours_hook)
        theirs = TorchDDP(build("mlp"))
        theirs.register_comm_hook(None, torch_hook)
        engines = [ours, theirs]
        if ours_hook is not hooks.bf16_compress_hook:  # torch DDP refuses that name without NCCL
            engines.append(TorchDDP(build("mlp")))  # our hooks also plug into torch DDP
            engines[-1].register_comm_hook(None, ours_hook)
        for engine in engines:
            engine(shard(x, env.rank), shard(y, env.rank))[1].backward()
        for engine in engines[1:]:
            assert_same_grads(ours.module, engine.module, f"{ours_hook.__name__} vs {type(engine)}", **tol)
        assert_same_grads(ours.module, plain.module, f"{ours_hook.__name__} vs no hook", rtol=2e-2, atol=1e-4)
    doubled = DistributedDataParallel(build("mlp"), bucket_cap_mb=0.01, comm_backend=backend)
    doubled.register_comm_hook(None, _doubling_hook)
    doubled(shard(x, env.rank), shard(y, env.rank))[1].backward()
    for p, q in zip(doubled.module.parameters(), plain.module.parameters(), strict=True):
        assert_close(p.grad, 2 * q.grad, **TIGHT)


def case_no_sync_accumulation(env, backend, as_view):
    """k micro-batches with no_sync on the first k-1 == one batch of k*ws*B samples."""
    ws = env.world_size
    for k in range(1, 5):
        ddp = DistributedDataParallel(
            build("mlp"), bucket_cap_mb=0.01, gradient_as_bucket_view=as_view, comm_backend=backend
        )
        ddp.record_timeline = True
        x, y = global_batch("mlp", k * ws * B, k)
        for micro in range(k):
            last = micro == k - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                rows = slice((micro * ws + env.rank) * B, (micro * ws + env.rank + 1) * B)
                (ddp(x[rows], y[rows])[1] / k).backward()
            launches = [e for e in ddp.last_timeline if e[0] == "launch"]
            assert bool(launches) == last, f"k={k} micro {micro}: {len(launches)} bucket launches"
        reference = build("mlp")
        reference(x, y)[1].backward()
        assert_same_grads(ddp.module, reference, f"no_sync k={k}")


def case_find_unused_parameters(env, backend, static_graph):
    torch.manual_seed(0)
    ddp = DistributedDataParallel(
        Branchy(), bucket_cap_mb=0.0001, find_unused_parameters=True, static_graph=static_graph, comm_backend=backend
    )
    for step in range(3):
        ddp.zero_grad(set_to_none=True)
        x = torch.randn(env.world_size * B, 8, generator=torch.Generator().manual_seed(step))
        ddp(shard(x, env.rank), env.rank == 0).backward()
        reference = branchy_reference(env.world_size, step)
        assert_same_grads(ddp.module, reference, f"step {step}")
        assert ddp.module.never.weight.grad is None  # unused everywhere: left alone, like torch DDP


def case_unused_without_flag_raises(env, backend):
    torch.manual_seed(0)
    ddp = DistributedDataParallel(Branchy(), comm_backend=backend)
    x = torch.randn(B, 8)
    with pytest.raises(RuntimeError) as info:
        ddp(x, env.rank == 0).backward()
    message = str(info.value)
    assert "never.weight" in message and "find_unused_parameters=True" in message, message
    if env.world_size > 1:
        assert "branch.weight" in message, message  # unused on some ranks only: still reported
    probe = torch.ones(3)  # the ranks are still in step: a collective completes
    dist.all_reduce(probe)
    assert probe.tolist() == [env.world_size] * 3


def case_overlap_is_real(env, backend):
    """Some bucket's all-reduce is launched while backward is still producing gradients."""
    ddp = DistributedDataParallel(build("gpt"), bucket_cap_mb=1, comm_backend=backend)
    ddp.record_timeline = True
    for step in range(2):
        x, y = global_batch("gpt", B * env.world_size, step)
        ddp(shard(x, env.rank), shard(y, env.rank))[1].backward()
        launches = [t for event, t, _ in ddp.last_timeline if event == "launch"]
        last_grad = max(t for event, t, _ in ddp.last_timeline if event == "grad_ready")
        early = [t for t in launches if t < last_grad]
        assert len(launches) == len(ddp.reducer.buckets) > 1
        assert early, f"step {step}: all {len(launches)} launches came after the last gradient"


class Shuffled(nn.Module):
    """Registered late-then-early but used early-then-late: registration order is a bad guess."""

    def __init__(self):
        super().__init__()
        self.late = nn.Linear(16, 16)
        self.early = nn.Linear(16, 16)

    def forward(self, x):
        return self.late(torch.relu(self.early(x))).pow(2).mean()


def case_buckets_rebuilt_in_ready_order(env, backend):
    torch.manual_seed(0)
    ddp = DistributedDataParallel(Shuffled(), bucket_cap_mb=0.001, comm_backend=backend)
    torch.manual_seed(0)
    reference = Shuffled()
    assert ddp.bucket_param_names[0][0].startswith("early")  # the reverse-registration guess
    for step in range(3):
        ddp.zero_grad()
        reference.zero_grad()
        x = torch.randn(env.world_size * B, 16, generator=torch.Generator().manual_seed(step))
        ddp(shard(x, env.rank)).backward()
        (reference(x)).backward()
        assert_same_grads(ddp.module, reference, f"step {step}")
        if step >= 1:
            assert ddp.bucket_param_names[0][0].startswith("late"), ddp.bucket_param_names


def case_mismatched_models_raise_everywhere(env, backend):
    last = env.world_size - 1
    torch.manual_seed(0)
    odd = MLPClassifier(in_features=32, hidden=48 if env.rank == last else 64)
    with pytest.raises(ValueError, match=rf"net\.0\.weight.*rank {last}"):
        DistributedDataParallel(odd, comm_backend=backend)
    frozen = build("mlp")
    frozen.net[2].bias.requires_grad_(env.rank != last)
    with pytest.raises(ValueError, match=r"net\.2\.bias.*frozen"):
        DistributedDataParallel(frozen, comm_backend=backend)


class WithCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("counter", torch.zeros(3))

    def forward(self, x, scale=1.0):
        Pair = collections.namedtuple("Pair", "out total")
        out = self.lin(x) * scale
        return {"pair": Pair(out, out.sum()), "counter": self.counter.clone()}


def case_buffers_forward_api_and_state_dict(env, backend):
    for broadcast_buffers in (True, False):
        ddp = DistributedDataParallel(WithCounter(), broadcast_buffers=broadcast_buffers, comm_backend=backend)
        ddp.module.counter.fill_(env.rank)
        result = ddp(torch.ones(2, 4), scale=2.0)  # kwargs in, dict of namedtuple out
        expected = 0.0 if broadcast_buffers else float(env.rank)
        assert result["counter"].tolist() == [expected] * 3
        result["pair"].total.backward()
    theirs = TorchDDP(WithCounter())
    assert list(ddp.state_dict()) == list(theirs.state_dict())
    assert all(key.startswith("module.") for key in ddp.state_dict())
    ddp.load_state_dict(theirs.state_dict())
    assert_close(ddp.module.lin.weight, theirs.module.lin.weight, rtol=0, atol=0)


def case_verify_replicas(env, backend):
    model = build("mlp", seed=env.rank)
    DistributedDataParallel(model, comm_backend=backend)  # broadcasts rank 0's values
    verify_replicas(model, comm_backend=backend)
    last = env.world_size - 1
    with torch.no_grad():
        model.net[2].weight[0, 0] += 1e-3 if env.rank == last else 0.0
    with pytest.raises(ValueError, match=rf"'net\.2\.weight' on ranks \[{last}\]"):
        verify_replicas(model, comm_backend=backend)
    verify_replicas(model, atol=1e-2, comm_backend=backend)


def cases(world_size: int) -> list[tuple[str, callable]]:
    """Every check for one world size, torch backend first; names become pytest ids."""
    p = functools.partial
    full = world_size == 2  # the complete matrix at ws=2, a representative subset at 3 and 4
    out = []
    for backend in BACKENDS:
        for kind in ("mlp", "gpt"):
            configs = [(cap, view) for cap in CAPS_MB for view in (False, True)]
            if kind == "gpt" and not full:
                configs = [(1, False), (0.001, True)]
            if kind == "mlp" and world_size == 4:
                configs = [(0.001, False), (25, True)]
            for cap, view in configs:
                name = f"{backend}-matches_single_process-{kind}-cap{cap}-{'view' if view else 'copy'}"
                out.append((name, p(case_matches_single_process, backend=backend, kind=kind, cap_mb=cap, as_view=view)))
        out.append(
            (
                f"{backend}-same_grads_as_torch_ddp-{'gpt' if full else 'mlp'}",
                p(case_same_grads_as_torch_ddp, backend=backend, kind="gpt" if full else "mlp"),
            )
        )
        for view in (False, True) if full else (False,):
            out.append(
                (
                    f"{backend}-no_sync-{'view' if view else 'copy'}",
                    p(case_no_sync_accumulation, backend=backend, as_view=view),
                )
            )
        for static in (False, True) if full else (False,):
            out.append(
                (
                    f"{backend}-find_unused_parameters-{'static' if static else 'dynamic'}",
                    p(case_find_unused_parameters, backend=backend, static_graph=static),
                )
            )
        simple = [case_unused_without_flag_raises, case_mismatched_models_raise_everywhere]
        if full:
            simple += [
                case_bucket_view_grads_live_in_buckets,
                case_comm_hooks_match_torch,
                case_overlap_is_real,
                case_buckets_rebuilt_in_ready_order,
                case_buffers_forward_api_and_state_dict,
                case_verify_replicas,
            ]
        for fn in simple:
            out.append((f"{backend}-{fn.__name__.removeprefix('case_')}", p(fn, backend=backend)))
    return out


def ddp_suite(env, out_dir):
    run_cases(env, cases(env.world_size), out_dir)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return suites_by_world_size(ddp_suite, tmp_path_factory, "ddp", timeout=420)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "world_size,case",
    [(ws, name) for ws in (2, 3, 4) for name, _ in cases(ws)],
    ids=[f"ws{ws}-{name}" for ws in (2, 3, 4) for name, _ in cases(ws)],
)
def test_ddp(suite, world_size, case):
    suite(world_size).check(case)


# ---- single-process checks (no launch) -----------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, "25", True, float("nan")])
def test_bucket_cap_must_be_positive(bad):
    with pytest.raises(ValueError, match="bucket_cap_mb must be a number > 0"):
        DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb=bad)


def test_bad_arguments_are_rejected_clearly():
    with pytest.raises(ValueError, match="comm_backend must be one of"):
        DistributedDataParallel(nn.Linear(2, 2), comm_backend="mpi")
    with pytest.raises(ValueError, match="at most one device"):
        DistributedDataParallel(nn.Linear(2, 2), device_ids=[0, 1])
    with pytest.raises(TypeError, match="torch.nn.Module"):
        DistributedDataParallel(lambda x: x)


def test_world_size_one_is_a_pass_through():
    """Without a process group (or with one rank) the wrapper adds nothing: same grads, same
    `module.`-prefixed state_dict as torch DDP, no_sync still accumulates."""
    assert not dist.is_initialized()
    model, plain = build("mlp"), build("mlp")
    ddp = nanoddp.DistributedDataParallel(model)
    x, y = global_batch("mlp", 4, 0)
    with ddp.no_sync():
        ddp(x[:2], y[:2])[1].backward()
    ddp(x[2:], y[2:])[1].backward()
    plain(x[:2], y[:2])[1].backward()
    plain(x[2:], y[2:])[1].backward()
    assert_same_grads(model, plain, "pass-through", rtol=0, atol=0)
    assert set(ddp.state_dict()) == {f"module.{k}" for k in plain.state_dict()}
    clone = copy.deepcopy(ddp.module)
    assert_close(clone.net[0].weight, model.net[0].weight)
