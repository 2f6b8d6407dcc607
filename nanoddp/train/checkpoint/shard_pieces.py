"""Where one rank's piece of a sharded tensor lies in the whole tensor, and rebuilding any
piece from the pieces the saving ranks held.

Why one description for every engine: a DTensor sharded `Shard(0)` (torch's `fully_shard`,
ours) holds whole rows, i.e. one contiguous range of the flattened tensor; a ZeRO-2 flat shard
holds a range of the flattened parameter too; a replicated tensor is the range of all of it.
So a piece is saved as the element range [start, stop) of the flattened whole tensor, and
loading at another world size, across engines, or into a plain model is one piece of
arithmetic: the new piece's range, filled from the saved ranges that overlap it, reading only
the ranks that hold them. A piece that is not a range (`Shard(1)`: a block of columns) is kept
as its box (offset, size) and loads back only into the same box (same world size and
placements): said in one line naming the tensor, never guessed.

Pieces are plain tuples, so a manifest holding them loads under `weights_only=True`:
`("range", start, stop)` or `("box", offset, size)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

Piece = tuple[Any, ...]


def whole_piece(shape: tuple[int, ...]) -> Piece:
    """All of a tensor of `shape`: what a plain (unsharded) tensor holds."""
    return ("range", 0, math.prod(shape))


def box_piece(shape: tuple[int, ...], offset: tuple[int, ...], size: tuple[int, ...]) -> Piece:
    """The block at `offset` of `size`: a range when it spans whole rows, else a box."""
    if len(shape) == 0:
        return whole_piece(())
    row = math.prod(shape[1:])
    if tuple(size[1:]) == tuple(shape[1:]):
        return ("range", offset[0] * row, (offset[0] + size[0]) * row)
    return ("box", tuple(offset), tuple(size))


def dtensor_piece(t: DTensor, where: str) -> Piece:
    """This rank's piece of DTensor `t`; ValueError naming `where` for placements other than
    Shard/Replicate (Partial values are not a piece of anything yet, strided shards not a block)."""
    # Imported here: only a DTensor comes here ([Note: DTensor on first use]).
    from torch.distributed.tensor import Replicate, Shard

    from nanoddp.parallel.fsdp.state_dict import local_block

    odd = [p for p in t.placements if type(p) not in (Shard, Replicate)]
    if odd:
        raise ValueError(f"{where} is a DTensor placed {tuple(t.placements)}; only Shard and Replicate can be saved")
    size, offset = local_block(t.shape, t.device_mesh, t.placements)
    return box_piece(tuple(t.shape), offset, size)


def piece_numel(piece: Piece) -> int:
    return piece[2] - piece[1] if piece[0] == "range" else math.prod(piece[2])


def assemble(
    where: str,
    dtype: torch.dtype,
    target: Piece,
    saved: list[Piece],
    read: Callable[[int], torch.Tensor],
    prefer: int,
) -> torch.Tensor:
    """The values of `target` (flat for a range, the block for a box) from the saved pieces.

    `saved[r]` is the piece saving rank r held and `read(r)` its local tensor (read lazily: only
    ranks overlapping `target` are read, rank `prefer`, this one, first, so a same-size load
    reads its own file alone). ValueError naming `where` when the saved pieces can't make it.
    """
    if target[0] == "box":
        same = [r for r, piece in enumerate(saved) if piece == target]
        if not same:
            raise ValueError(
                f"{where} was saved in blocks that are not whole rows ({saved}); it loads back only "
                "with the world size and placements that saved it"
            )
        return _checked(where, read(prefer if prefer in same else same[0]), target, prefer)
    _, start, stop = target
    out = torch.empty(stop - start, dtype=dtype)  # (piece numel,)
    candidates = sorted((p[1], r != prefer, r, p) for r, p in enumerate(saved) if p[0] == "range" and p[2] > p[1])
    pos = start
    for lo, _, r, piece in candidates:
        if pos >= stop:
            break
        hi = piece[2]
        if hi <= pos:
            continue
        if lo > pos:
            break
        take = min(hi, stop)
        values = _checked(where, read(r), piece, r).reshape(-1)  # (saved piece numel,)
        out[pos - start : take - start] = values[pos - lo : take - lo]
        pos = take
    if pos < stop:
        boxes = [p for p in saved if p[0] == "box"]
        why = "it was saved in blocks that are not whole rows" if boxes else "no saved shard holds them"
        raise ValueError(f"{where}: elements [{pos}, {stop}) can't be loaded: {why}")
    return out


def _checked(where: str, value: Any, piece: Piece, rank: int) -> torch.Tensor:
    """A saved local tensor, refused if its size is not the manifest's piece (files mixed up)."""
    if not torch.is_tensor(value) or value.numel() != piece_numel(piece):
        got = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
        raise ValueError(f"{where}: rank {rank}'s shard file holds {got}, the manifest says piece {piece}")
    return value
