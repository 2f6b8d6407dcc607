"""`nanoddp.comm.plan.plan.plan`: every switch point, on both sides, for every op, group size and backend.

The expected paths are written from the rules (sizes spelled out), not from `plan`'s own helpers, so
a threshold moved or a comparison flipped in plan.py fails here. The collectives run what `plan`
says (tests/multiproc/test_comm_paths.py checks they give torch's results on every path).
"""

from __future__ import annotations

import pytest

from nanoddp.comm.plan import cost_model, plan
from nanoddp.comm.plan.plan import Path

KB, MB = 1024, 1024 * 1024
ALL_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "scatter", "gather")
MODEL_FROM = plan.MODEL_FROM_WORLD_SIZE
NEW = (Path.HALVING_DOUBLING, Path.TREE, Path.SCATTER_ALLGATHER)


@pytest.fixture(autouse=True)
def _fixed_thresholds(monkeypatch):
    """The fixed table's rules, at every world size: the α–β model's choices (from
    MODEL_FROM_WORLD_SIZE ranks) are tested below with the model switched back on."""
    monkeypatch.setattr(plan, "MODEL_FROM_WORLD_SIZE", 10**9)


def gloo(op: str, nbytes: int, ws: int, cpu: bool = True) -> Path:
    return plan.plan(op, nbytes, ws, "gloo", cpu=cpu)


def nccl(op: str, nbytes: int, ws: int) -> Path:
    return plan.plan(op, nbytes, ws, "nccl", cpu=False)


@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_one_rank_is_local_and_no_data_is_the_header_round_alone(op, backend):
    for nbytes in (0, 4, 64 * MB):
        assert plan.plan(op, nbytes, 1, backend) is Path.LOCAL
    for ws in (2, 3, 8):
        assert plan.plan(op, 0, ws, backend) is Path.HEADER_ONLY


