"""nanoddp.fsdp.fully_shard accepts and refuses what torch's FSDP2 does, checked against torch.

Every case runs torch's `torch.distributed.fsdp.fully_shard` and ours on the same model, seed
and batches (ws 2, gloo, one launch for all cases): a tie across two calls (refused at the
first forward), `fully_shard.state`, a unit over a list of modules (grouped, tied, a partial
forward with the head called per chunk, two partial forwards leaving the head without a
gradient), `reset_iter_state` after an exception in forward and in backward, a change of the
shards while the whole tensors are held, or a row's block of them (against one process: torch has no check),
`reshard_after_forward` as an int (rows of 2 of 4 ranks: the one ws-4 launch) or False,
`Shard(1)` from `shard_placement_fn`,
`register_fsdp_forward_method` and `isinstance` of torch's `FSDPModule`, a DTensor parameter
assigned before the first forward, `copy.deepcopy`, and the refusals (same error type, and
torch's message inside ours).

Tolerance: none. At ws 2 both implementations gather the same bytes, copy out the same slices
and average two gradients (a sum of two terms does not depend on order), so parameters,
gradients and losses are compared bitwise.
"""

from __future__ import annotations

import copy
import functools
import re

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
import torch.nn.functional as F
from helpers import run_cases, suites_by_world_size
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import nanoddp.fsdp as our_fsdp
from nanoddp.parallel.fsdp.fully_shard import _reshard_after_forward
from nanoddp.parallel.fsdp.unit import ShardedState

IMPLS = {"ours": our_fsdp.fully_shard, "torch": torch_fsdp.fully_shard}
STEPS = 3


class Block(nn.Module):
    def __init__(self, c: int = 6):
        super().__init__()
        self.a = nn.Linear(c, 8)
        self.b = nn.Linear(8, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))  # (B, T, C)


class LM(nn.Module):
    """Embedding, one block, a norm and a head: dim 0 of 11 is uneven at 2."""

    def __init__(self, tied: bool = False, run_head: bool = True):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.block = Block()
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 11)
        if tied:
            self.head.weight = self.emb.weight
        self.run_head = run_head  # False: forward stops at the norm; the head runs per chunk outside

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.block(self.emb(idx)))  # (B, T, C)
        return self.head(h) if self.run_head else h

    def generate(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy, two tokens; reads the root's own head parameters outside any forward."""
        for _ in range(2):
            h = self.norm(self.block(self.emb(idx)))[:, -1]  # (B, C)
            logits = F.linear(h, self.head.weight, self.head.bias)  # (B, V)
            idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], 1)
        return idx, logits


def build(**kwargs) -> LM:
    torch.manual_seed(0)
    return LM(**kwargs)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 11, (2, 4), generator=g), torch.randint(0, 11, (2, 4), generator=g)


