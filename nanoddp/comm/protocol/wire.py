"""The wire: what a header round puts on the wire, how it is counted and how its verdict is read.

Why it exists: every collective starts with a header round, run either by the general round
(`nanoddp.comm.protocol.header_round`, any collective, size and group) or by a round prepared for one call
signature (`nanoddp.comm.protocol.cached_rounds`, the optional layer above). A rank on one may meet a peer
on the other, so both must speak exactly the same wire, and this module is that wire, once:

* **the frame format**: a frame is `HEADER_BYTES` of int64 slots (collective, numel, dtype, op,
  root, payload bytes, error code, spare; the codes below) and then the payload, in a group's
  reusable `FrameBuffers`, whose capacity is the same on every rank, so a frame from a rank that
  disagrees about sizes can never overrun a receive (gloo aborts the process when a message is
  larger than the buffer posted for it);
* **the tag counter**: `counted` runs a round and advances `Peers.calls`, passed or raised; it
  is the only code that does, so every rank's count, and so every call's tags, stay in step;
* **the verdict**: `check_table` raises, worded identically on every rank, when a rank's call
  was invalid or the headers differ; `raise_down_frame` reads the error a hub sent down; the
  payload-size checks name ranks that run with different limits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from nanoddp.comm.plan import plan
from nanoddp.comm.protocol.settle import settle
from nanoddp.comm.transport.transport import Peers

TAG_FRAME = 0x6E6401  # our own tag: a user's send/recv on the same group cannot steal a frame
HEADER_FIELDS = ("collective", "numel", "dtype", "op", "root")
HEADER_BYTES = 64  # 8 int64 slots: the fields above, the payload size, an error code, 1 spare
SLOT_NBYTES, SLOT_ERROR = 5, 6
ERROR_ROOM = 64 * 1024  # a down frame may carry an error message instead of a result
# What went wrong with an invalid call, as sent in a frame's error slot (0: the call is valid).
ERRORS = {1: ValueError, 2: TypeError}

DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
)  # fmt: skip
DTYPE_CODES = {dtype: code for code, dtype in enumerate(DTYPES)}
COLLECTIVES = (
    "all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "scatter", "gather", "all_to_all", "barrier",
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
)  # fmt: skip
OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX")


# --- the tag counter ------------------------------------------------------------------------------

T = TypeVar("T")
E = TypeVar("E", bound=Exception)


def counted(peers: Peers, run: Callable[..., T], *args) -> T:
    """Run one header round, `run(*args)`, and count it on `peers`, passed or raised: the one
    place `Peers.calls` advances (every rank counts every round, so `Peers.call_tags` agree).

    A round that raised its verdict (the same error on every rank) first settles what the call
    posted before it (`nanoddp.comm.protocol.settle`); any other error leaves the group to its fate."""
    try:
        return run(*args)
    except (ValueError, TypeError) as exc:
        if peers.gloo and getattr(exc, "raised_on_every_rank", False):
            settle(peers)
        raise
    finally:
        peers.unsettled = []
        peers.calls += 1


def _everywhere(exc: E) -> E:
    """Mark a verdict's error: every rank of the round raises it (so they can all settle, above)."""
    exc.raised_on_every_rank = True  # type: ignore[attr-defined]
    return exc


# --- header rows ----------------------------------------------------------------------------------


def up_slots(header: Sequence[int], nbytes: int, error: int = 0) -> list[int]:
    """A rank's own header row: its call, the payload bytes it sends, its error code (0: valid)."""
    return [*header, nbytes, error, 0]


def down_slots(code: int, nbytes: int) -> list[int]:
    """The row of a star's down frame: the verdict (0 or an ERRORS code) and the payload bytes."""
    return [code, 0, 0, 0, 0, nbytes, 0, 0]


def error_code(exc: Exception) -> int:
    return 2 if isinstance(exc, TypeError) else 1


# --- frames ---------------------------------------------------------------------------------------


