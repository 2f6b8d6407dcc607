"""A simulated slow link under nanoddp's sends: one bandwidth and one latency per directed link.

Why it exists: DiLoCo and LocalSGD pay off only where the link between replicas is slow (two
machines over 1 Gbit/s or less), and a laptop or a CI runner has no such link to measure on. With
`NANODDP_LINK_BANDWIDTH=100mbit NANODDP_LINK_LATENCY=20ms` every gloo send of nanoddp's collectives
(`transport.send_on`, the one place they all pass) is held back as such a link would hold it.

The model, per directed link (this process -> one peer process): a message of n bytes occupies the
link for 8n / bandwidth seconds, starting when the link is free (messages queue behind each other,
a token bucket with no burst), and arrives `latency` seconds after its last byte leaves. The
shaper posts the real send at that arrival time, so on loopback the receiver sees it then.

It is a simulation, and a simple one: no loss, no jitter, no shared bottleneck (each peer has a
link of its own, however many this process sends on), no TCP slow start, and no reordering (each
link keeps its messages in order). Only nanoddp's gloo sends are shaped: torch's own collectives,
nccl and the rendezvous store run at full speed. A sender's `wait()` returns when its message was
delivered, not when its last byte left (a real link frees the buffer `latency` sooner).

[Note: one posting thread] The calling thread never sleeps (DDP overlaps its all-reduce with
backward, and a caller held back would make DDP look worse than a slow link makes it), and no
second thread may post gloo sends beside it on the same pair (`transport.Peers.send_early`'s
note): while shaping is on, every send is posted by the shaper's one thread, in order of due
time, and the caller gets a handle to wait on.

This module knows nothing of torch: it schedules callables; `transport` hands it the sends.
"""

from __future__ import annotations

import heapq
import itertools
import os
import re
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

BANDWIDTH_VAR = "NANODDP_LINK_BANDWIDTH"
LATENCY_VAR = "NANODDP_LINK_LATENCY"

# Decimal units, as network rates are quoted (100 Mbit/s = 1e8 bits per second).
_BITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_BYTES = {"B/s": 8, "kB/s": 8e3, "MB/s": 8e6, "GB/s": 8e9}
_SECONDS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_NUMBER_UNIT = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z/]*)\s*")
BANDWIDTH_FORMS = "e.g. 100mbit, 1gbit, 500kbit (bits per second) or 12.5MB/s, 800kB/s (bytes per second)"
LATENCY_FORMS = "e.g. 20ms, 0.5s, 250us or 0"


def parse_bandwidth(text: str, name: str = BANDWIDTH_VAR) -> float:
    """A rate such as `100mbit` or `12.5MB/s` in bits per second (> 0); one clear error otherwise."""
    match = _NUMBER_UNIT.fullmatch(text)
    unit = match[2] if match else ""
    scale = _BITS.get(unit.lower().removesuffix("/s")) or _BYTES.get(unit)
    if match is None or scale is None:
        raise ValueError(f"{name} must be a number and a unit, {BANDWIDTH_FORMS}; got {text!r}")
    bits_per_s = float(match[1]) * scale
    if bits_per_s <= 0:
        raise ValueError(f"{name} must be > 0 ({BANDWIDTH_FORMS}); got {text!r}")
    return bits_per_s


def parse_latency(text: str, name: str = LATENCY_VAR) -> float:
    """A one-way delay such as `20ms` in seconds (>= 0; a bare 0 needs no unit)."""
    match = _NUMBER_UNIT.fullmatch(text)
    if match is not None and match[2] == "" and float(match[1]) == 0:
        return 0.0
    if match is None or match[2] not in _SECONDS:
        raise ValueError(f"{name} must be a number and a unit (us, ms or s), {LATENCY_FORMS}; got {text!r}")
    return float(match[1]) * _SECONDS[match[2]]


@dataclass(frozen=True)
class LinkModel:
    """One simulated link: `bandwidth_bits_per_s` (inf: latency only) and a one-way `latency_s`."""

    bandwidth_bits_per_s: float = float("inf")
    latency_s: float = 0.0

    def idle_delay_s(self, nbytes: int) -> float:
        """Seconds from handing `nbytes` to an idle link until they arrive: latency + 8n / bandwidth."""
        return self.latency_s + 8 * nbytes / self.bandwidth_bits_per_s

    def describe(self) -> str:
        """`100 Mbit/s, 20 ms` (for logs and reports)."""
        bits = self.bandwidth_bits_per_s
        rate = "unlimited" if bits == float("inf") else f"{bits / 1e6:g} Mbit/s"
        return f"{rate}, {self.latency_s * 1e3:g} ms"


