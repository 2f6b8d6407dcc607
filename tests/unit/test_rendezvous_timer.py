"""torch's rendezvous timer freed on its own thread: no traceback after the launcher's last line.

The c10d rendezvous renews its lease from a `_PeriodicTimer` thread. When the last reference to
the timer goes away on that thread, its finalizer joins the thread it runs on and Python reports
RuntimeError("cannot join current thread") through `sys.unraisablehook`: under load this was
printed after `nanoddp train`'s one SIGINT line (tests/multiproc/test_torchrun.py saw it on a
busy machine). Here the same thing happens on purpose: the timer's own tick drops the last
reference. `torchrun.ignore_rendezvous_timer_self_join` must swallow that report and only that one.
"""

from __future__ import annotations

import sys
import threading
from datetime import timedelta

import pytest
from torch.distributed.elastic.rendezvous.utils import _PeriodicTimer

from nanoddp import torchrun


def _timer_freed_on_its_own_thread() -> None:
    """Start a timer whose first tick drops the only reference to it; wait until that tick ran.

    The tick waits until this thread has let go of the timer, so the tick's drop is always the
    last one; the finalizer, and the report of its failed join, run inside that drop, before
    `ticked` is set."""
    holder: dict[str, _PeriodicTimer] = {}
    released, ticked = threading.Event(), threading.Event()

    def tick() -> None:
        if ticked.is_set():
            return
        released.wait(10)
        holder.pop("timer", None)  # the last reference: the timer is freed here, on its thread
        ticked.set()

    timer = _PeriodicTimer(timedelta(seconds=0.01), tick)
    holder["timer"] = timer
    timer.start()
    del timer
    released.set()
    assert ticked.wait(10), "the timer never ticked"


@pytest.fixture
def reported(monkeypatch):
    """What reaches the hook that was installed before ours (a list of exceptions)."""
    seen: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: seen.append(unraisable.exc_value))
    return seen


def test_torch_reports_the_self_join_without_the_filter(reported):
    _timer_freed_on_its_own_thread()
    assert len(reported) == 1 and "cannot join current thread" in str(reported[0])


def test_the_filter_drops_that_report_and_passes_others_on(reported):
    torchrun.ignore_rendezvous_timer_self_join()
    _timer_freed_on_its_own_thread()
    assert reported == []
    other = ValueError("some other finalizer failed")
    sys.unraisablehook(type("Args", (), {"exc_value": other, "exc_traceback": None})())
    assert reported == [other]
