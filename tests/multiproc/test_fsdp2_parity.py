"""nanoddp.fsdp against torch's own FSDP2 (`torch.distributed.fsdp.fully_shard`) and one process.

The model is awkward on purpose: every dim 0 (11, 7, 5) is indivisible by 2 and 3, the blocks
have 1-D biases, the embedding and the head share one weight (tied, both in the root unit), and
`frozen` has requires_grad=False. Both implementations start from the same seed, see the same
batches and take the same steps.

Tolerances. Against torch FSDP2: bitwise where the reduction order is the same. Both
all-gather the same bytes, copy out the same rows and reduce-scatter the same padded gradients
with AVG (sum, then divide). At ws 2 a sum of two terms does not depend on order, so our
collectives give torch's bits; at ws 3 they add the three terms in another order than gloo, so
the ws-3 suite runs bitwise on `settings.comm_backend = "torch"` and checks our collectives
against it with assert_close's float32 defaults (`case_our_collectives_at_ws3`). Against one
process on the concatenated batch: the float32 defaults too, because the one process sums the
batch inside one matmul, in another order.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from helpers import run_on_ranks

import nanoddp
import nanoddp.fsdp as our_fsdp

STEPS = 3
BATCH = 4  # per rank


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))  # (B, 5)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 5)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.frozen = nn.Linear(5, 5)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(5, 11)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx).mean(1)  # (B, 5)
        for block in self.blocks:
            x = block(x)
        return self.head(self.frozen(x))  # (B, 11)


def build(fully_shard=None, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    model = Net()
    if fully_shard is not None:
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
    return model


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 11, (BATCH, 6), generator=g), torch.randint(0, 11, (BATCH,), generator=g)


def full_batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(batch(step, r) for r in range(world_size)), strict=True)
    return torch.cat(xs), torch.cat(ys)  # (ws*B, 6), (ws*B,)


def train(env, model: nn.Module, clip: float | None = None) -> tuple[list[float], list[torch.Tensor]]:
    """STEPS SGD steps; the losses and (if clipping) the total norms torch's clip_grad_norm_ gave."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = batch(step, env.rank)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def whole(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}


def assert_equal_states(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for k, v in want.items():
        assert torch.equal(got[k], v), f"{what} {k}: max diff {(got[k] - v).abs().max()}"


# ---- the cases (run inside one launch per world size) ------------------------------------------


def case_sgd_matches_torch_fsdp2(env, **policy) -> None:
    ours, theirs = build(our_fsdp.fully_shard, **policy), build(torch_fsdp.fully_shard, **policy)
    assert isinstance(ours, our_fsdp.FSDPModule) and type(ours).__name__ == "FSDPNet"
    got_losses, _ = train(env, ours)
    want_losses, _ = train(env, theirs)
    assert got_losses == want_losses, (got_losses, want_losses)
    assert_equal_states(whole(ours), whole(theirs), f"params {policy}")


def case_clip_norm_matches(env) -> None:
    """torch's clip_grad_norm_ on our DTensor grads: the global norm, torch FSDP2's exactly."""
    ours, theirs = build(our_fsdp.fully_shard), build(torch_fsdp.fully_shard)
    _, got = train(env, ours, clip=0.5)
    _, want = train(env, theirs, clip=0.5)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w), (got, want)
    assert_equal_states(whole(ours), whole(theirs), "clipped params")
    ref = build()  # one process: its norm is the global one (a per-rank norm would differ)
    x, y = full_batch(0, env.world_size)
    nn.functional.cross_entropy(ref(x), y).backward()
    torch.testing.assert_close(got[0], torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))


def case_grads_are_the_full_batch_average(env) -> None:
    """Raw grads after one backward (no clip) are the single-process full-batch gradient: a sum
    instead of the average would be ws times it."""
    ref = build()
    x, y = full_batch(0, env.world_size)
    nn.functional.cross_entropy(ref(x), y).backward()
    model = build(our_fsdp.fully_shard)
    x, y = batch(0, env.rank)
    nn.functional.cross_entropy(model(x), y).backward()
    want = {name: p.grad for name, p in ref.named_parameters()}
    for name, p in model.named_parameters():
        assert p.placements == (torch.distributed.tensor.Shard(0),), name
        assert p.shape == dict(ref.named_parameters())[name].shape, name
        if not p.requires_grad:
            assert p.grad is None, name
            continue
        torch.testing.assert_close(p.grad.full_tensor(), want[name], msg=lambda m, name=name: f"{name}.grad: {m}")


