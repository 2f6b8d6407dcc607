"""The header round: every collective's first round, and for small messages its only one.

Why it exists: ranks that disagree about a call (which collective, numel, dtype, op, root) must
all raise the same ValueError instead of hanging or overrunning each other's buffers, and so must
ranks whose call failed its argument checks on one rank only (`nanoddp.comm.protocol.checks`). So every
rank's header (plus, for an invalid call, its error message) reaches a place where the whole table
is checked, and the verdict reaches every rank, before any bulk data moves.

Its shape depends on the group size alone, never on what a call says, so ranks that disagree still
send each other the same messages and all learn of the disagreement:

* **2 ranks: one exchange.** Each rank sends the other its frame and checks the pair itself.
* **3+ ranks: a star through group rank 0.** Every other rank sends its frame *up* to rank 0,
  which checks the table and answers each rank with one *down* frame: the verdict and that rank's
  result. 2(n-1) messages instead of an all-to-all's n(n-1). [Note: star, not all-to-all] It
  takes two hops instead of one, but with more ranks than cores every message costs a scheduling
  round, so the star wins several times over (about 5x for the round alone at 4 ranks on 2
  cores). It is also what makes rooted ops cheap: their check goes through one rank, like their
  data, not between every pair.

Small payloads ride inside the frames, so for them the check is free: the round *is* the
collective. A one-round collective is three functions: `part(p)`, the bytes this rank contributes
to rank p's result (`p=None`: its whole contribution, what goes up the star); `select(whole, p)`,
rank p's share of a whole contribution; and `combine(pick, p)`, rank p's result from `pick(q)` =
rank q's share for p. With 2 ranks each combines its own result; in the star rank 0 combines
everyone's and sends each rank its own.

The frame format, the round counter and the verdict are `nanoddp.comm.protocol.wire`'s, shared with the
rounds prepared per call signature (`nanoddp.comm.protocol.cached_rounds`, the optional layer above this
one), so either may meet the other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch

from nanoddp.comm.protocol import wire
from nanoddp.comm.protocol.wire import SLOT_NBYTES, TAG_FRAME, FrameBuffers, as_bytes, buffers, check_table
from nanoddp.comm.transport.transport import Peers, wait_all

Part = Callable[[int | None], torch.Tensor | None]
Select = Callable[[torch.Tensor, int], torch.Tensor]
Pick = Callable[[int], torch.Tensor]  # rank q's share for the rank being combined for
Combine = Callable[[Pick, int], torch.Tensor | None]


def _picks(shares: Callable[[int], torch.Tensor | None]) -> Pick:
    """`shares` as `combine` sees it: a combine picks only ranks that contributed a share (a rank
    whose `part` gives None sends no payload, and no combine asks for it), which no checker can see."""
    return cast(Pick, shares)


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
    if peers.size == 1:
        return wire.counted(peers, _alone, header, part, combine, error)
    if peers.size == 2:
        return wire.counted(peers, _exchange, peers, list(header), device, part, combine, error)
    return wire.counted(peers, _star, peers, list(header), device, part, select or _whole, combine, same_for_all, error)


def others_for(size: int) -> Combine:
    """all_gather/gather's combine: rank p's result is every other rank's data, in rank order."""

    def combine(pick: Callable[[int], torch.Tensor], p: int) -> torch.Tensor:
        others = [as_bytes(pick(q)) for q in range(size) if q != p]
        return others[0] if len(others) == 1 else torch.cat(others)

    return combine


def unpack(result: torch.Tensor | None, outputs: list[torch.Tensor]) -> None:
    """Copy equal consecutive pieces of a one-round result's bytes into `outputs`."""
    assert result is not None, "the round gave this rank no result"  # its combine makes one for every caller
    data = as_bytes(result)
    size = data.numel() // max(len(outputs), 1)
    for i, out in enumerate(outputs):
        out.copy_(data[i * size : (i + 1) * size].view(out.dtype))


