"""The header round between 2 gloo ranks, prepared once per call signature (`PairRound`).

Why a second way to run the same round: small collectives on 2 ranks are what a training loop
repeats every step (a loss all_reduce, a metric all_gather, DDP's buffer broadcast), and on a CPU
host each step of a call costs far more than it does in a warm loop: the two processes and gloo's
I/O threads share the cores and evict each other's caches between calls, so every tensor op,
slice and helper call on the way costs microseconds (measured: docs/performance.md, "Per-call
cost"). `frames.one_round` serves every collective, size and group through callbacks and builds
its views, header rows and checks per call; a `PairRound` makes them once for one signature
(collective, numel, dtype, op, root and the payload sizes each way), so a call writes the header,
copies the payload in, sends and receives, compares the peer's header row with the one it expects
and hands back a typed view of what arrived.

The wire format is the frames' own (same tag, same header slots, same buffers), so a peer that
took the general path, or made a mismatched or invalid call, is checked exactly as there and every
rank raises the same error (`frames.check_table`).
"""

from __future__ import annotations

import torch

from nanoddp.comm import frames
from nanoddp.comm.frames import HEADER_BYTES, SLOT_NBYTES, TAG_FRAME, FrameBuffers
from nanoddp.comm.ring import Peers

MAX_ROUNDS = 256  # prepared signatures kept per group (a training loop uses a handful)


class PairRound:
    """One prepared round: fill `outgoing`, call `run()`, read what it returns."""

    __slots__ = ("_expected", "_frame", "_group", "_in_row", "_in_slots", "_mine", "_other", "_out_slots", "_peers",
                 "incoming", "outgoing")  # fmt: skip

    def __init__(self, peers: Peers, bufs: FrameBuffers, header: tuple[int, ...], dtype: torch.dtype,
                 out_numel: int, in_numel: int) -> None:  # fmt: skip
        other = 1 - peers.rank
        out_bytes, in_bytes = out_numel * dtype.itemsize, in_numel * dtype.itemsize
        self._peers, self._group, self._other = peers, peers.group, other
        self._mine = [*header, out_bytes, 0, 0]  # this rank's header slots (frames.HEADER_BYTES)
        self._expected = [*header, in_bytes, 0, 0]  # the peer's, if it made the same call
        self._out_slots, self._in_slots = bufs.slot_arrays()
        out_row, self._in_row = bufs.out_rows[other], bufs.in_rows[other]
        self._frame = out_row[: HEADER_BYTES + out_bytes]
        self.outgoing = out_row[HEADER_BYTES : HEADER_BYTES + out_bytes].view(dtype)  # (out_numel,)
        self.incoming = self._in_row[HEADER_BYTES : HEADER_BYTES + in_bytes].view(dtype)  # (in_numel,)

    def run(self) -> torch.Tensor:
        """Send this rank's frame (header + `outgoing`), receive the peer's, check them; return
        `incoming`, the peer's payload (valid until the group's next collective)."""
        peers, other = self._peers, self._other
        self._out_slots[other] = self._mine
        try:
            received = self._group.recv(
                [self._in_row], other, TAG_FRAME
            )  # receive first: gloo sends once it is announced
            sent = self._group.send([self._frame], other, TAG_FRAME)
            received.wait()
            sent.wait()
        finally:
            peers.calls += 1  # every round counts, passed or raised (ring.Peers.call_tags)
        theirs = self._in_slots[other].tolist()
        if theirs != self._expected:
            self._disagree(theirs)
        return self.incoming

    def _disagree(self, theirs: list[int]) -> None:
        """The peer's header row is not the expected one: raise what the general path raises."""
        table = [self._mine, theirs] if self._peers.rank == 0 else [theirs, self._mine]
        peer_payload = self._in_row[HEADER_BYTES : HEADER_BYTES + theirs[SLOT_NBYTES]]
        frames.check_table(table, lambda q: peer_payload if table[q] is theirs else None)
        raise ValueError(  # same header, other payload size: the ranks' frame limits differ
            f"nanoddp.comm: ranks agree on the call but not on its payload size (group rank "
            f"{self._peers.rank} expected {self._expected[SLOT_NBYTES]} bytes, got {theirs[SLOT_NBYTES]}); "
            "every rank must run the same nanoddp version with the same limits"
        )


def prepared(peers: Peers, header: list[int], dtype: torch.dtype, device: torch.device, out_numel: int,
             in_numel: int) -> PairRound | None:  # fmt: skip
    """The prepared round for this signature, or None where `frames.one_round` must run it
    (not 2 gloo ranks, or frames not on CPU, whose header slots are written through numpy)."""
    if peers.size != 2 or not peers.gloo or device.type != "cpu":
        return None
    bufs = frames.buffers(peers, device)
    key = (*header, out_numel, in_numel)
    prepared_round = bufs.rounds.get(key)
    if prepared_round is None:
        if len(bufs.rounds) >= MAX_ROUNDS:
            bufs.rounds.clear()
        prepared_round = bufs.rounds[key] = PairRound(peers, bufs, tuple(header), dtype, out_numel, in_numel)
    return prepared_round
