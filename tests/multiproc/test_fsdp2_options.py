"""Every `fully_shard` option honoured, each against torch's own FSDP2 on the same model.

Each case builds the same model twice from one seed, shards it with `nanoddp.fsdp.fully_shard`
and with `torch.distributed.fsdp.fully_shard` given the same arguments, runs the same steps, and
compares what the option is about, so that a case fails when its option is ignored:
  - reshard_after_forward, given explicitly on the blocks and the root: the whole tensors held
    after forward, and the all-gathers backward needs (none for a unit that kept its own);
  - two backwards without zero_grad: the sharded gradients are the sum;
  - set_requires_gradient_sync(False) on the first backward: no reduce-scatter until re-enabled;
  - HSDP's set_requires_all_reduce(False) on the first backward: no all-reduce, and the deferred
    gradient is in the result after the second;
  - ignored_params: plain, whole, never reduced;
  - mp_policy: the dtypes the blocks see and return, and the values;
  - a load or an in-place change while a unit holds its whole tensors: the next forward uses it;
  - dim-0 sizes divisible by the world size or not (8; 7, 11, 3), at ws 2 and ws 4.
Collectives are counted by wrapping the functions each side calls: torch's FSDP2 calls
`torch.distributed.all_gather_single` / `reduce_scatter_single` / `all_reduce`, ours the
all_gather_into_tensor / reduce_scatter_tensor / all_reduce of `collectives_for(settings.comm_backend)`.

Tolerances: bitwise (torch.equal) against torch at ws 2, where a sum of two terms does not depend
on the order, and on torch's collectives at ws 4; our collectives at ws 4 add four terms in
another order than gloo, so there assert_close's float32 defaults. HSDP (2 x 2) reduces two terms
at each level, and an average of 4 done as two averages of 2 only divides by powers of two
(exact): bitwise too. One launch per world size; ws 4 holds HSDP and the ws-4 sizes.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from helpers import run_cases, suites_by_world_size
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import nanoddp.fsdp as our_fsdp
from nanoddp.comm.api.backend import collectives_for

SIDES = {"ours": our_fsdp, "torch": torch_fsdp}
SIZES = (5, 7, 11, 3)  # every dim 0 indivisible by 2 and by 4; 3 < 4 leaves rank 3 no rows
EVEN_SIZES = (8, 8, 8, 8)


class Block(nn.Linear):
    """A Linear that takes any floating input (with cast_forward_inputs=False it gets fp32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(x.to(self.weight.dtype)))  # (B, out)


class Net(nn.Module):
    """Blocks (each its own unit) and a head that the root's unit takes."""

    def __init__(self, sizes=SIZES):
        super().__init__()
        self.blocks = nn.ModuleList([Block(a, b) for a, b in zip(sizes[:-2], sizes[1:-1], strict=True)])
        self.head = nn.Linear(sizes[-2], sizes[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)  # (B, d)
        return self.head(x.to(self.head.weight.dtype))  # (B, sizes[-1])


def build(side: str | None, sizes=SIZES, root: dict | None = None, **kwargs) -> Net:
    """The seeded Net, sharded bottom-up by `side` with `kwargs` (the root with `root` if given)."""
    torch.manual_seed(0)
    model = Net(sizes)
    if side is not None:
        for block in model.blocks:
            SIDES[side].fully_shard(block, **kwargs)
        SIDES[side].fully_shard(model, **(kwargs if root is None else root))
    return model


def batch(step: int, rank: int, sizes=SIZES) -> torch.Tensor:
    return torch.randn(4, sizes[0], generator=torch.Generator().manual_seed(100 * step + rank))  # (B, d0)


def backward(model: nn.Module, env, step: int, sizes=SIZES) -> None:
    model(batch(step, env.rank, sizes)).float().pow(2).mean().backward()


@contextlib.contextmanager
def counting(side: str) -> Iterator[Counter]:
    """Count the all-gathers, reduce-scatters and all-reduces `side`'s FSDP2 launches inside."""
    if side == "torch":
        space = dist
        names = {"all_gather": "all_gather_single", "reduce_scatter": "reduce_scatter_single"}
    else:
        space = collectives_for(our_fsdp.settings.comm_backend)
        names = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}
    names["all_reduce"] = "all_reduce"
    counts: Counter = Counter()
    originals = {name: getattr(space, name) for name in names.values()}

    def counted(kind, fn, *args, **kwargs):
        counts[kind] += 1
        return fn(*args, **kwargs)

    for kind, name in names.items():
        setattr(space, name, functools.partial(counted, kind, originals[name]))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(space, name, fn)


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


