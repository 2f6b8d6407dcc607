"""The run's timeouts and margins that more than one part of nanoddp must agree on, each defined once.

A margin written twice drifts: the launcher's workers, `nanoddp run`'s bootstrap and the
Trainer's own join would each give torch's collectives a different slack after the watchdog,
and which one fires first (our one-line diagnosis, or torch's C++ abort) would depend on the
entry point.
"""

from __future__ import annotations

# torch's own collectives give up this long after our watchdog would: the watchdog, which names
# the stuck rank and collective, always fires first
PG_TIMEOUT_MARGIN_S = 30

# stopping a process: SIGTERM, then this long to save a snapshot and exit, then SIGKILL (one grace
# for every launcher, so a worker's save-on-SIGTERM has the same time whoever stops it)
STOP_GRACE_S = 5.0
