"""Which path a collective takes: `plan(op, nbytes, world_size, backend) -> Path`, from one table.

Why it exists: the choice between carrying a message inside the header round's frames and
running a bulk algorithm after it (and which one) depends on the message size, the group size
and the backend only, and must be made the same way on every rank, by the collectives and by
anything that reports what they do (`nanoddp bench collectives` prints `plan()`'s answer). So
every switch point is a constant below, with the reason it exists beside it. Between the
algorithms whose cost depends on the group size (halving/doubling, the binomial tree, scatter +
all-gather) the α–β model in `cost_model` chooses, so the choice is explained rather than tuned
(docs/comm.md, "How plan() chooses: the α–β model").

This module is a table and a pure function: it imports nothing of the layers above it, and the
algorithms read their piece sizes from it. Tests shrink the thresholds by setting these module
attributes; every call asks `plan()` again, and the frames follow the inline limits
(`wire.buffers`).

`nbytes` is one rank's share: its tensor for all_reduce, broadcast, reduce, all_gather, gather
and scatter; its output for reduce_scatter.
"""

from __future__ import annotations

import enum
import os

from nanoddp.comm.plan import cost_model

# --- the table ----------------------------------------------------------------------------------
# Largest frame payload on nccl, and the floor on gloo: nccl frames travel whole (exact receive
# sizes), so a large frame costs its full size on every call.
INLINE_MAX_BYTES = 64 * 1024
# gloo: a payload rides in the frames while what one rank sends in that round stays within this
# (3 MB at ws 2, 1.5 MB at ws 3, 1 MB at ws 4): on a CPU host a round trip costs far more than its
# bytes, and the ring needs 2(ws-1) of them plus the header round.
INLINE_SEND_BYTES = 3 * 1024 * 1024
# all_gather, broadcast and reduce_scatter leave the frames from this share on gloo: their bulk
# paths send straight from the tensor (reduce_scatter's ring reads its input where it lies), where
# the frames copy each share in and out and keep frame rows of that size resident.
IN_PLACE_BULK_OPS = ("all_gather", "broadcast", "reduce_scatter")
BULK_FROM_BYTES = 1024 * 1024
# Pipelining granularity, two pieces per chunk within these bounds: each piece costs a gloo send
# and receive, so small pieces cost more than the overlap they buy, large ones pipeline too coarsely.
PIECE_MIN_BYTES = 1024 * 1024
PIECE_MAX_BYTES = 4 * 1024 * 1024
# all_reduce on 2 gloo ranks past the frames and up to this size is one exchange of whole tensors:
# the ring's two dependent exchanges with a reduction between them cost more there.
EXCHANGE_MAX_BYTES = 6 * 1024 * 1024
# broadcast on 3+ gloo ranks past the frames and up to this size goes straight from the root: the
# chain's n-1 hops each wait for a whole piece. Above it the chain sends each byte from the root once.
DIRECT_BROADCAST_MAX_BYTES = 8 * 1024 * 1024
# The first piece of a bulk message goes out with the header round (`early_bytes`): a power of
# two within these bounds; below the floor the copies it saves are not what costs.
EARLY_MIN_BYTES = 64 * 1024
EARLY_MAX_BYTES = 4 * 1024 * 1024
# Halving/doubling, the binomial tree and scatter + all-gather are considered on gloo from this
# many ranks: at 2-4 ranks the fixed paths measured as fast or faster at every size
# (docs/comm.md, "How plan() chooses: the α–β model"); above, `cost_model` picks by size.
MODEL_FROM_WORLD_SIZE = 5
# An explicit path per op, for tests and for benchmarking a path where plan() would not choose it
# (gloo only; e.g. NANODDP_COMM_FORCE="all_reduce=HALVING_DOUBLING,broadcast=TREE").
FORCED: dict[str, Path] = {}

# --- the paths ----------------------------------------------------------------------------------


