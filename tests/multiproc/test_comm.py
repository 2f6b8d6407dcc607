"""nanoddp.comm against torch.distributed's built-ins on the same inputs, on 1-4 gloo processes.

Each launched function loops over sizes, dtypes and ops itself (a launch costs seconds).
Inputs are small integers, so SUM/PRODUCT/MIN/MAX must match *exactly* in every dtype;
random-normal inputs check the float paths with dtype-appropriate tolerances.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from helpers import run_on_ranks
from hypothesis import given
from hypothesis import strategies as st

from nanoddp import comm
from nanoddp.comm import ReduceOp
from nanoddp.comm.algorithms import message_pieces
from nanoddp.comm.plan import plan
from nanoddp.comm.protocol import wire
from nanoddp.comm.transport import runner
from nanoddp.comm.transport.runner import runner_for
from nanoddp.groups import new_group, subgroups_by

OPS = [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8]
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# fp16/bf16: gloo rounds after every pairwise add, nanoddp's one-round path only once (fp32)
TOL = {
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-12, 1e-12),
    torch.float16: (1e-3, 2e-2),
    torch.bfloat16: (1.6e-2, 0.15),
}
BIG = 2**20 + 3  # float32: over the one-round limit at every world size; `_ring_everywhere` covers the rest


def _mid(n: int) -> int:
    """Elements just over the one-round (inline) limit for 4-byte dtypes at world size n."""
    return plan.INLINE_SEND_BYTES // max(n - 1, 1) // 4 + 1


def _sizes(n: int) -> list[int]:
    return sorted({0, 1, max(n - 1, 1), n + 1, 1023, 40_000, _mid(n)})


def _ints(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    low = 0 if dtype == torch.uint8 else -3
    return torch.randint(low, 4, (numel,), generator=torch.Generator().manual_seed(seed)).to(dtype)


def _randn(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _torch_reduce_scatter(output, input, op=ReduceOp.SUM, group=None):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, input, op=op, group=group)


def _same(ours: torch.Tensor, ref: torch.Tensor, what: str, exact: bool = True) -> None:
    if exact or not ref.is_floating_point():
        assert torch.equal(ours, ref), f"{what}: {ours[:8]} != {ref[:8]}"
    else:
        rtol, atol = TOL[ref.dtype]
        torch.testing.assert_close(ours, ref, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _all_reduce_cases(env) -> int:
    """Every size x dtype x op (AVG: floats only, as in torch) against dist.all_reduce."""
    n, checked = env.world_size, 0
    for numel in _sizes(n):
        for dtype in DTYPES:
            for op in OPS:
                if op == ReduceOp.AVG and not dtype.is_floating_point:
                    continue
                x = _ints(numel, dtype, seed=100 * env.rank + numel)
                ours, ref = x.clone(), x.clone()
                comm.all_reduce(ours, op=op)
                dist.all_reduce(ref, op=op)
                _same(ours, ref, f"all_reduce {numel} {dtype} {op}", exact=op != ReduceOp.AVG)
                checked += 1
    for dtype in DTYPES:  # the big ring: every dtype with SUM, every op for float32
        for op in OPS if dtype == torch.float32 else [ReduceOp.SUM]:
            x = _ints(BIG, dtype, seed=env.rank)
            ours, ref = x.clone(), x.clone()
            comm.all_reduce(ours, op=op)
            dist.all_reduce(ref, op=op)
            _same(ours, ref, f"all_reduce {BIG} {dtype} {op}", exact=op != ReduceOp.AVG)
            checked += 1
    for numel in (1023, _mid(n), BIG):  # random floats, and bitwise-equal results on every rank
        for dtype in FLOATS:
            x = _randn(numel, dtype, seed=env.rank)
            ours, ref = x.clone(), x.clone()
            comm.all_reduce(ours)
            dist.all_reduce(ref)
            _same(ours, ref, f"all_reduce randn {numel} {dtype}", exact=False)
            everyone = [torch.empty_like(ours) for _ in range(n)]
            dist.all_gather(everyone, ours)
            assert all(torch.equal(e, ours) for e in everyone), f"ranks disagree: {numel} {dtype}"
    for shape in ((33, 65), (1030, 260)):  # non-contiguous: the result lands in the caller's view
        base = _ints(shape[0] * shape[1], torch.float32, seed=env.rank).view(shape)
        ours, ref = base.clone().t(), base.clone().t().contiguous()
        comm.all_reduce(ours, op=ReduceOp.MAX)
        dist.all_reduce(ref, op=ReduceOp.MAX)
        assert not ours.is_contiguous() and torch.equal(ours, ref)
    return checked


def _rooted_cases(env, numel: int, dtype: torch.dtype) -> None:
    """broadcast, reduce, scatter, gather from/to every root."""
    n, r = env.world_size, env.rank
    x = _ints(numel, dtype, seed=7 * r + 1)
    for root in range(n):
        ours, ref = x.clone(), x.clone()
        comm.broadcast(ours, src=root)
        dist.broadcast(ref, src=root)
        _same(ours, ref, f"broadcast {numel} {dtype} src={root}")
        for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.PRODUCT):
            ours, ref = x.clone(), x.clone()
            comm.reduce(ours, dst=root, op=op)
            dist.reduce(ref, dst=root, op=op)
            if r == root:
                _same(ours, ref, f"reduce {numel} {dtype} {op} dst={root}")
            else:
                assert torch.equal(ours, x), "reduce must leave non-destination tensors alone"
        parts = [_ints(numel, dtype, seed=1000 + 10 * r + i) for i in range(n)]
        ours, ref = torch.empty_like(x), torch.empty_like(x)
        comm.scatter(ours, parts if r == root else None, src=root)
        dist.scatter(ref, parts if r == root else None, src=root)
        _same(ours, ref, f"scatter {numel} {dtype} src={root}")
        ours_list = [torch.full_like(x, -1) for _ in range(n)] if r == root else None
        ref_list = [torch.full_like(x, -1) for _ in range(n)] if r == root else None
        comm.gather(x, ours_list, dst=root)
        dist.gather(x, ref_list, dst=root)
        if r == root:
            for i in range(n):
                _same(ours_list[i], ref_list[i], f"gather {numel} {dtype} dst={root} from {i}")


def _gather_scatter_cases(env, numel: int, dtype: torch.dtype) -> None:
    """all_gather, all_gather_into_tensor, reduce_scatter_tensor (numel = per-rank part)."""
    n, r = env.world_size, env.rank
    x = _ints(numel, dtype, seed=3 * r + 2)
    ours_list, ref_list = [torch.empty_like(x) for _ in range(n)], [torch.empty_like(x) for _ in range(n)]
    comm.all_gather(ours_list, x)
    dist.all_gather(ref_list, x)
    for i in range(n):
        _same(ours_list[i], ref_list[i], f"all_gather {numel} {dtype} from {i}")
    ours, ref = x.new_empty(n * numel), x.new_empty(n * numel)
    comm.all_gather_into_tensor(ours, x)
    dist.all_gather_into_tensor(ref, x)
    _same(ours, ref, f"all_gather_into_tensor {numel} {dtype}")
    big = _ints(n * numel, dtype, seed=5 * r + 3)
    for op in (ReduceOp.SUM, ReduceOp.MIN) + ((ReduceOp.AVG,) if dtype.is_floating_point else ()):
        ours, ref = x.new_empty(numel), x.new_empty(numel)
        kept = big.clone()
        comm.reduce_scatter_tensor(ours, big, op=op)
        _torch_reduce_scatter(ref, big, op=op)
        _same(ours, ref, f"reduce_scatter {numel} {dtype} {op}", exact=op != ReduceOp.AVG)
        assert torch.equal(big, kept), "reduce_scatter_tensor must not modify its input"


def _other_collectives(env) -> None:
    n = env.world_size
    for numel in (0, 1, n + 1, 1023, 40_000, _mid(n)):
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            _rooted_cases(env, numel, dtype)
            _gather_scatter_cases(env, numel, dtype)
    strided = _ints(2 * 1030, torch.float32, seed=env.rank)  # non-contiguous outputs
    ours, ref = strided.clone(), strided.clone()
    comm.broadcast(ours[::2], src=0)
    rank0 = _ints(2 * 1030, torch.float32, seed=0)
    dist.broadcast(rank0, src=0)  # (gloo's own broadcast rejects/ignores strided views)
    ref[::2] = rank0[::2]
    assert torch.equal(ours, ref)
    outs = [torch.zeros(1030, 2).t() for _ in range(n)]  # (2, 1030) views, non-contiguous
    comm.all_gather(outs, torch.full((2, 1030), float(env.rank)))
    assert all(torch.equal(o, torch.full((2, 1030), float(i))) for i, o in enumerate(outs))


def _ring_everywhere(env) -> None:
    """The ring and chain paths for every dtype and op, on tensors kept small by shrinking the
    one-round limit to 64 KB and the pieces to 16-64 KB: every world size then forwards several
    pieces per chunk and posts reduce-scatter receives into reused scratch slots. At 2 ranks
    all_reduce runs twice: as one exchange of whole tensors (its default at these sizes), and
    as the ring (the exchange limit set to 0, as for tensors past it)."""
    saved = plan.INLINE_SEND_BYTES, plan.PIECE_MIN_BYTES, plan.PIECE_MAX_BYTES, plan.EXCHANGE_MAX_BYTES
    plan.INLINE_SEND_BYTES, plan.PIECE_MIN_BYTES, plan.PIECE_MAX_BYTES = 0, 16 * 1024, 64 * 1024
    try:
        for exchange_max in (saved[3], 0) if env.world_size == 2 else (saved[3],):
            plan.EXCHANGE_MAX_BYTES = exchange_max
            exchange = plan.plan("all_reduce", BIG * 4, env.world_size, "gloo") is plan.Path.EXCHANGE
            path = "exchange" if exchange else "ring"
            for dtype in DTYPES:
                for op in OPS if dtype == torch.float32 else [ReduceOp.SUM, ReduceOp.MAX]:
                    x = _ints(2**17 + 3, dtype, seed=env.rank)
                    ours, ref = x.clone(), x.clone()
                    comm.all_reduce(ours, op=op)
                    dist.all_reduce(ref, op=op)
                    _same(ours, ref, f"{path} all_reduce {dtype} {op}", exact=op != ReduceOp.AVG)
            for op in OPS:
                x = _randn(BIG, torch.float32, seed=env.rank)
                ours, ref = x.clone(), x.clone()
                comm.all_reduce(ours, op=op)
                dist.all_reduce(ref, op=op)
                _same(ours, ref, f"many pieces {path} all_reduce {op}", exact=op == ReduceOp.SUM and path == "exchange")
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            _rooted_cases(env, 2**16 + 1, dtype)
            _gather_scatter_cases(env, 2**16 + 1, dtype)
    finally:
        plan.INLINE_SEND_BYTES, plan.PIECE_MIN_BYTES, plan.PIECE_MAX_BYTES, plan.EXCHANGE_MAX_BYTES = saved


def _matches_torch(env) -> int:
    checked = _all_reduce_cases(env)
    _other_collectives(env)
    _ring_everywhere(env)
    return checked


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_collectives_match_torch(world_size):
    checked = run_on_ranks(_matches_torch, world_size, timeout=300)
    assert checked[0] > 100


def _grouped_rounds(env) -> None:
    """The path nccl takes (one grouped send+receive per round, exact sizes, no tags), run here
    on gloo, which accepts it too: same results as torch's built-ins."""
    from nanoddp.comm.transport.runner import runner_for

    runner_for(None).peers.gloo = False
    for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX):
        x = _randn(BIG, torch.float32, seed=env.rank)
        ours, ref = x.clone(), x.clone()
        comm.all_reduce(ours, op=op)
        dist.all_reduce(ref, op=op)
        _same(ours, ref, f"grouped all_reduce {op}", exact=False)
    for numel in (1, 40_000, 2**18 + 1):
        _rooted_cases(env, numel, torch.float32)
        _gather_scatter_cases(env, numel, torch.int64)


