"""The policy objects `fully_shard` takes: FSDP2's names, fields and defaults.

Why our own and not torch's: code written for `torch.distributed.fsdp` constructs these by
keyword and reads their fields; ours are the same frozen dataclasses (same field names, same
reprs) so `fully_shard`'s signature prints identically and a user's policy works unchanged.
torch's own instances are accepted too: only the fields are read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Module-level mixed precision.

    `param_dtype`: dtype of the all-gather and of the unsharded parameters the forward and
    backward compute with (None: the parameter's own). The sharded parameters, their gradients
    and the optimizer step keep the original dtype.
    `reduce_dtype`: dtype of the gradient reduce-scatter (None: `param_dtype`'s, so the grads
    the compute produced).
    `output_dtype`: floating-point forward outputs are cast to it (None: left alone).
    `cast_forward_inputs`: cast floating-point forward inputs to `param_dtype` before the
    module runs.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass
class OffloadPolicy:
    """No offloading: the default `offload_policy`."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and optimizer state in CPU memory.

    nanoddp shards on the CPU (gloo / our collectives), where everything already lives in CPU
    memory: this policy is accepted and is the identity. On an accelerator mesh `fully_shard`
    refuses it rather than pretend to offload.
    """

    pin_memory: bool = True
