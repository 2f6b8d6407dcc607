"""The trainer's fsdp engine on models that are not the built-in GPT, mixed precision with the
sharded engines, and the refusals for a model that is sharded already.

- auto-wrap: an `nn.Sequential` of MLP blocks and a tiny Hugging Face `LlamaForCausalLM` get one
  FSDP unit per block / decoder layer, plus the root; `fsdp_wrap` names classes instead;
- `--amp bf16|fp16` with fsdp (MixedPrecisionPolicy, float32 reduce) and zero2 (autocast) at
  ws=2 against the same engine and policy in one process; fp16's GradScaler skips a step on
  every rank when one rank's gradient shard overflowed;
- an already-sharded model: `DistributedDataParallel` and the non-fsdp engines refuse it,
  naming the engine to use; engine fsdp trains it as is (bitwise what the trainer's own
  sharding of the same model gives);
- hsdp (fsdp within replica groups) at 4 ranks in groups of 2 against torch's FSDP2 on the
  same 2-D mesh, bitwise, and its snapshots resumed at the same and at other group and world sizes.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from helpers import TINY, run_on_ranks, train_tiny
from torch.utils.data import TensorDataset

import nanoddp
from nanoddp.env import DistEnv
from nanoddp.fsdp import FSDPModule, fully_shard
from nanoddp.parallel.fsdp.auto_wrap import modules_to_shard
from nanoddp.parallel.grad_scaler import ShardedGradScaler
from nanoddp.train.engines import shard_model

# bf16 keeps 8 significant bits, fp16 11: the ws=2 run sums each weight gradient over half the
# batch per rank (then a float32 reduce-scatter) where one process sums the whole batch in the
# half dtype, so gradients differ by a few half-precision roundings. AdamW turns a rounding of a
# near-zero gradient into a whole step (up to ~lr) for that element, so: at most AMP_OFF_SHARE
# of the elements may differ by more than AMP_ATOL, and none by more than AMP_MAX (4 steps of
# lr <= 3e-3). Measured: bf16 0.24 % of elements, fp16 0.01 %. bf16 against float32 (1.6 %)
# fails it (asserted below): the tolerance tells the policies apart.
AMP_ATOL, AMP_OFF_SHARE, AMP_MAX = 1e-4, 0.01, 1.2e-2


def _off_share(got: dict, want: dict) -> tuple[float, float]:
    """(share of elements differing by more than AMP_ATOL, largest difference)."""
    diffs = torch.cat([(got[k].float() - want[k].float()).abs().reshape(-1) for k in want])
    return (diffs > AMP_ATOL).float().mean().item(), diffs.max().item()


class MLPBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


def _sequential() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), MLPBlock(16), MLPBlock(16), MLPBlock(16), nn.Linear(16, 2))


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def test_auto_wrap_picks_the_repeated_layers():
    """No processes: which modules become units, by each rule."""
    seq = _sequential()
    assert modules_to_shard(seq) == [seq[1], seq[2], seq[3]]  # by size: the blocks, not the 2 small Linears
    llama = _llama()
    assert [type(m).__name__ for m in modules_to_shard(llama)] == ["LlamaDecoderLayer"] * 2
    wrapped = nn.Sequential(_llama())  # a wrapper (as nanoddp's SmolLM2) declares nothing itself
    assert [type(m).__name__ for m in modules_to_shard(wrapped)] == ["LlamaDecoderLayer"] * 2
    assert modules_to_shard(seq, "MLPBlock,Linear")[:3] == [seq[1].fc1, seq[1].fc2, seq[2].fc1]  # inner first
    with pytest.raises(ValueError, match=r"fsdp_wrap names \['Block'\], not a module class of Sequential"):
        modules_to_shard(seq, "Block")


def _units(model: nn.Module) -> list[str]:
    """The sharded modules' classes, root first (module order)."""
    return [type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)]


def _data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)  # (n, 6)
    return TensorDataset(x, (x.sum(1) > 0).long())


