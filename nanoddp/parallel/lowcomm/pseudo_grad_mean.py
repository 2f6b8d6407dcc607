"""A pseudo-gradient's mean over ranks, started in the background and sent fp32, bf16, fp16 or int8.

Why: DiLoCo's only traffic is the pseudo-gradient (weights at the last sync - weights now), and
it is a sum of many small inner steps that tolerates a coarse wire format far better than a
single gradient does (OpenDiLoCo sends it fp16; int8 with error feedback loses nothing over the
run: what rounding drops this round is sent the next). Streaming DiLoCo starts this mean
`sync_delay` inner steps before it is needed, so `start_mean` returns at once with a
`MeanInFlight` whose `wait()` gives the mean.

    fp32        x / world_size, all-reduced (sum)                 4 bytes an element
    bf16, fp16  x / world_size cast to the wire dtype, all-reduced 2 bytes an element; the
                (sum in fp32 per addition, rounded: comm.api.collectives)
    int8        blockwise absmax, error feedback, all-gathered     1 byte an element + 4 per block

int8 rule (the tests' simulation quantizes by the same words): the flat pseudo-gradient plus the
residual is cut into blocks of `INT8_BLOCK` elements (the last one shorter); a block's scale is
its largest magnitude / 127 (fp32), each element `round(x / scale)` (half to even) clamped to
[-127, 127], or 0 in an all-zero block; dequantized, `q * scale`. The residual becomes x minus
its dequantized self.

[Note: int8 by all-gather] Adding int8 values on the wire overflows, and a ring that dequantizes,
adds and requantizes at every hop rounds differently on each chunk's path. So each rank sends
its int8 blocks and their scales whole (one all-gather of one int8 buffer: scales, then values),
and every rank dequantizes all of them and adds them in rank order in fp32: no overflow, one
rounding per replica's contribution, bitwise the same mean everywhere. The price is traffic that
grows with the group: each rank receives (world_size - 1) payloads, against a ring all-reduce's
2 (world_size - 1) / world_size fp32 payloads, so the saving is 4x at 2 ranks, 2x at 4, none at
8. DiLoCo's setting is a few replicas over a slow link; a requantizing int8 ring (prime's) is
what a large group would want.

`sum_in_rank_order` is the blocking form for fault-tolerant syncs (`nanoddp.ft.rounds`), whose
membership changes: every format's values added in member-rank order, the same bits at any size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from nanoddp.comm.api.backend import Collectives
from nanoddp.comm.api.collectives import all_gather_into_tensor
from nanoddp.comm.api.rank_order import all_reduce_in_rank_order
from nanoddp.parallel.replicas import group_size_rank_src

COMPRESSIONS = ("fp32", "bf16", "fp16", "int8")
WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INT8_BLOCK = 256  # elements per absmax scale: 1.6 % of the int8 payload is scales
INT8_MAX = 127  # symmetric: -128 is never used, so negating a value never overflows


def check_compress(compress: str) -> None:
    """The one error for an unknown wire format."""
    if compress not in COMPRESSIONS:
        raise ValueError(f"compress (--pseudo-grad-dtype) must be one of {COMPRESSIONS}, got {compress!r}")


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax int8 of the flat fp32 `x` (N,): values (N,) int8, scales (ceil(N/B),) fp32."""
    n = x.numel()
    blocks = -(-n // INT8_BLOCK)
    padded = x.new_zeros(blocks * INT8_BLOCK)
    padded[:n] = x
    padded = padded.view(blocks, INT8_BLOCK)  # (blocks, B)
    scales = padded.abs().amax(dim=1) / INT8_MAX  # (blocks,)
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block stays 0
    q = torch.round(padded / divisor[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.view(-1)[:n], scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`quantize_int8`'s inverse up to rounding: (N,) fp32."""
    n = q.numel()
    padded = torch.zeros(scales.numel() * INT8_BLOCK, dtype=torch.float32, device=q.device)
    padded[:n] = q
    return (padded.view(-1, INT8_BLOCK) * scales[:, None]).view(-1)[:n]  # (N,)


class MeanInFlight:
    """A mean over ranks that may still be on the wire; `wait()` gives it (once finished, again).

    [Note: wire bytes of a background collective] The trainer's `comm_bytes` counts what
    nanoddp's transport sent inside each step; a collective that runs between steps would be
    missed. So the mean measures its own: the transport's byte count when it is submitted, and
    again when it completes (a callback on the group's worker thread, before the next queued
    collective runs). Collectives on a group run one at a time, in order, so with nothing else
    queued on it at submission (DiLoCo has at most one fragment in flight) the difference is
    this collective's bytes, headers included. Traffic of another group at the same time would
    be counted too; the low-communication engines use one group.
    """

    def __init__(
        self, works: Sequence, finish: Callable[[], torch.Tensor], sent_bytes: int, wire_mark: int = 0
    ) -> None:
        self._works = list(works)
        self._finish: Callable[[], torch.Tensor] | None = finish
        self._mean: torch.Tensor | None = None
        self.sent_bytes = sent_bytes  # the payload this rank handed to the collective
        self._wire_marks = [wire_mark]  # the transport's count before submission, then at completion
        if self._works:
            self._works[-1].get_future().then(lambda _: self._wire_marks.append(_transport_sent()))

    def wire_bytes(self) -> int:
        """What the transport sent for this mean (after `wait()`; 0 for a mean known already)."""
        return self._wire_marks[-1] - self._wire_marks[0] if len(self._wire_marks) == 2 else 0

    @classmethod
    def done(cls, mean: torch.Tensor) -> MeanInFlight:
        """A mean already known (one rank alone, or one restored from a checkpoint)."""
        return cls((), lambda: mean, 0)

    def wait(self) -> torch.Tensor:
        """The mean (N,) fp32: waits for the collective the first time."""
        if self._mean is None:
            for work in self._works:
                work.wait()
            assert self._finish is not None
            self._mean, self._finish, self._works = self._finish(), None, []
        return self._mean


@torch.no_grad()
def start_mean(
    flat: torch.Tensor, compress: str, collectives: Collectives, group=None, residual: torch.Tensor | None = None
) -> MeanInFlight:
    """Start the mean over the ranks of `group` of the flat fp32 `flat` (N,), sent as `compress`
    (module doc); `flat` is consumed. With int8, `residual` (N,) fp32 is this rank's error
    feedback: added before quantizing, then set to what the quantization lost."""
    world_size = group_size_rank_src(group)[0]
    if world_size == 1:  # nothing to send: nothing to round either
        return MeanInFlight.done(flat)
    if compress == "int8":
        return _start_int8_mean(flat, world_size, collectives, group, residual)
    wire = flat.div_(world_size).to(WIRE_DTYPES[compress])  # divide, then sum: flat_average's Note
    mark = _transport_sent()
    work = collectives.all_reduce(wire, group=group, async_op=True)
    return MeanInFlight([work], lambda: wire.to(torch.float32), wire.numel() * wire.element_size(), mark)


def _start_int8_mean(
    flat: torch.Tensor, world_size: int, collectives: Collectives, group, residual: torch.Tensor | None
) -> MeanInFlight:
    payload, n_scale_bytes = _int8_payload(flat, residual)
    gathered = [torch.empty_like(payload) for _ in range(world_size)]
    mark = _transport_sent()
    work = collectives.all_gather(gathered, payload, group=group, async_op=True)
    finish = lambda: _add_int8_payloads(gathered, n_scale_bytes, flat).div_(world_size)  # noqa: E731
    return MeanInFlight([work], finish, payload.numel(), mark)


@torch.no_grad()
def sum_in_rank_order(flat: torch.Tensor, compress: str, group, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The sum over the ranks of `group` of the flat fp32 `flat` (N,), sent as `compress` and added
    in member-rank order, blocking: the same bits for any number of ranks (`comm.api.rank_order`),
    which a fault-tolerant sync needs, its membership changing. fp32/bf16/fp16: the rank-order
    all-reduce of `flat` cast to the wire dtype; int8: as `start_mean`'s (`residual` included),
    every rank adding the dequantized payloads in rank order. Returns (N,) fp32; `flat` is consumed."""
    if compress != "int8":
        wire = flat.to(WIRE_DTYPES[compress])
        all_reduce_in_rank_order(wire, group)
        return wire.to(torch.float32)
    payload, n_scale_bytes = _int8_payload(flat, residual)
    # the group's own size: a fault-tolerant run's group is one torch's registry does not know
    world_size = group.size() if group is not None else dist.get_world_size() if dist.is_initialized() else 1
    gathered = payload.new_empty(world_size * payload.numel())
    if world_size > 1:
        all_gather_into_tensor(gathered, payload, group=group)
    else:
        gathered.copy_(payload)
    return _add_int8_payloads(list(gathered.view(world_size, -1)), n_scale_bytes, flat)


def _int8_payload(flat: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """This rank's int8 payload of `flat` plus `residual` (the module doc's rule; `residual`
    becomes what the rounding lost): scales then values, one int8 buffer; and the scales' bytes."""
    if residual is None:
        raise ValueError("int8 pseudo-gradients keep error feedback: pass the residual (zeros at the start)")
    flat.add_(residual)
    q, scales = quantize_int8(flat)
    residual.copy_(flat - dequantize_int8(q, scales))
    payload = torch.cat([scales.view(torch.int8), q])  # scales first: their fp32 view stays aligned
    return payload, scales.numel() * scales.element_size()


def _add_int8_payloads(payloads: Sequence[torch.Tensor], n_scale_bytes: int, like: torch.Tensor) -> torch.Tensor:
    """[Note: int8 by all-gather]: every rank dequantizes the ranks' payloads and adds them in
    rank order, in fp32: (N,) like `like`."""
    total = torch.zeros_like(like)
    for theirs in payloads:
        total.add_(dequantize_int8(theirs[n_scale_bytes:], theirs[:n_scale_bytes].view(torch.float32)))
    return total


def _transport_sent() -> int:
    """nanoddp's transport byte count (imported here: importing a wrapper never needs nanoddp.comm)."""
    from nanoddp.comm.transport.transport import sent_bytes

    return sent_bytes()
