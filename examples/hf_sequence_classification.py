"""A Hugging Face model under nanoddp's DDP engine (seeds 001/003: loss computed in forward).

Task: which standard-library package does a 10-line snippet of Python come from?
(asyncio, email, xml or unittest: real text nobody here wrote.) A byte-level BPE tokenizer is
trained locally with `tokenizers`; the model is a small BERT built from a config (random init:
no weights can be downloaded here). Each rank trains on its shard under
`nanoddp.DistributedDataParallel`; validation accuracy is summed over all ranks.

With the hub reachable, start from real weights instead of a config:
    model = AutoModelForSequenceClassification.from_pretrained("bert-base-uncased", num_labels=4)
    tokenizer = AutoTokenizer.from_pretrained("bert-base-uncased")

Run: python examples/hf_sequence_classification.py [--nproc 2] [--steps 150]
"""

from __future__ import annotations

import argparse
import random
import sysconfig
from pathlib import Path

import torch
import torch.distributed as dist
from tokenizers import ByteLevelBPETokenizer
from transformers import BertConfig, BertForSequenceClassification

import nanoddp

PACKAGES = ("asyncio", "email", "xml", "unittest")
SNIPPET_LINES, MAX_TOKENS, PER_CLASS = 10, 96, 500


def stdlib_snippets(seed: int = 0) -> list[tuple[str, int]]:
    """Balanced (text, label) pairs: consecutive 10-line chunks of each package's sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rng = random.Random(seed)
    samples = []
    for label, package in enumerate(PACKAGES):
        chunks = []
        for path in sorted((root / package).rglob("*.py")):
            lines = [line for line in path.read_text(errors="ignore").splitlines() if line.strip()]
            chunks += ["\n".join(lines[i : i + SNIPPET_LINES]) for i in range(0, len(lines), SNIPPET_LINES)]
        samples += [(text, label) for text in rng.sample(chunks, PER_CLASS)]
    rng.shuffle(samples)
    return samples


def train_tokenizer(texts: list[str]) -> ByteLevelBPETokenizer:
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(texts, vocab_size=2000, min_frequency=2, special_tokens=["<pad>", "<cls>"])
    tokenizer.enable_truncation(MAX_TOKENS)
    return tokenizer


def collate(tokenizer: ByteLevelBPETokenizer, batch: list[tuple[str, int]]) -> dict[str, torch.Tensor]:
    """Pad to the longest snippet in the batch; the attention mask hides the padding."""
    pad_id, cls_id = tokenizer.token_to_id("<pad>"), tokenizer.token_to_id("<cls>")
    ids = [[cls_id] + tokenizer.encode(text).ids[: MAX_TOKENS - 1] for text, _ in batch]
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), pad_id)  # (B, T)
    for row, seq in enumerate(ids):
        input_ids[row, : len(seq)] = torch.tensor(seq)
    return {
        "input_ids": input_ids,
        "attention_mask": (input_ids != pad_id).long(),
        "labels": torch.tensor([label for _, label in batch]),
    }


def evaluate(model: torch.nn.Module, tokenizer, shard, batch_size: int) -> float:
    """Accuracy over every rank's validation shard: (correct, seen) summed with all_reduce."""
    model.eval()
    counts = torch.zeros(2)
    with torch.no_grad():
        for i in range(0, len(shard), batch_size):
            batch = collate(tokenizer, shard[i : i + batch_size])
            logits = model(**batch).logits
            counts += torch.tensor([(logits.argmax(-1) == batch["labels"]).sum().item(), len(batch["labels"])])
    dist.all_reduce(counts)
    model.train()
    return (counts[0] / counts[1]).item()


def worker(env: nanoddp.DistEnv, steps: int, batch_size: int) -> float:
    torch.set_num_threads(1)
    samples = stdlib_snippets()
    split = int(0.8 * len(samples))
    train, val = samples[:split], samples[split:]
    tokenizer = train_tokenizer([text for text, _ in train])  # same data + same trainer on every rank
    nanoddp.seed_everything(0, env.rank)
    config = BertConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=MAX_TOKENS,
        num_labels=len(PACKAGES),
        pad_token_id=tokenizer.token_to_id("<pad>"),
    )
    model = nanoddp.DistributedDataParallel(BertForSequenceClassification(config))  # replicas synced
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    shard = train[env.rank :: env.world_size]  # manual sharding: rank r takes every world_size-th sample
    rng = random.Random(env.rank)
    before = evaluate(model, tokenizer, val[env.rank :: env.world_size], 64)
    if env.is_master:
        print(f"{len(train)} train / {len(val)} val snippets, {len(PACKAGES)} classes (chance 25%)")
        print(f"accuracy before training: {before:.1%}")
    for step in range(1, steps + 1):
        batch = collate(tokenizer, rng.sample(shard, batch_size))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss  # HF ModelOutput through our DDP: loss computed in forward
        loss.backward()  # gradients averaged over ranks by the engine
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if env.is_master and step % 50 == 0:
            print(f"step {step} | loss {loss.item():.3f}")
    accuracy = evaluate(model, tokenizer, val[env.rank :: env.world_size], 64)
    if env.is_master:
        print(f"validation accuracy: {accuracy:.1%} over {len(val)} snippets from {env.world_size} ranks")
    return accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    args = parser.parse_args()
    nanoddp.launch(worker, args.nproc, args=(args.steps, args.batch_size), backend="gloo")


if __name__ == "__main__":
    main()
