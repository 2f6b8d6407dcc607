"""nanoddp's DDP against torch's DDP where torch users meet its edges: sparse gradients, 16-bit
compress hooks (and their bytes on the wire), `_ddp_params_and_buffers_to_ignore`, the
refusals of `register_comm_hook` and of the constructor, and pickling (torch.save, deepcopy).
Every case runs torch's DDP on the same model and data and compares bit for bit (errors: type
and text). One launch per world size: ws=2 for everything, ws=3 for the sparse cases (with
three ranks the order of the sums matters).
"""

from __future__ import annotations

import copy
import functools
import io
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import run_cases, suites_by_world_size
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.testing import assert_close

from nanoddp import DistributedDataParallel, hooks

TIGHT = {"rtol": 1e-5, "atol": 1e-6}

# ---- sparse gradients ------------------------------------------------------------------------


class SparseAndDense(nn.Module):
    """A sparse EmbeddingBag and a sparse Embedding feeding dense layers."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(12, 4, mode="sum", sparse=True)
        self.emb = nn.Embedding(12, 4, sparse=True)
        self.head = nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        h = self.bag(ids, offsets) + self.emb(ids[: offsets.numel()])  # (R, 4)
        return self.head(torch.tanh(h)).pow(2).mean()


def torch_layout(ddp: TorchDDP) -> list[list[str]]:
    """torch DDP's buckets, as parameter names in reduction order."""
    names = {p: n for n, p in ddp.module.named_parameters()}
    return [[names[p] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()]


def sparse_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-dependent rows, with rows repeated inside a rank and rows shared by ranks."""
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randint(0, 12, (9,), generator=g), torch.tensor([0, 3, 5])  # (9,), 3 bags


def _seen_by(log: list, hook):
    """A hook that notes what each bucket looks like, then runs `hook`."""

    def spy(state, bucket):
        buffer = bucket.buffer()
        log.append((bucket.index(), str(buffer.layout), tuple(buffer.shape), len(bucket.gradients())))
        return hook(state, bucket)

    return spy


def assert_dense_equal(ours: torch.Tensor, theirs: torch.Tensor, exact: bool, what: str) -> None:
    """Bitwise at ws=2 (one addition per element). At ws=3 gloo's ring all-reduce sums each
    element in an order that depends on where it falls in the chunks of the flat bucket, and the
    two engines lay their dense buckets out differently: equal up to rounding then."""
    if exact:
        assert torch.equal(ours, theirs), f"{what}: max diff {(ours - theirs).abs().max().item()}"
    else:
        assert_close(ours, theirs, **TIGHT, msg=lambda m: f"{what}: {m}")


def assert_same_grads(ours: nn.Module, theirs: nn.Module, exact: bool, what: str) -> None:
    """Sparse gradients: same layout, indices and values, bitwise at every world size, because
    the sums run in torch's order (each rank's duplicate rows, then rank 0 + rank 1 + ...; see
    nanoddp/parallel/ddp/sparse.py). Dense ones: see assert_dense_equal."""
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert p.grad.layout == q.grad.layout, f"{what}: {name}: {p.grad.layout} vs torch's {q.grad.layout}"
        if p.grad.is_sparse:
            assert p.grad.is_coalesced() == q.grad.is_coalesced(), f"{what}: {name}: coalesced differs"
            assert torch.equal(p.grad.indices(), q.grad.indices()), f"{what}: {name}: indices differ"
            assert torch.equal(p.grad.values(), q.grad.values()), f"{what}: {name}: values differ"
        else:
            assert_dense_equal(p.grad, q.grad, exact, f"{what}: {name}.grad")


def case_sparse_matches_torch(env, backend, as_view, hook_pair):
    """2 steps of SGD on sparse + dense parameters: grads and parameters as torch DDP's, bitwise;
    a hook sees what torch's hook sees (a sparse bucket's buffer is the sparse gradient)."""
    torch.manual_seed(0)
    ours_model = SparseAndDense()
    ours = DistributedDataParallel(ours_model, gradient_as_bucket_view=as_view, comm_backend=backend)
    torch.manual_seed(0)
    theirs = TorchDDP(SparseAndDense(), gradient_as_bucket_view=as_view)
    logs: tuple[list, list] = ([], [])
    if hook_pair is not None:
        ours.register_comm_hook(None, _seen_by(logs[0], hook_pair[0]))
        theirs.register_comm_hook(None, _seen_by(logs[1], hook_pair[1]))
    optimizers = [torch.optim.SGD(e.parameters(), lr=0.5) for e in (ours, theirs)]
    exact = env.world_size == 2
    for step in range(2):  # the second step runs on rebuilt buckets in both engines
        for engine, opt in zip((ours, theirs), optimizers, strict=True):
            opt.zero_grad()
            engine(*sparse_batch(env.rank, step)).backward()
        assert_same_grads(ours_model, theirs.module, exact, f"step {step}")
        if step == 1:  # rebuilt in arrival order: a sparse gradient alone, where torch puts it
            assert ours.bucket_param_names == torch_layout(theirs), f"{ours.bucket_param_names} vs torch's"
        for opt in optimizers:
            opt.step()
        for (name, p), q in zip(ours_model.named_parameters(), theirs.module.parameters(), strict=True):
            # the embeddings' values depend on their sparse gradients alone: bitwise at any ws
            assert_dense_equal(p, q, exact or name.startswith(("bag", "emb")), f"step {step}: {name}")
            with torch.no_grad():
                p.copy_(q)  # ws=3: the next sparse gradients start from the same dense weights
    if hook_pair is not None:
        assert sorted(logs[0]) == sorted(logs[1]), f"hook saw {logs[0]}, torch's saw {logs[1]}"
        assert any(layout == str(torch.sparse_coo) for _, layout, _, _ in logs[0])


class BagAndHead(nn.Module):
    """A sparse EmbeddingBag feeding a dense head: a rank whose bags are empty touches no row."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(12, 4, mode="sum", sparse=True)
        self.head = nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.bag(ids, offsets))).pow(2).mean()


