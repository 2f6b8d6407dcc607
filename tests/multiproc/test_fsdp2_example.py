"""The PyTorch FSDP2 example, walked twice: once with torch's names, once with only the import
changed to `nanoddp.fsdp`. The results must be torch's, bitwise (ws 2: see test_fsdp2_parity).

The walk (pytorch/examples distributed/FSDP2): a transformer built on the meta device,
`fully_shard` on each block and the root with `MixedPrecisionPolicy(bf16, fp32)`, explicit
forward/backward prefetch and `model.unshard()` every step, `to_empty` + `reset_parameters`,
Adam, torch's `clip_grad_norm_`; then a DTensor checkpoint (`full_tensor()` to save,
`distribute_tensor` + `load_state_dict(assign=True)` into a fresh meta model to load) and a DCP
checkpoint of model and optimizer (`get/set_*_state_dict`), and a resume from each that must
continue exactly as the uninterrupted run.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from helpers import run_on_ranks
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import distribute_tensor

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 11, 12, 2, 3, 6, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(DIM, 3 * DIM), nn.GELU(), nn.Linear(3 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff(self.norm2(x))  # (B, T, D)

    def reset_parameters(self) -> None:
        self.attn.out_proj.reset_parameters()  # MHA's own reset leaves this weight alone
        self.attn._reset_parameters()
        for m in (self.norm1, self.norm2, self.ff[0], self.ff[2]):
            m.reset_parameters()


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))  # (B, T, D)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x)).float()  # (B, T, V)

    def reset_parameters(self) -> None:
        for m in (self.tok, self.pos, self.norm, self.output):
            m.reset_parameters()
        for layer in self.layers:
            layer.reset_parameters()


def sharded_meta_model(fsdp) -> nn.Module:
    """The example's setup: meta build, per-block + root fully_shard, explicit prefetch."""
    with torch.device("meta"):
        model = Transformer()
    mp = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fsdp.fully_shard(layer, mp_policy=mp)
    fsdp.fully_shard(model, mp_policy=mp)
    assert isinstance(model, fsdp.FSDPModule)
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 3])
        layer.set_modules_to_backward_prefetch(layers[max(0, i - 2) : i][::-1])
    return model


def train_steps(env, model: nn.Module, optim, steps: range) -> tuple[list[float], list[float]]:
    losses, norms = [], []
    for step in steps:
        model.unshard()
        g = torch.Generator().manual_seed(100 * step + env.rank)
        loss = model(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)).sum()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0).full_tensor().item())
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, norms


def whole(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def walk(env, fsdp_name: str, ckpt: str) -> dict:
    fsdp = importlib.import_module(fsdp_name)
    model = sharded_meta_model(fsdp)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.reset_parameters()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, norms = train_steps(env, model, optim, range(3))

    full = whole(model)  # the DTensor checkpoint: whole tensors out ...
    probe = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        at_save = model(probe)  # what the saved weights compute
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{ckpt}/{fsdp_name}")
    more = train_steps(env, model, optim, range(3, 5))  # the uninterrupted run

    restored = sharded_meta_model(fsdp)  # ... and in, through distribute_tensor on the meta shards
    meta_sd = restored.state_dict()
    restored.load_state_dict(
        {k: nn.Parameter(distribute_tensor(v, meta_sd[k].device_mesh, meta_sd[k].placements)) for k, v in full.items()},
        assign=True,
    )
    for k, v in whole(restored).items():
        assert torch.equal(v, full[k]), k
    with torch.no_grad():  # the assigned DTensors are what the units gather, not only what state_dict shows
        assert torch.equal(restored(probe), at_save)

    resumed = sharded_meta_model(fsdp)  # DCP resume: model and Adam state
    resumed.to_empty(device="cpu")
    resumed_optim = torch.optim.Adam(resumed.parameters(), lr=1e-2)
    msd, osd = get_state_dict(resumed, resumed_optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=f"{ckpt}/{fsdp_name}")
    set_state_dict(resumed, resumed_optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    again = train_steps(env, resumed, resumed_optim, range(3, 5))
    assert again == more, (again, more)
    for k, v in whole(resumed).items():
        assert torch.equal(v, whole(model)[k]), k
    return {"losses": losses + more[0], "norms": norms + more[1], "params": whole(model)}


def _both(env, ckpt: str) -> None:
    theirs = walk(env, "torch.distributed.fsdp", ckpt)
    ours = walk(env, "nanoddp.fsdp", ckpt)
    assert ours["losses"] == theirs["losses"], (ours["losses"], theirs["losses"])
    assert ours["norms"] == theirs["norms"], (ours["norms"], theirs["norms"])
    for k, v in theirs["params"].items():
        assert torch.equal(ours["params"][k], v), k


def test_fsdp2_example_runs_unchanged_on_nanoddp(tmp_path):
    run_on_ranks(_both, 2, str(tmp_path), timeout=400)
