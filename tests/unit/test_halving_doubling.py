"""The step schedules of halving/doubling, scatter + all-gather and the binomial tree, run by a
simulator (no processes): every message each rank sends is received by exactly one matching
receive of the same size, and the results are right, on 2-16 ranks and every root.

The simulated data say where each value came from: an element is the sorted tuple of the
(source rank, position) pairs summed into it. So a right result is not only "every rank
contributed" but "every rank's element at this very position": a block landing at another
block's place (a folded rank handed its partner's block, say) fails even though every rank
contributed to it.

The multiprocess tests (tests/multiproc/test_comm_algorithms.py) run the same schedules over
gloo against torch; this covers the world sizes a 2-core host cannot launch.
"""

from __future__ import annotations

from collections import defaultdict, deque

import pytest

from nanoddp.comm.algorithms import tree
from nanoddp.comm.algorithms.halving_doubling import Layout, all_gather_steps, reduce_scatter_steps
from nanoddp.comm.algorithms.message_pieces import balanced_bounds
from nanoddp.comm.algorithms.van_de_geijn import broadcast_steps

Element = tuple[tuple[int, int], ...]  # the (source rank, position) pairs summed into it, sorted


def own_data(rank: int, numel: int) -> list[Element]:
    """What `rank` starts with: at each position, its own value for that position."""
    return [((rank, i),) for i in range(numel)]


def summed(ranks, i: int) -> Element:
    """The right result at position `i`: the sum of the ranks' values for position `i`."""
    return tuple(sorted((r, i) for r in ranks))


def simulate(n: int, steps_of, bufs: list[list], offset: int = 0) -> list[list]:
    """Run every rank's steps with sums as the reduction, in rounds until all are done; a sum
    joins the contributions of both elements (a multiset, kept as a sorted tuple)."""
    schedules = [steps_of((r - offset) % n) for r in range(n)]
    at = [0] * n
    mail: dict[tuple[int, int, int], deque] = defaultdict(deque)
    sent = [False] * n
    for _ in range(100 * n):
        progressed = False
        for r in range(n):
            if at[r] == len(schedules[r]):
                continue
            s = schedules[r][at[r]]
            if not sent[r]:
                for peer, a, b in s.sends:
                    if b > a:
                        mail[(r, (peer + offset) % n, s.tag)].append(list(bufs[r][a:b]))
                sent[r] = True
            if s.recv is not None and s.recv[2] > s.recv[1]:
                peer, a, b = s.recv
                box = mail[((peer + offset) % n, r, s.tag)]
                if not box:
                    continue
                got = box.popleft()
                assert len(got) == b - a, "a message must land in a receive of its size"
                if s.reduce:
                    bufs[r][a:b] = [tuple(sorted(x + y)) for x, y in zip(bufs[r][a:b], got, strict=True)]
                    mixed = [e for e in bufs[r][a:b] if len({i for _, i in e}) > 1]
                    assert not mixed, f"rank {r} summed values of different positions: {mixed[0]}"
                else:
                    bufs[r][a:b] = got
            at[r], sent[r], progressed = at[r] + 1, False, True
        if all(at[r] == len(schedules[r]) for r in range(n)):
            assert not any(mail.values()), "every message is received"
            return bufs
        assert progressed, f"deadlock at steps {at}"
    raise AssertionError("did not finish")


@pytest.mark.parametrize("n", range(2, 17))
@pytest.mark.parametrize("numel", [0, 1, 5, 37])
def test_all_reduce_and_reduce_scatter(n, numel):
    every = range(n)
    bounds = balanced_bounds(numel, n)
    out = simulate(
        n, lambda rel: reduce_scatter_steps(Layout(n, bounds), rel, True), [own_data(r, numel) for r in range(n)]
    )
    want = [summed(every, i) for i in range(numel)]
    for r in range(n):
        assert out[r] == want, f"all_reduce: rank {r}"
    m = max(numel // n, 1) if numel else 0
    rs_bounds = [(q * m, (q + 1) * m) for q in range(n)]
    out = simulate(
        n, lambda rel: reduce_scatter_steps(Layout(n, rs_bounds), rel, False), [own_data(r, n * m) for r in range(n)]
    )
    for r in range(n):
        got = out[r][r * m : (r + 1) * m]
        assert got == [summed(every, i) for i in range(r * m, (r + 1) * m)], f"reduce_scatter: rank {r}'s block"


@pytest.mark.parametrize("n", range(2, 17))
@pytest.mark.parametrize("m", [0, 1, 3])
def test_all_gather(n, m):
    bounds = [(q * m, (q + 1) * m) for q in range(n)]
    bufs = [[("x",)] * n * m for _ in range(n)]
    for r in range(n):
        bufs[r][r * m : (r + 1) * m] = own_data(r, n * m)[r * m : (r + 1) * m]
    out = simulate(n, lambda rel: all_gather_steps(Layout(n, bounds), rel), bufs)
    want = [((i // m, i),) for i in range(n * m)]  # position i: its owner's value for it
    for r in range(n):
        assert out[r] == want, f"all_gather: rank {r}"


@pytest.mark.parametrize("n", range(2, 17))
def test_scatter_allgather_broadcast_and_tree(n):
    for root in {0, 1, n - 1, n // 2}:
        for numel in (1, 5, 37):
            want = own_data(root, numel)
            bufs = [list(want) if r == root else [("x",)] * numel for r in range(n)]
            lay = Layout(n, balanced_bounds(numel, n))
            out = simulate(n, lambda rel, lay=lay: broadcast_steps(lay, rel), bufs, offset=root)
            assert all(buf == want for buf in out), (root, numel)
        reached = {0}
        for v in range(1, n):
            assert tree.parent(v) < v and v in tree.children(tree.parent(v), n)
            reached.add(v)
        assert reached == set(range(n))
        assert max(len(tree.children(v, n)) for v in range(n)) == (n - 1).bit_length()