@pytest.mark.parametrize(
    ("ws", "limit"),
    # gloo: what one rank sends in the round stays within 3 MB, so 3 MB / (ws - 1), never below 64 KB
    [(2, 3 * MB), (3, 3 * MB // 2), (8, 3 * MB // 7)],
)
def test_all_reduce_on_gloo(ws, limit):
    small = Path.PAIR if ws == 2 else Path.IN_FRAMES
    assert gloo("all_reduce", 4, ws) is small
    assert gloo("all_reduce", limit, ws) is small
    assert gloo("all_reduce", limit, ws, cpu=False) is Path.IN_FRAMES  # cached rounds need CPU frames
    if ws == 2:  # past the frames: one exchange of whole tensors up to 6 MB, then the ring
        assert gloo("all_reduce", limit + 1, ws) is Path.EXCHANGE
        assert gloo("all_reduce", 6 * MB, ws) is Path.EXCHANGE
        assert gloo("all_reduce", 6 * MB + 1, ws) is Path.RING
    else:
        assert gloo("all_reduce", limit + 1, ws) is Path.RING
    assert gloo("all_reduce", 64 * MB, ws) is Path.RING


@pytest.mark.parametrize("ws", [2, 3, 8])
def test_on_nccl_frames_hold_64_kb_and_nothing_is_cached(ws):
    for op in ("all_reduce", "broadcast", "reduce"):  # one share per frame
        assert nccl(op, 64 * KB, ws) is Path.IN_FRAMES
    assert nccl("all_reduce", 64 * KB + 1, ws) is Path.RING  # no exchange: gloo only
    assert nccl("broadcast", 64 * KB + 1, ws) is Path.CHAIN  # no direct broadcast: gloo only
    assert nccl("reduce", 64 * KB + 1, ws) is Path.CHAIN
    share = 64 * KB if ws == 2 else 64 * KB // (ws - 1)  # the hub's down frame holds ws - 1 shares
    assert nccl("all_gather", share, ws) is Path.IN_FRAMES
    assert nccl("all_gather", share + 1, ws) is Path.RING
    assert nccl("gather", share + 1, ws) is Path.DIRECT
    share = 64 * KB if ws == 2 else 64 * KB // ws  # the hub's up frames hold whole inputs: ws shares
    assert nccl("reduce_scatter", share, ws) is Path.IN_FRAMES
    assert nccl("reduce_scatter", share + 1, ws) is Path.RING
    assert nccl("scatter", share, ws) is Path.IN_FRAMES
    assert nccl("scatter", share + 1, ws) is Path.DIRECT


@pytest.mark.parametrize(("ws", "limit"), [(2, 3 * MB), (3, 3 * MB // 2), (8, 3 * MB // 7)])
def test_all_gather_and_gather_on_gloo(ws, limit):
    share = limit if ws == 2 else limit // (ws - 1)
    if ws == 2:  # all_gather also leaves the frames from 1 MB per rank (its ring receives in place)
        assert gloo("all_gather", MB - 1, ws) is Path.PAIR
        assert gloo("all_gather", MB - 1, ws, cpu=False) is Path.IN_FRAMES
        assert gloo("all_gather", MB, ws) is Path.RING
    else:
        assert gloo("all_gather", min(share, MB - 1), ws) is Path.IN_FRAMES
        assert gloo("all_gather", share + 1, ws) is Path.RING
    assert gloo("gather", share, ws) is Path.IN_FRAMES  # gather has no in-place rule
    assert gloo("gather", share + 1, ws) is Path.DIRECT


@pytest.mark.parametrize(("ws", "limit"), [(2, 3 * MB), (3, 3 * MB // 2), (8, 3 * MB // 7)])
def test_reduce_scatter_and_scatter_on_gloo(ws, limit):
    share = limit if ws == 2 else limit // ws
    assert gloo("scatter", share, ws) is Path.IN_FRAMES  # no cached round for it
    assert gloo("scatter", share + 1, ws) is Path.DIRECT
    # reduce_scatter also leaves the frames from 1 MB per rank (its ring reads the input in place)
    assert gloo("reduce_scatter", min(share, MB - 1), ws) is Path.IN_FRAMES
    assert gloo("reduce_scatter", min(share + 1, MB), ws) is Path.RING


@pytest.mark.parametrize("ws", [2, 3, 8])
def test_broadcast_and_reduce_on_gloo(ws):
    small, limit = Path.PAIR if ws == 2 else Path.STAR, 3 * MB // (ws - 1)
    largest = min(MB - 1, limit)  # broadcast also leaves the frames from 1 MB (its bulk path receives in place)
    assert gloo("broadcast", 4, ws) is small
    assert gloo("broadcast", largest, ws) is small
    assert gloo("broadcast", largest, ws, cpu=False) is Path.IN_FRAMES
    if ws == 2:
        assert gloo("broadcast", MB, ws) is Path.CHAIN
    else:  # straight from the root up to 8 MB, the chain past it
        assert gloo("broadcast", MB, ws) is Path.DIRECT
        assert gloo("broadcast", 8 * MB, ws) is Path.DIRECT
        assert gloo("broadcast", 8 * MB + 1, ws) is Path.CHAIN
        assert gloo("broadcast", largest + 1, ws) is Path.DIRECT
    assert gloo("reduce", limit, ws) is Path.IN_FRAMES  # reduce: no cached round, no in-place rule
    assert gloo("reduce", limit + 1, ws) is Path.CHAIN


def test_every_op_and_size_gets_one_path_and_in_frames_paths_fit_the_frames():
    for backend in ("gloo", "nccl"):
        for ws in (2, 3, 4, 5, 8):
            frame = plan.inline_limit_for(ws, backend == "gloo")
            for op in ALL_OPS:
                for nbytes in (1, 4 * KB, 64 * KB, 65 * KB, MB, 3 * MB, 7 * MB, 64 * MB):
                    path = plan.plan(op, nbytes, ws, backend)
                    assert isinstance(path, Path)
                    if path.in_frames:
                        assert plan.largest_frame_bytes(op, nbytes, ws) <= frame
                    if path in (Path.PAIR, Path.EXCHANGE):
                        assert ws == 2 and backend == "gloo"
                    if path is Path.STAR:
                        assert ws > 2 and backend == "gloo" and op == "broadcast"


def test_the_plan_follows_the_thresholds_as_set(monkeypatch):
    monkeypatch.setattr(plan, "INLINE_SEND_BYTES", 0)
    monkeypatch.setattr(plan, "INLINE_MAX_BYTES", 1024)
    assert gloo("all_reduce", 1024, 2) is Path.PAIR
    assert gloo("all_reduce", 1025, 2) is Path.EXCHANGE
    monkeypatch.setattr(plan, "EXCHANGE_MAX_BYTES", 0)
    assert gloo("all_reduce", 1025, 2) is Path.RING
    monkeypatch.setattr(plan, "BULK_FROM_BYTES", 16)
    assert gloo("broadcast", 15, 3) is Path.STAR
    assert gloo("broadcast", 16, 3) is Path.DIRECT
    monkeypatch.setattr(plan, "DIRECT_BROADCAST_MAX_BYTES", 0)
    assert gloo("broadcast", 16, 3) is Path.CHAIN


def test_header_round_path_and_bad_arguments():
    assert plan.header_round_path(2, "gloo") is Path.PAIR
    assert plan.header_round_path(2, "gloo", cpu=False) is Path.IN_FRAMES
    assert plan.header_round_path(3, "gloo") is Path.IN_FRAMES
    assert plan.header_round_path(2, "nccl") is Path.IN_FRAMES
    with pytest.raises(ValueError, match="no plan for op 'all_to_all'"):
        plan.plan("all_to_all", 4, 2, "gloo")
    with pytest.raises(ValueError, match="backend must be one of"):
        plan.plan("all_reduce", 4, 2, "mpi")


def test_early_bytes():
    assert plan.early_bytes(64 * KB - 1, gloo=True) == 0
    assert plan.early_bytes(64 * KB, gloo=True) == 64 * KB
    assert plan.early_bytes(3 * MB, gloo=True) == 2 * MB  # the largest power of two within
    assert plan.early_bytes(64 * MB, gloo=True) == 4 * MB
    assert plan.early_bytes(64 * MB, gloo=False) == 0  # nccl matches by order: nothing goes early


# --- the α–β model's choices (cost_model) ---------------------------------------------------------

SIZES = [1 << e for e in range(2, 27)] + [3 << e for e in range(1, 25)]


def test_the_model_is_off_up_to_4_ranks_and_on_nccl(monkeypatch):
    """At 2-4 ranks the measured fixed paths were as fast or faster (docs/comm.md): never a new path."""
    monkeypatch.setattr(plan, "MODEL_FROM_WORLD_SIZE", MODEL_FROM)
    assert MODEL_FROM == 5
    for op in ALL_OPS:
        for nbytes in SIZES:
            for ws in (2, 3, 4):
                assert gloo(op, nbytes, ws) not in NEW
            for ws in (5, 8, 16, 64):
                assert nccl(op, nbytes, ws) not in NEW


@pytest.mark.parametrize("ws", [5, 6, 7, 8, 12, 16])
def test_from_5_ranks_plan_takes_the_models_cheapest(monkeypatch, ws):
    monkeypatch.setattr(plan, "MODEL_FROM_WORLD_SIZE", MODEL_FROM)
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        for nbytes in SIZES:
            path = gloo(op, nbytes, ws)
            with monkeypatch.context() as m:
                m.setattr(plan, "MODEL_FROM_WORLD_SIZE", 10**9)
                old = gloo(op, nbytes, ws)
            options = [old, *({"broadcast": (Path.TREE, Path.SCATTER_ALLGATHER)}.get(op, (Path.HALVING_DOUBLING,)))]
            costs = {p: cost_model.cost(p.name, op, nbytes, ws) for p in options}
            assert costs[path] == min(costs.values()), (op, nbytes, path, costs)
            assert path is old or costs[path] < costs[old]  # a tie keeps the old path


def test_the_models_crossovers(monkeypatch):
    """Sizes spelled out (the fitted α = 228 µs, β = 0.48 ns/B): a changed fit or formula fails here."""
    monkeypatch.setattr(plan, "MODEL_FROM_WORLD_SIZE", MODEL_FROM)
    assert gloo("all_reduce", 256 * KB, 8) is Path.IN_FRAMES
    assert gloo("all_reduce", 384 * KB, 8) is Path.HALVING_DOUBLING  # the star's hub moves 14 shares
    assert gloo("all_reduce", 64 * MB, 8) is Path.HALVING_DOUBLING  # same bytes as the ring, 8 steps fewer
    assert gloo("all_reduce", 768 * KB, 6) is Path.HALVING_DOUBLING
    assert gloo("all_reduce", 1536 * KB, 6) is Path.RING  # the fold's extra bytes outweigh 4 steps
    assert gloo("all_reduce", 1 * MB, 5) is Path.RING
    assert gloo("all_gather", 32 * KB, 8) is Path.IN_FRAMES
    assert gloo("all_gather", 48 * KB, 8) is Path.HALVING_DOUBLING
    assert gloo("all_gather", 192 * KB, 6) is Path.RING
    assert gloo("reduce_scatter", 32 * KB, 8) is Path.HALVING_DOUBLING
    assert gloo("reduce_scatter", 24 * KB, 8) is Path.IN_FRAMES
    assert gloo("broadcast", 256 * KB, 8) is Path.STAR
    assert gloo("broadcast", 384 * KB, 8) is Path.SCATTER_ALLGATHER
    assert gloo("broadcast", 64 * MB, 8) is Path.SCATTER_ALLGATHER
    assert gloo("broadcast", 192 * KB, 16) is Path.TREE
    assert gloo("broadcast", 768 * KB, 5) is Path.TREE
    assert gloo("broadcast", 1 * MB, 5) is Path.SCATTER_ALLGATHER
    assert gloo("broadcast", 12 * MB, 5) is Path.CHAIN
    for op in ("reduce", "scatter", "gather"):  # no new path for these
        assert gloo(op, 64 * MB, 16) not in NEW


def test_forced_paths_and_the_environment(monkeypatch):
    monkeypatch.setattr(plan, "FORCED", {"all_reduce": Path.HALVING_DOUBLING})
    assert gloo("all_reduce", 4, 2) is Path.HALVING_DOUBLING
    assert gloo("all_reduce", 0, 2) is Path.HEADER_ONLY  # no data, or one rank: nothing to force
    assert gloo("all_reduce", 4, 1) is Path.LOCAL
    assert nccl("all_reduce", 4, 8) is Path.IN_FRAMES  # gloo only
    plan.FORCED["broadcast"] = Path.TREE
    assert gloo("broadcast", 4, 3) is Path.TREE
    monkeypatch.setenv("NANODDP_COMM_FORCE", "all_gather=HALVING_DOUBLING, broadcast=SCATTER_ALLGATHER")
    assert plan._forced_from_env() == {"all_gather": Path.HALVING_DOUBLING, "broadcast": Path.SCATTER_ALLGATHER}


def test_the_fit_recovers_alpha_and_beta():
    alpha, beta = 123e-6, 0.7e-9
    samples = [
        (path, op, nbytes, n, cost_model.cost(path, op, nbytes, n, alpha, beta))
        for path, op in (("RING", "all_reduce"), ("HALVING_DOUBLING", "all_gather"), ("TREE", "broadcast"))
        for nbytes in (4 * KB, MB, 16 * MB)
        for n in (2, 4)
    ]
    fitted = cost_model.fit(samples)
    assert fitted == pytest.approx((alpha, beta), rel=1e-9)


def test_the_cost_shapes():
    assert cost_model.shape("RING", "all_reduce", 1000, 8) == (2 + 14, 4 * 7 / 8 * 1000)
    assert cost_model.shape("HALVING_DOUBLING", "all_reduce", 1000, 8) == (2 + 6, 4 * 7 / 8 * 1000)
    assert cost_model.shape("HALVING_DOUBLING", "all_reduce", 1000, 6) == (2 + 4 + 2, 3000 + 2000)  # p = 4, fold
    assert cost_model.shape("TREE", "broadcast", 1000, 5) == (2 + 3, 3000)
    assert cost_model.shape("SCATTER_ALLGATHER", "broadcast", 1000, 8) == (2 + 1 + 3, 2 * 7 / 8 * 1000)
    assert cost_model.shape("IN_FRAMES", "all_reduce", 1000, 8) == (2, 14000)
    assert cost_model.shape("PAIR", "all_reduce", 1000, 2) == (1, 2000)
    with pytest.raises(ValueError, match="no cost"):
        cost_model.shape("LOCAL", "all_reduce", 1, 2)