def case_meta_init(env) -> None:
    """Built on meta, sharded, `to_empty` + `reset_parameters`: torch FSDP2's values exactly, and
    a deterministic init gives the CPU-built model's values; `.to(float64)` keeps units working."""
    models = []
    for fully_shard in (our_fsdp.fully_shard, torch_fsdp.fully_shard):
        with torch.device("meta"):
            model = Net()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cpu")
        torch.manual_seed(1)
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        models.append(model)
    assert_equal_states(whole(models[0]), whole(models[1]), "meta init")
    with torch.device("meta"):
        meta = Net()
    our_fsdp.fully_shard(meta)
    meta.to_empty(device="cpu")
    cpu = build()
    with torch.no_grad():  # deterministic values: what each rank holds must be its rows
        for p, q in zip(meta.parameters(), cpu.parameters(), strict=True):
            q.copy_(torch.arange(q.numel(), dtype=q.dtype).view(q.shape) / 7)
            rows = -(-p.shape[0] // env.world_size)
            p.to_local().copy_(q.detach()[env.rank * rows : (env.rank + 1) * rows])
    assert_equal_states(whole(meta), cpu.state_dict(), "meta rows")
    x, _ = batch(0, env.rank)
    torch.testing.assert_close(meta(x), cpu(x))
    meta.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in meta.parameters())
    torch.testing.assert_close(meta(x), cpu.double()(x))


def case_our_collectives_at_ws3(env) -> None:
    ours, theirs = build(our_fsdp.fully_shard), build(torch_fsdp.fully_shard)
    got, want = train(env, ours)[0], train(env, theirs)[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want))
    mine, torchs = whole(ours), whole(theirs)
    for k, v in torchs.items():
        torch.testing.assert_close(mine[k], v, msg=lambda m, k=k: f"{k}: {m}")


def parity_suite(env) -> None:
    if env.world_size == 3:
        case_our_collectives_at_ws3(env)
        our_fsdp.settings.comm_backend = "torch"  # this process only: bitwise from here on
    case_sgd_matches_torch_fsdp2(env)
    mp = our_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ours, theirs = build(our_fsdp.fully_shard, mp_policy=mp), build(torch_fsdp.fully_shard, mp_policy=mp)
    got, want = train(env, ours)[0], train(env, theirs)[0]
    assert got == want, ("bf16/fp32", got, want)
    assert_equal_states(whole(ours), whole(theirs), "bf16/fp32 params")
    case_clip_norm_matches(env)
    case_grads_are_the_full_batch_average(env)
    case_meta_init(env)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 3])
def test_parity_with_torch_fsdp2(world_size):
    run_on_ranks(parity_suite, world_size, timeout=400)


def test_signature_is_torchs():
    ours, theirs = inspect.signature(our_fsdp.fully_shard), inspect.signature(torch_fsdp.fully_shard)
    assert [(p.name, p.kind, repr(p.default), p.annotation) for p in ours.parameters.values()] == [
        (p.name, p.kind, repr(p.default), p.annotation) for p in theirs.parameters.values()
    ]
    assert nanoddp.fully_shard is our_fsdp.fully_shard
    for name in ("MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"):
        assert repr(getattr(our_fsdp, name)()) == repr(getattr(torch_fsdp, name)())
    methods = [
        "unshard", "reshard", "set_modules_to_forward_prefetch", "set_modules_to_backward_prefetch",
        "set_requires_gradient_sync", "set_reshard_after_forward", "set_reshard_after_backward",
        "set_is_last_backward", "set_requires_all_reduce", "set_gradient_divide_factor", "set_unshard_in_backward",
    ]  # fmt: skip
    for name in methods:
        assert inspect.signature(getattr(our_fsdp.FSDPModule, name)) == inspect.signature(
            getattr(torch_fsdp.FSDPModule, name)
        ), name
    assert not hasattr(our_fsdp.FSDPModule, "set_custom_all_gather")  # absent, not a stub
