"""The step schedules of halving/doubling, scatter + all-gather and the binomial tree, run by a
simulator (no processes): every message each rank sends is received by exactly one matching
receive of the same size, and the results are right, on 2-16 ranks and every root.

The multiprocess tests (tests/multiproc/test_comm_algorithms.py) run the same schedules over
gloo against torch; this covers the world sizes a 2-core host cannot launch.
"""

from __future__ import annotations

from collections import defaultdict, deque

import pytest

from nanoddp.comm import tree
from nanoddp.comm.halving_doubling import Layout, all_gather_steps, reduce_scatter_steps
from nanoddp.comm.pieces import balanced_bounds
from nanoddp.comm.van_de_geijn import broadcast_steps


def simulate(n: int, steps_of, bufs: list[list], offset: int = 0) -> list[list]:
    """Run every rank's steps with sums as the reduction, in rounds until all are done; each
    element is a frozenset-free multiset of contributions (a tuple of ranks, sorted)."""
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
    every = tuple(range(n))
    bounds = balanced_bounds(numel, n)
    out = simulate(
        n, lambda rel: reduce_scatter_steps(Layout(n, bounds), rel, True), [[(r,)] * numel for r in range(n)]
    )
    assert all(buf == [every] * numel for buf in out)
    m = max(numel // n, 1) if numel else 0
    rs_bounds = [(q * m, (q + 1) * m) for q in range(n)]
    out = simulate(
        n, lambda rel: reduce_scatter_steps(Layout(n, rs_bounds), rel, False), [[(r,)] * n * m for r in range(n)]
    )
    for r in range(n):
        assert out[r][r * m : (r + 1) * m] == [every] * m


@pytest.mark.parametrize("n", range(2, 17))
@pytest.mark.parametrize("m", [0, 1, 3])
def test_all_gather(n, m):
    bounds = [(q * m, (q + 1) * m) for q in range(n)]
    bufs = [[("x",)] * n * m for _ in range(n)]
    for r in range(n):
        bufs[r][r * m : (r + 1) * m] = [(r,)] * m
    out = simulate(n, lambda rel: all_gather_steps(Layout(n, bounds), rel), bufs)
    want = [(q,) for q in range(n) for _ in range(m)]
    assert all(buf == want for buf in out)


@pytest.mark.parametrize("n", range(2, 17))
def test_scatter_allgather_broadcast_and_tree(n):
    for root in {0, 1, n - 1, n // 2}:
        for numel in (1, 5, 37):
            want = [(i,) for i in range(numel)]
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
