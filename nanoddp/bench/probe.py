"""Outside probes that time and count every engine's gradient communication the same way.

Why from outside: a probe inside one engine (a Python comm hook on torch DDP, a timeline in
ours) changes what it measures and costs one side more than the other. These probes touch
neither engine's code path, and every engine pays them alike:

- `GradClock`: a post-accumulate-grad hook on each parameter, registered on the bare module
  before any wrapper exists, so it fires just before the wrapper's own per-parameter hook
  (torch's reducer and ours both hand a bucket to the collective layer from that hook, the
  moment its last gradient lands). With the wrapper's bucket layout (structure, not timings)
  this gives when the first bucket was handed over, and when the last gradient was ready.
- `step_window`: from those, the step's communication as the trainer's timer defines it
  (`nanoddp.train.metrics.CommWindow`: first hand-over to last done, and the last gradient as
  the end of backward's compute), so a benchmark's comm and exposed figures mean what the
  training log line's do.
- `bytes_written`: the bytes this process passed to write()/writev() (Linux /proc/self/io
  `wchar`), the calls gloo's TCP transport sends with: every frame on the wire, headers
  included, for torch's collectives and ours alike.

Column definitions built from them live in `nanoddp.bench.report.DEFINITIONS`.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn as nn

from nanoddp.train.metrics import CommWindow


class GradClock:
    """When each trainable parameter's gradient was last accumulated (perf_counter seconds)."""

    def __init__(self, module: nn.Module):
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.names = [name for name, p in module.named_parameters() if p.requires_grad]
        self.ready = [0.0] * len(self.params)
        for index, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(functools.partial(self._on_ready, index))

    def _on_ready(self, index: int, param: torch.Tensor) -> None:
        self.ready[index] = time.perf_counter()

    def reset(self) -> None:
        """Call before each backward: a parameter without a gradient then reads 0."""
        self.ready = [0.0] * len(self.params)

    def last_ready(self) -> float:
        """When the last gradient hook of the backward ran (0.0 if none ran)."""
        return max(self.ready, default=0.0)

    def first_handoff(self, layout: list[list[int]]) -> float | None:
        """When bucket 0 was complete, i.e. handed to the collective layer (None: unknown).

        Both DDPs launch buckets strictly in index order, bucket i once its last gradient is
        in; bucket 0 therefore goes first, at the ready time of its latest member.
        """
        if not layout or not layout[0]:
            return None
        times = [self.ready[i] for i in layout[0]]
        return max(times) if all(times) else None


def bucket_layout(model: nn.Module, clock: GradClock) -> list[list[int]] | None:
    """The wrapper's buckets in launch order, as indices into `clock.params` (None: no buckets).

    Read once after warm-up (both DDPs rebuild their buckets after the first iteration);
    torch's is read from its reducer, ours from `bucket_param_names`.
    """
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from nanoddp.parallel.ddp.wrapper import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        index = {name: i for i, name in enumerate(clock.names)}
        return [[index[name] for name in bucket] for bucket in model.bucket_param_names] or None
    if isinstance(model, TorchDDP):
        by_id = {id(p): i for i, p in enumerate(clock.params)}
        buckets = model.reducer._get_zeros_like_grad_buckets()  # the reducer's buckets, in order
        return [[by_id[id(p)] for p in bucket.parameters()] for bucket in buckets] or None
    return None


def step_window(
    clock: GradClock, layout: list[list[int]] | None, backward_end: float, sync_end: float, syncs_after: bool
) -> CommWindow | None:
    """The step just taken's gradient communication, from the outside probes (None: not seen).

    `syncs_after`: a manual engine, whose communication is its sync call after backward
    (`backward_end` to `sync_end`); else a DDP, whose bucket 0 is handed over from its last
    gradient's hook and whose last bucket is done when backward returns. The end of compute is
    the last gradient hook either way.
    """
    last_grad = clock.last_ready()
    if not last_grad:  # no gradient hook ran (a wrapper that swaps the parameters): unknown
        return None
    if syncs_after:
        return CommWindow(backward_end, sync_end, compute_done=last_grad)
    handoff = clock.first_handoff(layout or [])
    if handoff is None:  # no bucket layout known for this wrapper (yet): not measured
        return None
    return CommWindow(handoff, backward_end, compute_done=last_grad)


def bytes_written() -> int | None:
    """Bytes this process has passed to write()/writev() so far (None where not on Linux)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None
