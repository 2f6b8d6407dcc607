"""How a bulk message is cut into pieces: chunks per rank, pieces per chunk, the early piece.

Why it exists: every bulk algorithm (ring, chain, exchange, direct broadcast) pipelines its data
in pieces, and every rank must cut the same message the same way, or a piece would land in a
receive of another size (gloo aborts the process on a message larger than its receive). So the
cutting rules live in one place, sized by `plan.PIECE_MIN_BYTES`/`PIECE_MAX_BYTES` and
`plan.early_bytes`.
"""

from __future__ import annotations

import torch

from nanoddp.comm.plan import plan
from nanoddp.comm.transport.transport import Peers


def piece_numel(longest: int, itemsize: int) -> int:
    """Elements per piece for chunks of at most `longest` elements (the same on every rank)."""
    nbytes = min(max(-(-longest * itemsize // 2), plan.PIECE_MIN_BYTES), plan.PIECE_MAX_BYTES)
    return max(1, nbytes // itemsize)


def pieces(length: int, step: int) -> list[tuple[int, int]]:
    """[0, length) in pieces of `step` (the last may be shorter)."""
    return [(a, min(a + step, length)) for a in range(0, length, step)]


def pieces_after(length: int, first: int, step: int) -> list[tuple[int, int]]:
    """[0, first) as one piece (if first > 0), then the rest in pieces of `step`."""
    rest = [(first + a, first + b) for a, b in pieces(length - first, step)]
    return [(0, first), *rest] if first else rest


def balanced_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """n contiguous ranges covering [0, numel), sizes differing by at most one."""
    return [(numel * i // n, numel * (i + 1) // n) for i in range(n)]


def message_pieces(peers: Peers, flat: torch.Tensor) -> tuple[int, list[tuple[int, int, int]]]:
    """How one whole message moves (the chain, the 2-rank exchange, the direct broadcast): (early
    elements, pieces as (start, end, tag)). Its early piece (`plan.early_bytes`) comes first under
    the tag naming its size, the rest in pieces of `piece_numel` under this call's first tag."""
    itemsize = flat.element_size()
    early = plan.early_bytes(flat.numel() * itemsize, peers.gloo) // itemsize  # elements
    tag = peers.call_tags()[0]
    cut = [(a, b, tag) for a, b in pieces_after(flat.numel(), early, piece_numel(flat.numel(), itemsize))]
    if early:
        cut[0] = (0, early, peers.early_tag(early * itemsize))
    return early, cut
