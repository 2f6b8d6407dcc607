"""The user-facing methods of nanoddp's DDP that only set state the engine reads later:
`no_sync`, `register_comm_hook` (torch's names and contracts) and the bucket layout."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from nanoddp.parallel.ddp.buckets import GradBucket

CommHook = Callable[[Any, GradBucket], torch.futures.Future]


class DDPUserAPI:
    """Mixed into DistributedDataParallel (which owns every attribute used here)."""

    _serialize_hooks = False  # see register_comm_hook

    @property
    def bucket_param_names(self) -> list[list[str]]:
        """Parameter names per bucket, in reduction order (for inspection and tests)."""
        return [[self._param_names[i] for i in b.param_indices] for b in self._buckets]

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient synchronisation for backward passes whose forward runs inside the block;
        gradients accumulate locally and the next synchronised backward reduces their sum."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Replace the default all-reduce with `hook(state, bucket) -> Future[Tensor]` (torch's
        contract; see nanoddp.parallel.ddp.comm_hooks). Register once, before the first backward."""
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket), got {type(hook).__name__}")
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once per DistributedDataParallel")
        if self._sync_iterations > 0:
            raise RuntimeError("register_comm_hook must be called before the first synchronised backward")
        self._comm_hook, self._comm_hook_state = hook, state
        # gloo (CPU tensors) completes futures, and so runs their callbacks, on its own threads:
        # a hook that issues collectives from a callback (torch's PowerSGD: its second
        # all-reduce) would race the next bucket's launch, and ranks would issue collectives in
        # different orders (an abort or a hang; torch's own DDP fails so). For such hooks the
        # engine waits for each bucket's future before launching the next hook. nanoddp's own
        # hooks (and its wrappers of them) issue every collective in the call: no wait, the
        # buckets keep overlapping.
        foreign = not getattr(hook, "__module__", "").startswith("nanoddp.")
        self._serialize_hooks = foreign and all(p.device.type == "cpu" for p in self._params)