class FrameBuffers:
    """One group's reusable frames: an inbox and an outbox row per group rank.

    On CPU the header slots are also held as numpy views, so writing and reading a header costs
    no torch op (each costs microseconds, and this runs on every collective's critical path)."""

    def __init__(self, size: int, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.limits: tuple[int, int] | None = None  # the inline limits it was sized for (`buffers`)
        self.inbox = torch.empty(size, capacity, dtype=torch.uint8, device=device)  # (n, capacity)
        self.outbox = torch.empty(size, capacity, dtype=torch.uint8, device=device)
        self.in_rows, self.out_rows = self.inbox.unbind(0), self.outbox.unbind(0)
        in_slots = self.inbox[:, :HEADER_BYTES].view(torch.int64)  # (n, 8)
        out_slots = self.outbox[:, :HEADER_BYTES].view(torch.int64)
        cpu = device.type == "cpu"
        self._in = in_slots.numpy() if cpu else in_slots
        self._out = out_slots.numpy() if cpu else out_slots

        # Views into the rows by (peer, payload bytes): slicing a tensor costs microseconds, and a
        # training loop sends the same few sizes over and over. Cleared when it grows large.
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # The rounds the layer above prepares on these frames, by signature (`cached_rounds`, which
        # types them): they hold views into these rows, so they live and are dropped with them.
        self.rounds: dict[tuple[int | str, ...], Any] = {}

    def _views_for(self, peer: int, nbytes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(outbox payload, outbox frame of header + payload, inbox payload) for `peer`, `nbytes`."""
        views = self._views.get((peer, nbytes))
        if views is None:
            if len(self._views) >= 256:
                self._views.clear()
            end = HEADER_BYTES + nbytes
            out_row, in_row = self.out_rows[peer], self.in_rows[peer]
            views = self._views[(peer, nbytes)] = (out_row[HEADER_BYTES:end], out_row[:end], in_row[HEADER_BYTES:end])
        return views

    def fill(self, peer: int, slots: Sequence[int], payload: torch.Tensor | None, exact: bool) -> torch.Tensor:
        """Write `slots` (8 ints) and `payload` into the outbox row for `peer`; return what to send
        (only the bytes used, unless `exact`: nccl receives need the sizes they posted)."""
        if isinstance(self._out, torch.Tensor):
            self._out[peer] = torch.tensor(slots, dtype=torch.int64, device=self._out.device)
        else:
            self._out[peer] = slots
        nbytes = slots[SLOT_NBYTES]
        room, frame, _ = self._views_for(peer, nbytes)
        if nbytes:
            assert payload is not None  # the slots announce payload bytes only for a payload
            room.copy_(as_bytes(payload))
        return self.out_rows[peer] if exact else frame

    def slots(self, peer: int) -> list[int]:
        return self._in[peer].tolist()

    def slot_arrays(self):
        """(outbox, inbox) header slots, (n, 8) int64 each: numpy arrays on CPU, tensors elsewhere."""
        return self._out, self._in

    def payload(self, peer: int, nbytes: int) -> torch.Tensor:
        return self._views_for(peer, nbytes)[2]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (any dtype)."""
    flat = tensor if tensor.dim() == 1 else tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def buffers(peers: Peers, device: torch.device) -> FrameBuffers:
    """This group's frames on `device`, re-made when the inline limit changed (tests shrink it).

    Runs on every collective: the limits are compared as the two constants the capacity derives
    from, and the capacity worked out only when those changed."""
    limits = (plan.INLINE_MAX_BYTES, plan.INLINE_SEND_BYTES)
    bufs: FrameBuffers | None = peers.cache.get(device)
    if bufs is None or bufs.limits != limits:
        limit = plan.inline_limit_for(peers.size, peers.gloo)
        payload = -(-max(limit, ERROR_ROOM) // 64) * 64  # rows stay 64-byte aligned
        capacity = HEADER_BYTES + payload
        if bufs is None or bufs.capacity != capacity:
            bufs = peers.cache[device] = FrameBuffers(peers.size, capacity, device)
        bufs.limits = limits
    return bufs


# --- the verdict --------------------------------------------------------------------------------


def error_frame(name: str, exc: Exception) -> tuple[int, torch.Tensor]:
    """(error code, message bytes) for a call to `name` that failed this rank's argument checks."""
    code = error_code(exc)
    message = f"{name}\n{exc}".encode()[: plan.INLINE_MAX_BYTES]
    return code, torch.frombuffer(bytearray(message), dtype=torch.uint8) if message else torch.empty(
        0, dtype=torch.uint8
    )


def down_frame_message(exc: Exception) -> torch.Tensor:
    """The bytes of the down frame a star's hub sends every rank when its check raised `exc`."""
    return torch.frombuffer(bytearray(str(exc).encode()[:ERROR_ROOM]), dtype=torch.uint8)


def raise_down_frame(code: int, payload: torch.Tensor) -> None:
    """Raise the error a star's hub sent down (`code` != 0), in the hub's own words."""
    raise _everywhere(ERRORS[code](bytes(payload.tolist()).decode(errors="replace")))


def raise_payload_mismatch(collective: str, expected: object, got: object) -> None:
    """Raise for ranks whose headers agree but whose payload sizes do not: their frame limits differ."""
    raise _everywhere(
        ValueError(
            f"nanoddp.comm.{collective}: ranks agree on the call but not on its payload sizes (expected "
            f"{expected} bytes, got {got}); every rank must run the same nanoddp version with the same limits"
        )
    )


def check_table(table: list[list[int]], payload_of: Callable[[int], torch.Tensor | None]) -> None:
    """Raise, identically on every rank, if any rank's call was invalid or the headers differ."""
    first = table[0][:SLOT_NBYTES]
    if all(row[:SLOT_NBYTES] == first and not row[SLOT_ERROR] for row in table):
        return  # the common case, decided in one pass
    raise_invalid(table, payload_of)
    check_headers(table)


def raise_invalid(table: list[list[int]], payload_of: Callable[[int], torch.Tensor | None]) -> None:
    """If any rank's call was invalid, raise its error, worded identically on every rank.

    The lowest group rank with an invalid call decides the message and the type; the others
    are named, so a user sees every rank that erred."""
    if not any(row[SLOT_ERROR] for row in table):
        return
    bad = [r for r, row in enumerate(table) if row[SLOT_ERROR] != 0]
    first = bad[0]
    message_bytes = payload_of(first)
    assert message_bytes is not None  # an invalid call's frame carries its error message
    name, _, message = bytes(message_bytes.tolist()).decode(errors="replace").partition("\n")
    others = f" (and on group ranks {bad[1:]})" if len(bad) > 1 else ""
    raise _everywhere(
        ERRORS[table[first][SLOT_ERROR]](
            f"nanoddp.comm.{name}: invalid call on group rank {first}{others}: {message} "
            "[raised on every rank of the group]"
        )
    )


def check_headers(table: list[list[int]]) -> None:
    """Raise one ValueError, worded identically on every rank, if the ranks' headers differ."""
    first = table[0][: len(HEADER_FIELDS)]
    if all(row[: len(HEADER_FIELDS)] == first for row in table):
        return
    for field, name in enumerate(HEADER_FIELDS):
        values = [row[field] for row in table]
        if len(set(values)) == 1:
            continue
        shown = ", ".join(f"rank {r}: {_describe(name, v)}" for r, v in enumerate(values))
        collective = COLLECTIVES[table[0][0]]
        raise _everywhere(
            ValueError(
                f"nanoddp.comm.{collective}: ranks disagree on {name} ({shown}; ranks are group ranks); "
                "every rank must call the same collectives in the same order, with tensors of the "
                "same numel and dtype and the same op/src/dst"
            )
        )


def _describe(name: str, value: int) -> str:
    if name == "collective":
        return COLLECTIVES[value]
    if name == "dtype":
        return str(DTYPES[value]).removeprefix("torch.")
    if name == "op":
        return OPS[value] if value >= 0 else "none"
    return str(value)