def case_sparse_rank_without_rows(env, backend):
    """The last rank's bags are all empty, so its sparse gradient has no rows: every rank still
    ends with the others' rows, summed and averaged, as torch DDP gives (bitwise)."""
    models = []
    for wrap in (functools.partial(DistributedDataParallel, comm_backend=backend), TorchDDP):
        torch.manual_seed(0)
        models.append(wrap(BagAndHead()))
    ids, offsets = sparse_batch(env.rank, 0)
    if env.rank == env.world_size - 1:
        ids, offsets = ids[:0], torch.zeros_like(offsets)  # three empty bags
    for engine in models:
        engine(ids, offsets).backward()
    ours, theirs = (engine.module for engine in models)
    assert theirs.bag.weight.grad._nnz() > 0, "torch's sum has rows: the case tests a rank that had none"
    assert_same_grads(ours, theirs, env.world_size == 2, "a rank without rows")


# ---- 16-bit compress hooks -------------------------------------------------------------------


def build_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))


def dense_batch(rank: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))  # (4, 16)


def _renamed(hook):
    """torch DDP refuses hooks *named* bf16_compress_hook / bf16_compress_wrapper_hook without
    NCCL; the same function under another name is its reference on CPU."""

    def torch_reference_hook(state, bucket):
        return hook(state, bucket)

    return torch_reference_hook


def _counting(collectives, sent: list):
    """`collectives` with the bytes of each gradient all-reduce noted in `sent` (not the reducer's
    int32 count of parameter use)."""

    def all_reduce(tensor, *args, **kwargs):
        if tensor.is_floating_point():
            sent.append(tensor.numel() * tensor.element_size())
        return collectives.all_reduce(tensor, *args, **kwargs)

    return types.SimpleNamespace(**{**vars(collectives), "all_reduce": all_reduce})


