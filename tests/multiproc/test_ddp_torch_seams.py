"""nanoddp's DDP against torch's DDP where torch users meet its edges: sparse gradients, 16-bit
compress hooks (and their bytes on the wire), `_ddp_params_and_buffers_to_ignore`, and the
refusals of `register_comm_hook`. Every case runs torch's DDP on the same model and data and
compares bit for bit. One launch per world size: ws=2 for everything, ws=3 for the sparse cases
(with three ranks the order of the sums matters).
"""

from __future__ import annotations

import functools
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import run_cases, suites_by_world_size
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
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
    if world_size == 2:
        out += [(f"compress-{pair[0]}", p(case_compress_hook_matches_torch, backend="nanoddp", pair=pair))
                for pair in compress_pairs()]  # fmt: skip
        out += [(f"{b}-ignored_stay_local", p(case_ignored_stay_local, backend=b)) for b in ("torch", "nanoddp")]
        out += [("hook_checks_as_torch", p(case_hook_checks_as_torch, backend="nanoddp"))]
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