class Path(enum.Enum):
    """How one call moves its data (each member says where it is run)."""

    LOCAL = "one rank: the result is computed locally, nothing is sent"
    HEADER_ONLY = "no data (numel 0): the header round alone"
    IN_FRAMES = "data in the header round's frames (header_round.one_round)"
    PAIR = "data in the frames, 2 gloo ranks, by a round prepared for the signature (cached_rounds.PairRound)"
    STAR = "broadcast in the frames, 3+ gloo ranks, by a star prepared for the signature (cached_rounds.StarBroadcast)"
    EXCHANGE = "header round, then one exchange of whole tensors (exchange.py)"
    RING = "header round, then the pipelined ring (ring.py)"
    CHAIN = "header round, then the pipelined chain from or to the root (chain.py)"
    DIRECT = "header round, then the root sends to or receives from every rank itself (chain.py, rooted.py)"
    HALVING_DOUBLING = "header round, then recursive halving and/or doubling (halving_doubling.py)"
    TREE = "broadcast: header round, then a binomial tree from the root (tree.py)"
    SCATTER_ALLGATHER = "broadcast: header round, then scatter + all-gather by doubling (van_de_geijn.py)"

    @property
    def in_frames(self) -> bool:
        return self in (Path.IN_FRAMES, Path.PAIR, Path.STAR)


OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "scatter", "gather")
BACKENDS = ("gloo", "nccl")

# What a call too large for the frames runs (all_reduce and broadcast have two, see `plan`).
_BULK = {
    "all_reduce": Path.RING,
    "all_gather": Path.RING,
    "reduce_scatter": Path.RING,
    "broadcast": Path.CHAIN,
    "reduce": Path.CHAIN,
    "scatter": Path.DIRECT,
    "gather": Path.DIRECT,
}
# Which collectives have a prepared round for their frames, by group size (2: PAIR; 3+: STAR); empty
# tuples (and `header_round_path` giving IN_FRAMES) turn the optional cached_rounds layer off.
_CACHED_PAIR = ("all_reduce", "all_gather", "broadcast")
_CACHED_STAR = ("broadcast",)
# What the α–β model may choose instead, on gloo from MODEL_FROM_WORLD_SIZE ranks.
_MODEL = {
    "all_reduce": (Path.HALVING_DOUBLING,),
    "all_gather": (Path.HALVING_DOUBLING,),
    "reduce_scatter": (Path.HALVING_DOUBLING,),
    "broadcast": (Path.TREE, Path.SCATTER_ALLGATHER),
}


