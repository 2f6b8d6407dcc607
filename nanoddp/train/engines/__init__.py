"""Engines: the ways to keep N model replicas in step, one small object per kind behind one interface.

| engine      | wraps the model in                  | gradient sync                          |
|-------------|-------------------------------------|----------------------------------------|
| `nanoddp`   | `nanoddp.DistributedDataParallel`   | bucketed all-reduce hooked into backward |
| `torch`     | `torch.nn.parallel.DistributedDataParallel` | the same, torch's C++ reducer   |
| `allreduce` | nothing                             | one all-reduce per parameter after backward |
| `rs_ag`     | nothing                             | one flat reduce-scatter + all-gather after backward |
| `single`    | nothing (one process)               | none                                   |
| `zero1`     | `nanoddp.DistributedDataParallel`   | as `nanoddp`; optimizer: `ZeroRedundancyOptimizer` |
| `zero2`     | ZeRO-2 hooks on the module (`parallel.zero.stage2`) | bucketed reduce-scatter into gradient shards |
| `fsdp`      | `nanoddp.fsdp.fully_shard` per unit, then the root | all-gather params per unit, reduce-scatter grads |
| `hsdp`      | `fully_shard` per unit on a 2-D mesh (groups x `--group-size`) | as `fsdp` in a group, then across |
| `localsgd`  | nothing; optimizer: `nanoddp.LocalSGD` | none; weights averaged every `--sync-every` steps |
| `diloco`    | nothing; optimizer: `nanoddp.DiLoCo` | none; outer step on the mean pseudo-gradient every H |

Files: `base.py` (the `Engine` interface), one per family (`ddp.py`, `manual.py`, `single.py`,
`zero2.py`, `fsdp.py` (fsdp and hsdp), `lowcomm.py`), and `registry.py` (name -> engine class, `build_engine`). Gradient
accumulation differs by kind: the DDP-like engines run the non-final micro-steps inside
`no_sync()` so that backward skips the sync; the manual engines simply do not call their sync
function until the last micro-step; the low-communication engines have nothing to skip.
`Engine.micro_step(sync)` hides the difference.
"""

from nanoddp.train.engines.base import Engine, device_ids_for
from nanoddp.train.engines.fsdp import AMP_DTYPES, check_group_size, load_model_state, shard_model
from nanoddp.train.engines.manual import ManualEngine
from nanoddp.train.engines.registry import (
    ENGINE_REGISTRY,
    ENGINES,
    EngineName,
    build_engine,
    engine_help,
    prepare_model,
)

__all__ = [
    "AMP_DTYPES",
    "ENGINES",
    "ENGINE_REGISTRY",
    "Engine",
    "EngineName",
    "ManualEngine",
    "build_engine",
    "check_group_size",
    "device_ids_for",
    "engine_help",
    "load_model_state",
    "prepare_model",
    "shard_model",
]
