"""A call that is invalid on ONE rank only raises the same error on EVERY rank, and nothing hangs.

Each case passes a bad argument on some ranks and a good one on the others; every rank must
raise, with the same type and the same words, and the group must stay usable afterwards.
Also: a BaseException (KeyboardInterrupt, SystemExit) inside a collective reaches the caller as
itself and leaves the group's runner working.
"""

from __future__ import annotations

import pytest
import torch
from helpers import run_on_ranks

from nanoddp import comm
from nanoddp.comm import ReduceOp
from nanoddp.comm.transport.runner import runner_for

BAD_ON_ONE_RANK = [  # (name, fn(rank, n, bad: bool), exception type, words of the bad rank's message)
    (
        "int AVG",
        lambda r, n, bad: comm.all_reduce(torch.ones(4, dtype=torch.int64), op=ReduceOp.AVG if bad else ReduceOp.SUM),
        ValueError,
        "ReduceOp.AVG needs a floating-point tensor",
    ),
    ("bad src", lambda r, n, bad: comm.broadcast(torch.ones(4), src=99 if bad else 0), ValueError, "src must be"),
    ("bad dst", lambda r, n, bad: comm.reduce(torch.ones(4), dst=-1 if bad else 0), ValueError, "dst must be"),
    (
        "output size",
        lambda r, n, bad: comm.all_gather_into_tensor(torch.empty(n * 4 + bad), torch.ones(4)),
        ValueError,
        "nanoddp.comm.all_gather_into_tensor: invalid call on group rank",  # the public name
    ),
    (
        "list length",
        lambda r, n, bad: comm.all_gather([torch.empty(4) for _ in range(n + bad)], torch.ones(4)),
        ValueError,
        "tensor_list must be a list",
    ),
    (
        "input size",
        lambda r, n, bad: comm.reduce_scatter_tensor(torch.empty(4), torch.ones(n * 4 + bad)),
        ValueError,
        "input must be",
    ),
    (
        "root's scatter_list",
        lambda r, n, bad: comm.scatter(torch.empty(4), None if bad else [torch.ones(4)] * n, src=r if bad else 0),
        ValueError,
        "scatter_list must be",
    ),
    (
        "not a tensor",
        lambda r, n, bad: comm.all_reduce([1.0] if bad else torch.ones(1)),
        TypeError,
        "tensor must be a torch.Tensor",
    ),
    (
        "dtype",
        lambda r, n, bad: comm.all_reduce(torch.ones(2, dtype=torch.complex64 if bad else torch.float32)),
        ValueError,
        "unsupported dtype",
    ),
    (
        "async",
        lambda r, n, bad: comm.all_reduce(
            torch.ones(3, dtype=torch.int32), ReduceOp.AVG if bad else ReduceOp.SUM, async_op=True
        ).wait(),  # noqa: E501
        ValueError,
        "ReduceOp.AVG",
    ),
]


def _still_usable(n: int) -> None:
    ok = torch.ones(4)
    comm.all_reduce(ok)
    assert ok.tolist() == [float(n)] * 4, "the group must be usable after an invalid call"


def _invalid_calls(env, bad_rank_sets: list[list[int]]) -> list[list[tuple[str, str]]]:
    """Run every case with the bad argument on each set of ranks; (type, message) per set and case."""
    r, n, per_set = env.rank, env.world_size, []
    for bad_ranks in bad_rank_sets:
        seen = []
        for name, call, expected, _ in BAD_ON_ONE_RANK:
            try:
                call(r, n, r in bad_ranks)
            except expected as exc:
                seen.append((type(exc).__name__, str(exc)))
            else:
                raise AssertionError(f"{name}: rank {r} did not raise {expected.__name__}")
            _still_usable(n)
        per_set.append(seen)
    return per_set


@pytest.mark.parametrize(("world_size", "bad_rank_sets"), [(2, [[1]]), (3, [[1], [2, 1]])])
def test_invalid_call_on_some_ranks_raises_the_same_error_on_every_rank(world_size, bad_rank_sets):
    per_rank = run_on_ranks(_invalid_calls, world_size, bad_rank_sets, timeout=120)
    for s, bad_ranks in enumerate(bad_rank_sets):
        first = min(bad_ranks)
        for i, (name, _, expected, words) in enumerate(BAD_ON_ONE_RANK):
            kinds = {rank_seen[s][i] for rank_seen in per_rank}
            assert len(kinds) == 1, f"{name} (bad on {bad_ranks}): ranks raised different errors: {kinds}"
            kind, message = kinds.pop()
            assert kind == expected.__name__ and words in message, f"{name}: {message}"
            assert f"invalid call on group rank {first}" in message, message
            if len(bad_ranks) > 1:
                assert f"and on group ranks {sorted(bad_ranks)[1:]}" in message, message


def _interrupted(env) -> dict:
    """A KeyboardInterrupt / SystemExit raised inside a collective's body, blocking and async."""
    runner, n, seen = runner_for(None), env.world_size, {}

    def interrupt(kind: type[BaseException]):
        def body() -> None:
            raise kind("stopped by the user")

        return body

    for kind in (KeyboardInterrupt, SystemExit):
        try:  # blocking: runs inline on this thread
            runner.submit("all_reduce", 1, interrupt(kind), [], async_op=False)
        except kind:
            seen[f"blocking {kind.__name__}"] = True
        t = torch.ones(2)
        work = runner.submit("all_reduce", 1, interrupt(kind), [t], async_op=True)  # on the runner thread
        try:
            work.wait(timeout=60)
        except kind:
            seen[f"async {kind.__name__}"] = True
        try:
            work.get_future().wait()
        except RuntimeError as exc:
            seen[f"future {kind.__name__}"] = kind.__name__ in str(exc)
        after = torch.ones(3)  # the runner thread survived: queued work still runs
        comm.all_reduce(after, async_op=True).wait(timeout=60)
        assert after.tolist() == [float(n)] * 3
        _still_usable(n)
    return seen


def test_base_exceptions_reach_the_caller_and_the_runner_keeps_working():
    for seen in run_on_ranks(_interrupted, 2, timeout=120):
        expected = [
            f"{how} {k}" for k in ("KeyboardInterrupt", "SystemExit") for how in ("blocking", "async", "future")
        ]
        assert sorted(k for k, v in seen.items() if v) == sorted(expected)