def plan(op: str, nbytes: int, world_size: int, backend: str, *, cpu: bool = True) -> Path:
    """The path of an `op` call with `nbytes` per rank on `world_size` ranks of `backend`.

    `cpu`: whether the frames live in CPU memory (the prepared rounds write their header slots
    through numpy, so they run there only). The one place that chooses a prepared round."""
    if op not in _BULK:
        raise ValueError(f"no plan for op {op!r}; choose from {list(OPS)}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    gloo = backend == "gloo"
    if world_size == 1:
        return Path.LOCAL
    if nbytes == 0:
        return Path.HEADER_ONLY
    if gloo and op in FORCED:
        return FORCED[op]
    fixed = _fixed_plan(op, nbytes, world_size, gloo, cpu)
    if not gloo or world_size < MODEL_FROM_WORLD_SIZE or op not in _MODEL:
        return fixed
    best, best_cost = fixed, cost_model.cost(fixed.name, op, nbytes, world_size)
    for path in _MODEL[op]:
        if (c := cost_model.cost(path.name, op, nbytes, world_size)) < best_cost:
            best, best_cost = path, c
    return best


def _fixed_plan(op: str, nbytes: int, world_size: int, gloo: bool, cpu: bool) -> Path:
    """The frames, or the bulk algorithm that the fixed thresholds pick."""
    if rides_in_frames(op, nbytes, world_size, gloo):
        if gloo and cpu and world_size == 2 and op in _CACHED_PAIR:
            return Path.PAIR
        if gloo and cpu and world_size > 2 and op in _CACHED_STAR:
            return Path.STAR
        return Path.IN_FRAMES
    if op == "all_reduce" and gloo and world_size == 2 and nbytes <= EXCHANGE_MAX_BYTES:
        return Path.EXCHANGE
    if op == "broadcast" and gloo and world_size > 2 and nbytes <= DIRECT_BROADCAST_MAX_BYTES:
        return Path.DIRECT
    return _BULK[op]


def _forced_from_env() -> dict[str, Path]:
    spec = os.environ.get("NANODDP_COMM_FORCE", "")
    pairs = [item.split("=", 1) for item in spec.split(",") if item.strip()]
    return {op.strip(): Path[name.strip()] for op, name in pairs}


FORCED.update(_forced_from_env())


def header_round_path(world_size: int, backend: str, *, cpu: bool = True) -> Path:
    """How a header round without data runs (before a bulk phase, a barrier): by the prepared pair
    round at 2 gloo ranks with frames on CPU (a frame of header slots only, made once), else the
    general round."""
    return Path.PAIR if world_size == 2 and backend == "gloo" and cpu else Path.IN_FRAMES


# --- the frames' limit ----------------------------------------------------------------------------

# How many ranks' worth of data the largest frame of a one-round collective holds, in the star
# (3+ ranks): rank 0 sends all_gather/gather results holding every other rank's data, and gets
# whole reduce_scatter/scatter inputs. With 2 ranks every frame holds one rank's share.
_STAR_SHARES = {
    "all_gather": lambda n: n - 1,
    "gather": lambda n: n - 1,
    "reduce_scatter": lambda n: n,
    "scatter": lambda n: n,
}


def inline_limit_for(world_size: int, gloo: bool) -> int:
    """Largest per-peer payload (bytes) that rides in a frame on a group of `world_size` ranks
    (gloo: what one rank sends in all stays under INLINE_SEND_BYTES; nccl: INLINE_MAX_BYTES)."""
    if not gloo:
        return INLINE_MAX_BYTES
    per_peer = INLINE_SEND_BYTES // (world_size - 1) if world_size > 2 else INLINE_SEND_BYTES
    return per_peer if per_peer > INLINE_MAX_BYTES else INLINE_MAX_BYTES  # no max(): runs every call


def largest_frame_bytes(op: str, share_bytes: int, world_size: int) -> int:
    """Payload bytes of the largest frame a one-round `op` moves when each rank's share is `share_bytes`."""
    if world_size <= 2 or op not in _STAR_SHARES:
        return share_bytes
    return _STAR_SHARES[op](world_size) * share_bytes


def rides_in_frames(op: str, share_bytes: int, world_size: int, gloo: bool) -> bool:
    """Whether a one-round `op` with `share_bytes` per rank carries its data in the frames."""
    if gloo and op in IN_PLACE_BULK_OPS and share_bytes >= BULK_FROM_BYTES:
        return False
    largest = share_bytes if world_size <= 2 else largest_frame_bytes(op, share_bytes, world_size)
    return largest <= inline_limit_for(world_size, gloo)


def early_bytes(nbytes: int, gloo: bool) -> int:
    """How many leading bytes of an `nbytes` bulk message go out *with* the header round, before
    its verdict: the largest power of two <= nbytes, at most EARLY_MAX_BYTES; 0 below
    EARLY_MIN_BYTES and on nccl (which matches messages by order, so nothing may overtake the
    header's frames).

    Sending data before the ranks know they agree is safe because of the size: gloo aborts the
    process when a message is larger than the receive it lands in, and this piece's tag names its
    size (`Peers.early_tag`), so it can only meet a receive of exactly its size. If the ranks
    disagree, the round raises on every rank, and every rank settles what it posted before the
    verdict (`nanoddp.comm.protocol.settle`): a matched early piece lands, an unmatched one is taken or
    filled with nothing, so gloo is left holding none of it."""
    if not gloo or nbytes < EARLY_MIN_BYTES:
        return 0
    return min(1 << (nbytes.bit_length() - 1), EARLY_MAX_BYTES)
