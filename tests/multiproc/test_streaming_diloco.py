"""Streaming DiLoCo and compressed pseudo-gradients on 2 gloo ranks, every check in one launch.

- fragments F in {1, 2}, sync delay tau in {0, 1}, mix alpha in {0, 0.5}: bitwise torchft 0.2.0's
  `DiLoCo(model_fragments, ..., fragment_sync_delay, fragment_update_alpha)` (one outer SGD per
  fragment, as torchtitan builds it; ours is one optimizer whose step skips the parameters
  without a pseudo-gradient: the same per-parameter SGD), driven by a
  stand-in for torchft's Manager (`AveragingManager`) whose allreduce averages over the same gloo
  group as torchft's Manager does: sum, then divide by the participants on completion. Ours
  divides, then sums; with two ranks x/2 + y/2 and (x + y)/2 round the same (halving is exact);
- int8 with error feedback (F = 2, tau = 1, alpha = 0.5): bitwise a single-process simulation of
  the two replicas that quantizes block by block by the rule `pseudo_grad_mean` documents; so
  are bf16 and fp16 (cast, summed in fp32, rounded once); the last-sync weights (the global
  model) are the same on both ranks; the bytes are the wire format's;
- the same run stopped with a fragment's mean on the wire, saved, rebuilt and resumed, equals
  the uninterrupted run bitwise.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import run_on_ranks

from nanoddp.parallel.lowcomm import DiLoCo

H, STEPS, STOP = 4, 9, 5  # after step 5 (tau = 1, F = 2) fragment 0's mean is on the wire
INT8_BLOCK = 256  # the documented block size (pseudo_grad_mean.INT8_BLOCK); the simulation's own copy
WIRES = ("int8", "bf16", "fp16")
COMBOS = [(f, tau, alpha) for f, tau, alpha in itertools.product((1, 2), (0, 1), (0.0, 0.5))]


def halves(width: int, hidden: int) -> nn.Sequential:
    """Two linear layers of equal size: DiLoCo's equal-count cut at F = 2 falls between them."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, width))


def small() -> nn.Sequential:
    return halves(8, 8)  # 64 + 8 | 64 + 8 elements


def int8_model() -> nn.Sequential:
    return halves(16, 32)  # 512 + 32 | 512 + 16 elements: three int8 blocks a fragment, the last short


def batch(width: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, width, generator=g), torch.randn(4, width, generator=g)  # (4, W), (4, W)


def train(model: nn.Module, optimizer, rank: int, steps: range) -> None:
    width = model[0].in_features
    for step in steps:
        x, y = batch(width, rank, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


class _AveragedWork:
    def __init__(self, work, tensor: torch.Tensor, participants: int) -> None:
        self.work, self.tensor, self.participants = work, tensor, participants

    def wait(self) -> bool:
        self.work.wait()
        self.tensor /= self.participants  # torchft's Manager.allreduce: the division on completion
        return True


class AveragingManager:
    """What torchft 0.2.0's DiLoCo calls on its Manager, and no more: allreduce (async, averaged
    over the default gloo group), should_commit (always: no failures here; it advances the step,
    which picks the fragment), current_step, and the quorum/state hooks, which have nothing to do
    without fault tolerance."""

    _use_async_quorum = False

    def __init__(self) -> None:
        self.step = 0
        self.state_fns: dict[str, tuple] = {}

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False) -> _AveragedWork:
        assert not should_quantize
        return _AveragedWork(dist.all_reduce(tensor, async_op=True), tensor, dist.get_world_size())

    def should_commit(self) -> bool:
        self.step += 1
        return True

    def current_step(self) -> int:
        return self.step

    def start_quorum(self) -> None:
        pass

    def register_state_dict_fn(self, key: str, load_fn, save_fn) -> None:
        self.state_fns[key] = (load_fn, save_fn)

    def allow_state_dict_read(self) -> None:
        pass

    def disallow_state_dict_read(self) -> None:
        pass