def compress_pairs():
    """(name, hook for our DDP, torch's equivalent for torch DDP, wire dtype, goes over our collectives)."""
    allreduce = default_hooks.allreduce_hook
    return [
        ("torch_fp16", default_hooks.fp16_compress_hook, default_hooks.fp16_compress_hook, torch.float16, False),
        ("torch_bf16", default_hooks.bf16_compress_hook, _renamed(default_hooks.bf16_compress_hook),
         torch.bfloat16, False),
        ("torch_fp16_wrapper", default_hooks.fp16_compress_wrapper(allreduce),
         default_hooks.fp16_compress_wrapper(allreduce), torch.float16, False),
        ("torch_bf16_wrapper", default_hooks.bf16_compress_wrapper(allreduce),
         _renamed(default_hooks.bf16_compress_wrapper(allreduce)), torch.bfloat16, False),
        ("fp16_wrapper_of_ours", default_hooks.fp16_compress_wrapper(hooks.allreduce_hook),
         default_hooks.fp16_compress_wrapper(allreduce), torch.float16, True),
        ("bf16_wrapper_of_ours", default_hooks.bf16_compress_wrapper(hooks.allreduce_hook),
         _renamed(default_hooks.bf16_compress_wrapper(allreduce)), torch.bfloat16, True),
        ("ours_fp16", hooks.fp16_compress_hook, default_hooks.fp16_compress_hook, torch.float16, True),
        ("ours_bf16", hooks.bf16_compress_hook, _renamed(default_hooks.bf16_compress_hook), torch.bfloat16, True),
    ]  # fmt: skip


def case_compress_hook_matches_torch(env, backend, pair):
    """The hook's 16-bit tensor is what is all-reduced (half the fp32 bytes, counted where it is
    handed to the collective), and the gradients equal torch DDP's with the same hook, bitwise
    (ws=2: one 16-bit addition per element, the same in every backend)."""
    _, our_hook, torch_hook, wire_dtype, over_ours = pair
    ours = DistributedDataParallel(build_mlp(), bucket_cap_mb=0.001, comm_backend=backend)
    theirs = TorchDDP(build_mlp(), bucket_cap_mb=0.001)
    ours.register_comm_hook(None, our_hook)
    theirs.register_comm_hook(None, torch_hook)
    sent: list[int] = []
    if over_ours:
        ours.reducer.collectives = _counting(ours.reducer.collectives, sent)
    fp32_bytes = sum(b.nbytes for b in ours.reducer.buckets)
    torch_all_reduce = dist.all_reduce

    def counting_torch_all_reduce(tensor, *args, **kwargs):  # torch's hooks call dist.all_reduce
        sent.append(tensor.numel() * tensor.element_size())
        assert tensor.dtype == wire_dtype, f"torch.distributed.all_reduce got {tensor.dtype}"
        return torch_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_torch_all_reduce
    try:
        ours(dense_batch(env.rank)).pow(2).mean().backward()
    finally:
        dist.all_reduce = torch_all_reduce
    assert sum(sent) * 2 == fp32_bytes, f"{sum(sent)} bytes all-reduced for {fp32_bytes} bytes of fp32 gradients"
    theirs(dense_batch(env.rank)).pow(2).mean().backward()
    for (name, p), q in zip(ours.module.named_parameters(), theirs.module.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), f"{name}: max diff {(p.grad - q.grad).abs().max().item()}"


# ---- parameters and buffers to ignore --------------------------------------------------------