@pytest.mark.parametrize("world_size", [2, 3])
def test_nccl_grouped_path_matches_torch(world_size):
    run_on_ranks(_grouped_rounds, world_size, timeout=240)


def _subgroups(env) -> None:
    r = env.rank
    even, odd = new_group([0, 2]), new_group([1, 3])
    single = subgroups_by(lambda rank: rank)
    group = even if r % 2 == 0 else odd
    members = [0, 2] if r % 2 == 0 else [1, 3]
    x = _ints(_mid(2) + 3, torch.float32, seed=r)
    for g, ranks in ((group, members), (single, [r])):
        ours, ref = x.clone(), x.clone()
        comm.all_reduce(ours, op=ReduceOp.SUM, group=g)
        dist.all_reduce(ref, op=ReduceOp.SUM, group=g)
        _same(ours, ref, f"subgroup {ranks} all_reduce")
        for small in (x[:5].clone(), x.clone()):  # inline and ring/chain paths
            ours, ref = small.clone(), small.clone()
            comm.broadcast(ours, src=ranks[-1], group=g)  # src is a *global* rank
            dist.broadcast(ref, src=ranks[-1], group=g)
            _same(ours, ref, f"subgroup {ranks} broadcast")
            ours, ref = small.clone(), small.clone()
            comm.reduce(ours, dst=ranks[-1], op=ReduceOp.MAX, group=g)
            dist.reduce(ref, dst=ranks[-1], op=ReduceOp.MAX, group=g)
            if r == ranks[-1]:
                _same(ours, ref, f"subgroup {ranks} reduce")
        ours_list = [torch.empty(7) for _ in ranks]
        comm.all_gather(ours_list, torch.full((7,), float(r)), group=g)
        assert [int(t[0]) for t in ours_list] == ranks
        out = torch.empty(4)
        comm.reduce_scatter_tensor(out, torch.arange(4.0 * len(ranks)) * (r + 1), group=g)
        ref = torch.empty(4)
        _torch_reduce_scatter(ref, torch.arange(4.0 * len(ranks)) * (r + 1), group=g)
        _same(out, ref, f"subgroup {ranks} reduce_scatter")
    with pytest.raises(ValueError, match="not a member of the group"):
        comm.broadcast(x, src=members[0] ^ 1, group=group)  # a rank of the other group
    with pytest.raises(ValueError, match="not a member of the group"):
        comm.gather(x, None, dst=(r + 1) % 4, group=single)