def torchft_run(rank: int, fragments: int, tau: int, alpha: float) -> list[torch.Tensor]:
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo

    model = small()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pieces = [model] if fragments == 1 else [model[0], model[2]]
    # one outer optimizer per fragment, as torchtitan passes them: a single one over the whole
    # model would, at a fragment's outer step, also move the other fragments by the inner
    # gradients their last backward left in .grad
    outer = [torch.optim.SGD(piece.parameters(), lr=0.7, momentum=0.9, nesterov=True) for piece in pieces]
    with TorchftDiLoCo(
        AveragingManager(), pieces, inner, outer, sync_every=H, fragment_sync_delay=tau, fragment_update_alpha=alpha
    ):
        train(model, inner, rank, range(STEPS))
    return params(model)


def ours_run(rank: int, fragments: int, tau: int, alpha: float, backend: str) -> list[torch.Tensor]:
    model = small()
    opt = DiLoCo(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        sync_every=H,
        fragments=fragments,
        sync_delay=tau,
        mix=alpha,
        comm_backend=backend,
    )
    train(model, opt, rank, range(STEPS))
    return params(model)


def streaming_diloco(model: nn.Module, compress: str = "int8") -> DiLoCo:
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return DiLoCo(inner, sync_every=H, fragments=2, sync_delay=1, mix=0.5, compress=compress)


def _worker(env) -> dict:
    out: dict = {}
    for combo in COMBOS:
        out[f"torchft-{combo}"] = torchft_run(env.rank, *combo)
        out[f"ours-{combo}"] = ours_run(env.rank, *combo, backend="nanoddp")
    out["ours-torch-backend"] = ours_run(env.rank, 2, 1, 0.5, backend="torch")

    for compress in WIRES:
        whole = int8_model()
        opt = streaming_diloco(whole, compress)
        sent = []
        for step in range(STEPS):
            train(whole, opt, env.rank, range(step, step + 1))
            sent.append(opt.last_sync_bytes)
        out[compress], out[f"{compress}-sent"] = params(whole), sent
        out[f"{compress}-last-sync"] = [s.clone() for s in opt.last_sync]

    stopped = int8_model()
    stopped_opt = streaming_diloco(stopped)
    train(stopped, stopped_opt, env.rank, range(STOP))
    assert stopped_opt.in_flight, "the resume check must stop with a fragment on the wire"
    saved_model, saved_opt = copy.deepcopy(stopped.state_dict()), copy.deepcopy(stopped_opt.state_dict())
    resumed = int8_model()
    resumed_opt = streaming_diloco(resumed)
    resumed.load_state_dict(saved_model)  # after the wrapper: its start-up broadcast would undo it
    resumed_opt.load_state_dict(saved_opt)
    train(resumed, resumed_opt, env.rank, range(STOP, STEPS))
    out["int8-resumed"] = params(resumed)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(_worker, 2, timeout=240)


