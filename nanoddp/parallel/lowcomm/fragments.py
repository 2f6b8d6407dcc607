"""Streaming DiLoCo's schedule: how the model is cut into fragments, and which step each syncs on.

Why: a whole-model sync every H steps sends the whole model at once and stalls every step that
waits on it. Streaming DiLoCo (Douillard et al., 2025, "Streaming DiLoCo with overlapping
communication") cuts the model into F fragments that sync one at a time, each every H steps
but H/F steps apart, so the peak traffic is 1/F of the model; and starts each fragment's
all-reduce `sync_delay` (tau) inner steps before its outer step, so the wire works while the
inner steps go on. With F = 1 and tau = 0 this is plain DiLoCo.

The schedule is torchft 0.2.0's `DiLoCo(model_fragments, ..., fragment_sync_delay)`, so that the
two give the same bits: with period P = H / F, after inner step s (counted from 1)

    s + tau = k P  ->  start fragment (k - 1) mod F   (its pseudo-gradient: as of step s)
    s       = k P  ->  finish fragment (k - 1) mod F  (wait, outer step, mix)

Fragment i therefore syncs at steps (i + 1) P, (i + 1) P + H, ...: its own offset in each round.

The cut: fragments are contiguous runs of the trainable parameters in order, of near-equal
element counts: the k-th cut falls at the tensor boundary nearest k/F of all elements, every
fragment keeping at least one tensor. (torchft takes the fragments as modules; where a model's
halves are equal, as in the tests, the cut is at the same place.)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


def check_schedule(sync_every: int, fragments: int, sync_delay: int, mix: float, n_tensors: int | None = None) -> None:
    """One clear ValueError for the first knob that breaks the schedule's rules (`n_tensors`: the
    model's trainable tensors, None where the model is not built yet, as in the launcher)."""
    if fragments < 1:
        raise ValueError(f"fragments must be >= 1 (1 = the whole model syncs at once), got {fragments}")
    if n_tensors is not None and fragments > n_tensors:
        raise ValueError(
            f"fragments must be between 1 and the number of trainable parameter tensors ({n_tensors}): "
            f"each fragment is at least one whole tensor; got {fragments}"
        )
    if sync_every % fragments:
        raise ValueError(
            f"sync_every must be a multiple of fragments (the {fragments} fragments sync sync_every/fragments "
            f"steps apart), got sync_every={sync_every}, fragments={fragments}"
        )
    period = sync_every // fragments
    if not 0 <= sync_delay < period:
        raise ValueError(
            f"sync_delay must be in [0, sync_every/fragments) = [0, {period}): a fragment's all-reduce starts "
            f"sync_delay steps before its outer step and must finish before the next fragment's starts; "
            f"got {sync_delay}"
        )
    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"mix must be in [0, 1] (the share of the local weights kept after a sync), got {mix}")


def cut_fragments(sizes: Sequence[int], count: int) -> list[range]:
    """Tensor index ranges of the `count` fragments of tensors with `sizes` elements (module doc)."""
    total = sum(sizes)
    before = [0, *itertools.accumulate(sizes)]  # before[j]: elements in tensors 0 .. j-1
    cuts = [0]
    for k in range(1, count):
        target = total * k / count
        candidates = range(cuts[-1] + 1, len(sizes) - (count - k) + 1)
        cuts.append(min(candidates, key=lambda j: abs(before[j] - target)))  # ties: the earlier boundary
    cuts.append(len(sizes))
    return [range(a, b) for a, b in itertools.pairwise(cuts)]


def fragment_starting(step: int, sync_every: int, fragments: int, sync_delay: int) -> int | None:
    """The fragment whose all-reduce starts after inner step `step` (counted from 1), if any."""
    period = sync_every // fragments
    ahead = step + sync_delay
    return (ahead // period - 1) % fragments if ahead % period == 0 else None


def fragment_finishing(step: int, sync_every: int, fragments: int) -> int | None:
    """The fragment whose outer step runs after inner step `step`, if any."""
    period = sync_every // fragments
    return (step // period - 1) % fragments if step % period == 0 else None
