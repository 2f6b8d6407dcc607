"""Broadcast as scatter + all-gather (van de Geijn): the large-message broadcast on many ranks.

Why it exists: a binomial tree (`tree.py`) sends the whole message log2(n) times along its
deepest path, and the direct broadcast makes the root send it n-1 times; past a few hundred KB
those bytes are what costs. Here the root sends each rank one block (a scatter: (n-1)/n of the
message in all), and the ranks then all-gather the blocks by recursive doubling
(`halving_doubling`): about 2(n-1)/n of the message through the root, in 1 + log2(p) steps
(+1 where n is not a power of two). `plan.Path.SCATTER_ALLGATHER`; where it pays is
`cost_model`'s answer.

Everything runs in relative ranks (group rank - root) mod n, so the root is relative rank 0: a
survivor of the fold (vrank 0) that already holds every block, so the doubling sends it nothing,
and it receives nothing. Its scatter gives each survivor v the blocks it stands for (its own and,
for a pair, its folded partner's), so the fold needs no step in; the fold-back sends the whole
message to the folded ranks. Data is copied, never reduced: every rank ends with the root's bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanoddp.comm.algorithms.halving_doubling import GATHER, REDUCE, Layout, Step, doubling, start_steps
from nanoddp.comm.algorithms.message_pieces import balanced_bounds
from nanoddp.comm.transport.transport import Peers


def broadcast_steps(lay: Layout, rel: int) -> list[Step]:
    """This relative rank's steps: the scatter from relative rank 0, doubling, the fold-back."""
    v = lay.vrank(rel)
    if v is None:  # sits out: gets the whole message from its survivor at the end
        return [Step((), (rel - 1, *lay.whole), False, GATHER)]
    if v == 0:
        scatter = Step(tuple((lay.rel(w), *lay.span(w, w + 1)) for w in range(1, lay.p)), None, False, REDUCE)
    else:
        scatter = Step((), (0, *lay.span(v, v + 1)), False, REDUCE)
    steps = [scatter, *doubling(lay, v, skip_rel0=True)]
    if v < lay.e:
        steps.append(Step(((rel + 1, *lay.whole),), None, False, GATHER))
    return steps


def start_scatter_allgather_broadcast(peers: Peers, flat: torch.Tensor, root: int) -> Callable[[], None]:
    """Broadcast `flat` from group rank `root`; receives are posted now (before the header round),
    the returned function runs it."""
    n = peers.size
    lay = Layout(n, balanced_bounds(flat.numel(), n))
    return start_steps(peers, flat, broadcast_steps(lay, (peers.rank - root) % n), None, offset=root)