class WithLocalState(nn.Module):
    """`local` (a layer) and `seen` (a buffer) are rank-local; `shared` and `count` are not."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(16, 6)
        self.local = nn.Linear(6, 1)
        self.register_buffer("seen", torch.zeros(1))
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.sum().detach()
        self.count += 1
        return self.local(torch.tanh(self.shared(x))).pow(2).mean()


IGNORED = ["local.weight", "local.bias", "seen"]


def _rank_local_model(rank: int, set_ignored) -> nn.Module:
    torch.manual_seed(rank)  # every tensor differs between ranks before wrapping
    model = WithLocalState()
    model.seen.fill_(rank)
    model.count.fill_(10 + rank)
    set_ignored(model, IGNORED)
    return model


def _differs_across_ranks(tensor: torch.Tensor) -> bool:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor.detach().contiguous())
    return not all(torch.equal(gathered[0], t) for t in gathered[1:])


def case_ignored_stay_local(env, backend):
    """Ignored tensors keep each rank's values at construction and in every forward, and their
    gradients stay local; the others are rank 0's and averaged: all bitwise as torch DDP."""
    ours_model = _rank_local_model(env.rank, DistributedDataParallel._set_params_and_buffers_to_ignore_for_model)
    theirs_model = _rank_local_model(env.rank, TorchDDP._set_params_and_buffers_to_ignore_for_model)
    assert ours_model._ddp_params_and_buffers_to_ignore == IGNORED and ours_model.local.weight._ddp_ignored
    ours = DistributedDataParallel(ours_model, comm_backend=backend)
    theirs = TorchDDP(theirs_model)
    optimizers = [torch.optim.SGD(e.parameters(), lr=0.1) for e in (ours, theirs)]
    for step in range(2):
        for engine, opt in zip((ours, theirs), optimizers, strict=True):
            opt.zero_grad()
            engine(dense_batch(env.rank + step)).backward()
        for (name, p), q in zip(ours_model.named_parameters(), theirs_model.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), f"step {step}: {name}.grad differs from torch DDP's"
        assert _differs_across_ranks(ours_model.local.weight.grad), "an ignored parameter's gradient was averaged"
        for opt in optimizers:
            opt.step()
        ours_state, theirs_state = ours_model.state_dict(), theirs_model.state_dict()
        for name, value in ours_state.items():
            assert torch.equal(value, theirs_state[name]), f"step {step}: {name} differs from torch DDP's"
    for name in ("local.weight", "seen"):
        assert _differs_across_ranks(ours_state[name]), f"{name} was synchronised across ranks"
    assert not _differs_across_ranks(ours_state["count"]) and not _differs_across_ranks(ours_state["shared.weight"])


# ---- register_comm_hook's refusals -----------------------------------------------------------


def hook_returning_int(state, bucket) -> int:
    return 0


def hook_with_int_bucket(state, bucket: int):
    return None


def _refusal(engine, hook) -> tuple[str, str]:
    try:
        engine.register_comm_hook(None, hook)
    except Exception as exc:  # the type and text are what is compared
        return type(exc).__name__, str(exc)
    return "accepted", ""


