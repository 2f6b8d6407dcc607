"""Recursive halving and doubling (Rabenseifner): reduce-scatter by halving, all-gather by doubling.

Why it exists: the ring (`ring.py`) pays 2(n-1) dependent steps for an all_reduce, and on a host
where every step costs a scheduling round in Python and gloo, that latency, not bandwidth, is
what loses to gloo's own collectives on 8 or 16 ranks. Halving and doubling moves the same
2(p-1)/p of the message per rank in 2 log2(p) steps (`plan.Path.HALVING_DOUBLING`; where it pays
is `cost_model`'s answer, docs/comm.md "How plan() chooses: the α–β model").

The message is n blocks (`bounds`), block i belonging to relative rank i. Relative rank =
(group rank - offset) mod n: offset 0 for all_reduce, all_gather and reduce_scatter; the root for
the broadcast that reuses the all-gather half (`van_de_geijn.py`).

* **Fold** (n not a power of two): with p the largest power of two <= n and e = n - p, relative
  ranks 2i+1 (i < e) hand their data to 2i and sit out; the p survivors are *vranks*: 2i -> i,
  and r >= 2e -> r - e. Survivor v then stands for blocks [start(v), start(v+1)), contiguous by
  construction (two blocks for a pair, one otherwise), so every message below is one range.
* **Halving**: at distance d = p/2, p/4, ..., 1 vrank v keeps the half of its vrank range that
  holds v, sends the other half to v XOR d and reduces what it receives for its own half. After
  log2 p steps v holds its blocks, reduced over all n ranks.
* **Doubling**: the reverse, d = 1, 2, ..., p/2: v sends its range to v XOR d and receives that
  rank's range beside it. Then survivors send the result back to the ranks that sat out.

Reduction order (floats): every element is reduced by one rank only and then copied, so all ranks
hold the same bytes. The order is a fixed tree over relative ranks: x(2i) op x(2i+1) for the
folded pairs, then vranks combined with the vrank at distance p/2, then p/4, ..., 1. IEEE add,
multiply, min and max give the same bits either way round (a op b == b op a), so the tree, not
which rank computed a node, decides the result. fp16/bf16 round after each step, as gloo's ring
does; AVG sums and divides once, on the final blocks.

gloo only (`plan` chooses it there): every receive is posted before the header round, under this
call's tags (`Peers.call_tags`), so a send starts the moment it is made. Receives land in scratch
(halving) or straight in place (doubling, fold-back): a doubling receive's region was sent away at
the mirror halving step, and the finished values can only come back after that send was read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from nanoddp.comm.algorithms.reduce import finish_avg, reduce_into
from nanoddp.comm.transport.transport import Peers, Waitable, wait_all

REDUCE, GATHER = 0, 1  # which of the call's two tags a step uses: fold-in and halving; doubling and fold-back


class Step(NamedTuple):
    """One dependent step of this rank: post `sends`, then wait for `recv` (and reduce it)."""

    sends: tuple[tuple[int, int, int], ...]  # (relative peer, start, end) of the buffer
    recv: tuple[int, int, int] | None  # (relative peer, start, end)
    reduce: bool  # recv lands in scratch and is reduced into [start, end); else it lands in place
    tag: int  # REDUCE or GATHER
    finish: tuple[int, int] | None = None  # AVG divides this range once, after this step


class Layout:
    """Who folds into whom and which vrank stands for which blocks, for n ranks."""

    def __init__(self, n: int, bounds: Sequence[tuple[int, int]]) -> None:
        self.n, self.bounds = n, bounds
        self.p = 1 << (n.bit_length() - 1)  # the largest power of two <= n
        self.e = n - self.p  # folded pairs

    def vrank(self, rel: int) -> int | None:
        """The vrank of relative rank `rel`, or None if it sits out (it folded into rel - 1)."""
        if rel < 2 * self.e:
            return None if rel % 2 else rel // 2
        return rel - self.e

    def rel(self, v: int) -> int:
        return 2 * v if v < self.e else v + self.e

    def span(self, lo: int, hi: int) -> tuple[int, int]:
        """Element range of vranks [lo, hi): their blocks are contiguous."""
        first = self.rel(lo)
        last = self.rel(hi - 1) + (2 if hi - 1 < self.e else 1)  # one past the last block
        return self.bounds[first][0], self.bounds[last - 1][1]

    @property
    def whole(self) -> tuple[int, int]:
        return self.bounds[0][0], self.bounds[-1][1]


def halving(lay: Layout, v: int) -> tuple[list[Step], int, int]:
    """The halving steps of vrank v, and the vrank range [lo, hi) it holds reduced after them."""
    steps, lo, hi, d = [], 0, lay.p, lay.p // 2
    while d >= 1:
        mid = lo + d
        keep, give = ((mid, hi), (lo, mid)) if v & d else ((lo, mid), (mid, hi))
        peer = lay.rel(v ^ d)
        steps.append(Step(((peer, *lay.span(*give)),), (peer, *lay.span(*keep)), True, REDUCE))
        (lo, hi), d = keep, d // 2
    return steps, lo, hi


def doubling(lay: Layout, v: int, skip_rel0: bool = False) -> list[Step]:
    """The doubling steps of vrank v. `skip_rel0`: relative rank 0 has everything already (the
    broadcast's root): nothing is sent to it."""
    steps, d = [], 1
    while d < lay.p:
        lo, other = v & ~(d - 1), (v & ~(d - 1)) ^ d
        peer = lay.rel(v ^ d)
        send = () if skip_rel0 and peer == 0 else ((peer, *lay.span(lo, lo + d)),)
        recv = None if skip_rel0 and v == 0 else (peer, *lay.span(other, other + d))
        steps.append(Step(send, recv, False, GATHER))
        d *= 2
    return steps


def reduce_scatter_steps(lay: Layout, rel: int, all_reduce: bool) -> list[Step]:
    """Fold-in, halving, then (all_reduce) doubling and the whole result back to the folded rank,
    or (reduce_scatter) the folded rank's own block back."""
    v = lay.vrank(rel)
    if v is None:  # a folded rank: hand over everything, get the result back
        back = lay.whole if all_reduce else lay.bounds[rel]
        return [Step(((rel - 1, *lay.whole),), None, False, REDUCE), Step((), (rel - 1, *back), False, GATHER)]
    steps = [Step((), (rel + 1, *lay.whole), True, REDUCE)] if v < lay.e else []
    halves, lo, hi = halving(lay, v)
    steps += halves
    steps[-1] = steps[-1]._replace(finish=lay.span(lo, hi))
    if all_reduce:
        steps += doubling(lay, v)
    if v < lay.e:
        back = lay.whole if all_reduce else lay.bounds[rel + 1]
        steps.append(Step(((rel + 1, *back),), None, False, GATHER))
    return steps


def all_gather_steps(lay: Layout, rel: int) -> list[Step]:
    """Fold-in (the folded rank's block to its partner), doubling, the whole result back."""
    v = lay.vrank(rel)
    if v is None:
        give = Step(((rel - 1, *lay.bounds[rel]),), None, False, REDUCE)
        return [give, Step((), (rel - 1, *lay.whole), False, GATHER)]
    steps = [Step((), (rel + 1, *lay.bounds[rel + 1]), False, REDUCE)] if v < lay.e else []
    steps += doubling(lay, v)
    if v < lay.e:
        steps.append(Step(((rel + 1, *lay.whole),), None, False, GATHER))
    return steps


def start_steps(
    peers: Peers, buf: torch.Tensor, steps: list[Step], op: str | None, offset: int = 0
) -> Callable[[], None]:
    """Post every receive of `steps` now (before the header round); the returned function runs
    them in order. Peers are relative ranks: group rank = (peer + offset) mod n."""
    n = peers.size
    tags = peers.call_tags()
    scratch_numel = sum(s.recv[2] - s.recv[1] for s in steps if s.reduce and s.recv is not None)
    scratch = peers.scratch("halving", scratch_numel, buf.dtype, buf.device) if scratch_numel else None
    posted: list[tuple[torch.Tensor, Waitable] | None] = []
    at = 0
    for s in steps:
        if s.recv is None or s.recv[2] == s.recv[1]:  # empty ranges are never sent
            posted.append(None)
            continue
        peer, a, b = s.recv
        target = buf[a:b]
        if s.reduce:
            assert scratch is not None  # sized for every reducing step's receive
            target, at = scratch[at : at + b - a], at + b - a
        posted.append((target, peers.irecv(target, (peer + offset) % n, tags[s.tag])))

    def run() -> None:
        sends = []
        for s, landed in zip(steps, posted, strict=True):
            tag = tags[s.tag]
            sends += [peers.isend(buf[a:b], (peer + offset) % n, tag) for peer, a, b in s.sends if b > a]
            if landed is not None:
                incoming, work = landed
                work.wait()
                if s.reduce:
                    assert op is not None and s.recv is not None  # reducing steps: a reduction, a receive
                    reduce_into(op, buf[s.recv[1] : s.recv[2]], incoming)
            if s.finish is not None:
                assert op is not None  # only a reduction's steps finish
                finish_avg(op, buf[s.finish[0] : s.finish[1]], n)
        wait_all(sends)

    return run


def start_all_reduce(
    peers: Peers, flat: torch.Tensor, bounds: Sequence[tuple[int, int]], op: str
) -> Callable[[], None]:
    """all_reduce of `flat` in place (blocks `bounds`, one per rank); receives posted now."""
    lay = Layout(peers.size, bounds)
    return start_steps(peers, flat, reduce_scatter_steps(lay, peers.rank, all_reduce=True), op)


def start_reduce_scatter(peers: Peers, work: torch.Tensor, m: int, op: str) -> Callable[[], None]:
    """reduce_scatter over `work` (n blocks of m, a copy of the input): after the run, this rank's
    block holds its reduced result (the others hold partial sums)."""
    lay = Layout(peers.size, [(q * m, (q + 1) * m) for q in range(peers.size)])
    return start_steps(peers, work, reduce_scatter_steps(lay, peers.rank, all_reduce=False), op)


def start_all_gather(peers: Peers, whole: torch.Tensor, m: int) -> Callable[[], None]:
    """all_gather into `whole` (n blocks of m, this rank's own block already in place)."""
    lay = Layout(peers.size, [(q * m, (q + 1) * m) for q in range(peers.size)])
    return start_steps(peers, whole, all_gather_steps(lay, peers.rank), None)
