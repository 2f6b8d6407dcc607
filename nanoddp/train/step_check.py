"""The ranks' one agreement per step, made before the optimizer step: did any rank see a
non-finite loss, and did any rank get a stop signal.

Why before the optimizer step: a NaN or inf loss on one rank becomes NaN gradients on every rank
after the all-reduce, and the optimizer step would write them into the weights, into every later
snapshot and into `model.pt`. Checked first, the step can be refused on every rank together:
`--on-nan stop` (the default) stops the run with one line naming the step and the ranks, the
weights still those of the step before; `--on-nan skip` drops the step's update on every rank and
goes on. Why one collective: the per-rank flags and the signal number travel in one small
all-reduce (MAX), the round the signal check needed anyway, so the check costs no extra round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanoddp.env import DistEnv
from nanoddp.train.ranks import broadcast_from_master, distributed


class NonFiniteLoss(RuntimeError):
    """The loss was NaN or inf on some rank and the run was asked to stop (`--on-nan stop`)."""


@dataclass(frozen=True)
class Verdict:
    """What every rank agreed on for this step."""

    signum: int  # a stop signal some rank received (0: none)
    nonfinite_ranks: tuple[int, ...]  # ranks whose loss was NaN or inf


def agree(loss: torch.Tensor, signum: int, env: DistEnv) -> Verdict:
    """Collective (every rank, every step): this rank's `loss` finite? and its pending signal."""
    flags = torch.zeros(1 + env.world_size, dtype=torch.int32, device=loss.device)  # (1 + ws,)
    flags[0] = signum
    flags[1 + env.rank] = (~torch.isfinite(loss)).any().int()
    if distributed():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    values = flags.tolist()
    return Verdict(values[0], tuple(rank for rank, bad in enumerate(values[1:]) if bad))


def stop_line(step: int, ranks: tuple[int, ...]) -> str:
    """The one line every rank raises under `--on-nan stop`."""
    return (
        f"step {step}: the loss is NaN or inf on rank(s) {', '.join(map(str, ranks))}; stopped before the "
        "optimizer step, so the weights and every snapshot hold the finite state before it. Lower the "
        "learning rate, check that step's data, or pass --on-nan skip to drop such steps' updates"
    )


def skip_line(step: int, ranks: tuple[int, ...], scope: str = "every rank") -> str:
    """The line `--on-nan skip` logs; `scope`: where the update was skipped (the low-communication
    engines under `--on-failure continue` skip on the replica that saw it alone)."""
    return f"step {step}: the loss is NaN or inf on rank(s) {', '.join(map(str, ranks))}; update skipped on {scope}"


def refuse_nonfinite_export(model_state: dict[str, torch.Tensor], step: int, env: DistEnv) -> None:
    """Raise `NonFiniteLoss` on every rank if rank 0's whole `model_state` holds NaN or inf, so
    that `model.pt` is never written from a broken state (collective)."""
    bad = broadcast_from_master(nonfinite_entries(model_state) if env.is_master else None, env)
    if bad:
        raise NonFiniteLoss(export_refusal(bad, step))


def nonfinite_entries(model_state: dict[str, torch.Tensor]) -> list[str]:
    """The names of `model_state`'s floating-point tensors that hold NaN or inf."""
    floats = {k: v for k, v in model_state.items() if torch.is_tensor(v) and v.is_floating_point()}
    return [k for k, v in floats.items() if not v.isfinite().all()]


def export_refusal(bad: list[str], step: int) -> str:
    """The line that refuses to write `model.pt` from a state whose tensors `bad` are not finite."""
    return f"model.pt not written: {', '.join(bad[:5])} hold NaN or inf after step {step}"