def _trainer(env: DistEnv, model: nn.Module, out: str, **options) -> nanoddp.Trainer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = {"steps": 3, "batch_size": 8, "grad_clip": 0.5, "progress": False, "resume": "never", **options}
    return nanoddp.Trainer(model, optimizer, _data(), loss_fn=F.cross_entropy, env=env, out=out, **options)


def _fit(env: DistEnv, model: nn.Module, out: str, **options) -> nanoddp.Trainer:
    trainer = _trainer(env, model, out, **options)
    trainer.fit()
    return trainer


def _wrap_worker(env: DistEnv, tmp: str) -> None:
    trainer = _fit(env, _sequential(), f"{tmp}/seq", engine="fsdp")
    assert _units(trainer.module) == ["FSDPSequential"] + ["FSDPMLPBlock"] * 3
    assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in trainer.optimizer.param_groups[0]["params"])
    trainer = _fit(env, _sequential(), f"{tmp}/named", engine="fsdp", fsdp_wrap="Linear")
    assert _units(trainer.module) == ["FSDPSequential"] + ["FSDPLinear"] * 8
    llama = shard_model(_llama(), env)
    assert _units(llama) == ["FSDPLlamaForCausalLM"] + ["FSDPLlamaDecoderLayer"] * 2
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(env.rank))
    llama(input_ids=ids, labels=ids).loss.backward()  # the sharded HF model runs forward and backward
    assert all(p.grad is not None for p in llama.parameters())


def _prestepped_worker(env: DistEnv, tmp: str) -> None:
    """An optimizer that stepped before the Trainer: fsdp moves its state onto the shards."""
    model = _sequential()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _data().tensors
    F.cross_entropy(model(x[:8]), y[:8]).backward()
    optimizer.step()  # the same on every rank: same seed, same batch
    before = {name: optimizer.state[p]["exp_avg"].clone() for name, p in model.named_parameters()}
    trainer = nanoddp.Trainer(
        model, optimizer, _data(), loss_fn=F.cross_entropy, env=env, out=tmp, engine="fsdp", steps=1, batch_size=8
    )
    for name, p in trainer.module.named_parameters():  # this rank's rows of the state it had
        state = trainer.optimizer.state[p]["exp_avg"]
        assert state.to_local().shape == p.to_local().shape and torch.equal(state.full_tensor(), before[name]), name


def test_fsdp_engine_shards_any_model_per_block_plus_root(tmp_path):
    run_on_ranks(_prestepped_worker, 2, str(tmp_path / "stepped"), timeout=240)
    run_on_ranks(_wrap_worker, 2, str(tmp_path), timeout=240)


# ---- mixed precision ------------------------------------------------------------------------


def _amp_worker(env: DistEnv, tmp: str) -> dict:
    out = {}
    for engine, amp in (("fsdp", "bf16"), ("fsdp", "fp16"), ("zero2", "fp16"), ("fsdp", "off")):
        trainer = train_tiny(replace(TINY, engine=engine, amp=amp, out=f"{tmp}/{engine}-{amp}-{env.world_size}"), env)
        if engine == "fsdp" and amp != "off":
            assert trainer.module._fsdp_state.mp.param_dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[amp]
            assert trainer.module._fsdp_state.mp.reduce_dtype == torch.float32
        out[f"{engine}-{amp}"] = trainer.engine.state_dict()  # collective
        if amp == "fp16":
            out[f"{engine}-{amp}-scale"] = trainer.scaler.get_scale()
    return out


def test_sharded_engines_with_amp_match_one_process_with_the_same_policy(tmp_path):
    two = run_on_ranks(_amp_worker, 2, str(tmp_path), timeout=400)
    one = run_on_ranks(_amp_worker, 1, str(tmp_path), timeout=400)[0]  # one process (a group of one)
    for key, expected in one.items():
        if key.endswith("-scale"):
            assert two[0][key] == two[1][key] == expected, key  # no rank skipped a step alone
            continue
        if key.endswith("-off"):  # float32: reduction order only, as in test_trainer_sharded
            torch.testing.assert_close(two[0][key], expected, rtol=1e-4, atol=1e-5)
        else:
            share, largest = _off_share(two[0][key], expected)
            assert share <= AMP_OFF_SHARE and largest <= AMP_MAX, (key, share, largest)
        for name in expected:
            assert torch.equal(two[0][key][name], two[1][key][name]), (key, name)  # one model on both ranks
    share, _ = _off_share(one["fsdp-bf16"], one["fsdp-off"])
    assert share > AMP_OFF_SHARE, share  # bf16 really ran: the tolerance tells it from float32


