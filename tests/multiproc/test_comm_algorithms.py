"""Halving/doubling, the binomial tree and scatter + all-gather against torch, on 2-8 gloo ranks.

`plan` chooses these paths from 5 ranks by its α–β model; here each is forced (`plan.FORCED`) so
every one runs at every world size, 3, 5, 6 and 7 (the fold) included, for every op and dtype,
on uneven, empty and one-element messages, and on a subgroup of the even ranks. Every result
must be bitwise the same on every rank, exact against torch for integers and within the
documented reduction order (a fixed tree, `halving_doubling`) for floats. One launch per world
size runs every case (a launch costs seconds).

The same launches, at 2 and 4 ranks, check `sent_bytes()` (the trainer's `comm_bytes`) on the
bulk paths, which send the caller's dtype, not byte frames (a count of elements would read 4x
low for float32). Reference: torch's byte count of the tensor (`Tensor.nbytes`) times the
volume each algorithm moves per rank, 2 (ws - 1) / ws of the message for an all-reduce by ring
or halving/doubling, ws - 1 times it for an all-gather; each call runs at n and 2n elements,
whose difference is the data alone (the header round's frame is the same for both).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from helpers import run_on_ranks

from nanoddp import comm
from nanoddp.comm import ReduceOp
from nanoddp.comm.plan import plan
from nanoddp.comm.plan.plan import Path
from nanoddp.comm.transport.runner import runner_for
from nanoddp.comm.transport.transport import sent_bytes
from nanoddp.groups import new_group

OPS = [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64]
# floats: the tree's order differs from gloo's, and fp16/bf16 round after each step in both
TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12), torch.float16: (2e-3, 2e-2),
       torch.bfloat16: (1.6e-2, 0.15)}  # fmt: skip
HALVING = {"all_reduce": Path.HALVING_DOUBLING, "all_gather": Path.HALVING_DOUBLING,
           "reduce_scatter": Path.HALVING_DOUBLING}  # fmt: skip


def _data(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point and seed % 2:  # random normal half the time: rounding shows
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(-3, 4, (numel,), generator=g).to(dtype)


def _close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    if ref.is_floating_point():
        rtol, atol = TOL[ref.dtype]
        torch.testing.assert_close(ours, ref, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(ours, ref), f"{what}: {ours[:8]} != {ref[:8]}"


class Results:
    """Every result's bytes, compared across the group's ranks at the end (bitwise equality)."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []

    def add(self, t: torch.Tensor) -> None:
        self.parts.append(t.contiguous().view(-1).view(torch.uint8).clone())

    def check_same_everywhere(self, group) -> int:
        mine = torch.cat(self.parts) if self.parts else torch.zeros(0, dtype=torch.uint8)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, mine, group=group)
        assert all(torch.equal(e, mine) for e in everyone), "ranks hold different bytes"
        return len(self.parts)


def _reductions(r: int, n: int, group, sizes, same: Results) -> None:
    for numel in sizes:
        for dtype in DTYPES:
            for op in OPS:
                if op == ReduceOp.AVG and not dtype.is_floating_point:
                    continue
                what = f"all_reduce {op} {dtype} numel {numel} ws {n}"
                x = _data(numel, dtype, seed=31 * r + numel)
                ours, ref = x.clone(), x.clone()
                comm.all_reduce(ours, op=op, group=group)
                dist.all_reduce(ref, op=op, group=group)
                _close(ours, ref, what)
                same.add(ours)
                m = numel // n
                whole = _data(n * m, dtype, seed=7 * r + numel)
                out = torch.full((m,), 99, dtype=dtype)
                comm.reduce_scatter_tensor(out, whole.view(n, m) if m else whole, op=op, group=group)
                dist.all_reduce(reference := whole.clone(), op=op, group=group)  # gloo has no reduce_scatter
                _close(out, reference[r * m : (r + 1) * m], f"reduce_scatter {op} {dtype} share {m} ws {n}")
                assert torch.equal(whole, _data(n * m, dtype, seed=7 * r + numel)), "the input survives"


