"""nanoddp.fsdp checkpoints through torch's own tools: DCP, `get/set_*_state_dict`, DTensor.

Saved at ws 2 (ours and torch FSDP2 after the same training: the same values, see
test_fsdp2_parity), loaded at ws 3: every rank's local rows must be its rows of the whole
tensors (resharding by hand), and each implementation's checkpoint must load into the other.
All comparisons are bitwise: a checkpoint moves bytes, it does not compute.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from helpers import run_on_ranks
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

import nanoddp.fsdp as our_fsdp


class Net(nn.Module):
    """Dim 0 of 11, 7 and 3: uneven at ws 2, and at ws 3 for 11 and 7."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 5)
        self.block = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.block(self.emb(idx).mean(1))  # (B, 3)


def build(fully_shard) -> nn.Module:
    model = Net()
    fully_shard(model.block)
    return fully_shard(model)


def step(env, model: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(env.rank)
    x, y = torch.randint(0, 11, (4, 6), generator=g), torch.randn(4, 3, generator=g)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return opt


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t  # AdamW's `step` is a plain tensor


def whole(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def _save(env, root: str) -> None:
    full_options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    for name, fully_shard in (("ours", our_fsdp.fully_shard), ("torch", torch_fsdp.fully_shard)):
        model = build(fully_shard)
        opt = step(env, model)
        dcp.save({"model": model.state_dict()}, checkpoint_id=f"{root}/{name}")
        full = get_model_state_dict(model, options=full_options)  # rank 0 only holds it
        if env.rank == 0:
            torch.save(full, f"{root}/{name}_full.pt")
        if name == "ours":  # whole-model and optimizer state dicts through torch's helpers
            fresh = build(fully_shard)
            set_model_state_dict(fresh, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
            for k, v in whole(model).items():
                assert torch.equal(whole(fresh)[k], v), k
            osd = get_optimizer_state_dict(model, opt)
            fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
            set_optimizer_state_dict(fresh, fresh_opt, osd)
            got = get_optimizer_state_dict(fresh, fresh_opt)
            for key, state in osd["state"].items():
                for field, value in state.items():
                    assert torch.equal(_whole(got["state"][key][field]), _whole(value)), (key, field)


def _load(env, root: str) -> None:
    for saved in ("ours", "torch"):
        full = torch.load(f"{root}/{saved}_full.pt")
        for name, fully_shard in (("ours", our_fsdp.fully_shard), ("torch", torch_fsdp.fully_shard)):
            model = build(fully_shard)
            state = model.state_dict()
            dcp.load({"model": state}, checkpoint_id=f"{root}/{saved}")
            for k, v in model.state_dict().items():
                rows = -(-v.shape[0] // env.world_size)  # resharding by hand: torch.chunk's rows
                want = full[k][env.rank * rows : (env.rank + 1) * rows]
                assert torch.equal(v.to_local(), want), (saved, name, k)
                assert torch.equal(v.full_tensor(), full[k]), (saved, name, k)


def test_dcp_saved_at_ws2_loads_at_ws3_both_ways(tmp_path):
    run_on_ranks(_save, 2, str(tmp_path), timeout=300)
    full = {name: torch.load(tmp_path / f"{name}_full.pt") for name in ("ours", "torch")}
    for k, v in full["torch"].items():  # same training, same values: the cross-loads below mean something
        assert torch.equal(full["ours"][k], v), k
    run_on_ranks(_load, 3, str(tmp_path), timeout=300)