def test_subgroups_of_four():
    run_on_ranks(_subgroups, 4, timeout=180)


def _async(env) -> dict:
    torch.manual_seed(env.rank)
    tensors = [torch.randn(2**20) for _ in range(3)]
    refs = [t.clone() for t in tensors]
    for ref in refs:
        dist.all_reduce(ref)
    works = [comm.all_reduce(t, async_op=True) for t in tensors]  # queued, FIFO on every rank
    a = torch.randn(256, 256)
    for _ in range(20):  # compute while the ring runs in the background
        a = torch.tanh(a @ a)
    deadline = time.monotonic() + 60
    while not works[-1].is_completed() and time.monotonic() < deadline:
        time.sleep(0.005)
    finished_without_wait = works[-1].is_completed()
    for work, t, ref in zip(works, tensors, refs, strict=True):
        assert work.wait() is True
        _same(t, ref, "async all_reduce", exact=False)
    # a blocking call queues behind pending async work
    first, second = torch.ones(3000) * env.rank, torch.ones(5)
    work = comm.all_reduce(first, async_op=True)
    comm.all_reduce(second)
    assert work.is_completed() and second.tolist() == [2.0] * 5
    assert torch.equal(first, torch.ones(3000))
    # from another thread (autograd hooks run on other threads), with a torch Future
    box = {}
    thread = threading.Thread(target=lambda: box.update(work=comm.all_reduce(torch.ones(9), async_op=True)))
    thread.start()
    thread.join()
    future_value = box["work"].get_future().wait()[0]
    assert future_value.tolist() == [2.0] * 9
    out = torch.empty(8)
    comm.all_gather_into_tensor(out, torch.full((4,), float(env.rank)), async_op=True).wait()
    assert out.tolist() == [0.0] * 4 + [1.0] * 4
    # forgetting the groups ends the runner threads (they kept the group alive past its destroy)
    closed = runner.forget_groups()
    assert [thread.name for _, thread in closed] == [f"nanoddp-comm-rank{env.rank}of2"]
    closed[0][1].join(30)
    assert not closed[0][1].is_alive()
    again = torch.full((5,), float(env.rank + 1))
    comm.all_reduce(again, async_op=True).wait()  # a fresh runner on the same group
    assert again.tolist() == [3.0] * 5
    return {"finished_without_wait": finished_without_wait}