def loss_of(model: LM, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if model.run_head:
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    h = model(x)  # (B, T, C): the head runs on each half of T, after the model's forward
    chunks = zip(h.chunk(2, dim=1), y.chunk(2, dim=1), strict=True)
    return sum(F.cross_entropy(model.head(c).flatten(0, 1), t.flatten()) for c, t in chunks) / 2


def train(env, model: LM) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        loss = loss_of(model, *batch(step, env.rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def whole(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}


def assert_same_training(env, ours: LM, theirs: LM) -> None:
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    got, want = train(env, ours), train(env, theirs)
    assert got == want, (got, want)
    mine, torchs = whole(ours), whole(theirs)
    assert mine.keys() == torchs.keys()
    for k, v in torchs.items():
        assert torch.equal(mine[k], v), f"{k}: max diff {(mine[k] - v).abs().max()}"


def raised(fn) -> BaseException:
    try:
        fn()
    except Exception as exc:
        return exc
    raise AssertionError(f"{fn} raised nothing")


def assert_same_refusal(make, what: str) -> None:
    """Ours raises torch's error type (or a subclass: an `except` of torch's catches ours), with
    torch's message (its first line, up to the values it prints, quoted names aside: ours names
    the parameter where it found it) inside."""
    got, want = raised(functools.partial(make, "ours")), raised(functools.partial(make, "torch"))
    assert isinstance(got, type(want)), f"{what}: ours {type(got).__name__}: {got}; torch {type(want).__name__}: {want}"
    head = str(want).splitlines()[0].split(": param.shape")[0].split(": torch.Size")[0].split(" but got")[0]
    unquoted = re.sub(r"'[^']*'", "'_'", head), re.sub(r"'[^']*'", "'_'", str(got))
    assert unquoted[0] in unquoted[1], f"{what}: ours {got!r} lacks torch's {head!r}"


# ---- 1. a tie across two fully_shard calls; 2. a unit over a list of modules -----------------------


def case_tie_across_calls_refused_at_first_forward(env) -> None:
    """The tied weight in two units: the calls pass, the root's first forward (torch's lazy
    init) refuses it, whether the root or a second call took it again."""
    for inner in (["emb"], ["emb", "head"]):

        def make(impl, forward=True, inner=inner):
            model = build(tied=True)
            for name in inner:
                IMPLS[impl](getattr(model, name))
            IMPLS[impl](model)
            if forward:
                model(batch(0, env.rank)[0])

        for impl in IMPLS:
            make(impl, forward=False)  # raises nothing
        assert_same_refusal(make, f"tie across calls {inner}")
        message = str(raised(functools.partial(make, "ours")))
        assert "'emb.weight' is 'head.weight'" in message or "'head.weight' is 'emb.weight'" in message, message


def grouped(impl: str, **kwargs) -> tuple[LM, list]:
    model = build(**kwargs)
    IMPLS[impl](model.block)
    units = IMPLS[impl]([model.emb, model.head] if kwargs.get("tied") else [model.norm, model.head])
    IMPLS[impl](model)
    return model, units


def case_tied_unit_over_two_modules_matches_torch(env) -> None:
    (ours, units), (theirs, torch_units) = grouped("ours", tied=True), grouped("torch", tied=True)
    assert type(units) is type(torch_units) is list
    assert units[0] is ours.emb and units[1] is ours.head
    names = [type(m).__name__ for m in units]
    assert names == [type(m).__name__ for m in torch_units] == ["FSDPEmbedding", "FSDPLinear"]
    assert all(isinstance(m, our_fsdp.FSDPModule) for m in units)
    assert ours.emb._fsdp_state is ours.head._fsdp_state  # one state, as torch_fsdp.fully_shard.state shows
    assert torch_fsdp.fully_shard.state(theirs.emb) is torch_fsdp.fully_shard.state(theirs.head)
    assert ours.head.weight is ours.emb.weight  # the tie holds: one DTensor parameter
    assert_same_training(env, ours, theirs)


def case_grouped_forward_matches_torch(env) -> None:
    (ours, _), (theirs, _) = grouped("ours"), grouped("torch")
    torch_group = torch_fsdp.fully_shard.state(theirs.norm)._fsdp_param_group.fsdp_params
    ours_group = ours.norm._fsdp_state.unit.params
    assert [p.shape for p in ours_group] == [p._orig_size for p in torch_group]  # norm's and head's, in order
    assert_same_training(env, ours, theirs)


def case_partial_forward_head_per_chunk_matches_torch(env) -> None:
    """The root's forward runs the norm only; the head (same unit) runs per chunk afterwards.
    The root's post-forward reshards the unit (DTensors registered), a head call gathers it
    and keeps it (plain tensors) for the other modules of the unit, as torch does."""
    (ours, _), (theirs, _) = grouped("ours", run_head=False), grouped("torch", run_head=False)
    kinds = {}
    for impl, model in (("ours", ours), ("torch", theirs)):
        x, _ = batch(0, env.rank)
        h = model(x)
        after_root = registered_kinds(model.norm) + registered_kinds(model.head)
        out = model.head(h[:, :2])
        after_head = registered_kinds(model.norm) + registered_kinds(model.head)
        out.sum().backward()
        kinds[impl] = (after_root, after_head, registered_kinds(model.norm) + registered_kinds(model.head))
        model.zero_grad(set_to_none=True)
    assert kinds["ours"] == kinds["torch"], kinds
    assert kinds["ours"][:2] == (["DTensor"] * 4, ["Tensor"] * 4), kinds
    assert_same_training(env, ours, theirs)


def case_state_attribute_is_torchs(env) -> None:
    """`fully_shard.state(m)`: one state per call (a list's modules share one), None unsharded."""
    for impl, fully_shard in IMPLS.items():
        model, _ = grouped(impl)
        states = [fully_shard.state(m) for m in (model, model.block, model.norm, model.head)]
        assert states[2] is states[3] and len({id(s) for s in states}) == 3 and None not in states, impl
        assert fully_shard.state(model.emb) is None and fully_shard.state(nn.Linear(2, 2)) is None, impl
        if impl == "ours":
            assert states[1] is model.block._fsdp_state


def case_double_partial_forward_no_grad_for_unused(env) -> None:
    """Two forwards stopping at the norm, one backward: the head (in the norm's unit) took no
    part, so it gets no gradient, as torch's; the rest get torch's, bitwise."""
    grads = {}
    for impl in IMPLS:
        model, _ = grouped(impl, run_head=False)
        h1, h2 = model(batch(0, env.rank)[0]), model(batch(1, env.rank)[0])
        (h1.sum() + h2.sum()).backward()
        grads[impl] = {n: p.grad if p.grad is None else p.grad.full_tensor() for n, p in model.named_parameters()}
    assert grads["torch"]["head.weight"] is None and grads["torch"]["head.bias"] is None
    for name, want in grads["torch"].items():
        got = grads["ours"][name]
        assert (got is None) == (want is None), f"{name}: ours {got}, torch {want}"
        assert want is None or torch.equal(got, want), name


def armed_raiser(armed: dict, where: str):
    def hook(*_) -> None:
        if armed[where]:
            raise RuntimeError(f"boom in {where}")

    return hook


def raise_in_backward(armed: dict):
    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.register_hook(armed_raiser(armed, "backward"))

    return hook


def case_reset_iter_state_after_exceptions(env) -> None:
    """An exception mid-forward (in the block, after the root's gather) and one mid-backward
    (at the embedding's output, after the head's and block's reduce-scatters launched), each
    followed by `reset_iter_state()` on the root: training then goes on as torch's, bitwise."""
    models = {}
    for impl in IMPLS:
        armed = {"forward": False, "backward": False}
        model = build(run_head=False)
        model.block.register_forward_pre_hook(armed_raiser(armed, "forward"))
        model.emb.register_forward_hook(raise_in_backward(armed))
        IMPLS[impl](model.block)
        IMPLS[impl]([model.norm, model.head])
        IMPLS[impl](model)
        for where in armed:
            armed[where] = True
            try:
                loss_of(model, *batch(0, env.rank)).backward()
            except RuntimeError as exc:
                assert f"boom in {where}" in str(exc), exc
            else:
                raise AssertionError(f"{impl}: no exception in {where}")
            armed[where] = False
            model.reset_iter_state()
            model.zero_grad(set_to_none=True)
        models[impl] = model
    assert_same_refusal(lambda impl: models[impl].block.reset_iter_state(), "reset_iter_state on a non-root")
    assert_same_training(env, models["ours"], models["torch"])


def case_unit_over_modules_needs_a_root(env) -> None:
    def make(impl):
        model = build()
        IMPLS[impl]([model.norm, model.head])
        model.head(torch.ones(2, 6))

    assert_same_refusal(make, "grouped root")


# ---- 3. reshard_after_forward: an int, and False ------------------------------------------------------


def case_reshard_after_forward_int(env) -> None:
    for value in (0, 3):  # not a factor of the shard size, 2
        assert_same_refusal(lambda impl, v=value: IMPLS[impl](nn.Linear(2, 2), reshard_after_forward=v), f"{value}")
    for value, same_as in ((1, False), (2, True)):
        models = {impl: build() for impl in IMPLS}
        for impl, model in models.items():
            IMPLS[impl](model.block, reshard_after_forward=value)
            IMPLS[impl](model)
        state = models["ours"].block._fsdp_state
        assert state.reshard_after_forward is same_as, (value, state.reshard_after_forward)
        assert_same_training(env, models["ours"], models["torch"])


def ws4_reshard_to_rows_of_two(env) -> None:
    """ws 4, `reshard_after_forward=2`: after forward each rank holds its block of 2 of the 4
    ranks' parts (rows {0,1} and {2,3} hold the whole parameters between them), backward
    gathers within the row. Bitwise torch's with the same reduce-scatter (torch's, as the
    sum of 4 terms depends on the order); bitwise our reshard-to-all run on our collectives."""
    runs = {}
    for name, fully_shard, value, backend in (
        ("torch", torch_fsdp.fully_shard, 2, "torch"),
        ("ours-torch-comm", our_fsdp.fully_shard, 2, "torch"),
        ("ours", our_fsdp.fully_shard, 2, "nanoddp"),
        ("ours-to-all", our_fsdp.fully_shard, True, "nanoddp"),
    ):
        our_fsdp.settings.comm_backend = backend
        model = build()
        fully_shard(model.block, reshard_after_forward=value)
        fully_shard(model)
        runs[name] = model
    our_fsdp.settings.comm_backend = "nanoddp"
    unit = runs["ours"].block._fsdp_state.unit
    x, y = batch(0, env.rank)
    before = runs["ours"].block.sharded_bytes()["params"]
    loss = F.cross_entropy(runs["ours"](x).flatten(0, 1), y.flatten())
    block_bytes = unit.numel * 2 * 4  # 2 of the 4 ranks' parts, float32
    assert runs["ours"].block.sharded_bytes()["params"] == before + block_bytes, (before, block_bytes)
    loss.backward()
    runs["ours"].zero_grad(set_to_none=True)
    assert runs["ours"].block.sharded_bytes()["params"] == before  # backward consumed the block
    assert_same_training(env, runs["ours-torch-comm"], runs["torch"])
    assert_same_training(env, runs["ours"], runs["ours-to-all"])


def ws4_rows_changed_while_held(env) -> None:
    """ws 4, `reshard_after_forward=2`: an eval forward leaves the block holding its block of the
    rows' buffer; then the shards change (an in-place op, a for-loop and a foreach SGD step).
    The next forward runs the new weights, as one process does. One batch on every rank: the
    average of four equal gradients is each up to rounding (three additions), so assert_close."""
    x, y = batch(0, 0)
    for change in ("mul_", "sgd", "sgd-foreach"):
        model, plain = build(), build()
        our_fsdp.fully_shard(model.block, reshard_after_forward=2)
        our_fsdp.fully_shard(model)
        outs = []
        for m in (model, plain):
            params = list(m.parameters())
            opt = torch.optim.SGD(params, lr=0.1, foreach=change == "sgd-foreach")
            F.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()
            with torch.no_grad():
                m(x)  # ours: the block keeps its block of 2 of the 4 ranks' parts
                if m is model:
                    state = model.block._fsdp_state.unit.sharded_state
                    assert state is ShardedState.SHARDED_POST_FORWARD, f"{state}: the case would not test staleness"
                if change == "mul_":
                    for p in params:
                        p.mul_(2)
                else:
                    opt.step()
                outs.append(m(x))
        torch.testing.assert_close(outs[0], outs[1], msg=lambda m, c=change: f"{c}: the next forward ran: {m}")


def registered_kinds(model: nn.Module) -> list[str]:
    return [type(p.data).__name__ for p in model.parameters()]


def case_no_reshard_registers_whole_tensors(env) -> None:
    """After forward with reshard_after_forward=False the module holds its whole parameters as
    plain tensors (torch's), until state_dict() or backward puts the DTensor shards back."""
    seen = {}
    for impl, fully_shard in IMPLS.items():
        model = build()
        fully_shard(model.block, reshard_after_forward=False)
        fully_shard(model)
        x, y = batch(0, env.rank)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        after_forward = registered_kinds(model)
        values = {n: p.detach().clone() for n, p in model.block.named_parameters()}
        sd_kinds = [type(v).__name__ for v in model.state_dict().values()]
        after_state_dict = registered_kinds(model)
        loss.backward()
        seen[impl] = (after_forward, sd_kinds, after_state_dict, registered_kinds(model))
        if impl == "ours":
            assert set(after_forward) == {"Tensor"}, after_forward
            for n, p in model.block.named_parameters():  # the whole tensors, equal to the shards
                assert torch.equal(values[n], p.full_tensor()), n
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        else:
            for n, p in model.named_parameters():
                assert torch.equal(grads[n], p.grad.full_tensor()), n
    assert seen["ours"] == seen["torch"], seen


def case_shards_changed_while_gathered(env) -> None:
    """The root keeps its whole tensors after an eval forward; then its shards change through
    the DTensor parameters: an in-place op, a for-loop and a foreach optimizer step (a foreach
    step bumps no version counter itself). The next forward runs the new weights, as one
    process does (torch's FSDP2 runs the copy it holds). One batch on every rank: the average
    of two equal gradients is each, bitwise."""
    x, y = batch(0, 0)
    for change in ("mul_", "sgd", "sgd-foreach"):
        model, plain = build(), build()
        our_fsdp.fully_shard(model.block)
        our_fsdp.fully_shard(model, reshard_after_forward=False)
        outs = []
        for m in (model, plain):
            params = list(m.parameters())  # ours: the DTensors (whole tensors are registered while held)
            opt = torch.optim.SGD(params, lr=0.1, foreach=change == "sgd-foreach")
            F.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()
            with torch.no_grad():
                m(x)  # ours: the root's whole tensors stay (reshard_after_forward=False)
                if change == "mul_":
                    for p in params:
                        p.mul_(2)
                else:
                    opt.step()
                outs.append(m(x))
        assert model._fsdp_state.unit.is_unsharded, "nothing held: the case would not test staleness"
        assert torch.equal(outs[0], outs[1]), f"{change}: the forward after it ran the old weights"


# ---- 4. Shard(1) from shard_placement_fn ---------------------------------------------------------------


def shard_wide_on_dim1(p: nn.Parameter) -> Shard | None:
    return Shard(1) if p.dim() == 2 and p.shape[1] % 2 == 0 else None  # Linear weights, the embedding


def case_shard_dim1_matches_torch(env) -> None:
    models = {}
    for impl, fully_shard in IMPLS.items():
        model = build()
        fully_shard(model.block, shard_placement_fn=shard_wide_on_dim1)
        fully_shard(model, shard_placement_fn=shard_wide_on_dim1)
        models[impl] = model
    ours, theirs = models["ours"], models["torch"]
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert p.placements == q.placements, (name, p.placements, q.placements)
        assert p.to_local().shape == q.to_local().shape and torch.equal(p.to_local(), q.to_local()), name
    assert ours.block.a.weight.placements == (Shard(1),) and ours.block.a.bias.placements == (Shard(0),)
    assert_same_training(env, ours, theirs)
    for name, p in ours.named_parameters():  # the gradient shards too, not only the result
        assert torch.equal(p.to_local(), dict(theirs.named_parameters())[name].to_local()), name
    state = whole(theirs)
    ours.load_full_state_dict(state)  # each rank copies its columns back in
    assert all(torch.equal(v, state[k]) for k, v in whole(ours).items())


def case_shard_dim_refusals(env) -> None:
    assert_same_refusal(lambda impl: IMPLS[impl](nn.Linear(5, 6), shard_placement_fn=lambda p: Shard(1)), "uneven")
    assert_same_refusal(lambda impl: IMPLS[impl](nn.Linear(4, 6), shard_placement_fn=lambda p: Shard(2)), "dim 2")


# ---- 5. forward methods and torch's FSDPModule ---------------------------------------------------------


def case_forward_method_and_torch_fsdpmodule(env) -> None:
    outputs = []
    for impl, register in (("torch", torch_fsdp.register_fsdp_forward_method),
                           ("ours", torch_fsdp.register_fsdp_forward_method),
                           ("ours", our_fsdp.register_fsdp_forward_method)):  # fmt: skip
        model = build()
        IMPLS[impl](model.block)
        IMPLS[impl](model)
        assert isinstance(model, torch_fsdp.FSDPModule) and isinstance(model.block, torch_fsdp.FSDPModule)
        register(model, "generate")
        with torch.no_grad():
            outputs.append(model.generate(batch(0, env.rank)[0]))
    for got in outputs[1:]:
        assert torch.equal(got[0], outputs[0][0]) and torch.equal(got[1], outputs[0][1])
    plain = build()
    our_fsdp.register_fsdp_forward_method(plain, "generate")  # not sharded: a no-op, as torch's
    assert "generate" not in vars(plain)
    assert not hasattr(our_fsdp.FSDPModule, "set_custom_all_gather")  # torch's, not implemented: absent


# ---- 6. a parameter assigned after fully_shard; deepcopy ---------------------------------------------------


def case_assigned_dtensor_taken_at_first_forward(env) -> None:
    """Meta init, then a new DTensor parameter assigned before the first forward: torch's lazy
    init takes it as the shard, and so do we (the old shard would give other values)."""
    models = {}
    for impl, fully_shard in IMPLS.items():
        with torch.device("meta"):
            model = LM()
        fully_shard(model.block)
        fully_shard(model)
        model.to_empty(device="cpu")
        torch.manual_seed(1)
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        old = model.block.a.weight
        value = torch.arange(48, dtype=torch.float32).view(8, 6) / 50
        model.block.a.weight = nn.Parameter(distribute_tensor(value, old.device_mesh, old.placements))
        models[impl] = model
    assert_same_training(env, models["ours"], models["torch"])
    model = build()
    our_fsdp.fully_shard(model)
    model.head.weight = nn.Parameter(torch.ones(11, 6))  # plain: torch fails with an AttributeError
    message = str(raised(lambda: model(batch(0, env.rank)[0])))
    assert "weight: a plain Parameter (11, 6)" in message and "distribute_tensor" in message, message


def case_deepcopy_refused(env) -> None:
    assert_same_refusal(lambda impl: copy.deepcopy(IMPLS[impl](build())), "deepcopy")


# ---- 7. refusals ---------------------------------------------------------------------------------------------


def channels_last(impl: str) -> None:
    conv = nn.Conv2d(3, 4, 3)
    conv.weight = nn.Parameter(conv.weight.detach().to(memory_format=torch.channels_last))
    IMPLS[impl](conv)


def with_scalar(impl: str) -> None:
    model = nn.Linear(2, 2)
    model.scale = nn.Parameter(torch.tensor(1.0))
    IMPLS[impl](model)


def twice(impl: str) -> None:
    model = nn.Linear(2, 2)
    IMPLS[impl](model)
    IMPLS[impl](model)


def case_refusals_match_torch(env) -> None:
    assert_same_refusal(lambda impl: IMPLS[impl](nn.ModuleList([nn.Linear(2, 2)])), "ModuleList")
    assert_same_refusal(lambda impl: IMPLS[impl](nn.ModuleDict({"a": nn.Linear(2, 2)})), "ModuleDict")
    assert_same_refusal(channels_last, "channels_last")
    mesh_2d, mesh_3d = init_device_mesh("cpu", (1, 2)), init_device_mesh("cpu", (1, 1, 2))
    assert_same_refusal(lambda impl: IMPLS[impl](nn.Linear(2, 2), mesh=mesh_2d), "2-D mesh without names")
    assert_same_refusal(lambda impl: IMPLS[impl](nn.Linear(2, 2), mesh=mesh_3d), "3-D mesh")
    assert_same_refusal(with_scalar, "scalar")
    assert_same_refusal(twice, "twice")


CASES = {
    2: [(fn.__name__.removeprefix("case_"), fn) for name, fn in sorted(globals().items()) if name.startswith("case_")],
    4: [
        ("reshard_to_rows_of_two", ws4_reshard_to_rows_of_two),
        ("rows_changed_while_held", ws4_rows_changed_while_held),
    ],  # the smallest shard size with a row size
}


def behaviour_suite(env, out_dir):
    run_cases(env, CASES[env.world_size], out_dir)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return suites_by_world_size(behaviour_suite, tmp_path_factory, "fsdp2-torch-behaviour", timeout=300)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size,case", [(ws, name) for ws, cases in CASES.items() for name, _ in cases])
def test_behaves_as_torch(suite, world_size, case):
    suite(world_size).check(case)


def test_int_reshard_after_forward_is_torchs():
    """An int is a row size: a non-trivial factor of the shard size is kept; 1 is False and the
    shard size True, as torch says; anything else is torch's ValueError."""
    assert _reshard_after_forward(2, 4) == 2 and _reshard_after_forward(2, 4) is not True
    assert _reshard_after_forward(4, 4) is True and _reshard_after_forward(1, 4) is False
    with pytest.raises(ValueError, match="it should be a factor of 4, not 3"):
        _reshard_after_forward(3, 4)