def _scaler_worker(env: DistEnv) -> dict:
    """Rank 1's gradient shard overflows, rank 0's does not: both skip, both back off."""
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=4.0)
    scaler.scale(p.sum()).backward()  # (scale: 4 on both ranks)
    p.grad = torch.full((3,), float("inf") if env.rank == 1 else 1.0)  # rank 1's shard overflowed
    scaler.step(opt)
    scaler.update()
    return {"param": p.detach().clone(), "scale": scaler.get_scale()}


def test_sharded_grad_scaler_skips_on_every_rank():
    results = run_on_ranks(_scaler_worker, 2, timeout=120)
    for r in results:
        assert torch.equal(r["param"], torch.ones(3)) and r["scale"] == 2.0, r


# ---- a model sharded already ----------------------------------------------------------------


def _presharded(torch_fsdp: bool = False) -> nn.Module:
    model = _sequential()
    shard = torch.distributed.fsdp.fully_shard if torch_fsdp else fully_shard
    for block in model[1:4]:
        shard(block)
    return shard(model)


def _refusal_worker(env: DistEnv, tmp: str) -> dict:
    for torch_fsdp in (False, True):
        model = _presharded(torch_fsdp)
        with pytest.raises(ValueError, match="already sharded .*engine='fsdp'"):
            nanoddp.DistributedDataParallel(model)
        for engine in ("nanoddp", "torch", "zero2"):
            with pytest.raises(ValueError, match=f"already sharded \\(fsdp\\): engine '{engine}'.*engine='fsdp'"):
                _fit(env, model, f"{tmp}/refused-{engine}", engine=engine)
    zero2_model = nanoddp.parallel.zero.stage2.zero2(_sequential())
    with pytest.raises(ValueError, match="already sharded \\(zero2.*engine='zero2'"):
        nanoddp.DistributedDataParallel(zero2_model)
    as_is = _fit(env, _presharded(), f"{tmp}/as-is", engine="fsdp")
    ours = _fit(env, _sequential(), f"{tmp}/ours", engine="fsdp")
    dist.barrier()
    return {"as-is": as_is.engine.state_dict(), "ours": ours.engine.state_dict()}


def test_already_sharded_models_are_refused_or_used_as_is(tmp_path):
    for r in run_on_ranks(_refusal_worker, 2, str(tmp_path), timeout=240):
        assert r["as-is"].keys() == r["ours"].keys()
        for name, value in r["ours"].items():
            assert torch.equal(r["as-is"][name], value), name


# ---- hsdp: fsdp within replica groups --------------------------------------------------------

HSDP_STEPS, HSDP_STOP = 4, 2


