"""A state's tensors moved as one flat tensor per dtype: what a joiner's transfer sends.

Why: torchft's `PGTransport` sends a state dict's tensors one at a time and waits for each
before the next. The built-in GPT's weights and AdamW state are 176 tensors (39 MB), and
those round trips, not the bytes, made most of a joiner's heal: 0.29 s on the 2-core VM, a
quarter of what a failure held the survivors up. Packed, the same bytes go as one tensor per
dtype (`docs/ft.md`, "What a failure costs, measured").

`pack` copies every plain tensor of a nested state (dicts, lists and tuples of anything) into
the flat tensor of its dtype and device, and leaves a `Slot` where it was; `unpack` gives each
slot its own tensor again (a copy: a tensor the optimizer keeps must not pin the whole transfer
buffer). The bytes are copied as they are, so the state arrives bitwise equal. Tensor subclasses
(a DTensor) stay where they are: the transport moves them itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

FLAT_KEY = "nanoddp_packed"  # the packed state: {FLAT_KEY: [flat tensors], "tree": the rest, slots included}


@dataclass(frozen=True)
class Slot:
    """Where one tensor of the state was: its span in flat tensor `flat` and its shape."""

    flat: int
    start: int
    numel: int
    shape: tuple[int, ...]


def pack(state: Any) -> dict[str, Any]:
    """`state` with every plain tensor copied into one flat tensor per (dtype, device)."""
    pieces: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    filled: dict[tuple[torch.dtype, torch.device], int] = {}

    def slot_for(tensor: torch.Tensor) -> Slot:
        key = (tensor.dtype, tensor.device)
        flat = list(pieces).index(key) if key in pieces else len(pieces)
        start = filled.get(key, 0)
        pieces.setdefault(key, []).append(tensor.detach().reshape(-1))
        filled[key] = start + tensor.numel()
        return Slot(flat, start, tensor.numel(), tuple(tensor.shape))

    tree = _map_tensors(state, slot_for)
    return {FLAT_KEY: [torch.cat(parts) for parts in pieces.values()], "tree": tree}


def unpack(packed: dict[str, Any]) -> Any:
    """The state `pack` was given, each tensor a tensor of its own again."""
    flats: list[torch.Tensor] = packed[FLAT_KEY]

    def tensor_for(slot: Slot) -> torch.Tensor:
        return flats[slot.flat][slot.start : slot.start + slot.numel].view(slot.shape).clone()

    return _map_slots(packed["tree"], tensor_for)


def _map_tensors(node: Any, fn: Any) -> Any:
    if type(node) in (torch.Tensor, torch.nn.Parameter):  # another subclass (DTensor) is the transport's to move
        return fn(node)
    return _map_children(node, lambda child: _map_tensors(child, fn))


def _map_slots(node: Any, fn: Any) -> Any:
    if isinstance(node, Slot):
        return fn(node)
    return _map_children(node, lambda child: _map_slots(child, fn))


def _map_children(node: Any, fn: Any) -> Any:
    """`node` with `fn` applied to each child of a dict, list or tuple (its type kept); any other
    leaf as it is."""
    if isinstance(node, dict):
        return type(node)((key, fn(value)) for key, value in node.items())
    if isinstance(node, list):
        return [fn(value) for value in node]
    if isinstance(node, tuple) and not hasattr(node, "_fields"):
        return tuple(fn(value) for value in node)
    if isinstance(node, tuple):  # a namedtuple: its fields by position
        return type(node)(*(fn(value) for value in node))
    return node
