"""DiLoCo: H inner steps apart, then one outer step on the averaged pseudo-gradient.

Why: LocalSGD's plain average throws away what the ranks learned about the direction of travel.
DiLoCo (Douillard et al., 2023, "Distributed Low-Communication Training of Language Models")
treats the distance each rank moved since the last sync as a gradient: every rank runs its inner
optimizer (AdamW) for `sync_every` steps, then

    pseudo_grad = weights at the last sync - weights now        (per rank)
    pseudo_grad = mean over ranks                               (one all-reduce)
    global -= outer SGD step(pseudo_grad)   (Nesterov momentum)  (same on every rank)
    weights = global                                             (replicas equal again)

The paper's outer optimizer, and the defaults here: SGD, lr 0.7, momentum 0.9, Nesterov. With
outer lr 1 and no momentum the outer step is LocalSGD's average; the momentum is what lets it
match synchronous training while communicating hundreds of times less.

Use it around the inner optimizer, on a model NOT wrapped in DDP:

    optimizer = DiLoCo(torch.optim.AdamW(model.parameters(), lr=3e-4), sync_every=100)

Streaming DiLoCo (`fragments=F`, `sync_delay=tau`, `mix=alpha`; schedule and cut in
`fragments.py`): fragment i's pseudo-gradient leaves tau inner steps before its outer step, a
background collective while the inner steps go on; its outer step then moves fragment i of the
last-sync weights, and this rank's fragment becomes global + alpha (local - global) (torchft's
`fragment_update_alpha`: alpha = 0 takes the global weights, 1 keeps the local ones). One outer
optimizer holds every fragment (each fragment's step sets only its own gradients, as torchft's
single outer optimizer does). `compress` picks the wire format (`pseudo_grad_mean.py`).

The weights at the last sync (one fp32 copy of the trainable parameters: the memory DiLoCo
costs; int8 keeps a second, its error-feedback residual) and the outer optimizer's state are
in `state_dict()`, with the inner state and the step count, so a resume is exact. A fragment
whose mean is on the wire is waited for there (every rank started it, so this is no new
collective) and its mean is saved: a run resumed mid-flight uses the mean the uninterrupted run
got.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from nanoddp.comm.api.backend import DEFAULT_COMM_BACKEND
from nanoddp.parallel.lowcomm.fragments import check_schedule, cut_fragments, fragment_finishing, fragment_starting
from nanoddp.parallel.lowcomm.periodic import PeriodicSync
from nanoddp.parallel.lowcomm.pseudo_grad_mean import MeanInFlight, check_compress, start_mean

OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
# What `outer=` takes: torch.optim.Adam, functools.partial(torch.optim.SGD, lr=0.5), a lambda.
OuterFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]


class DiLoCo(PeriodicSync):
    """Wrap the inner `optimizer`; its fragments take their outer steps on the module doc's schedule.

    `outer` builds the outer optimizer from the last-sync weights (default: SGD with `outer_lr`,
    `outer_momentum`, Nesterov); `compress` is "fp32", "bf16", "fp16" or "int8". See
    `PeriodicSync` for when to build it and how to save it.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        sync_every: int,
        *,
        fragments: int = 1,
        sync_delay: int = 0,
        mix: float = 0.0,
        outer: OuterFactory | None = None,
        compress: str = "fp32",
        outer_lr: float = OUTER_LR,
        outer_momentum: float = OUTER_MOMENTUM,
        nesterov: bool = True,
        group=None,
        comm_backend: str = DEFAULT_COMM_BACKEND,
    ) -> None:
        self.check_wrapped(optimizer, sync_every)
        sizes = [p.numel() for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        check_schedule(int(sync_every), fragments, sync_delay, mix, len(sizes))
        check_compress(compress)
        if outer is None and not outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {outer_lr}")
        super().__init__(optimizer, sync_every, group, comm_backend)
        self.fragments = cut_fragments(sizes, fragments)
        self.sync_delay, self.mix, self.compress = sync_delay, float(mix), compress
        # The outer optimizer steps a copy of the weights as they were at the last sync.
        self.last_sync = [p.detach().clone() for p in self._params()]
        self.outer: torch.optim.Optimizer
        if outer is None:
            nesterov = nesterov and outer_momentum > 0
            self.outer = torch.optim.SGD(self.last_sync, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
        else:
            self.outer = outer(self.last_sync)
            if not isinstance(self.outer, torch.optim.Optimizer):
                raise TypeError(f"outer must build a torch.optim.Optimizer from the params, built {self.outer!r}")
        # int8's error feedback: per fragment, what rounding lost last time (flat, fp32).
        self.residuals = [self._flat_zeros(f) if compress == "int8" else None for f in self.fragments]
        self.in_flight: dict[int, MeanInFlight] = {}  # fragment -> its mean on the wire
        self.last_finished_wire_bytes = 0  # what the transport sent for the mean the last step used

    def _flat_zeros(self, fragment: range) -> torch.Tensor:
        tensors = [self.last_sync[i] for i in fragment]
        return torch.zeros(sum(t.numel() for t in tensors), dtype=torch.float32, device=tensors[0].device)

    def _after_step(self) -> int:
        """Start the fragment due to leave, then finish the one due its outer step (schedule: fragments.py)."""
        f = len(self.fragments)
        sent, starting = 0, fragment_starting(self.local_step, self.sync_every, f, self.sync_delay)
        if starting is not None:
            sent = self._start(starting)
        finishing = fragment_finishing(self.local_step, self.sync_every, f)
        self.last_finished_wire_bytes = 0 if finishing is None else self._finish(finishing)
        return sent

    @torch.no_grad()
    def _start(self, fragment: int) -> int:
        """Send fragment's pseudo-gradient (how far this rank moved since its last sync) for averaging."""
        pseudo_grad = self._pseudo_grad(fragment)
        pending = start_mean(pseudo_grad, self.compress, self.collectives, self.group, self.residuals[fragment])
        self.in_flight[fragment] = pending
        return pending.sent_bytes

    @torch.no_grad()
    def _finish(self, fragment: int) -> int:
        """Fragment's mean arrived: its outer step (`_outer_step`). Returns the bytes the transport
        sent for that mean (`MeanInFlight.wire_bytes`)."""
        pending = self.in_flight.pop(fragment)
        self._outer_step(fragment, pending.wait())
        return pending.wire_bytes()

    def _pseudo_grad(self, fragment: int) -> torch.Tensor:
        """How far this rank moved fragment's weights since its last sync, flat fp32 (N,)."""
        params = self._params()
        return torch.cat([(self.last_sync[i] - params[i]).reshape(-1).float() for i in self.fragments[fragment]])

    def fragment_count(self) -> int:
        return len(self.fragments)

    @torch.no_grad()
    def sync_contribution(self, fragment: int = 0) -> torch.Tensor:
        return self._pseudo_grad(fragment)

    @torch.no_grad()
    def take_mean(self, mean: torch.Tensor | None, fragment: int = 0, keep_local: bool = True) -> None:
        self._outer_step(fragment, mean, self.mix if keep_local else 0.0)

    @torch.no_grad()
    def forget_local_progress(self) -> None:
        for p, synced in zip(self._params(), self.last_sync, strict=True):
            p.copy_(synced)

    @torch.no_grad()
    def _outer_step(self, fragment: int, mean: torch.Tensor | None, mix: float | None = None) -> None:
        """The outer step on fragment's mean pseudo-gradient (None: no step, nobody moved it); then
        local = global + mix (local - global), `mix` the wrapper's unless given."""
        mix = self.mix if mix is None else mix
        params, offset = self._params(), 0
        if mean is not None:
            for i in self.fragments[fragment]:
                synced = self.last_sync[i]
                synced.grad = mean[offset : offset + synced.numel()].view_as(synced).to(synced.dtype)
                offset += synced.numel()
            self.outer.step()
        for i in self.fragments[fragment]:
            p, synced = params[i], self.last_sync[i]
            local = p.detach().clone() if mix else None
            p.copy_(synced)
            if local is not None:
                p.lerp_(local, mix)
            synced.grad = None

    def replicas_equal(self) -> bool:
        """After a whole-model sync that keeps nothing local (one fragment, mix 0)."""
        return len(self.fragments) == 1 and self.mix == 0 and self.local_step % self.sync_every == 0

    def state_dict(self) -> dict[str, Any]:
        in_flight = {i: pending.wait().clone() for i, pending in self.in_flight.items()}  # module doc
        return {
            "optimizer": self.optimizer.state_dict(),
            "outer": self.outer.state_dict(),
            "last_sync": [s.detach().clone() for s in self.last_sync],
            "local_step": self.local_step,
            "fragments": len(self.fragments),
            "in_flight": in_flight,
            "residuals": [None if r is None else r.clone() for r in self.residuals],
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["last_sync"]
        if len(saved) != len(self.last_sync):
            raise ValueError(
                f"DiLoCo state holds {len(saved)} last-sync tensors, this model has {len(self.last_sync)} "
                "trainable parameters: load it into the model it was saved from"
            )
        fragments = state_dict.get("fragments", 1)  # saved before Streaming DiLoCo: one fragment
        residuals = state_dict.get("residuals", [None] * fragments)
        if fragments != len(self.fragments) or [r is None for r in residuals] != [r is None for r in self.residuals]:
            raise ValueError(
                f"DiLoCo state was saved with {fragments} fragments and int8 residuals "
                f"{'kept' if any(r is not None for r in residuals) else 'not kept'}; this DiLoCo has "
                f"fragments={len(self.fragments)}, compress={self.compress!r}: resume with the saved settings"
            )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.outer.load_state_dict(state_dict["outer"])
        for synced, theirs in zip(self.last_sync, saved, strict=True):
            synced.copy_(theirs)
        for residual, kept in zip(self.residuals, residuals, strict=True):
            if residual is not None:
                residual.copy_(kept)
        self.in_flight = {
            int(i): MeanInFlight.done(mean.clone()) for i, mean in state_dict.get("in_flight", {}).items()
        }
        self.local_step = int(state_dict["local_step"])

    def __repr__(self) -> str:
        streaming = f"fragments={len(self.fragments)}, sync_delay={self.sync_delay}, mix={self.mix}, "
        return (
            f"DiLoCo(sync_every={self.sync_every}, {streaming}compress={self.compress!r}, "
            f"outer={self.outer!r}, inner={self.optimizer!r})"
        )