def assert_bitwise(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"{what}: parameter {i} differs by {(a - b).abs().max().item():.3g}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("combo", COMBOS, ids=[f"F{f}-tau{t}-mix{a}" for f, t, a in COMBOS])
def test_equals_torchft_diloco_bitwise(ranks, combo):
    for rank, out in enumerate(ranks):
        assert_bitwise(out[f"ours-{combo}"], out[f"torchft-{combo}"], f"rank {rank} {combo} vs torchft")
    # step 9 is mid-round: the replicas trained apart since the last sync (else nothing was local)
    assert not torch.equal(ranks[0][f"ours-{combo}"][0], ranks[1][f"ours-{combo}"][0])


@pytest.mark.timeout(300)
def test_torch_comm_backend_gives_the_same_bits(ranks):
    for out in ranks:
        assert_bitwise(out["ours-torch-backend"], out["torchft-(2, 1, 0.5)"], "comm_backend='torch' vs torchft")


def quantized(x: torch.Tensor) -> torch.Tensor:
    """The documented rule, block by block: absmax / 127 scales, round half to even, dequantized."""
    out = torch.empty_like(x)
    for start in range(0, x.numel(), INT8_BLOCK):
        block = x[start : start + INT8_BLOCK]
        scale = block.abs().max() / 127
        q = torch.round(block / scale).clamp(-127, 127).to(torch.int8) if scale > 0 else torch.zeros_like(block)
        out[start : start + INT8_BLOCK] = q.float() * scale
    return out


def simulate(wire: str) -> list[list[torch.Tensor]]:
    """Both replicas in this process: F = 2 (layer 1 | layer 2), period 2, tau = 1, alpha = 0.5.
    int8: each replica sends its quantized pseudo-gradient plus what rounding lost last time, and
    the mean is the dequantized sum / 2. bf16/fp16: each sends its half cast to the wire dtype,
    and the mean is their sum in fp32 rounded once to that dtype (two terms: one addition)."""
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(wire)
    models = [int8_model() for _ in range(2)]
    inners = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    synced = [p.detach().clone() for p in models[0].parameters()]
    outer = torch.optim.SGD(synced, lr=0.7, momentum=0.9, nesterov=True)
    fragments = [range(0, 2), range(2, 4)]
    residual = {(r, f): torch.zeros(sum(synced[i].numel() for i in fragments[f])) for r in range(2) for f in range(2)}
    pending: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for step in range(1, STEPS + 1):
            for rank in range(2):
                with torch.enable_grad():
                    train(models[rank], inners[rank], rank, range(step - 1, step))
            if (step + 1) % 2 == 0:  # tau = 1 before the outer step
                f = ((step + 1) // 2 - 1) % 2
                sent = []
                for rank, model in enumerate(models):
                    ps = list(model.parameters())
                    x = torch.cat([(synced[i] - ps[i]).reshape(-1) for i in fragments[f]])
                    if half is None:
                        x = x + residual[rank, f]
                        sent.append(quantized(x))
                        residual[rank, f] = x - sent[-1]
                    else:
                        sent.append((x / 2).to(half))
                if half is None:
                    pending[f] = (sent[0] + sent[1]) / 2
                else:
                    pending[f] = (sent[0].float() + sent[1].float()).to(half).float()
            if step % 2 == 0:
                f = (step // 2 - 1) % 2
                mean, offset = pending.pop(f), 0
                for i in fragments[f]:
                    synced[i].grad = mean[offset : offset + synced[i].numel()].view_as(synced[i])
                    offset += synced[i].numel()
                outer.step()
                for model in models:
                    ps = list(model.parameters())
                    for i in fragments[f]:
                        local = ps[i].detach().clone()
                        ps[i].copy_(synced[i])
                        ps[i].lerp_(local, 0.5)
                        synced[i].grad = None
    return [params(m) for m in models]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_half_precision_wire_equals_the_simulation(ranks, wire):
    replicas = simulate(wire)
    for rank, out in enumerate(ranks):
        assert_bitwise(out[wire], replicas[rank], f"rank {rank} {wire} vs the simulation")
    assert_bitwise(ranks[0][f"{wire}-last-sync"], ranks[1][f"{wire}-last-sync"], "the global model, rank 0 vs 1")
    halves = [2 * (512 + 32), 2 * (512 + 16)]  # 2 bytes an element
    assert ranks[0][f"{wire}-sent"] == [halves[(s // 2) % 2] if s % 2 == 1 else 0 for s in range(1, STEPS + 1)]


@pytest.mark.timeout(300)
def test_int8_with_error_feedback_equals_the_simulation(ranks):
    replicas = simulate("int8")
    for rank, out in enumerate(ranks):
        assert_bitwise(out["int8"], replicas[rank], f"rank {rank} int8 vs the simulation")
    assert_bitwise(ranks[0]["int8-last-sync"], ranks[1]["int8-last-sync"], "the global model on rank 0 vs 1")
    # one fragment leaves at steps 1, 3, 5, 7, 9: int8 values and one fp32 scale per 256 of them
    fragment_elements = [512 + 32, 512 + 16]
    int8_bytes = [n + 4 * -(-n // INT8_BLOCK) for n in fragment_elements]
    expected = [int8_bytes[(s // 2) % 2] if s % 2 == 1 else 0 for s in range(1, STEPS + 1)]
    assert ranks[0]["int8-sent"] == expected
    assert 4 * sum(fragment_elements) > 3.8 * sum(int8_bytes)  # vs fp32: nearly 4x fewer bytes


@pytest.mark.timeout(300)
def test_resume_with_a_fragment_in_flight_is_exact(ranks):
    for rank, out in enumerate(ranks):
        assert_bitwise(out["int8-resumed"], out["int8"], f"rank {rank} resumed at step {STOP} vs uninterrupted")
