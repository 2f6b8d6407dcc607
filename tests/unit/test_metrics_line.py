"""The step log line's communication figure: exposed time (what the step waited for after
backward's compute) and the share hidden under compute, from `CommTimer`'s measurements."""

from __future__ import annotations

import random

import pytest

from nanoddp.train.metrics import CommTimer, format_comm, format_log_line

RECORD = {"step": 120, "loss": 2.31, "lr": 3e-4, "step_time_s": 0.0412, "samples_per_s": 155, "tokens_per_s": 9900}


def test_log_line_shows_exposed_comm_and_hidden_share():
    line = format_log_line({**RECORD, "comm_time_s": 0.24, "comm_exposed_s": 0.024})
    assert line.endswith("| comm 24 ms exposed (90 % hidden)")
    assert format_comm(0.01, 0.0012) == "comm 1.2 ms exposed (88 % hidden)"
    assert format_comm(0.0, 0.0) == "comm 0.0 ms exposed"  # nothing to hide: no share
    assert format_comm(0.005, 0.005) == "comm 5.0 ms exposed (0 % hidden)"  # a manual engine
    assert format_comm(0.24, None) == "comm 240 ms"  # window measured, exposure not
    assert "comm" not in format_log_line({**RECORD, "comm_time_s": None, "comm_exposed_s": None})


def _timeline(launch: float, ready: list[float], done: float) -> list[tuple[str, float, object]]:
    events = [("forward", launch - 1.0, None), ("launch", launch, 0)]
    events += [("grad_ready", t, i) for i, t in enumerate(ready)]
    events += [("finalize", max(ready), None), ("done", done, None)]
    return sorted(events, key=lambda e: e[1])


def test_ddp_timeline_exposed_is_the_wait_after_the_last_gradient():
    timer = CommTimer()
    timer.add_timeline(_timeline(launch=1.0, ready=[0.9, 1.2, 1.5], done=1.6))
    timer.close_step()
    timer.add_timeline(_timeline(launch=2.0, ready=[1.9, 2.3], done=2.3))  # all hidden
    timer.close_step()
    total, exposed = timer.pop()
    assert total == pytest.approx(0.6 + 0.3) and exposed == pytest.approx(0.1)
    assert timer.pop() == (0.0, 0.0)  # popped: the next window starts empty


def test_manual_sync_is_all_exposed_and_a_hook_alone_gives_no_exposure():
    timer = CommTimer()
    timer.compute_done()
    timer.launched()
    timer.finished()
    timer.close_step()
    total, exposed = timer.pop()
    assert exposed == total >= 0
    timer.launched()  # a timed comm hook: the window, no end of compute
    timer.finished()
    timer.close_step()
    total, exposed = timer.pop()
    assert total >= 0 and exposed is None


def test_exposed_never_exceeds_the_comm_window():
    rng = random.Random(0)
    timer = CommTimer()
    for _ in range(200):
        launch = rng.uniform(0, 1)
        ready = [rng.uniform(0, 2) for _ in range(3)]
        timer.add_timeline(_timeline(launch, ready, done=launch + rng.uniform(0, 1)))
        timer.close_step()
        total, exposed = timer.pop()
        assert 0.0 <= exposed <= total