def assert_same(ours: nn.Module, theirs: nn.Module, what: str, grads: bool = True, exact: bool = True) -> None:
    """This rank's parameters (and gradients) equal torch's: same type, placements, bytes."""
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert type(p) is type(q) and p.shape == q.shape, f"{what}: {name}: {type(p)} {p.shape} vs {q.shape}"
        assert getattr(p, "placements", None) == getattr(q, "placements", None), f"{what}: {name}"
        pairs = [(local(p), local(q), name)]
        if grads:
            assert (p.grad is None) == (q.grad is None), f"{what}: {name}.grad is None on one side only"
            if p.grad is not None:
                pairs.append((local(p.grad), local(q.grad), f"{name}.grad"))
        for a, b, label in pairs:
            if exact:
                assert torch.equal(a, b), f"{what}: {label}: max diff {(a - b).abs().max()}"
            else:
                torch.testing.assert_close(a, b, msg=lambda m, label=label: f"{what}: {label}: {m}")


# ---- the cases (ws 2 unless said) ---------------------------------------------------------------


def whole_bytes_held(model: nn.Module, side: str, shards: list[nn.Parameter]) -> int:
    """Bytes of whole (gathered) parameters `model` holds now; `shards` are its parameters as
    `fully_shard` left them. torch registers a unit's whole tensors until it reshards; ours
    reports what it holds (`sharded_bytes`: the shards plus any whole tensors)."""
    if side == "torch":
        return sum(p.numel() * p.element_size() for p in model.parameters() if not isinstance(p, DTensor))
    return model.sharded_bytes()["params"] - sum(p.to_local().numel() * p.element_size() for p in shards)


def forward_and_backward(side: str, env, blocks: bool, root: bool) -> tuple[tuple[int, int, int], list, Net]:
    """Explicit reshard_after_forward on the blocks and the root: (whole bytes held after
    forward, all-gathers in forward, in backward), the parameters registered after forward."""
    model = build(side, reshard_after_forward=blocks, root={"reshard_after_forward": root})
    shards = list(model.parameters())
    with counting(side) as counts:
        loss = model(batch(0, env.rank)).pow(2).mean()
        held, forward_gathers = whole_bytes_held(model, side, shards), counts["all_gather"]
        registered = [(type(p).__name__, tuple(p.shape)) for p in model.parameters()]
        loss.backward()
    return (held, forward_gathers, counts["all_gather"] - forward_gathers), registered, model


def case_reshard_after_forward(env, blocks: bool, root: bool) -> None:
    """After forward each side holds the same whole tensors, and backward re-gathers exactly the
    units that resharded (with False: none)."""
    (ours, _, model), (theirs, _, reference) = (forward_and_backward(s, env, blocks, root) for s in SIDES)
    assert ours == theirs, f"(held bytes, forward gathers, backward gathers): {ours} vs torch's {theirs}"
    assert ours[1:] == (3, 2 * blocks + root), ours  # two block units and the root's
    assert_same(model, reference, f"reshard_after_forward blocks={blocks} root={root}")


def case_registered_after_forward(env) -> None:
    """Between forward and backward, a unit that kept its whole tensors has them registered
    (plain parameters of the full shape), as torch does; a resharded one has its DTensors."""
    for blocks, root in ((False, True), (True, False)):
        (_, ours, _), (_, theirs, _) = (forward_and_backward(s, env, blocks, root) for s in SIDES)
        assert ours == theirs, f"blocks={blocks} root={root}: {ours} vs torch's {theirs}"


def case_grads_accumulate_without_zero_grad(env) -> None:
    models = {side: build(side) for side in SIDES}
    for step in (0, 1):
        for model in models.values():
            backward(model, env, step)
    assert_same(models["ours"], models["torch"], "two backwards")
    once = build("ours")
    backward(once, env, 1)
    assert not torch.equal(local(once.head.weight.grad), local(models["ours"].head.weight.grad)), "not a sum"


def case_gradient_sync_off_then_on(env) -> None:
    """First backward with sync off: no reduce-scatter and no sharded grads; the second one
    reduces the sum once per unit: torch's grads, bitwise."""
    results = {}
    for side in SIDES:
        model = build(side)
        with counting(side) as counts:
            model.set_requires_gradient_sync(False)
            backward(model, env, 0)
            first = (counts["reduce_scatter"], [p.grad is None for p in model.parameters()])
            model.set_requires_gradient_sync(True)
            backward(model, env, 1)
        results[side] = (first, counts["reduce_scatter"], model)
    (first, total, ours), (want_first, want_total, theirs) = results["ours"], results["torch"]
    assert first == want_first == (0, [True] * 6), (first, want_first)
    assert total == want_total == 3, (total, want_total)
    assert_same(ours, theirs, "sync off, then on")


