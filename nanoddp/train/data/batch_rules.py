"""From a batch to a loss: the rules `nanoddp.Trainer` applies to a model it did not write.

The trainer's loop is the same for every model; only this step differs. The rules are the ones
users bring from Hugging Face and nanoGPT code:

- `loss_fn` given: the batch is `(inputs, target)` and the loss is `loss_fn(model(inputs), target)`;
- a dict batch: `model(**batch)`, and the loss is the output's `.loss` (or `["loss"]`);
- a tuple/list batch: `model(*batch)`; a tensor batch: `model(batch)`;
- the output *is* the loss when it is a scalar tensor, has a `.loss`, or is a tuple ending in a
  scalar (nanoGPT's `logits, loss = model(x, y)`).

Anything else is an error that says which rule to use, not a guess.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn

BatchLoss = Callable[[nn.Module, Any], torch.Tensor]


def batch_len(batch: Any) -> int:
    """Samples in `batch`: the length of its first tensor (dicts, tuples and tensors alike)."""
    if isinstance(batch, torch.Tensor):
        return len(batch)
    values = batch.values() if isinstance(batch, Mapping) else batch
    for value in values:
        if isinstance(value, torch.Tensor):
            return len(value)
    raise TypeError(f"cannot tell the batch size of a {type(batch).__name__} holding no tensor")


def _loss_of(output: Any) -> torch.Tensor:
    """The scalar loss inside a model's output, or a TypeError saying what to return."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)) and output:
        last = output[-1]
        loss = last if isinstance(last, torch.Tensor) and last.dim() == 0 else None
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise TypeError(
            f"the model returned {shape}, not a loss: pass loss_fn=... (called as "
            "loss_fn(model(inputs), target) on (inputs, target) batches), or return a scalar loss, "
            "an object with .loss, or a tuple ending in the loss"
        )
    return loss


def batch_loss_for(loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> BatchLoss:
    """The function the trainer calls as `batch_loss(model, batch)` for these rules."""
    if loss_fn is not None:

        def with_loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise TypeError(
                    f"with loss_fn, each batch must be an (inputs, target) pair, got {type(batch).__name__}"
                    + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else "")
                )
            inputs, target = batch
            return loss_fn(model(inputs), target)

        return with_loss_fn

    def own_loss(model: nn.Module, batch: Any) -> torch.Tensor:
        if isinstance(batch, Mapping):
            return _loss_of(model(**batch))
        if isinstance(batch, (tuple, list)):
            return _loss_of(model(*batch))
        return _loss_of(model(batch))

    return own_loss