def link_from_environ(environ: Mapping[str, str] | None = None) -> LinkModel | None:
    """The link that NANODDP_LINK_BANDWIDTH / NANODDP_LINK_LATENCY describe; None when neither is set.

    Read by the comm layer itself, as `plan` reads NANODDP_COMM_FORCE: a knob of the transport, not
    a fact of where the process sits (`DistEnv`), and collectives run on groups a user made with
    torch alone. Set in the launching shell, every rank reads the same value and raises the same
    error."""
    environ = os.environ if environ is None else environ
    bandwidth, latency = environ.get(BANDWIDTH_VAR, "").strip(), environ.get(LATENCY_VAR, "").strip()
    if not bandwidth and not latency:
        return None
    return LinkModel(
        parse_bandwidth(bandwidth) if bandwidth else float("inf"),
        parse_latency(latency) if latency else 0.0,
    )


def link_environ(bandwidth: str | None, latency: str | None) -> dict[str, str]:
    """The variables that make `nanoddp train` (or any launch) shape its links; checked here, so a bad
    value is refused before anything starts."""
    out = {}
    if bandwidth is not None:
        parse_bandwidth(bandwidth, "--bandwidth")
        out[BANDWIDTH_VAR] = bandwidth
    if latency is not None:
        parse_latency(latency, "--latency")
        out[LATENCY_VAR] = latency
    return out


@dataclass(frozen=True)
class Backlog:
    """What a shaper holds back right now: `messages` of `nbytes` in all, the last one due to
    arrive `due_in_s` seconds from now (what the hang watchdog names when the link is the wait)."""

    messages: int
    nbytes: int
    due_in_s: float


class LinkShaper:
    """Holds each message back as its link would, then runs its `post` on the shaper's one thread.

    `submit(link, nbytes, post)` returns at once; `post()` runs at the message's due time. Due
    times on one link only grow, and ties keep submission order, so a link's messages are posted
    in the order they were submitted."""

    def __init__(self, model: LinkModel) -> None:
        self.model = model
        self._free_at: dict[Hashable, float] = {}  # when each link's last queued byte leaves
        self._due: list[tuple[float, int, int, Callable[[], None]]] = []  # a heap of (due, order, nbytes, post)
        self._order = itertools.count()
        self._posting = 0  # 1 while the thread runs a `post` (popped, not yet posted)
        self._held_bytes = 0  # of the messages queued or being posted
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, link: Hashable, nbytes: int, post: Callable[[], None]) -> float:
        """Queue one message of `nbytes` on `link`; `post` runs when it arrives. Returns its due time
        (`time.monotonic()` seconds)."""
        now = time.monotonic()
        with self._cond:
            leaves = max(now, self._free_at.get(link, now)) + 8 * nbytes / self.model.bandwidth_bits_per_s
            self._free_at[link] = leaves
            due = leaves + self.model.latency_s
            heapq.heappush(self._due, (due, next(self._order), nbytes, post))
            self._held_bytes += nbytes
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="nanoddp-link-shaper", daemon=True)
                self._thread.start()
            self._cond.notify()
        return due

    def pending(self) -> int:
        """Messages queued or being posted."""
        with self._cond:
            return len(self._due) + self._posting

    def backlog(self) -> Backlog:
        """The messages held back now, their bytes, and when the last of them arrives."""
        with self._cond:
            last_due = max((due for due, *_ in self._due), default=time.monotonic())
            return Backlog(len(self._due) + self._posting, self._held_bytes, max(last_due - time.monotonic(), 0.0))

    def _loop(self) -> None:
        while True:
            self._post_next()

    def _post_next(self) -> None:
        """Wait for the earliest due time, then post that message. A function of its own so that the
        loop, waiting, holds no reference to a posted message's tensor."""
        with self._cond:
            while not self._due or self._due[0][0] > time.monotonic():
                self._cond.wait(self._due[0][0] - time.monotonic() if self._due else None)
            _, _, nbytes, post = heapq.heappop(self._due)
            self._posting = 1
        try:
            post()  # never raises: transport's post hands an error to the message's waiter
        finally:
            with self._cond:
                self._posting = 0
                self._held_bytes -= nbytes