def case_ignored_params(env) -> None:
    """The head ignored: a plain whole parameter, its gradient this rank's own (not reduced)."""
    models = {}
    for side in SIDES:
        torch.manual_seed(0)
        model = Net()
        head = {model.head.weight, model.head.bias}
        for block in model.blocks:
            SIDES[side].fully_shard(block)
        SIDES[side].fully_shard(model, ignored_params=head)
        backward(model, env, 0)
        models[side] = model
    ours, theirs = models["ours"], models["torch"]
    for p in ours.head.parameters():
        assert type(p) is nn.Parameter and not isinstance(p, DTensor), type(p)
    assert_same(ours, theirs, "ignored head")
    plain = build(None)  # this rank's gradient alone, from one process
    backward(plain, env, 0)
    assert torch.equal(ours.head.weight.grad, plain.head.weight.grad)
    other = [torch.empty_like(ours.head.weight.grad) for _ in range(env.world_size)]
    dist.all_gather(other, ours.head.weight.grad)
    assert not torch.equal(other[0], other[1]), "the ranks' head gradients differ: none was averaged"


def case_mixed_precision(env, cast_forward_inputs: bool) -> None:
    """bf16 compute, fp32 reduce and output: the dtypes each block sees and the root returns, the
    output, grads and updated params all torch's."""
    mp = {
        side: fsdp.MixedPrecisionPolicy(torch.bfloat16, torch.float32, torch.float32, cast_forward_inputs)
        for side, fsdp in SIDES.items()
    }
    runs, seen = {}, {}
    for side in SIDES:
        model = build(side, mp_policy=mp[side])
        seen[side] = []  # the input dtype each unit's forward gets, after fully_shard's hook ran
        for m in (model, *model.blocks):
            m.register_forward_pre_hook(lambda _, args, seen=seen[side]: seen.append(args[0].dtype))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out = model(batch(0, env.rank))
        out.pow(2).mean().backward()
        opt.step()
        runs[side] = (out, model)
    (out, ours), (want, theirs) = runs["ours"], runs["torch"]
    assert out.dtype == want.dtype == torch.float32, (out.dtype, want.dtype)
    assert torch.equal(out, want)
    inputs = torch.bfloat16 if cast_forward_inputs else torch.float32  # blocks' outputs are fp32
    assert seen["ours"] == seen["torch"] == [inputs] * 3, seen
    assert_same(ours, theirs, f"mp_policy cast_forward_inputs={cast_forward_inputs}")


