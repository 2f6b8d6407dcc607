"""FSDP (`nanoddp.fsdp`) learned prefetch: from the second step on, a block's pre-forward
launches the next block's all-gather (before this block's forward returns), and a block's
pre-backward the all-gather of the block backward reaches next (before this block's gradients
are reduce-scattered). Seen in a recorded event order, not in timings: forward checks look at
the events up to the root's forward returning, backward checks only at those after it (the
forward prefetch of the same block must not count). The parameters after training are bitwise
those of the same run without prefetch (same bytes, gathered earlier)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.utils.checkpoint
from helpers import run_on_ranks

import nanoddp.fsdp
from nanoddp.env import DistEnv
from nanoddp.fsdp import fully_shard

STEPS = 3
N_BLOCKS = 3


class Stack(nn.Module):
    """Embedding, three blocks, a head: four units once sharded (root = emb + head)."""

    def __init__(self, checkpoint: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.checkpoint = checkpoint
        self.emb = nn.Embedding(11, 6)
        blocks = [nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 6)) for _ in range(N_BLOCKS)]
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(6, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx).mean(1)  # (B, 6)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpoint else block(x)
        return self.head(x)  # (B, 3)


def _record(log: dict, name: str, module: nn.Module) -> None:
    """Log `module`'s unit's all-gather launches (True: a prefetch, launched before the unit's
    own pre-forward / pre-backward asked for it), its reduce-scatters, and its forward
    returning, into `log["events"]` (the test swaps in a fresh list every step)."""
    state = module._fsdp_state
    unit = state.unit
    start, reduce_scatter, unshard = unit.start_unshard, unit.start_reduce, state.unshard
    asking = {"now": False}

    def logged_start():
        if not unit.is_unsharded and not unit.gathering():
            log["events"].append(("gather", name, not asking["now"]))
        return start()

    def logged_unshard():
        asking["now"] = True
        try:
            return unshard()
        finally:
            asking["now"] = False

    def logged_reduce_scatter():
        log["events"].append(("reduce_scatter", name))
        return reduce_scatter()

    unit.start_unshard, unit.start_reduce, state.unshard = logged_start, logged_reduce_scatter, logged_unshard
    module.register_forward_hook(lambda *_: log["events"].append(("forward_done", name)))


def _train(env: DistEnv, prefetch: bool, checkpoint: bool = False, reshard: bool = True):
    """STEPS AdamW steps of a sharded `Stack`; (whole parameters, each step's events)."""
    model = Stack(checkpoint)
    nanoddp.fsdp.settings.learned_prefetch = prefetch
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    log: dict = {"events": []}
    _record(log, "root", model)
    for k, block in enumerate(model.blocks):
        _record(log, f"block{k}", block)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps = []
    for step in range(STEPS):
        log["events"] = []
        g = torch.Generator().manual_seed(100 * step + env.rank)
        x, y = torch.randint(0, 11, (4, 5), generator=g), torch.randn(4, 3, generator=g)  # (B, 5), (B, 3)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        steps.append(log["events"])
    return model.full_state_dict(), steps


def _worker(env: DistEnv) -> dict:
    out = {}
    for checkpoint in (False, True):
        on, events = _train(env, prefetch=True, checkpoint=checkpoint)
        off, events_off = _train(env, prefetch=False, checkpoint=checkpoint)
        for key, value in off.items():
            assert torch.equal(on[key], value), (checkpoint, key)
        out[checkpoint] = (events, events_off)
    kept, _ = _train(env, prefetch=True, reshard=False)  # nothing freed: nothing to prefetch
    for key, value in _train(env, prefetch=False, reshard=False)[0].items():
        assert torch.equal(kept[key], value), key
    return out


def _at(events: list, event: tuple) -> int:
    assert event in events, (event, events)
    return events.index(event)


def test_next_blocks_gather_is_launched_while_this_block_runs():
    results = run_on_ranks(_worker, 2, timeout=120)
    for rank_result in results:
        for checkpoint, (events, events_off) in rank_result.items():
            assert all(not e[2] for s in events_off for e in s if e[0] == "gather"), "prefetch off: no prefetch"
            assert not any(e[0] == "gather" and e[2] for e in events[0]), "the first step learns the order"
            for step_events in events[1:]:
                split = _at(step_events, ("forward_done", "root")) + 1
                forward, backward = step_events[:split], step_events[split:]
                for k in range(N_BLOCKS - 1):  # forward: block k+1's gather starts inside block k's forward
                    launched = _at(forward, ("gather", f"block{k + 1}", True))
                    assert launched < _at(forward, ("forward_done", f"block{k}")), (checkpoint, k, step_events)
                for k in range(1, N_BLOCKS):  # backward: block k-1's gather starts before block k's grads
                    launched = _at(backward, ("gather", f"block{k - 1}", True))
                    assert launched < _at(backward, ("reduce_scatter", f"block{k}")), (checkpoint, k, step_events)
                # the root's gather starts block 0's; the root's pre-backward starts the last block's
                assert step_events[:2] == [("gather", "root", False), ("gather", "block0", True)], step_events
