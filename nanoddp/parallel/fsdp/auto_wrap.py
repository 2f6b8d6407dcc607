"""Which submodules get their own `fully_shard` call (an FSDP unit) before the root's.

Why a rule: FSDP gathers one unit at a time, so memory is one unit's whole parameters plus
the shards. Sharding only the root gathers the whole model at once (no better than DDP);
sharding every Linear pays one collective per tiny tensor. The unit that works is the
repeated layer, and which class that is depends on the model:

1. classes named by the user (`names`, e.g. "LlamaDecoderLayer,MyBlock");
2. else the model's own declaration: Hugging Face's `_no_split_modules` (its decoder layer
   classes, also on a model wrapped in another module), or the elements of a `blocks` list
   (nanoddp's GPT and models shaped like it);
3. else size: walking down from the root through the containers without a forward of their
   own (ModuleList, ModuleDict), every child holding at least `min_fraction` of the model's
   parameters (a `Sequential` of blocks: each block).

Units are returned innermost first (a named class may nest in another), siblings in
registration order, so `fully_shard` can be called on them in that order, then on the root.
"""

from __future__ import annotations

import torch.nn as nn

MIN_FRACTION = 0.05  # rule 3: a child holding >= 5 % of the parameters is worth its own all-gather


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def declared_classes(model: nn.Module) -> set[str]:
    """The class names the model declares as its layers (rule 2), or an empty set. A Hugging
    Face model inside a wrapper (nanoddp's SmolLM2 is one) declares them on the inner model."""
    names = {n for m in model.modules() for n in getattr(m, "_no_split_modules", None) or ()}
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        names |= {type(b).__name__ for b in blocks}
    return names


def _by_size(model: nn.Module, min_fraction: float) -> list[nn.Module]:
    threshold = max(1, int(_numel(model) * min_fraction))
    found: list[nn.Module] = []

    def walk(parent: nn.Module) -> None:
        for child in parent.children():
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):  # no forward: its hooks never run
                walk(child)
            elif _numel(child) >= threshold and _numel(child) < _numel(model):
                found.append(child)

    walk(model)
    return found


def modules_to_shard(model: nn.Module, names: str = "", min_fraction: float = MIN_FRACTION) -> list[nn.Module]:
    """The submodules to `fully_shard` before the root, innermost first (see the module docstring).

    `names`: comma-separated class names; each must occur in the model (a typo would silently
    shard the root alone), else ValueError listing the classes it has.
    """
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    if wanted:
        present = {type(m).__name__ for m in model.modules()}
        missing = sorted(wanted - present)
        if missing:
            raise ValueError(
                f"fsdp_wrap names {missing}, not a module class of {type(model).__name__}; "
                f"its classes: {sorted(present)}"
            )
    else:
        wanted = declared_classes(model)
    if not wanted:
        return _by_size(model, min_fraction)
    order: list[tuple[int, int, nn.Module]] = []  # (-depth, module order, module): innermost first
    for i, (name, m) in enumerate(model.named_modules()):
        if m is not model and type(m).__name__ in wanted and not isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            order.append((-name.count("."), i, m))
    return [m for _, _, m in sorted(order, key=lambda t: t[:2])]
