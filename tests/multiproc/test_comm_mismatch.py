"""Calls the ranks disagree on raise the same error on every rank, and leave the group usable.

Each launched function makes mismatched calls (numel, dtype, op, root, collective; the general
round, the prepared rounds of `nanoddp.comm.protocol.cached_rounds`, run fresh and run again, and bulk
paths whose receives and early data were posted before the verdict) and checks that every rank
raised the same words and that later calls still give torch.distributed's results.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
from helpers import run_on_ranks

from nanoddp import comm
from nanoddp.comm import ReduceOp
from nanoddp.comm.protocol import wire
from nanoddp.comm.transport.runner import runner_for

BIG = 2**20 + 3  # float32: over the one-round limit at every world size, so the bulk paths run


def _randn(numel: int, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def _same(ours: torch.Tensor, ref: torch.Tensor, what: str, exact: bool = True) -> None:
    """Bitwise, or (`exact=False`: an all_reduce over 3 ranks, whose ring adds the three
    contributions in another order than gloo's) within float32's default tolerance."""
    if exact:
        assert torch.equal(ours, ref), f"{what}: {ours[:8]} != {ref[:8]}"
    else:
        torch.testing.assert_close(ours, ref, msg=lambda m: f"{what}: {m}")


def _mismatches(env) -> list[str]:
    r, messages = env.rank, []

    def expect_error(call) -> None:
        try:
            call()
        except ValueError as exc:
            messages.append(str(exc))
        else:
            raise AssertionError("expected a ValueError")
        ok = torch.ones(4)  # the group is still usable afterwards
        comm.all_reduce(ok)
        assert ok.tolist() == [3.0] * 4

    expect_error(lambda: comm.all_reduce(torch.ones(5 if r == 2 else 4)))  # numel, inline
    expect_error(lambda: comm.all_reduce(torch.ones(2**18 if r == 0 else 10)))  # ring vs inline
    expect_error(lambda: comm.all_reduce(torch.ones(2**18 + r)))  # both ring-sized
    expect_error(lambda: comm.all_reduce(torch.ones(4, dtype=torch.float64 if r == 1 else torch.float32)))
    expect_error(lambda: comm.all_reduce(torch.ones(4), op=ReduceOp.MAX if r == 0 else ReduceOp.SUM))
    expect_error(lambda: comm.broadcast(torch.ones(4), src=r))  # src differs
    expect_error(
        lambda: comm.broadcast(torch.ones(4), src=0) if r == 0 else comm.all_reduce(torch.ones(4))
    )  # different collectives
    expect_error(  # the hub (group rank 0) on the general path, the others on a prepared star broadcast
        lambda: comm.all_reduce(torch.ones(4)) if r == 0 else comm.broadcast(torch.ones(4), src=1)
    )
    expect_error(lambda: comm.all_reduce(torch.ones(3 + r), async_op=True).wait())
    for bad in (
        lambda: comm.broadcast(torch.ones(4), src=3),
        lambda: comm.reduce(torch.ones(4), dst=-1),
        lambda: comm.all_gather([torch.ones(4)] * 2, torch.ones(4)),
        lambda: comm.all_gather_into_tensor(torch.ones(11), torch.ones(4)),
        lambda: comm.reduce_scatter_tensor(torch.ones(4), torch.ones(13)),
        lambda: comm.all_reduce(torch.ones(4, dtype=torch.int64), op=ReduceOp.AVG),
        lambda: comm.scatter(torch.ones(4), None, src=r),
    ):
        with pytest.raises(ValueError):  # bad on every rank: each raises (after the header round)
            bad()
    with pytest.raises(TypeError):
        comm.all_reduce([1.0, 2.0])
    return messages


def test_mismatched_calls_raise_the_same_error_on_every_rank():
    per_rank = run_on_ranks(_mismatches, 3, timeout=180)
    assert per_rank[0] == per_rank[1] == per_rank[2]
    text = "\n".join(per_rank[0])
    for field in ("numel", "dtype", "op", "root", "collective"):
        assert f"disagree on {field}" in text
    assert "rank 2: 5" in per_rank[0][0]


def _pair_mismatches(env) -> list[str]:
    """2 ranks: mismatched calls where both ranks run a prepared round (nanoddp.comm.protocol.cached_rounds), and
    where one does and the other takes the general or bulk path; one side of each runs a round
    prepared by an earlier call. After each, the same prepared calls still give torch's results."""
    r, messages = env.rank, []

    def still_right() -> None:  # the signatures prepared above, on fresh tensors
        mine, ref = torch.arange(4.0) + r, torch.arange(4.0) + r
        comm.all_reduce(mine)
        dist.all_reduce(ref)
        assert torch.equal(mine, ref)
        mine, ref = torch.full((4,), float(r)), torch.full((4,), float(r))
        comm.broadcast(mine, src=1)
        dist.broadcast(ref, src=1)
        assert torch.equal(mine, ref)

    def expect_error(call, error=ValueError) -> None:
        still_right()  # prepares the rounds first, so the mismatch meets prepared rounds
        with pytest.raises(error) as caught:
            call()
        messages.append(str(caught.value))
        still_right()

    still_right()
    bufs = wire.buffers(runner_for(None).peers, torch.device("cpu"))
    assert len(bufs.rounds) == 2, "the calls above must run as prepared rounds, from here on made before"
    expect_error(lambda: comm.all_reduce(torch.ones(5 if r == 1 else 4)))  # numel, both prepared
    expect_error(lambda: comm.broadcast(torch.ones(4), src=r))  # root
    expect_error(lambda: comm.all_reduce(torch.ones(4)) if r == 0 else comm.broadcast(torch.ones(4), src=1))
    expect_error(lambda: comm.all_reduce(torch.ones(4, dtype=torch.float64 if r else torch.float32)))
    expect_error(lambda: comm.all_reduce(torch.ones(2**20 if r == 0 else 4)))  # bulk path vs prepared
    expect_error(  # invalid on rank 1 only: it takes the general path carrying its error
        lambda: comm.all_reduce(
            torch.ones(4, dtype=torch.int64) if r else torch.ones(4, dtype=torch.int64),
            op=ReduceOp.AVG if r else ReduceOp.SUM,
        )
    )
    return messages


def test_mismatched_calls_on_two_ranks_raise_the_same_error_on_both():
    per_rank = run_on_ranks(_pair_mismatches, 2, timeout=180)
    assert per_rank[0] == per_rank[1]
    text = "\n".join(per_rank[0])
    for field in ("numel", "root", "collective", "dtype"):
        assert f"disagree on {field}" in text
    assert "invalid call on group rank 1" in per_rank[0][-1]


def _bulk_after_failed_bulk(env) -> None:
    """Ring and chain receives are posted before the header round's verdict; when the round
    raises they stay posted, unmatched, and later ring and chain traffic must not land in them."""
    r, n = env.rank, env.world_size
    for _ in range(2):
        with pytest.raises(ValueError, match="disagree on numel"):
            comm.all_reduce(torch.ones(BIG + r))  # both ring-sized: receives posted on every rank
        with pytest.raises(ValueError, match="disagree on numel"):
            comm.broadcast(torch.ones(BIG + r), src=0)  # chain-sized
        # Early data (plan.early_bytes) goes out before the verdict. Sizes of another power of two:
        # the early pieces' tags differ, so they never meet a receive of the wrong size.
        with pytest.raises(ValueError, match="disagree on numel"):
            comm.all_reduce(torch.ones(BIG * (1 + r)))
        with pytest.raises(ValueError, match="disagree on numel"):
            comm.broadcast(torch.ones(BIG * (1 + r)), src=0)
        # The same early size in two collectives: the pieces meet, and the round still raises.
        with pytest.raises(ValueError, match="disagree on collective"):
            if r == 0:
                comm.all_gather_into_tensor(torch.empty(n * BIG), torch.ones(BIG))
            else:
                comm.all_reduce(torch.ones(n * BIG))
    for numel in (BIG, BIG + 7):
        x = _randn(numel, seed=r)
        ours, ref = x.clone(), x.clone()
        comm.all_reduce(ours)
        dist.all_reduce(ref)
        _same(ours, ref, "ring all_reduce after failed ones", exact=False)
        ours, ref = x.clone(), x.clone()
        comm.broadcast(ours, src=1)
        dist.broadcast(ref, src=1)
        _same(ours, ref, "chain broadcast after failed ones")
        ours, ref = torch.empty(n * numel), torch.empty(n * numel)
        comm.all_gather_into_tensor(ours, x)
        dist.all_gather_into_tensor(ref, x)
        _same(ours, ref, "ring all_gather after failed ones")


@pytest.mark.parametrize("world_size", [2, 3])
def test_bulk_traffic_after_a_failed_header_round(world_size):
    run_on_ranks(_bulk_after_failed_bulk, world_size, timeout=180)


def _early_piece_behind_user_traffic(env) -> None:
    """A failed call's early piece that arrives after its receiver heard the verdict.

    At 3+ ranks the verdict comes from the hub (group rank 0), the early piece of the ring from
    the left neighbour, on another connection. Here rank 1's link to rank 2 is busy with a
    64 MB user message when the failing call sends its early piece, so rank 2 hears the verdict
    long before that piece arrives. Dropping the posted receive then would wedge gloo's
    connection 1 -> 2 for good (gloo cannot read a message whose receive buffer is gone), and
    the next ring all_reduce would hang: the failed call must settle its posted messages first."""
    r = env.rank
    user = torch.arange(2**24, dtype=torch.float32) if r == 1 else torch.zeros(2**24)
    for attempt in range(2):
        pending = dist.isend(user, 2) if r == 1 else dist.irecv(user, 1) if r == 2 else None
        with pytest.raises(ValueError, match="disagree on numel"):
            comm.all_reduce(torch.ones(BIG + (r == 0)))  # every rank's early piece the same size
        gc.collect()  # the raised error's traceback holds the call's frames: free its handles now
        if pending is not None:
            pending.wait()
        if r == 2:
            assert torch.equal(user, torch.arange(2**24, dtype=torch.float32)), "the user's message"
        x = _randn(BIG, seed=r + 10 * attempt)
        ours, ref = x.clone(), x.clone()
        comm.all_reduce(ours)
        dist.all_reduce(ref)
        _same(ours, ref, "ring all_reduce after a late early piece", exact=False)


def test_a_failed_calls_late_early_piece_does_not_wedge_the_link():
    run_on_ranks(_early_piece_behind_user_traffic, 3, timeout=90)
