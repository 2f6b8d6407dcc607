"""The header round: every collective's first round, and for small messages its only one.

Why it exists: ranks that disagree about a call (which collective, numel, dtype, op, root) must
all raise the same ValueError instead of hanging or overrunning each other's buffers, and so must
ranks whose call failed its argument checks on one rank only (`nanoddp.comm.checks`). So every
rank's header (plus, for an invalid call, its error message) reaches a place where the whole table
is checked, and the verdict reaches every rank, before any bulk data moves.

Its shape depends on the group size alone, never on what a call says, so ranks that disagree still
send each other the same messages and all learn of the disagreement:

* **2 ranks: one exchange.** Each rank sends the other its frame and checks the pair itself.
* **3+ ranks: a star through group rank 0.** Every other rank sends its frame *up* to rank 0,
  which checks the table and answers each rank with one *down* frame: the verdict and that rank's
  result. 2(n-1) messages instead of an all-to-all's n(n-1). It takes two hops instead of one, but
  with more ranks than cores every message costs a scheduling round, so the star wins several
  times over (docs/performance.md, "the header round"). It is also what makes rooted ops cheap:
  their check goes through one rank, like their data, not between every pair.

Small payloads ride inside the frames, so for them the check is free: the round *is* the
collective. A one-round collective is three functions: `part(p)`, the bytes this rank contributes
to rank p's result (`p=None`: its whole contribution, what goes up the star); `select(whole, p)`,
rank p's share of a whole contribution; and `combine(pick, p)`, rank p's result from `pick(q)` =
rank q's share for p. With 2 ranks each combines its own result; in the star rank 0 combines
everyone's and sends each rank its own.

Frames have a fixed capacity per group (`plan.inline_limit_for` plus room for an error table), the
same on every rank, so a frame from a rank that disagrees about sizes can never overrun a receive
(gloo aborts the process when a message is larger than the buffer posted for it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from nanoddp.comm import plan
from nanoddp.comm.transport import Peers, wait_all
from nanoddp.comm.wire import COLLECTIVES, DTYPES, OPS

TAG_FRAME = 0x6E6401  # our own tag: a user's send/recv on the same group cannot steal a frame
HEADER_FIELDS = ("collective", "numel", "dtype", "op", "root")
HEADER_BYTES = 64  # 8 int64 slots: the fields above, the payload size, an error code, 1 spare
SLOT_NBYTES, SLOT_ERROR = 5, 6
ERROR_ROOM = 64 * 1024  # a down frame may carry an error message instead of a result
# What went wrong with an invalid call, as sent in a frame's error slot (0: the call is valid).
ERRORS = {1: ValueError, 2: TypeError}

Part = Callable[[int | None], torch.Tensor | None]
Select = Callable[[torch.Tensor, int], torch.Tensor]
Combine = Callable[[Callable[[int], torch.Tensor], int], torch.Tensor | None]


class FrameBuffers:
    """One group's reusable frames: an inbox and an outbox row per group rank.

    On CPU the header slots are also held as numpy views, so writing and reading a header costs
    no torch op (each costs microseconds, and this runs on every collective's critical path)."""

    def __init__(self, size: int, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.limits: tuple[int, ...] | None = None  # the `plan.limits()` it was made for
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
        self.rounds: dict[tuple[int, ...], object] = {}  # nanoddp.comm.cached_rounds's rounds on these frames
        self.repeats: dict[tuple, object] = {}  # nanoddp.comm.cached_rounds's remembered calls (valid for `limits`)

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

    Runs on every collective: the limits are compared as the constants they derive from, and the
    capacity worked out only when those changed. Any change of `plan`'s thresholds drops the
    remembered calls, each of which skips the path choice that put it where it is."""
    limits = plan.limits()
    bufs = peers.cache.get(device)
    if bufs is None or bufs.limits != limits:
        limit = plan.inline_limit_for(peers.size, peers.gloo)
        payload = -(-max(limit, ERROR_ROOM) // 64) * 64  # rows stay 64-byte aligned
        capacity = HEADER_BYTES + payload
        if bufs is None or bufs.capacity != capacity:
            bufs = peers.cache[device] = FrameBuffers(peers.size, capacity, device)
        bufs.limits = limits
        bufs.repeats.clear()
    return bufs


def one_round(
    peers: Peers,
    header: Sequence[int],
    device: torch.device,
    part: Part | None = None,
    select: Select | None = None,
    combine: Combine | None = None,
    *,
    same_for_all: bool = False,
    error: int = 0,
) -> torch.Tensor | None:
    """Run the header round (with the payloads `part` gives, if any) and return this rank's result
    as `combine` made it (None if it gives none; received results come as uint8 bytes).

    Raises the same ValueError on every rank when the headers disagree, and every rank raises an
    invalid call's error (`error` != 0: `part` gives its message) word for word. `same_for_all`:
    `combine` gives every rank the same result, so the star computes it once."""
    try:
        if peers.size == 1:
            raise_invalid([[*header, 0, error, 0]], lambda q: part(0) if part else None)
            return combine(lambda q: part(0), 0) if combine else None
        if peers.size == 2:
            return _exchange(peers, list(header), device, part, combine, error)
        return _star(peers, list(header), device, part, select or _whole, combine, same_for_all, error)
    finally:
        peers.calls += 1  # every rank counts every round, passed or raised: see Peers.call_tags


def others_for(size: int) -> Combine:
    """all_gather/gather's combine: rank p's result is every other rank's data, in rank order."""

    def combine(pick: Callable[[int], torch.Tensor], p: int) -> torch.Tensor:
        others = [as_bytes(pick(q)) for q in range(size) if q != p]
        return others[0] if len(others) == 1 else torch.cat(others)

    return combine


def unpack(result: torch.Tensor, outputs: list[torch.Tensor]) -> None:
    """Copy equal consecutive pieces of a one-round result's bytes into `outputs`."""
    data = as_bytes(result)
    size = data.numel() // max(len(outputs), 1)
    for i, out in enumerate(outputs):
        out.copy_(data[i * size : (i + 1) * size].view(out.dtype))


def _whole(whole: torch.Tensor, p: int) -> torch.Tensor:
    return whole


def _slots(header: list[int], payload: torch.Tensor | None, error: int) -> list[int]:
    nbytes = 0 if payload is None else payload.numel() * payload.element_size()
    return [*header, nbytes, error, 0]


def _exchange(
    peers: Peers, header: list[int], device: torch.device, part: Part | None, combine: Combine | None, error: int
) -> torch.Tensor | None:
    """Two ranks: each sends the other its frame (header + its share for the other) and checks both."""
    me, other = peers.rank, 1 - peers.rank
    bufs = buffers(peers, device)
    outgoing = part(other) if part else None
    mine = _slots(header, outgoing, error)
    frame = bufs.fill(other, mine, outgoing, exact=not peers.gloo)
    wait_all(peers.exchange([(frame, other)], [(bufs.in_rows[other], other)], TAG_FRAME))
    theirs = bufs.slots(other)
    received = bufs.payload(other, theirs[SLOT_NBYTES])
    table = [mine, theirs] if me == 0 else [theirs, mine]
    check_table(table, lambda q: outgoing if q == me else received)
    if combine is None:
        return None
    own = part(me) if part else None
    return combine(lambda q: own if q == me else received, me)


def _star(
    peers: Peers,
    header: list[int],
    device: torch.device,
    part: Part | None,
    select: Select,
    combine: Combine | None,
    same_for_all: bool,
    error: int,
) -> torch.Tensor | None:
    """3+ ranks: frames go up to group rank 0, which checks them all and sends each rank its
    verdict and result (down frames: slot 0 = 0 or an ERRORS code, slot SLOT_NBYTES = bytes)."""
    bufs, exact = buffers(peers, device), not peers.gloo
    whole = part(None) if part else None
    mine = _slots(header, whole, error)
    if peers.rank != 0:
        up = bufs.fill(0, mine, whole, exact)
        wait_all(peers.exchange([(up, 0)], [(bufs.in_rows[0], 0)], TAG_FRAME))
        verdict = bufs.slots(0)
        payload = bufs.payload(0, verdict[SLOT_NBYTES])
        if verdict[0]:
            raise ERRORS[verdict[0]](bytes(payload.tolist()).decode(errors="replace"))
        return payload if combine else None
    n = peers.size
    wait_all(peers.exchange([], [(bufs.in_rows[p], p) for p in range(1, n)], TAG_FRAME))
    table = [mine] + [bufs.slots(p) for p in range(1, n)]
    wholes = [whole] + [bufs.payload(p, table[p][SLOT_NBYTES]) for p in range(1, n)]
    check_at_hub(peers, bufs, lambda: check_table(table, wholes.__getitem__), device)
    if combine is None:
        _send_down(peers, bufs, [None] * n, 0, exact)
        return None
    results: list[torch.Tensor | None] = []
    for p in range(n):
        if same_for_all and p > 0:
            results.append(results[0])
            continue
        results.append(combine(lambda q, p=p: select(wholes[q], p), p))
    _send_down(peers, bufs, results, 0, exact)
    return results[0]


def check_at_hub(peers: Peers, bufs: FrameBuffers, check: Callable[[], None], device: torch.device) -> None:
    """The star's rank 0, every up frame in: if `check()` raises, send every rank the error as its
    down frame and raise it here too (so all raise the same words)."""
    try:
        check()
    except (ValueError, TypeError) as exc:
        message = torch.frombuffer(bytearray(str(exc).encode()[:ERROR_ROOM]), dtype=torch.uint8).to(device)
        code = 2 if isinstance(exc, TypeError) else 1
        _send_down(peers, bufs, [message] * peers.size, code, not peers.gloo)
        raise


def _send_down(peers: Peers, bufs: FrameBuffers, payloads: list[torch.Tensor | None], code: int, exact: bool) -> None:
    """Send group rank p its down frame with `payloads[p]`. Ranks given the same payload object
    (a broadcast's data, an all_reduce's sum, a verdict) share one frame: one fill, not n-1."""
    sends: list[tuple[torch.Tensor, int]] = []
    for p in range(1, peers.size):
        payload = payloads[p]
        if p > 1 and payload is payloads[p - 1]:
            sends.append((sends[-1][0], p))
            continue
        nbytes = 0 if payload is None else payload.numel() * payload.element_size()
        sends.append((bufs.fill(p, [code, 0, 0, 0, 0, nbytes, 0, 0], payload, exact), p))
    wait_all(peers.exchange(sends, [], TAG_FRAME))


# --- the verdict --------------------------------------------------------------------------------


def error_frame(name: str, exc: Exception) -> tuple[int, torch.Tensor]:
    """(error code, message bytes) for a call to `name` that failed this rank's argument checks."""
    code = 2 if isinstance(exc, TypeError) else 1
    message = f"{name}\n{exc}".encode()[: plan.INLINE_MAX_BYTES]
    return code, torch.frombuffer(bytearray(message), dtype=torch.uint8) if message else torch.empty(
        0, dtype=torch.uint8
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
    name, _, message = bytes(payload_of(first).tolist()).decode(errors="replace").partition("\n")
    others = f" (and on group ranks {bad[1:]})" if len(bad) > 1 else ""
    raise ERRORS[table[first][SLOT_ERROR]](
        f"nanoddp.comm.{name}: invalid call on group rank {first}{others}: {message} "
        "[raised on every rank of the group; no data moved]"
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
        raise ValueError(
            f"nanoddp.comm.{collective}: ranks disagree on {name} ({shown}; ranks are group ranks); "
            "every rank must call the same collectives in the same order, with tensors of the "
            "same numel and dtype and the same op/src/dst"
        )


def _describe(name: str, value: int) -> str:
    if name == "collective":
        return COLLECTIVES[value]
    if name == "dtype":
        return str(DTYPES[value]).removeprefix("torch.")
    if name == "op":
        return OPS[value] if value >= 0 else "none"
    return str(value)