def test_async_handles_progress_in_background():
    results = run_on_ranks(_async, 2, timeout=180)
    assert all(r["finished_without_wait"] for r in results)


def _repeated_calls(env) -> None:
    """A call repeated with the same signature runs the round prepared for it the first time: still
    torch's results, bitwise, for every shape, op, root and async_op, and no new round is made; a
    non-contiguous tensor runs the same round through a contiguous copy, and a call whose limits
    changed takes the path the new limits give."""
    r, n = env.rank, env.world_size
    peers = runner_for(None).peers
    seed = iter(range(10_000))

    def fresh(*shape, dtype=torch.float32) -> torch.Tensor:
        return _ints(torch.Size(shape).numel(), dtype, seed=100 * r + next(seed)).view(shape)

    def calls(async_op: bool) -> None:
        def done(work) -> None:
            assert (work is not None) == async_op
            if work is not None:
                work.wait()

        for shape in ((5,), (2, 3)):
            for src in range(n):
                mine = fresh(*shape)
                ref = mine.clone()
                done(comm.broadcast(mine, src=src, async_op=async_op))
                dist.broadcast(ref, src=src)
                _same(mine, ref, f"repeated broadcast {shape} from {src}")
        if n != 2:
            return
        for dtype, op in ((torch.float32, ReduceOp.SUM), (torch.float32, ReduceOp.AVG), (torch.int64, ReduceOp.MAX)):
            mine = fresh(3, 2, dtype=dtype)
            ref = mine.clone()
            done(comm.all_reduce(mine, op=op, async_op=async_op))
            dist.all_reduce(ref, op=op)
            _same(mine, ref, f"repeated all_reduce {dtype} {op}")
        for out_shape in ((n * 6,), (n, 6)):
            x = fresh(6)
            mine, ref = torch.zeros(out_shape), torch.zeros(out_shape)
            done(comm.all_gather_into_tensor(mine, x, async_op=async_op))
            dist.all_gather_into_tensor(ref.view(-1), x)  # gloo takes the concatenated form only
            _same(mine, ref, f"repeated all_gather_into_tensor {out_shape}")

    rounds = wire.buffers(peers, torch.device("cpu")).rounds
    before = len(rounds)
    calls(async_op=False)
    prepared = len(rounds) - before
    # broadcast: 2 numels x n roots; at 2 ranks also 3 all_reduces and 1 all_gather (both output
    # shapes hold 2 x 6 elements: one signature, as a round is made for the numel, not the shape)
    assert prepared == 2 * n + (3 + 1 if n == 2 else 0), sorted(map(str, rounds))
    for async_op in (False, True, False):  # every one a repeat now
        calls(async_op)
    assert len(rounds) == before + prepared
    odd = fresh(10)[::2]  # not contiguous, 5 elements: the round made for (5,) above
    ref = odd.clone()
    comm.broadcast(odd, src=0)
    dist.broadcast(ref, src=0)
    _same(odd, ref, "non-contiguous broadcast")
    assert len(rounds) == before + prepared
    saved = plan.INLINE_SEND_BYTES, plan.INLINE_MAX_BYTES
    plan.INLINE_SEND_BYTES = plan.INLINE_MAX_BYTES = 0  # nothing rides in the frames: all take the bulk path
    try:
        calls(async_op=False)
    finally:
        plan.INLINE_SEND_BYTES, plan.INLINE_MAX_BYTES = saved
    calls(async_op=False)