def _whole(whole: torch.Tensor, p: int) -> torch.Tensor:
    return whole


def _nbytes(payload: torch.Tensor | None) -> int:
    return 0 if payload is None else payload.numel() * payload.element_size()


def _alone(header: Sequence[int], part: Part | None, combine: Combine | None, error: int) -> torch.Tensor | None:
    """One rank: no frames, but an invalid call still raises what it raises in a group."""
    wire.raise_invalid([wire.up_slots(header, 0, error)], lambda q: part(0) if part else None)
    return combine(_picks(lambda q: part(0) if part else None), 0) if combine else None


def _exchange(
    peers: Peers, header: list[int], device: torch.device, part: Part | None, combine: Combine | None, error: int
) -> torch.Tensor | None:
    """Two ranks: each sends the other its frame (header + its share for the other) and checks both."""
    me, other = peers.rank, 1 - peers.rank
    bufs = buffers(peers, device)
    outgoing = part(other) if part else None
    mine = wire.up_slots(header, _nbytes(outgoing), error)
    frame = bufs.fill(other, mine, outgoing, exact=not peers.gloo)
    wait_all(peers.exchange([(frame, other)], [(bufs.in_rows[other], other)], TAG_FRAME))
    theirs = bufs.slots(other)
    received = bufs.payload(other, theirs[SLOT_NBYTES])
    table = [mine, theirs] if me == 0 else [theirs, mine]
    check_table(table, lambda q: outgoing if q == me else received)
    if combine is None:
        return None
    own = part(me) if part else None
    return combine(_picks(lambda q: own if q == me else received), me)


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
    mine = wire.up_slots(header, _nbytes(whole), error)
    if peers.rank != 0:
        up = bufs.fill(0, mine, whole, exact)
        wait_all(peers.exchange([(up, 0)], [(bufs.in_rows[0], 0)], TAG_FRAME))
        verdict = bufs.slots(0)
        payload = bufs.payload(0, verdict[SLOT_NBYTES])
        if verdict[0]:
            wire.raise_down_frame(verdict[0], payload)
        return payload if combine else None
    n = peers.size
    wait_all(peers.exchange([], [(bufs.in_rows[p], p) for p in range(1, n)], TAG_FRAME))
    table = [mine] + [bufs.slots(p) for p in range(1, n)]
    wholes = [whole] + [bufs.payload(p, table[p][SLOT_NBYTES]) for p in range(1, n)]
    check_at_hub(peers, bufs, lambda: check_table(table, wholes.__getitem__), device)
    contributed = cast(list[torch.Tensor], wholes)  # past the check: a combine picks contributing ranks only
    if combine is None:
        _send_down(peers, bufs, [None] * n, 0, exact)
        return None
    results: list[torch.Tensor | None] = []
    for p in range(n):
        if same_for_all and p > 0:
            results.append(results[0])
            continue
        results.append(combine(_share_for(select, contributed, p), p))
    _send_down(peers, bufs, results, 0, exact)
    return results[0]


def _share_for(select: Select, wholes: list[torch.Tensor], p: int) -> Pick:
    """Rank p's pick in the star: rank q's share for p, cut from q's whole contribution."""
    return lambda q: select(wholes[q], p)


def check_at_hub(peers: Peers, bufs: FrameBuffers, check: Callable[[], None], device: torch.device) -> None:
    """The star's rank 0, every up frame in: if `check()` raises, send every rank the error as its
    down frame and raise it here too (so all raise the same words)."""
    try:
        check()
    except (ValueError, TypeError) as exc:
        message = wire.down_frame_message(exc).to(device)
        _send_down(peers, bufs, [message] * peers.size, wire.error_code(exc), not peers.gloo)
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
        sends.append((bufs.fill(p, wire.down_slots(code, _nbytes(payload)), payload, exact), p))
    wait_all(peers.exchange(sends, [], TAG_FRAME))