def _torch_hsdp(mesh, amp: str = "off") -> nn.Module:
    """The reference: torch's own FSDP2 on the same 2-D mesh and the same units (each block, then
    the root) with the trainer's policy for `amp`, which the fsdp engine trains as is."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if amp == "bf16" else None
    model = _sequential()
    for unit in (*model[1:4], model):
        torch.distributed.fsdp.fully_shard(unit, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy())
    return model


def _hsdp_worker(env: DistEnv, tmp: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from nanoddp.train.checkpoint import snapshot

    options = {"engine": "hsdp", "group_size": 2, "steps": HSDP_STEPS, "snapshot_every": HSDP_STOP}
    with pytest.raises(ValueError, match=r"already sharded \(fsdp\): engine 'hsdp'.*engine='fsdp'"):
        _fit(env, _presharded(), f"{tmp}/refused", **options)
    ours = _fit(env, _sequential(), f"{tmp}/hsdp", **options)
    weight = ours.module[1].fc1.weight
    assert weight.device_mesh.mesh.tolist() == [[0, 1], [2, 3]], weight.device_mesh  # a group: consecutive ranks
    assert weight.placements == (Replicate(), Shard(0))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch_ref = _fit(env, _torch_hsdp(mesh), f"{tmp}/torch", engine="fsdp", steps=HSDP_STEPS)
    out = {"hsdp": ours.engine.state_dict(), "torch": torch_ref.engine.state_dict()}  # collective
    ours_bf16 = _fit(env, _sequential(), f"{tmp}/hsdp-bf16", **{**options, "amp": "bf16"})
    torch_bf16 = _fit(env, _torch_hsdp(mesh, "bf16"), f"{tmp}/torch-bf16", engine="fsdp", amp="bf16", steps=HSDP_STEPS)
    out |= {"hsdp-bf16": ours_bf16.engine.state_dict(), "torch-bf16": torch_bf16.engine.state_dict()}
    _fit(env, _sequential(), f"{tmp}/split", **{**options, "steps": HSDP_STOP})  # the same run in two
    resumed = _fit(env, _sequential(), f"{tmp}/split", **options, resume="auto")
    assert resumed.resumed_from is not None and resumed.resumed_from.name.startswith(f"step-{HSDP_STOP:08d}")
    out["resumed"] = resumed.engine.state_dict()
    # the step-2 snapshot of the G=2 run, resumed at G=1 (DDP-like) and G=4 (fsdp-like)
    dist.barrier()
    step2 = str(snapshot.snapshot_path(f"{tmp}/hsdp/snapshots", HSDP_STOP))
    for size in (1, 4):
        other = _fit(env, _sequential(), f"{tmp}/g{size}", **{**options, "group_size": size, "resume": step2})
        assert other.resumed_from == Path(step2) and other.module[1].fc1.weight.device_mesh.shape == (4 // size, size)
        out[f"g{size}"] = other.engine.state_dict()
    return out


def _hsdp_ws2_worker(env: DistEnv, tmp: str) -> dict:
    """The 4-rank run's step-2 snapshot resumed by 2 ranks in groups of 1 (mesh 2 x 1)."""
    step2 = f"{tmp}/hsdp/snapshots/step-{HSDP_STOP:08d}.pt"
    options = {"engine": "hsdp", "group_size": 1, "steps": HSDP_STEPS, "resume": step2}
    trainer = _fit(env, _sequential(), f"{tmp}/ws2", **options)
    assert trainer.resumed_from == Path(step2) and trainer.module[1].fc1.weight.device_mesh.shape == (2, 1)
    return {"ws2": trainer.engine.state_dict()}


def test_hsdp_engine_matches_torch_hsdp_and_resumes_at_any_group_size(tmp_path):
    """4 ranks, --group-size 2: the weights torch's FSDP2 gives on the same 2-D mesh, bitwise, in
    float32 and under --amp bf16 (and model.pt holds them); a run stopped at a snapshot and
    resumed, bitwise; that snapshot resumed at group size 1 and 4, and by 2 ranks, the same run
    up to the order of float sums (the gradient is summed in other groupings)."""
    results = run_on_ranks(_hsdp_worker, 4, str(tmp_path), timeout=400)
    results += run_on_ranks(_hsdp_ws2_worker, 2, str(tmp_path), timeout=300)
    saved = torch.load(tmp_path / "hsdp" / "model.pt", weights_only=True)
    want = results[0]["hsdp"]
    for r in results:
        for name in want:
            for key in ("hsdp", "torch", "resumed"):
                assert key not in r or torch.equal(r[key][name], want[name]), (key, name)
            for key in ("g1", "g4", "ws2"):
                if key in r:
                    torch.testing.assert_close(r[key][name], want[name], rtol=1e-5, atol=1e-6, msg=f"{key} {name}")
            if "torch-bf16" in r:  # FSDP's policy: gather and compute in bf16, reduce in fp32
                assert torch.equal(r["hsdp-bf16"][name], r["torch-bf16"][name]), name
    assert not all(torch.equal(results[0]["hsdp-bf16"][name], want[name]) for name in want)  # bf16 really ran
    for name in want:
        assert torch.equal(saved[name], want[name]), name