@pytest.mark.parametrize("world_size", [2, 3])
def test_repeated_calls_match_torch(world_size):
    run_on_ranks(_repeated_calls, world_size, timeout=180)


@given(numel=st.integers(0, 3_000_000), n=st.integers(1, 9), itemsize=st.sampled_from([1, 2, 4, 8]))
def test_chunks_and_pieces_cover_everything_once(numel, n, itemsize):
    bounds = message_pieces.balanced_bounds(numel, n)
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert max(b - a for a, b in bounds) - min(b - a for a, b in bounds) <= 1
    step = message_pieces.piece_numel(max(b - a for a, b in bounds), itemsize)
    for a, b in bounds:
        cut = message_pieces.pieces(b - a, step)
        assert sum(y - x for x, y in cut) == b - a
        assert all(0 < (y - x) * itemsize <= plan.PIECE_MAX_BYTES for x, y in cut)
        early = plan.early_bytes((b - a) * itemsize, gloo=True) // itemsize
        assert early == 0 or (b - a) * itemsize >= plan.EARLY_MIN_BYTES
        after = message_pieces.pieces_after(b - a, early, step)
        assert sum(y - x for x, y in after) == b - a and all(
            p[1] == q[0] for p, q in zip(after, after[1:], strict=False)
        )
        assert not early or after[0] == (0, early)
