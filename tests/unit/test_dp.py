"""nanoddp.DataParallel: every step compared with a single-module, full-batch reference.

CPU "devices" (["cpu", "cpu"]) run the real multi-replica path (threads, replicas, gather).
torch.nn.parallel's own scatter/gather refuse CPU tensors, so on CPU the references are
`Tensor.chunk`/`torch.cat` and the unwrapped module; with CUDA, torch.nn.DataParallel itself.
"""

from __future__ import annotations

import copy
import traceback
from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

from nanoddp.models import GPT, MLPClassifier, gpt_config
from nanoddp.parallel.dp.data_parallel import DataParallel, mean_over_replicas, parallel_apply, replicate
from nanoddp.parallel.dp.scatter_gather import gather, scatter, scatter_kwargs

CPU2 = ["cpu", "cpu"]
CPU3 = ["cpu", "cpu", "cpu"]


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def make_model(kind: str, batch: int = 5) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A model with a batch of inputs and targets (5 rows: odd on purpose)."""
    torch.manual_seed(0)
    if kind == "mlp":
        return MLPClassifier(), torch.randn(batch, 64), torch.randint(0, 10, (batch,))
    model = GPT(gpt_config("tiny"))
    return model, torch.randint(0, 512, (batch, 12)), torch.randint(0, 512, (batch, 12))


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_outputs_and_gradients_equal_single_module(kind):
    model, x, _ = make_model(kind)
    reference = copy.deepcopy(model)
    expected = reference(x)
    expected.sum().backward()
    for devices in (CPU2, CPU3):  # 5 rows: 3+2 on two devices, 2+2+1 on three
        model.zero_grad(set_to_none=True)
        out = DataParallel(model, devices)(x)
        out.sum().backward()
        assert_close(out, expected)
        for got, want in zip(grads(model), grads(reference), strict=True):
            assert_close(got, want)


@pytest.mark.parametrize(
    "batch, devices, sizes",
    [(1, CPU2, [1]), (2, CPU3, [1, 1]), (5, ["cpu"] * 4, [2, 2, 1]), (7, CPU3, [3, 3, 1]), (4, CPU2, [2, 2])],
)
def test_odd_batches_use_chunk_sizes_and_fewer_replicas(batch, devices, sizes):
    model, _, _ = make_model("mlp")
    x = torch.randn(batch, 64)
    reference = copy.deepcopy(model)
    reference(x).sum().backward()
    dp = DataParallel(model, devices)
    out = dp(x)
    out.sum().backward()
    assert dp.replica_batch_sizes == sizes
    assert_close(out, reference(x))
    for got, want in zip(grads(model), grads(reference), strict=True):
        assert_close(got, want)


def test_scatter_matches_chunk_for_every_structure():
    x, y, z = torch.randn(5, 3), torch.arange(10).view(5, 2), torch.tensor(2.5)
    Pair = namedtuple("Pair", "a b")
    inputs = (x, [y, "tag"], {"z": z, "n": 7, "pair": Pair(x, None)})
    parts = scatter(inputs, CPU2)
    assert len(parts) == 2
    for i, part in enumerate(parts):
        assert_close(part[0], x.chunk(2)[i])
        assert isinstance(part[1], list) and part[1][1] == "tag"
        assert_close(part[1][0], y.chunk(2)[i])
        assert_close(part[2]["z"], z)  # 0-dim tensors and ints: every device
        assert part[2]["n"] == 7
        assert isinstance(part[2]["pair"], Pair) and part[2]["pair"].b is None
        assert_close(part[2]["pair"].a, x.chunk(2)[i])
    # Along another dim, and a batch smaller than the device count: fewer entries.
    assert [p.shape for p in scatter(x, CPU2, dim=1)] == [c.shape for c in x.chunk(2, dim=1)]
    assert len(scatter(torch.randn(2, 4), ["cpu"] * 4)) == 2
    # kwargs: padded to the positional count; the shorter split limits both.
    args, kwargs = scatter_kwargs((x,), {"targets": torch.arange(5), "flag": True}, CPU3)
    assert len(args) == len(kwargs) == 3 and [a[0].shape[0] for a in args] == [2, 2, 1]
    assert_close(kwargs[2]["targets"], torch.arange(5).chunk(3)[2])
    assert kwargs[2]["flag"] is True
    args, kwargs = scatter_kwargs((torch.randn(1, 2),), {"t": torch.randn(4, 2)}, CPU2)
    assert len(args) == len(kwargs) == 1


@dataclass
class Output:
    logits: torch.Tensor
    loss: torch.Tensor
    name: str = "out"


def test_gather_structures_scalars_and_backward():
    a = torch.randn(3, 2, requires_grad=True)
    b = torch.randn(2, 2, requires_grad=True)
    la, lb = a.sum(), b.sum()
    out = gather([{"t": (a, [la]), "none": None, "k": 1}, {"t": (b, [lb]), "none": None, "k": 1}], "cpu")
    assert_close(out["t"][0], torch.cat([a, b]))
    assert_close(out["t"][1][0], torch.stack([la, lb]))  # scalars -> a vector of length R
    assert out["none"] is None and out["k"] == 1
    weights = torch.randn(5, 2)
    (out["t"][0] * weights).sum().backward()
    assert_close(a.grad, weights[:3])
    assert_close(b.grad, weights[3:])
    dc = gather([Output(a, la, "r0"), Output(b, lb, "r1")], "cpu")
    assert isinstance(dc, Output) and dc.name == ["r0", "r1"]
    assert_close(dc.logits, torch.cat([a, b]))
    assert_close(dc.loss, torch.stack([la, lb]))
    assert_close(gather([a.T, torch.ones(2, 4)], "cpu", dim=1), torch.cat([a.T, torch.ones(2, 4)], dim=1))
    with pytest.raises(ValueError, match="different keys"):
        gather([{"a": a}, {"b": b}], "cpu")


class DictModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, scale=1.0):
        y = self.lin(x) * scale
        return {"y": y, "pair": (y.sum(), y.mean(dim=1)), "meta": "ok"}


def test_dict_and_tuple_outputs_with_kwargs():
    torch.manual_seed(0)
    model, x = DictModel(), torch.randn(5, 4)
    reference = copy.deepcopy(model)
    want = reference(x, scale=2.0)
    (want["y"].pow(2).sum() + want["pair"][1].sum()).backward()
    got = DataParallel(model, CPU2)(x=x, scale=2.0)  # keyword-only call, non-tensor kwarg
    (got["y"].pow(2).sum() + got["pair"][1].sum()).backward()
    assert got["meta"] == "ok"
    assert_close(got["y"], want["y"])
    assert_close(got["pair"][1], want["pair"][1])
    assert_close(got["pair"][0], torch.stack([want["y"][:3].sum(), want["y"][3:].sum()]))
    for g, w in zip(grads(model), grads(reference), strict=True):
        assert_close(g, w)


@pytest.mark.parametrize("kind, batch, devices", [("mlp", 5, CPU2), ("mlp", 7, CPU3), ("gpt", 5, CPU2)])
def test_loss_in_forward_weighted_mean_equals_full_batch(kind, batch, devices):
    model, x, y = make_model(kind, batch)
    reference = copy.deepcopy(model)
    _, full_loss = reference(x, y)
    full_loss.backward()
    dp = DataParallel(model, devices)
    _, losses = dp(x, y)
    assert losses.shape == (len(dp.replica_batch_sizes),)
    loss = dp.reduce_loss(losses)
    loss.backward()
    assert_close(loss, full_loss)
    for got, want in zip(grads(model), grads(reference), strict=True):
        assert_close(got, want)
    assert not torch.allclose(losses.mean(), full_loss)  # uneven split: a plain mean is biased
    with pytest.raises(ValueError, match="one loss per replica"):
        mean_over_replicas(losses, [1, 2, 3, 4])


def test_loss_in_forward_even_split_plain_mean():
    model, x, y = make_model("mlp", batch=6)  # 3 + 3 rows
    _, full_loss = copy.deepcopy(model)(x, y)
    _, losses = DataParallel(model, CPU2)(x, y)
    assert_close(losses.mean(), full_loss)


def test_replicate_makes_distinct_autograd_nodes_that_sum_into_the_original():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.BatchNorm1d(3))
    model[1].weight = model[0].weight  # tied weights
    replicas = replicate(model, CPU2)
    for r in replicas:
        assert r is not model and r[0].weight is not model[0].weight
        assert r[0].weight.grad_fn is not None and not r[0].weight.is_leaf
        assert r[0].weight is r[1].weight  # tied stays tied
    assert replicas[0][2].running_mean is model[2].running_mean  # replica 0 shares buffers (torch's rule)
    assert replicas[1][2].running_mean is not model[2].running_mean
    assert_close(replicas[1][2].running_mean, model[2].running_mean)
    x = torch.randn(4, 3)
    (replicas[0][0](x).sum() + 3 * replicas[1][0](x).sum()).backward()
    reference = copy.deepcopy(model)
    (4 * reference[0](x).sum()).backward()
    assert_close(model[0].weight.grad, reference[0].weight.grad)


def test_batchnorm_train_mode_per_replica_stats_and_replica0_running_stats():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6)).train()
    untouched = copy.deepcopy(model)
    x = torch.randn(8, 4)
    out = DataParallel(model, CPU2)(x)
    # Each replica normalises with its own chunk (no SyncBatchNorm) ...
    first, second = copy.deepcopy(untouched), copy.deepcopy(untouched)
    assert_close(out, torch.cat([first(x[:4]), second(x[4:])]))
    # ... and only replica 0's running-stat update reaches the wrapped module.
    assert_close(model[1].running_mean, first[1].running_mean)
    assert_close(model[1].running_var, first[1].running_var)
    assert model[1].num_batches_tracked.item() == 1


class FailingModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        if (x > 100).any():
            raise KeyError("poisoned row")
        return self.lin(x)


def test_exception_in_one_replica_surfaces_with_its_index_and_traceback():
    x = torch.zeros(6, 2)
    x[5] = 1000.0  # lands in the third chunk
    with pytest.raises(KeyError, match="replica 2 on device cpu") as info:
        DataParallel(FailingModel(), CPU3)(x)
    assert info.value.replica_index == 2
    frames = traceback.extract_tb(info.value.__cause__.__traceback__)
    assert any(f.name == "forward" and "raise KeyError" in f.line for f in frames)


def test_grad_mode_reaches_the_replica_threads():
    model, x, _ = make_model("mlp")
    with torch.no_grad():
        out = DataParallel(model, CPU2)(x)
    assert out.grad_fn is None and not out.requires_grad
    outs = parallel_apply(replicate(model, CPU2), [(x[:2],), (x[2:],)])
    assert all(o.requires_grad for o in outs)


def test_gradcheck_through_scatter_replicate_gather():
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    x = torch.randn(5, 3, dtype=torch.double, requires_grad=True)
    dp = DataParallel(model, CPU3)
    assert torch.autograd.gradcheck(lambda inp: torch.tanh(dp(inp)), (x,))


def test_one_device_is_the_module_itself():
    model, x, y = make_model("mlp")
    dp = DataParallel(model, ["cpu"])
    assert dp.module is model
    assert_close(dp(x), model(x), rtol=0, atol=0)
    logits, loss = dp(x, targets=y)
    assert loss.dim() == 0 and dp.reduce_loss(loss) is loss
    assert list(dp.state_dict()) == ["module." + k for k in model.state_dict()]


@pytest.mark.skipif(torch.cuda.is_available(), reason="default device_ids use the GPUs when present")
def test_default_device_ids_without_gpu_call_the_module():
    model, x, _ = make_model("mlp")
    dp = DataParallel(model)
    assert dp.device_ids == [] and dp.output_device is None
    assert_close(dp(x), model(x), rtol=0, atol=0)


def test_bad_arguments_raise_clear_errors():
    model = MLPClassifier()
    with pytest.raises(ValueError, match="device_ids is empty"):
        DataParallel(model, [])
    with pytest.raises(ValueError, match="must be a list"):
        DataParallel(model, "cpu")
    with pytest.raises(ValueError, match="mix device types"):
        DataParallel(model, ["cpu", "meta"])
    with pytest.raises(ValueError, match="not a device"):
        DataParallel(model, ["gpu7", "cpu"])
    with pytest.raises(ValueError, match=">= 0"):
        DataParallel(model, [-1])
    with pytest.raises(ValueError, match="dim must be an int"):
        DataParallel(model, CPU2, dim="0")
    with pytest.raises(TypeError, match="wraps an nn.Module"):
        DataParallel(lambda x: x, CPU2)
    if torch.cuda.device_count() < 8:
        with pytest.raises(ValueError, match="visible GPU"):
            DataParallel(model, [7])
    with pytest.raises(ValueError, match="device_ids\\[0\\]"):
        DataParallel(model, ["meta", "meta"])(torch.randn(2, 64))  # module lives on the CPU
    with pytest.raises(ValueError, match="one input per replica"):
        parallel_apply(replicate(model, CPU2), [(torch.randn(1, 64),)])


def _torch_dp_devices() -> list[int]:
    return list(range(torch.cuda.device_count()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.nn.DataParallel needs CUDA")
def test_matches_torch_dataparallel_on_cuda():
    """Outputs, per-replica losses and gradients equal torch.nn.DataParallel's on the same GPUs.

    With a single GPU, ours runs two replicas on it (["cuda:0", "cuda:0"]) while torch's calls
    the module, which still checks our replicate/thread/gather path on a real GPU.
    """
    gpu_ids = _torch_dp_devices()
    ours_devices = gpu_ids if len(gpu_ids) > 1 else ["cuda:0", "cuda:0"]
    for kind in ("mlp", "gpt"):
        model, x, y = make_model(kind, batch=6)  # even on 2 devices
        ours_model, torch_model = model.cuda(), copy.deepcopy(model).cuda()
        x, y = x.cuda(), y.cuda()
        ours_logits, ours_losses = DataParallel(ours_model, ours_devices)(x, y)
        torch_logits, torch_losses = nn.DataParallel(torch_model, gpu_ids)(x, y)
        assert_close(ours_logits, torch_logits, rtol=1e-4, atol=1e-5)
        assert_close(ours_losses.mean(), torch_losses.mean(), rtol=1e-4, atol=1e-5)
        (ours_losses.mean() + ours_logits.float().pow(2).mean()).backward()
        (torch_losses.mean() + torch_logits.float().pow(2).mean()).backward()
        for got, want in zip(grads(ours_model), grads(torch_model), strict=True):
            assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_scatter_gather_match_torch_on_cuda():
    from torch.nn.parallel import scatter_gather as torch_sg

    devices = _torch_dp_devices() if torch.cuda.device_count() > 1 else [0]
    x = {"a": torch.randn(7, 3, device="cuda"), "b": (torch.arange(7, device="cuda"), 4)}
    for ours, theirs in zip(scatter(x, devices), torch_sg.scatter(x, devices), strict=True):
        assert_close(ours["a"], theirs["a"])
        assert_close(ours["b"][0], theirs["b"][0])
        assert ours["b"][1] == theirs["b"][1]
    outs = [torch.randn(2, 3, device=f"cuda:{d}") for d in devices]
    assert_close(gather(outs, devices[0]), torch_sg.gather(outs, devices[0]))
    scalars = [torch.tensor(float(i), device=f"cuda:{d}") for i, d in enumerate(devices)]
    assert_close(gather(scalars, devices[0]), torch_sg.gather(scalars, devices[0]))


def test_loss_helper_matches_cross_entropy_over_concatenated_chunks():
    torch.manual_seed(0)
    logits, targets = torch.randn(7, 5), torch.randint(0, 5, (7,))
    per_chunk = torch.stack([F.cross_entropy(lg, t) for lg, t in zip(logits.chunk(3), targets.chunk(3), strict=True)])
    assert_close(mean_over_replicas(per_chunk, [3, 3, 1]), F.cross_entropy(logits, targets))


def test_drop_in_training_loop_matches_single_module_training():
    """Three AdamW steps through DataParallel leave the same parameters as plain full-batch steps."""
    model, x, y = make_model("mlp", batch=7)
    reference = copy.deepcopy(model)
    dp = DataParallel(model, CPU3)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (dp, reference))
    for _ in range(3):
        _, losses = dp(x, y)
        opt.zero_grad(set_to_none=True)
        dp.reduce_loss(losses).backward()
        opt.step()
        ref_opt.zero_grad(set_to_none=True)
        reference(x, y)[1].backward()
        ref_opt.step()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert_close(got, want)
