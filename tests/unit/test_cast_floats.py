"""`nanoddp.parallel.tensors.cast_floats` casts what torch's own mixed precision casts.

The references are torch's two input casts, run on the same structures: DDP's
`_cast_forward_inputs` and FSDP2's `_cast_fp_tensor` applied through `_apply_to_tensors`.
Both are compared container by container (the same class, the same keys, every tensor with the
same dtype and values, an untouched tensor the very same object).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict, namedtuple
from typing import Any

import pytest
import torch
from torch.distributed.fsdp._fully_shard._fsdp_common import _cast_fp_tensor
from torch.distributed.utils import _apply_to_tensors, _cast_forward_inputs
from torch.nn.utils.rnn import pack_sequence

from nanoddp.parallel.tensors import cast_floats

Pair = namedtuple("Pair", ["x", "mask"])


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    ids: torch.Tensor
    extra: Any = None


class Tagged(dict):
    """A dict subclass (as a tokenizer's batch is): torch hands back a plain dict."""


def _inputs() -> dict[str, Any]:
    x, ids = torch.randn(2, 3), torch.arange(4)
    return {
        "namedtuple": Pair(x, ids),
        "dataclass": Batch(x, ids, extra=[torch.randn(2, dtype=torch.float64), 3]),
        "ordered_dict": OrderedDict(a=x, b=(ids, x)),
        "dict_subclass": Tagged(a=x, b=ids),
        "nested": [(x, {"k": Pair(x, ids)}), x.to(torch.bfloat16)],
        "packed_sequence": pack_sequence([torch.randn(3), torch.randn(2)]),
        "plain_tensor": x,
        "no_float": (ids, "text", None),
    }


def _assert_same(ours: Any, theirs: Any, original: Any) -> None:
    assert type(ours) is type(theirs), (type(ours), type(theirs))
    if isinstance(theirs, torch.Tensor):
        assert ours.dtype == theirs.dtype
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)  # the same cast: bitwise
        assert (ours is original) == (theirs is original)  # no copy where torch makes none
    elif dataclasses.is_dataclass(theirs):
        for f in dataclasses.fields(theirs):
            _assert_same(getattr(ours, f.name), getattr(theirs, f.name), getattr(original, f.name))
    elif isinstance(theirs, dict):
        assert list(ours) == list(theirs)
        for key in theirs:
            _assert_same(ours[key], theirs[key], original[key])
    elif isinstance(theirs, (tuple, list)):
        assert len(ours) == len(theirs)
        for a, b, o in zip(ours, theirs, original, strict=True):
            _assert_same(a, b, o)
    else:
        assert ours == theirs


@pytest.mark.parametrize("case", list(_inputs()))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cast_floats_matches_torch_ddp_input_cast(case: str, dtype: torch.dtype) -> None:
    value = _inputs()[case]
    (theirs,), _ = _cast_forward_inputs(dtype, value)
    _assert_same(cast_floats(value, dtype), theirs, value)


@pytest.mark.parametrize("case", list(_inputs()))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cast_floats_matches_torch_fsdp2_cast(case: str, dtype: torch.dtype) -> None:
    value = _inputs()[case]
    theirs = _apply_to_tensors(functools.partial(_cast_fp_tensor, dtype), value)
    _assert_same(cast_floats(value, dtype), theirs, value)


def test_cast_floats_none_is_the_object_itself() -> None:
    value = _inputs()
    assert cast_floats(value, None) is value