def _gathers_and_broadcasts(r: int, n: int, group, sizes, same: Results) -> None:
    for numel in sizes:
        for dtype in DTYPES:
            x = _data(numel, dtype, seed=5 * r + numel)
            ours, ref = torch.zeros(n * numel, dtype=dtype), torch.zeros(n * numel, dtype=dtype)
            comm.all_gather_into_tensor(ours, x, group=group)
            dist.all_gather_into_tensor(ref, x, group=group)
            assert torch.equal(ours, ref), f"all_gather_into_tensor {dtype} numel {numel} ws {n}"
            listed = [torch.full((numel,), 7, dtype=dtype) for _ in range(n)]
            comm.all_gather(listed, x, group=group)
            assert torch.equal(torch.cat(listed), ref), f"all_gather (list) {dtype} numel {numel} ws {n}"
            same.add(ours)
            for src in range(n):
                src_global = dist.get_global_rank(group, src) if group is not None else src
                for path in (Path.TREE, Path.SCATTER_ALLGATHER):
                    plan.FORCED["broadcast"] = path
                    ours, ref = x.clone(), x.clone()
                    comm.broadcast(ours, src=src_global, group=group)
                    dist.broadcast(ref, src=src_global, group=group)
                    assert torch.equal(ours, ref), f"broadcast {path.name} from {src} {dtype} numel {numel} ws {n}"


def _mismatch(r: int, n: int) -> list[str]:
    """Rank n-1 alone passes another numel: every rank raises the same error, the group survives."""
    messages = []
    calls = {
        "all_reduce": lambda k: comm.all_reduce(torch.ones(k)),
        "all_gather": lambda k: comm.all_gather_into_tensor(torch.zeros(n * k), torch.ones(k)),
        "reduce_scatter": lambda k: comm.reduce_scatter_tensor(torch.zeros(k), torch.ones(n * k)),
        "broadcast tree": lambda k: comm.broadcast(torch.ones(k), src=0),
        "broadcast van de Geijn": lambda k: comm.broadcast(torch.ones(k), src=n - 1),
    }
    for name, call in calls.items():
        plan.FORCED["broadcast"] = Path.TREE if "tree" in name else Path.SCATTER_ALLGATHER
        with pytest.raises(ValueError) as caught:
            call(13 if r == n - 1 else 12)
        messages.append(f"{name}: {caught.value}")
        call(12)  # the group is still usable
    ours, ref = _data(12, torch.float32, seed=r), _data(12, torch.float32, seed=r)
    comm.all_reduce(ours)
    dist.all_reduce(ref)
    _close(ours, ref, "all_reduce after the mismatches")
    return messages


def _every_case(env) -> tuple[int, list[str]]:
    r, n = env.rank, env.world_size
    checked = 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan, "FORCED", dict(HALVING))
        for name, value in {"PIECE_MIN_BYTES": 64, "PIECE_MAX_BYTES": 128, "EARLY_MIN_BYTES": 64}.items():
            mp.setattr(plan, name, value)  # irrelevant to these paths; small, should they leak
        sizes = sorted({0, 1, n - 1, n + 1, 37, 3 * n + 2})
        same = Results()
        _reductions(r, n, None, sizes, same)
        _gathers_and_broadcasts(r, n, None, [0, 1, 3, 37], same)
        checked += same.check_same_everywhere(None)
        messages = _mismatch(r, n)
        if n >= 4:  # the even ranks as a subgroup (3 at ws 5-6, 4 at ws 7-8: a fold or not)
            evens = new_group(range(0, n, 2))
            if evens is not None:
                k, gr = dist.get_world_size(evens), dist.get_rank(evens)
                same = Results()
                _reductions(gr, k, evens, [1, k + 1, 37], same)
                _gathers_and_broadcasts(gr, k, evens, [1, 37], same)
                checked += same.check_same_everywhere(evens)
    return checked, messages


RING_RS_WORLD_SIZES = (2, 3, 5, 6)  # the ring reduce-scatter's slot reuse starts at 6 ranks
SENT_BYTES_WORLD_SIZES = (2, 4)
BYTES_NUMEL = 4096
BYTES_CALLS = [
    ("all_reduce", Path.RING, torch.float32),
    ("all_reduce", Path.HALVING_DOUBLING, torch.float32),
    ("all_reduce", Path.RING, torch.bfloat16),
    ("all_gather", Path.RING, torch.float32),
]


def _both(env) -> tuple[tuple[int, list[str]], int | None, list[int] | None]:
    """`_ring_reduce_scatter` where its world sizes ask, then `_every_case`, then `_sent_bytes`
    where its world sizes ask: one launch for all (starting ranks on 2 cores costs seconds per
    launch). The ring goes first: it checks the group's scratch buffers, which the other cases'
    paths would have filled."""
    ring = _ring_reduce_scatter(env) if env.world_size in RING_RS_WORLD_SIZES else None
    every = _every_case(env)
    return every, ring, _sent_bytes(env) if env.world_size in SENT_BYTES_WORLD_SIZES else None