def case_hook_checks_as_torch(env, backend):
    """Refused with torch's error type and text: a non-callable, `-> int`, `bucket: int`, a
    second registration. Accepted as by torch: a hook registered after the first backward,
    which the next backward then uses (a doubling hook doubles the average)."""
    ours = DistributedDataParallel(build_mlp(), comm_backend=backend)
    theirs = TorchDDP(build_mlp())
    for hook in (42, hook_returning_int, hook_with_int_bucket):
        expected = _refusal(theirs, hook)
        assert expected[0] != "accepted", f"torch accepted {hook}"
        assert _refusal(ours, hook) == expected
    for engine in (ours, theirs):
        engine(dense_batch(env.rank)).pow(2).mean().backward()  # the first backward, no hook yet

    def doubling_hook(state, bucket):
        fut = default_hooks.allreduce_hook(state, bucket)
        return fut.then(lambda f: f.value() * 2)

    assert _refusal(ours, doubling_hook) == _refusal(theirs, doubling_hook) == ("accepted", "")
    twice = _refusal(theirs, default_hooks.allreduce_hook)
    assert twice[0] == "RuntimeError" and _refusal(ours, default_hooks.allreduce_hook) == twice
    for engine in (ours, theirs):
        engine.zero_grad()
        engine(dense_batch(env.rank)).pow(2).mean().backward()
    for p, q in zip(ours.module.parameters(), theirs.module.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


# ---- pickling, and torch's construction-time refusals ------------------------------------------


def _save_and_load(engine: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(engine, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _sgd_step(engine: nn.Module, rank: int, step: int) -> None:
    """One step by hand (a copy has new parameters: no optimizer to carry over)."""
    engine(dense_batch(10 * step + rank)).pow(2).mean().backward()
    if isinstance(engine, TorchDDP) and engine._delay_all_reduce_params:
        # torch never waits for its delayed all-reduce (it drops the Work), so its .grad may
        # still be changing when backward() returns; gloo's barrier waits for all earlier work
        dist.barrier()
    with torch.no_grad():
        for p in engine.parameters():
            p -= 0.1 * p.grad
            p.grad = None


def _assert_same_model(ours: nn.Module, theirs: nn.Module, what: str) -> None:
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.equal(p, q), f"{what}: {name} differs from torch DDP's"


def case_pickles_as_torch(env, backend):
    """After a step, torch.save/torch.load and copy.deepcopy copy the wrapper as torch DDP's:
    the copy trains on with averaged gradients (hooks on its own parameters, buckets built and
    rebuilt again) bit for bit as torch's copy, and leaves the original alone, which trains on
    too. Over a group other than the default one, pickling is refused as torch refuses it."""
    ours = DistributedDataParallel(build_mlp(), bucket_cap_mb=0.001, comm_backend=backend)
    theirs = TorchDDP(build_mlp(), bucket_cap_mb=0.001)
    for engine in (ours, theirs):
        _sgd_step(engine, env.rank, 0)
    for copy_fn in (_save_and_load, copy.deepcopy):
        copies = [copy_fn(e) for e in (ours, theirs)]
        assert copies[0].module is not ours.module and copies[0].reducer is not ours.reducer
        for step in (1, 2):  # the second runs on rebuilt buckets
            for engine in copies:
                _sgd_step(engine, env.rank, step)
            _assert_same_model(copies[0].module, copies[1].module, f"{copy_fn.__name__} step {step}")
        assert copies[0].bucket_param_names == torch_layout(copies[1])
        _assert_same_model(ours.module, theirs.module, f"original after {copy_fn.__name__}")
    for engine in (ours, theirs):
        _sgd_step(engine, env.rank, 3)
    _assert_same_model(ours.module, theirs.module, "original, trained on")
    group = dist.new_group(list(range(env.world_size)))  # the same ranks, not the default group
    over_group = [DistributedDataParallel(build_mlp(), process_group=group, comm_backend=backend),
                  TorchDDP(build_mlp(), process_group=group)]  # fmt: skip
    refusals = [_refusal_of(torch.save, engine, io.BytesIO()) for engine in over_group]
    assert refusals[0] == refusals[1] and refusals[1][0] == "RuntimeError", refusals


def case_pickled_delayed_params(env, backend):
    """delay_all_reduce_named_params survive a torch.save/torch.load: the loaded wrapper still
    averages the delayed gradients, as an unpickled torch DDP does. (torch's own copy does not:
    its __setstate__ rebuilds the reducer but not the delayed hook, so the copy is no reference.)"""
    engines = []
    for engine_type in (DistributedDataParallel, TorchDDP):
        model = build_mlp()
        kwargs = {"comm_backend": backend} if engine_type is DistributedDataParallel else {}
        delayed = [("2.weight", model[2].weight)]
        engines.append(engine_type(model, delay_all_reduce_named_params=delayed,
                                   param_to_hook_all_reduce=model[0].weight, **kwargs))  # fmt: skip
    for engine in engines:
        _sgd_step(engine, env.rank, 0)
    ours, theirs = _save_and_load(engines[0]), engines[1]
    for step in (1, 2):
        for engine in (ours, theirs):
            _sgd_step(engine, env.rank, step)
        _assert_same_model(ours.module, theirs.module, f"step {step}")


def _refusal_of(fn, *args, **kwargs) -> tuple[str, str]:
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # the type and text are what is compared
        return type(exc).__name__, str(exc)
    return "accepted", ""


def _frozen() -> nn.Module:
    model = build_mlp()
    model.requires_grad_(False)
    return model


def _ignore(engine_type, model: nn.Module, names: list[str]) -> None:
    """The engine's own static method (ours, or torch's for torch's engine)."""
    engine = engine_type.func if isinstance(engine_type, functools.partial) else engine_type
    engine._set_params_and_buffers_to_ignore_for_model(model, names)


def _all_trainable_ignored(engine_type) -> nn.Module:
    model = build_mlp()
    model[2].requires_grad_(False)
    _ignore(engine_type, model, ["0.weight", "0.bias"])
    return model


def case_refusals_as_torch(env, backend):
    """torch's type and text where it refuses: no parameter to train (frozen, or every trainable
    one ignored), process_group with device_mesh, a 2-D mesh, two device_ids. Delayed
    parameters alone are accepted, as by torch."""
    mesh_1d = init_device_mesh("cpu", (env.world_size,))
    mesh_2d = init_device_mesh("cpu", (1, env.world_size), mesh_dim_names=("a", "b"))
    calls = {
        "frozen": lambda t: t(_frozen()),
        "all_trainable_ignored": lambda t: t(_all_trainable_ignored(t)),
        "group_and_mesh": lambda t: t(build_mlp(), process_group=dist.group.WORLD, device_mesh=mesh_1d),
        "mesh_2d": lambda t: t(build_mlp(), device_mesh=mesh_2d),
        "two_device_ids": lambda t: t(build_mlp(), device_ids=[0, 1]),
    }
    for what, call in calls.items():
        expected = _refusal_of(call, TorchDDP)
        assert expected[0] != "accepted", f"{what}: torch accepted it"
        ours = _refusal_of(call, functools.partial(DistributedDataParallel, comm_backend=backend))
        if what == "two_device_ids":  # torch's text, then the value and the fix
            ours = (ours[0], ours[1][: len(expected[1])])
        assert ours == expected, f"{what}: ours {ours}, torch's {expected}"
    for engine_type in (functools.partial(DistributedDataParallel, comm_backend=backend), TorchDDP):
        # trainable: a delayed one, and the hook's, which is ignored (torch's and nanoddp's
        # delayed all-reduce need a hook parameter outside the delayed ones)
        model = _frozen()
        model[0].weight.requires_grad_(True)
        model[2].weight.requires_grad_(True)
        _ignore(engine_type, model, ["0.weight"])
        only_delayed = {"delay_all_reduce_named_params": [("2.weight", model[2].weight)],
                        "param_to_hook_all_reduce": model[0].weight}  # fmt: skip
        assert _refusal_of(engine_type, model, **only_delayed) == ("accepted", ""), engine_type


# ---- one launch per world size -----------------------------------------------------------------


WS3_SPARSE = {("nanoddp", "no_hook", False), ("nanoddp", "our_hook", True)}


def cases(world_size: int):
    p = functools.partial
    hook_pairs = {"no_hook": None, "torch_hook": (default_hooks.allreduce_hook, default_hooks.allreduce_hook),
                  "our_hook": (hooks.allreduce_hook, default_hooks.allreduce_hook)}  # fmt: skip
    out = [
        (f"{backend}-sparse-{hook}-{'view' if as_view else 'copy'}",
         p(case_sparse_matches_torch, backend=backend, as_view=as_view, hook_pair=pair))
        for backend in ("torch", "nanoddp") for hook, pair in hook_pairs.items() for as_view in (False, True)
        if (backend == "nanoddp" or (hook == "no_hook" and not as_view))
        # ws=3 checks the order of the sums: over our collectives, with and without our hook
        and (world_size == 2 or (backend, hook, as_view) in WS3_SPARSE)
    ]  # fmt: skip
    out += [
        (f"{b}-sparse-rank-without-rows", p(case_sparse_rank_without_rows, backend=b)) for b in ("torch", "nanoddp")
    ]
    if world_size == 2:
        out += [(f"compress-{pair[0]}", p(case_compress_hook_matches_torch, backend="nanoddp", pair=pair))
                for pair in compress_pairs()]  # fmt: skip
        out += [(f"{b}-ignored_stay_local", p(case_ignored_stay_local, backend=b)) for b in ("torch", "nanoddp")]
        out += [("hook_checks_as_torch", p(case_hook_checks_as_torch, backend="nanoddp"))]
        out += [(f"{b}-{name}", p(fn, backend=b)) for b in ("torch", "nanoddp")
                for name, fn in (("pickles_as_torch", case_pickles_as_torch),
                                 ("pickled_delayed_params", case_pickled_delayed_params),
                                 ("refusals_as_torch", case_refusals_as_torch))]  # fmt: skip
    return out


def seams_suite(env, out_dir):
    run_cases(env, cases(env.world_size), out_dir)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return suites_by_world_size(seams_suite, tmp_path_factory, "ddp-torch-seams", timeout=300)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "world_size,case", [(ws, name) for ws in (2, 3) for name, _ in cases(ws)], ids=lambda v: str(v)
)
def test_ddp_torch_seams(suite, world_size, case):
    suite(world_size).check(case)
