"""The wire codes of `nanoddp.comm`: how a header names a collective, a dtype and an op.

Why it exists: a header is a row of ints that every rank compares, so the code for each
collective, dtype and op must be the same on every rank and readable back into words for the
error message when ranks disagree.
"""

from __future__ import annotations

import torch

DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
)  # fmt: skip
DTYPE_CODES = {dtype: code for code, dtype in enumerate(DTYPES)}
COLLECTIVES = (
    "all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "scatter", "gather", "all_to_all", "barrier",
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
)  # fmt: skip
OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX")