@functools.cache
def _launch(world_size: int) -> list[tuple[tuple[int, list[str]], int | None, list[int] | None]]:
    return run_on_ranks(_both, world_size, timeout=900)


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6, 8])  # 7 adds no path 5 and 8 miss
def test_new_paths_match_torch_on_every_rank(world_size):
    per_rank = [every for every, _, _ in _launch(world_size)]
    assert all(checked > 100 for checked, _ in per_rank)
    messages = [m for _, m in per_rank]
    assert all(m == messages[0] for m in messages), "every rank raises the same error"
    for message in messages[0]:
        assert "disagree on numel" in message, message


def _ring_reduce_scatter(env) -> int:
    """reduce_scatter's ring on gloo reads its input where it lies (`ring.start_reduce_scatter_ring`:
    receive slots for the steps before the last, at most three, reused from 6 ranks on): torch's
    results, the input untouched, no copy of it made and no more slots than that; then bitwise
    the result of the ring that reduces in a copy, which runs when the output overlaps the input
    (here: this rank's own chunk of it, in place)."""
    r, n = env.rank, env.world_size
    small = {"PIECE_MIN_BYTES": 64, "PIECE_MAX_BYTES": 128, "EARLY_MIN_BYTES": 64, "EARLY_MAX_BYTES": 64}
    cases = [(m, dtype, op) for m in (1, 37, 100) for dtype in DTYPES for op in OPS
             if op != ReduceOp.AVG or dtype.is_floating_point]  # fmt: skip
    outs = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan, "FORCED", {"reduce_scatter": Path.RING})
        for name, value in small.items():  # several pieces per chunk, the first of them early
            mp.setattr(plan, name, value)
        for m, dtype, op in cases:
            what = f"ring reduce_scatter {op} {dtype} share {m} ws {n}"
            whole = _data(n * m, dtype, seed=11 * r + m)
            out = torch.full((m,), 99, dtype=dtype)
            comm.reduce_scatter_tensor(out, whole, op=op)
            assert torch.equal(whole, _data(n * m, dtype, seed=11 * r + m)), f"{what}: the input changed"
            dist.all_reduce(reference := whole.clone(), op=op)  # gloo has no reduce_scatter
            _close(out, reference[r * m : (r + 1) * m], what)
            outs.append(out)
        scratch = runner_for(None).peers._scratch
        assert not any(name == "reduce_scatter" for name, _ in scratch), "the input was copied"
        # The last step lands in `out`: one slot per earlier step, at most three, none at 2 ranks.
        slot_bytes = max((buf.numel() for (name, _), buf in scratch.items() if name == "ring"), default=0)
        most = min(n - 2, 3) * 100 * max(dtype.itemsize for dtype in DTYPES)
        assert slot_bytes <= (max(most, 64) if most else 0), f"{slot_bytes} bytes of ring slots at ws {n}"
        for (m, dtype, op), out in zip(cases, outs, strict=True):
            in_place = _data(n * m, dtype, seed=11 * r + m)
            comm.reduce_scatter_tensor(in_place[r * m : (r + 1) * m], in_place, op=op)
            assert torch.equal(in_place[r * m : (r + 1) * m], out), f"{op} {dtype} {m}: the copying ring differs"
    return len(cases)


@pytest.mark.parametrize("world_size", RING_RS_WORLD_SIZES)
def test_ring_reduce_scatter_reads_its_input_in_place(world_size):
    assert all(checked is not None and checked > 50 for _, checked, _ in _launch(world_size))


def _sent_by(op: str, x: torch.Tensor, world_size: int) -> int:
    before = sent_bytes()
    if op == "all_reduce":
        comm.all_reduce(x)
    else:
        comm.all_gather_into_tensor(torch.empty(world_size * x.numel(), dtype=x.dtype), x)
    return sent_bytes() - before


def _sent_bytes(env) -> list[int]:
    """Per call of BYTES_CALLS, on its path: the bytes n more elements add to this rank's sends."""
    extra = []
    for op, path, dtype in BYTES_CALLS:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(plan, "FORCED", {op: path})
            small, large = (
                _sent_by(op, torch.ones(n, dtype=dtype), env.world_size) for n in (BYTES_NUMEL, 2 * BYTES_NUMEL)
            )
        extra.append(large - small)
    return extra


@pytest.mark.parametrize("world_size", SENT_BYTES_WORLD_SIZES)
def test_sent_bytes_are_torchs_byte_count_of_what_is_sent(world_size):
    for rank, (_, _, extra) in enumerate(_launch(world_size)):
        assert extra is not None
        for (op, path, dtype), got in zip(BYTES_CALLS, extra, strict=True):
            nbytes = torch.ones(BYTES_NUMEL, dtype=dtype).nbytes
            want = 2 * (world_size - 1) * nbytes // world_size if op == "all_reduce" else (world_size - 1) * nbytes
            assert got == want, f"rank {rank}: {op} by {path.name} in {dtype}: {got} bytes counted, {want} sent"
