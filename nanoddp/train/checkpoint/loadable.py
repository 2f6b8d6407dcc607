"""Values in the form `torch.load(weights_only=True)` reads back, or a TypeError saying where.

Why: weights_only loading is the only safe way to read a checkpoint, and it refuses numpy and
most Python classes. So `save_state` converts what has a safe form (numpy scalars to Python
numbers, arrays to tensors) and refuses the rest before anything is written, naming where the
value sits, rather than write a file that can never be loaded.
"""

from __future__ import annotations

import collections
import copy
from typing import Any

import torch

# Types `torch.load(weights_only=True)` rebuilds (torch._weights_only_unpickler's allowlist).
_ATOMS = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.Size, torch.device, torch.dtype)
_CONTAINERS = (dict, collections.OrderedDict, collections.Counter, list, tuple, set)


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _from_numpy(value: Any, where: str) -> Any:
    """A numpy scalar as a Python number, an array as a tensor; other values unchanged."""
    try:
        import numpy as np
    except ImportError:
        return value
    if isinstance(value, np.generic):
        item = value.item()
        if type(item) in _ATOMS:
            return item
        raise TypeError(
            f"save_state: {where} is a {_type_name(value)}, which torch.load(weights_only=True) cannot "
            "read back; store it as a number, a string or a tensor"
        )
    if isinstance(value, np.ndarray) and not isinstance(value, np.ma.MaskedArray):
        try:
            return torch.from_numpy(np.ascontiguousarray(value)).clone()
        except TypeError:
            raise TypeError(
                f"save_state: {where} is a numpy array of dtype {value.dtype}, which has no tensor form and "
                "torch.load(weights_only=True) cannot read back; store it as a list or a numeric array"
            ) from None
    return value


def convert(value: Any, where: str) -> Any:
    """`value` in a form `torch.load(weights_only=True)` reads back; TypeError naming `where` if
    there is none. Returns `value` itself when nothing changed (keeps a state_dict's _metadata)."""
    value = _from_numpy(value, where)
    kind = type(value)
    if kind in _ATOMS or kind in (torch.Tensor, torch.nn.Parameter):
        return value
    if kind in _CONTAINERS:
        if isinstance(value, dict):
            items = [(convert(k, f"{where} (a key)"), convert(v, f"{where}[{k!r}]")) for k, v in value.items()]
            if all(k is k0 and v is v0 for (k, v), (k0, v0) in zip(items, value.items(), strict=True)):
                return value
            converted = copy.copy(value)  # same class and attributes (a state_dict's _metadata)
            converted.clear()
            converted.update(items)
            return converted
        where_item = (lambda i: f"{where} (an element)") if kind is set else (lambda i: f"{where}[{i}]")
        items = [convert(v, where_item(i)) for i, v in enumerate(value)]
        return value if all(a is b for a, b in zip(items, value, strict=True)) else kind(items)
    if kind in torch.serialization.get_safe_globals():  # allowed by the user: their responsibility
        return value
    raise TypeError(
        f"save_state: {where} is a {_type_name(value)}, which torch.load(weights_only=True) cannot read "
        "back; store plain values (numbers, strings, tensors, lists and dicts of them) instead, or allow "
        "the class with torch.serialization.add_safe_globals"
    )
