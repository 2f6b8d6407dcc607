"""Per-rank training memory of DDP, ZeRO-1, ZeRO-2 and FSDP for a GPT of your size.

    python examples/sharding_ladder.py --d-model 2048 --n-layers 24 --vocab 50304 --nproc 1,2,4,8 --budget-gb 24

Counts fp32 bytes of parameters, gradients and AdamW state (two tensors per parameter) per
rank, using the same flat layouts the engines build (`nanoddp.parallel.zero.flat.FlatLayout`:
ceil(N/ws) elements per rank per flat unit), so padding is included. FSDP also counts its
transient peak: the largest unit gathered whole (one block, or the root's own parameters)
plus that unit's full gradient while it is reduce-scattered. Activations are not counted
(they depend on batch and sequence length, and are the same for every rung). The model is
built on the meta device: nothing is allocated, so any size works.

Measured numbers of the real engines: `nanoddp bench train --engines nanoddp,zero,zero2,fsdp`.
"""

from __future__ import annotations

import argparse

import torch

from nanoddp.models import GPT, gpt_config
from nanoddp.parallel.zero.flat import FlatLayout
from nanoddp.parallel.zero.stage2 import bucket_params

GB = 1024**3


def per_rank_bytes(model: torch.nn.Module, world_size: int, bucket_cap_mb: float = 25.0) -> dict[str, dict]:
    """{rung: {params, grads, optim, total}} in bytes for one rank."""
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    f32 = 4
    full = n * f32
    element = FlatLayout([p.numel() for p in params], world_size).chunk * f32  # ZeRO-1's exact split
    cap = int(bucket_cap_mb * 2**20) // f32
    zero2 = sum(FlatLayout([p.numel() for p in b], world_size).chunk for b in bucket_params(params, cap)) * f32
    blocks = list(model.blocks)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    units = [list(b.parameters()) for b in blocks] + [[p for p in params if id(p) not in in_blocks]]
    fsdp = sum(FlatLayout([p.numel() for p in u], world_size).chunk for u in units) * f32
    largest_unit = max(sum(p.numel() for p in u) for u in units) * f32
    rungs = {
        "ddp": (full, full, 2 * full, 0),
        "zero1": (full, full, 2 * element, 0),
        "zero2": (full, zero2, 2 * zero2, 0),
        "fsdp": (fsdp, fsdp, 2 * fsdp, 2 * largest_unit),  # + one unit whole, with its gradient
    }
    return {
        name: {"params": p, "grads": g, "optim": o, "transient": t, "total": p + g + o + t}
        for name, (p, g, o, t) in rungs.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="GPT preset to start from (tiny, small)")
    parser.add_argument("--d-model", type=int, default=None)
    parser.add_argument("--n-layers", type=int, default=None)
    parser.add_argument("--d-ff", type=int, default=None, help="default: 4 x d-model when --d-model is given")
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--nproc", default="1,2,4,8", help="comma-separated world sizes")
    parser.add_argument("--budget-gb", type=float, default=16.0, help="memory per rank for weights+grads+state")
    args = parser.parse_args()
    overrides = {}
    if args.d_model:
        overrides.update(d_model=args.d_model, d_ff=args.d_ff or 4 * args.d_model)
    elif args.d_ff:
        overrides["d_ff"] = args.d_ff
    if args.n_layers:
        overrides["n_layers"] = args.n_layers
    if args.vocab:
        overrides["vocab_size"] = args.vocab
    with torch.device("meta"):
        model = GPT(gpt_config(args.preset, **overrides))
    n = sum(p.numel() for p in model.parameters())
    print(f"GPT with {n / 1e6:.1f}M parameters; per-rank GB (params + grads + AdamW state [+ FSDP transient])")
    header = " ".join(f"{h:>8}" for h in ("params", "grads", "optim", "trans.", "total"))
    print(f"{'ws':>3} {'rung':<6} {header}  fits {args.budget_gb:g} GB")
    for ws in (int(w) for w in args.nproc.split(",")):
        for rung, row in per_rank_bytes(model, ws).items():
            cells = " ".join(f"{row[k] / GB:8.3f}" for k in ("params", "grads", "optim", "transient", "total"))
            fits = "yes" if row["total"] <= args.budget_gb * GB else "NO"
            print(f"{ws:>3} {rung:<6} {cells}  {fits}")
    ddp_total = per_rank_bytes(model, 1)["ddp"]["total"]
    if ddp_total > args.budget_gb * GB:
        print(f"DDP needs {ddp_total / GB:.2f} GB per rank at any world size: over the budget; shard (see rows above).")
    else:
        print(f"DDP fits ({ddp_total / GB:.2f} GB per rank); sharding buys headroom for activations.")


if __name__ == "__main__":
    main()