def case_output_dtype_unset_keeps_compute_dtype(env) -> None:
    for side, fsdp in SIDES.items():
        model = build(side, mp_policy=fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        assert model(batch(0, env.rank)).dtype == torch.bfloat16, side


def gathered_for_eval(side: str, x: torch.Tensor) -> tuple[Net, list[nn.Parameter], torch.Tensor]:
    """reshard_after_forward=False and an eval forward: every unit holds its whole tensors.
    Returns the model, its shards (the parameters an optimizer built after sharding holds) and
    the output."""
    model = build(side, reshard_after_forward=False).eval()
    shards = list(model.parameters())
    out = model(x)
    assert whole_bytes_held(model, side, shards) > 0, f"{side}: nothing held: the case would not test staleness"
    return model, shards, out


def other_values(side: str) -> dict[str, torch.Tensor]:
    """A state dict of other values, sharded as the model is: this rank's rows as DTensors."""
    torch.manual_seed(1)
    new = Net()
    for block in new.blocks:
        SIDES[side].fully_shard(block)
    return SIDES[side].fully_shard(new).state_dict()


@torch.no_grad()
def case_load_while_gathered(env) -> None:
    """load_state_dict after an eval forward held the whole tensors: the next forward runs the
    loaded weights (torch reshards in a load_state_dict pre-hook)."""
    x, outs = batch(0, env.rank), {}
    for side in SIDES:
        model, _, first = gathered_for_eval(side, x)
        model.load_state_dict(other_values(side))
        outs[side] = (first, model(x))
    torch.manual_seed(1)
    want = Net()(x)
    assert torch.equal(outs["torch"][1], want), "torch's reference itself"
    assert torch.equal(outs["ours"][0], outs["torch"][0]), "the forward before the load"
    assert torch.equal(outs["ours"][1], want), "the forward after load_state_dict ran the old weights"


@torch.no_grad()
def case_inplace_change_while_gathered(env) -> None:
    """An in-place change of the shards' local tensors after an eval forward held the whole
    tensors: the next forward runs the changed weights. One process is the reference: torch's
    FSDP2 has no check for it (its next forward runs the copy it holds)."""
    x = batch(0, env.rank)
    model, shards, _ = gathered_for_eval("ours", x)
    for p in shards:
        p.to_local().mul_(2)
    plain = build(None)
    for p in plain.parameters():
        p.mul_(2)
    assert torch.equal(model(x), plain(x)), "forward after an in-place change ran the old weights"


def case_sizes_match_torch(env, sizes, comm_backend: str) -> None:
    """Two SGD steps; params and grads as torch's, bitwise unless our collectives add 4 terms."""
    our_fsdp.settings.comm_backend, before = comm_backend, our_fsdp.settings.comm_backend
    try:
        models = {side: build(side, sizes) for side in SIDES}
    finally:
        our_fsdp.settings.comm_backend = before
    for model in models.values():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in (0, 1):
            opt.zero_grad()
            backward(model, env, step, sizes)
            opt.step()
    exact = env.world_size == 2 or comm_backend == "torch"
    assert_same(models["ours"], models["torch"], f"sizes {sizes} on {comm_backend}", exact=exact)


def case_hsdp_deferred_all_reduce(env) -> None:
    """2 x 2 mesh; the first backward with set_requires_all_reduce(False): reduce-scattered, not
    all-reduced, no grads yet; the second all-reduces the sum: torch's grads, bitwise."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    results = {}
    for side in SIDES:
        model = build(side, mesh=mesh)
        with counting(side) as counts:
            model.set_requires_all_reduce(False)
            backward(model, env, 0)
            first = (counts["reduce_scatter"], counts["all_reduce"], [p.grad is None for p in model.parameters()])
            model.set_requires_all_reduce(True)
            backward(model, env, 1)
        results[side] = (first, (counts["reduce_scatter"], counts["all_reduce"]), model)
    (first, total, ours), (want_first, want_total, theirs) = results["ours"], results["torch"]
    assert first == want_first and first[:2] == (3, 0), (first, want_first)
    assert total == want_total == (6, 3), (total, want_total)
    assert_same(ours, theirs, "HSDP, all-reduce deferred once")
    plain = build(None)  # one process on all 4 ranks' batches of both steps, summed
    for step in (0, 1):
        for rank in range(env.world_size):
            (plain(batch(step, rank)).pow(2).mean() / env.world_size).backward()
    for name, p in ours.named_parameters():
        want = dict(plain.named_parameters())[name].grad
        torch.testing.assert_close(p.grad.full_tensor(), want, msg=lambda m, name=name: f"{name}.grad: {m}")


def cases(world_size: int) -> list[tuple[str, functools.partial]]:
    p = functools.partial
    if world_size == 4:
        return [
            ("hsdp_deferred_all_reduce", p(case_hsdp_deferred_all_reduce)),
            *[(f"sizes_{s[0]}_{b}", p(case_sizes_match_torch, sizes=s, comm_backend=b))
              for s in (EVEN_SIZES, SIZES) for b in ("torch", "nanoddp")],
        ]  # fmt: skip
    return [
        *[(f"reshard_after_forward_blocks_{b}_root_{r}", p(case_reshard_after_forward, blocks=b, root=r))
          for b, r in ((True, True), (False, False), (False, True), (True, False))],
        ("registered_after_forward", p(case_registered_after_forward)),
        ("grads_accumulate_without_zero_grad", p(case_grads_accumulate_without_zero_grad)),
        ("gradient_sync_off_then_on", p(case_gradient_sync_off_then_on)),
        ("ignored_params", p(case_ignored_params)),
        *[(f"mixed_precision_cast_inputs_{c}", p(case_mixed_precision, cast_forward_inputs=c)) for c in (True, False)],
        ("output_dtype_unset", p(case_output_dtype_unset_keeps_compute_dtype)),
        ("load_while_gathered", p(case_load_while_gathered)),
        ("inplace_change_while_gathered", p(case_inplace_change_while_gathered)),
        *[(f"sizes_{s[0]}_nanoddp", p(case_sizes_match_torch, sizes=s, comm_backend="nanoddp"))
          for s in (EVEN_SIZES, SIZES)],
    ]  # fmt: skip


def options_suite(env, out_dir: str) -> None:
    run_cases(env, cases(env.world_size), out_dir)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return suites_by_world_size(options_suite, tmp_path_factory, "fsdp2-options", timeout=300)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size,case", [(ws, name) for ws in (2, 4) for name, _ in cases(ws)], ids=str)
def test_option(suite, world_size, case):
    suite(world_size).check(case)
