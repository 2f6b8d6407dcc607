"""When sharded gradients are reduced: as soon as a flat unit's backward is done.

ZeRO-2 and FSDP share the rule (nanoddp.parallel.zero.flat holds the storage, this the
timing): a unit's gradients are reduce-scattered the moment the last of them lands, overlapped
with the rest of backward, and everything is waited for and averaged when backward ends.
"""

from __future__ import annotations

import torch

from nanoddp.comm.transport.transport import Waitable
from nanoddp.parallel.zero.flat import FlatParamUnit


class GradReduceScatter:
    """Reduce-scatters each unit's gradients as soon as its backward is done, overlapped with
    the rest of backward, and finishes them all when backward ends.

    Runs from post-accumulate-grad hooks on the units' full views: a unit is ready once every
    one of its trainable views got its gradient *in this backward*. Autograd visits the graph
    in the same order on every rank, so every rank launches the same reduce-scatters in the
    same order. At the end of backward (an autograd engine callback) units that never became
    ready (parameters unused this step) are launched too, in unit order, with zeros for the
    missing gradients, then every launch is waited on and averaged into the shard pieces'
    `.grad`. `sync = False` (no_sync accumulation) leaves the full gradients to accumulate.
    """

    def __init__(self, units: list[FlatParamUnit], after_unit=None, after_backward=None):
        self.units = units
        self.sync = True
        self._after_unit = after_unit  # (unit) -> None, right after its launch (FSDP frees it)
        self._after_backward = after_backward  # () -> None, when backward ends
        self._fired: list[set[int]] = [set() for _ in units]
        self._launched: list[tuple[FlatParamUnit, Waitable | None, torch.Tensor]] = []
        self._callback_queued = False
        for k, unit in enumerate(units):
            for i, u in enumerate(unit.unsharded):
                if u.requires_grad:
                    u.register_post_accumulate_grad_hook(self._hook(k, i))

    def _hook(self, k: int, i: int):
        def on_grad(_: torch.Tensor) -> None:
            self._queue_callback()
            self._fired[k].add(i)
            unit = self.units[k]
            wanted = sum(u.requires_grad for u in unit.unsharded)
            if self.sync and len(self._fired[k]) == wanted:
                self._launch(k)

        return on_grad

    def _queue_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _launch(self, k: int) -> None:
        unit = self.units[k]
        work, keep_alive = unit.reduce_scatter_grads()
        self._launched.append((unit, work, keep_alive))
        self._fired[k] = {-1}  # launched: no second launch in this backward
        if self._after_unit is not None:
            self._after_unit(unit)

    def _finish(self) -> None:
        """End of backward: launch the stragglers, wait for everything, hand out the shards."""
        self._callback_queued = False
        if self.sync:
            for k in range(len(self.units)):
                if self._fired[k] != {-1}:
                    self._launch(k)
            for unit, work, _ in self._launched:
                if work is not None:
                    work.wait()
                unit.finish_grads()
        self._launched = []
        self._fired = [set() for _ in self.units]
        if self._after_backward is not None:
            self._after_backward()
