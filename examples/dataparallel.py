"""DataParallel from the inside: scatter -> replicate -> parallel_apply -> gather.

Part 1 runs the four steps by hand on a tiny GPT and checks the gradients against a plain
full-batch backward. Part 2 shows the output imbalance DataParallel is known for: with the
loss computed outside, the full logits tensor is gathered on the output device; with the loss
computed inside `forward`, one scalar per replica is. Part 3 trains a few steps that way.

    python examples/dataparallel.py                 # 2 GPUs if present, else ["cpu", "cpu"]
    python examples/dataparallel.py --devices cpu,cpu,cpu --batch 12
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanoddp import DataParallel
from nanoddp.models import GPT, gpt_config
from nanoddp.parallel.dp.data_parallel import mean_over_replicas, parallel_apply, replicate
from nanoddp.parallel.dp.scatter_gather import batch_size_of, gather, scatter


class LossInForward(nn.Module):
    """Return only each replica's mean loss, so nothing batch-sized travels to the output device."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model(idx, targets)[1]  # () per replica -> (R,) after gather


def tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    return sum(tensor_bytes(x) for x in obj) if isinstance(obj, (tuple, list)) else 0


def step_by_step(model: GPT, idx: torch.Tensor, targets: torch.Tensor, devices: list[str]) -> None:
    print("== 1. the four steps by hand ==")
    chunks = scatter((idx, targets), devices)  # one (idx_i, targets_i) per device
    shapes = [tuple(c[0].shape) for c in chunks]
    print(f"scatter : batch {tuple(idx.shape)} -> {shapes} on {devices[: len(chunks)]}")
    replicas = replicate(model, devices[: len(chunks)])
    weight = replicas[-1].head.weight
    print(
        f"replicate: {len(replicas)} replicas; replica head.weight is_leaf={weight.is_leaf}, "
        f"grad_fn={type(weight.grad_fn).__name__} (gradients flow back to the original)"
    )
    outputs = parallel_apply(replicas, chunks)  # one thread per replica
    print(f"parallel_apply: per-replica losses {[round(out[1].item(), 4) for out in outputs]}")
    logits, losses = gather(outputs, devices[0])  # (B, T, V), (R,)
    print(f"gather  : logits {tuple(logits.shape)}, losses {tuple(losses.shape)} on {logits.device}")
    loss = mean_over_replicas(losses, [batch_size_of(c) for c in chunks])  # weighted: exact full-batch mean
    loss.backward()
    reference = copy.deepcopy(model)
    reference.zero_grad(set_to_none=True)
    reference(idx, targets)[1].backward()
    pairs = zip(model.parameters(), reference.parameters(), strict=True)
    diff = max((p.grad - r.grad).abs().max().item() for p, r in pairs)
    print(f"backward: loss {loss.item():.4f}; max |grad - full-batch grad| = {diff:.2e}")
    model.zero_grad(set_to_none=True)


def output_imbalance(model: GPT, idx: torch.Tensor, targets: torch.Tensor, devices: list[str]) -> None:
    print("== 2. what lands on the output device ==")
    on_gpu = devices[0].startswith("cuda")
    plain, loss_in_forward = DataParallel(model, devices), DataParallel(LossInForward(model), devices)
    for name in ("logits gathered", "loss in forward"):
        if on_gpu:
            for d in devices:
                torch.cuda.reset_peak_memory_stats(d)
        start = time.perf_counter()
        if name == "logits gathered":
            out = plain(idx)  # (B, T, V) on the output device, then the loss there
            loss = F.cross_entropy(out.flatten(0, 1), targets.flatten())
        else:
            out = loss_in_forward(idx, targets)  # (R,)
            loss = loss_in_forward.reduce_loss(out)
        loss.backward()
        elapsed = time.perf_counter() - start
        line = f"{name:16s}: {tensor_bytes(out):>9,d} bytes gathered to {devices[0]} | loss {loss.item():.4f}"
        if on_gpu:
            peaks = [f"{d}: {torch.cuda.max_memory_allocated(d) / 2**20:.0f}" for d in devices]
            line += " | peak MiB per device " + ", ".join(peaks)
        print(line + f" | {elapsed * 1e3:.0f} ms")
        model.zero_grad(set_to_none=True)


def train(model: GPT, idx: torch.Tensor, targets: torch.Tensor, devices: list[str], steps: int) -> None:
    print("== 3. training with loss in forward ==")
    dp = DataParallel(model, devices)  # model(idx, targets) -> (logits, per-replica losses)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        start = time.perf_counter()
        _, losses = dp(idx, targets)
        loss = dp.reduce_loss(losses)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        elapsed = time.perf_counter() - start
        rate = len(idx) / elapsed
        print(f"step {step} | loss {loss.item():.4f} | {elapsed * 1e3:.0f} ms | {rate:.0f} samples/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", help="comma-separated, e.g. cpu,cpu or cuda:0,cuda:1")
    parser.add_argument("--batch", type=int, default=9, help="batch size (odd: shows the uneven split)")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sample")
    parser.add_argument("--steps", type=int, default=5, help="training steps in part 3")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per replica thread: the machine's cores are the "devices"
    torch.manual_seed(0)
    if args.devices:
        devices = args.devices.split(",")
    elif torch.cuda.device_count() >= 2:
        devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    else:
        devices = ["cpu", "cpu"]
    model = GPT(gpt_config("tiny", seq_len=args.seq)).to(devices[0])
    tokens = torch.randint(0, 512, (args.batch, args.seq + 1), device=devices[0])
    idx, targets = tokens[:, :-1], tokens[:, 1:]  # (B, T) each: predict the next token
    print(f"GPT tiny, batch {args.batch} x {args.seq} tokens, devices {devices}")
    step_by_step(model, idx, targets, devices)
    output_imbalance(model, idx, targets, devices)
    train(model, idx, targets, devices, args.steps)


if __name__ == "__main__":
    main()
