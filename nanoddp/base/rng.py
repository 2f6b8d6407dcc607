"""Every random number generator a training step may draw from, captured and restored as one.

A resumed rank (from a snapshot) and a healed rank (from a live peer) must continue with the
same draws as the run they rejoin, so both take and put back the same list of generators:
Python's `random`, numpy's legacy global generator, torch's CPU generator and every CUDA
device's. The state is kept in a form `torch.load(weights_only=True)` accepts (numpy's keys as
a torch tensor) and that survives a trip through plain containers (tuples may come back lists).
"""

from __future__ import annotations

import random
from typing import Any

import torch


def capture_rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from: python, numpy, torch CPU and CUDA."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        legacy = np.random.get_state()  # legacy=True, the default: MT19937's 5-tuple, never the dict
        assert isinstance(legacy, tuple)
        kind, keys, pos, has_gauss, cached = legacy
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached)
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of `capture_rng_state`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
