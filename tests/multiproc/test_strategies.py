"""The seeds' manual strategies (per-parameter all-reduce, flat reduce-scatter + all-gather,
SimpleDDP) against a single process on the full batch, on 1-4 gloo ranks, both comm backends."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from helpers import (
    BACKENDS,
    CHECKED_STEPS,
    STEPS,
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

from nanoddp import DistributedDataParallel, SimpleDDP
from nanoddp.parallel.manual import allreduce_gradients, reduce_scatter_all_gather_gradients

STRATEGIES = {"allreduce": allreduce_gradients, "rs_ag": reduce_scatter_all_gather_gradients}


def case_strategy_matches_single_process(env, backend, strategy, kind):
    expected = single_process_params(kind, env.world_size)
    model = build(kind)  # manual strategies do not broadcast: every rank seeds alike
    opt = sgd(model.parameters())
    for step in range(1, STEPS + 1):
        x, y = global_batch(kind, B * env.world_size, step)
        model(shard(x, env.rank), shard(y, env.rank))[1].backward()
        STRATEGIES[strategy](model, comm_backend=backend)
        opt.step()
        opt.zero_grad()
        if step in CHECKED_STEPS:
            assert_same_params(model, expected[step], f"{strategy} step {step}")


def case_strategy_missing_grads_count_as_zero(env, backend, strategy):
    torch.manual_seed(0)
    model = Branchy()
    x = torch.randn(env.world_size * B, 8, generator=torch.Generator().manual_seed(0))
    model(shard(x, env.rank), env.rank == 0).backward()
    STRATEGIES[strategy](model, comm_backend=backend)
    reference = branchy_reference(env.world_size, 0)
    reference.never.weight.grad = torch.zeros_like(reference.never.weight)  # zeros, not None, here
    reference.never.bias.grad = torch.zeros_like(reference.never.bias)
    assert_same_grads(model, reference, strategy)


def case_simple_ddp_no_sync_accumulation(env, backend):
    """SimpleDDP: k micro-batches, sync after the last only == one batch of k*ws*B."""
    ws, k = env.world_size, 3
    model = SimpleDDP(build("mlp"), comm_backend=backend)
    model.train()
    x, y = global_batch("mlp", k * ws * B, 7)
    for micro in range(k):
        if micro < k - 1:
            model.disable_grad_sync()
        else:
            model.enable_grad_sync()
        rows = slice((micro * ws + env.rank) * B, (micro * ws + env.rank + 1) * B)
        (model(x[rows], y[rows])[1] / k).backward()
        model.sync_gradients()
    reference = build("mlp")
    reference(x, y)[1].backward()
    assert_same_grads(model.model, reference, "SimpleDDP")
    with model.no_sync():
        assert not model.do_sync
    assert model.do_sync
    assert not model.eval().model.training


def case_simple_ddp_rejects_unseeded_replicas(env, backend):
    if env.world_size == 1:
        SimpleDDP(build("mlp", seed=123), comm_backend=backend)  # nothing to compare with
        return
    with pytest.raises(ValueError, match=r"'net\.0\.weight' differs from rank 0's on \d+ rank.*same seed"):
        SimpleDDP(build("mlp", seed=env.rank), comm_backend=backend)
    SimpleDDP(build("mlp", seed=5), comm_backend=backend)  # same seed everywhere: accepted


def case_world_size_one_is_plain(env, backend):
    """With one rank nothing is communicated: grads equal a plain backward, bit for bit."""
    ddp = DistributedDataParallel(build("mlp"), comm_backend=backend)
    plain = build("mlp")
    x, y = global_batch("mlp", B, 0)
    ddp(x, y)[1].backward()
    plain(x, y)[1].backward()
    assert_same_grads(ddp.module, plain, "ddp ws=1", rtol=0, atol=0)
    assert all(key.startswith("module.") for key in ddp.state_dict())
    for strategy in STRATEGIES.values():
        before = [p.grad.clone() for p in plain.parameters()]
        strategy(plain, comm_backend=backend)
        for p, g in zip(plain.parameters(), before, strict=True):
            assert torch.equal(p.grad, g)


def cases(world_size: int) -> list[tuple[str, callable]]:
    p = functools.partial
    out = []
    for backend in BACKENDS:
        if world_size == 1:
            out.append((f"{backend}-world_size_one_is_plain", p(case_world_size_one_is_plain, backend=backend)))
        kinds = ("mlp", "gpt") if world_size in (1, 2) else ("mlp",)
        for strategy in STRATEGIES:
            for kind in kinds:
                out.append(
                    (
                        f"{backend}-{strategy}-matches_single_process-{kind}",
                        p(case_strategy_matches_single_process, backend=backend, strategy=strategy, kind=kind),
                    )
                )
            if world_size > 1:
                out.append(
                    (
                        f"{backend}-{strategy}-missing_grads_count_as_zero",
                        p(case_strategy_missing_grads_count_as_zero, backend=backend, strategy=strategy),
                    )
                )
        out.append((f"{backend}-simple_ddp_no_sync", p(case_simple_ddp_no_sync_accumulation, backend=backend)))
        out.append(
            (
                f"{backend}-simple_ddp_rejects_unseeded_replicas",
                p(case_simple_ddp_rejects_unseeded_replicas, backend=backend),
            )
        )
    return out


def strategies_suite(env, out_dir):
    run_cases(env, cases(env.world_size), out_dir)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return suites_by_world_size(strategies_suite, tmp_path_factory, "strategies", timeout=300)


WORLD_SIZES = (1, 2, 3, 4)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "world_size,case",
    [(ws, name) for ws in WORLD_SIZES for name, _ in cases(ws)],
    ids=[f"ws{ws}-{name}" for ws in WORLD_SIZES for name, _ in cases(ws)],
)
def test_strategies(suite, world_size, case):
    suite(world_size).check(case)


def test_simple_ddp_without_process_group_needs_init():
    """The manual strategies are collectives: without a process group they fail loudly."""
    for backend in ("torch", "nanoddp"):
        with pytest.raises(ValueError, match="Default process group has not been initialized"):
            allreduce_gradients(nn.Linear(2, 2), comm_backend=backend)
