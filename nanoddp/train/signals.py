"""Graceful interruption of a training run: stop at a step every rank agrees on, with a snapshot.

A scheduler's preemption (SIGTERM) or Ctrl-C (SIGINT) reaches the `nanoddp train` agent, which
forwards it to every worker. A worker must not die mid-step (losing up to `snapshot_every` steps)
nor stop alone (its peers would wait in the next collective). So the handler only records the
signal; at each step the ranks all-reduce (MAX) the recorded signal number, and if
any rank got one, all stop after that same step, write a snapshot there, and exit with
128 + signal. A second signal on a rank means "now": it exits at once.
"""

from __future__ import annotations

import logging
import os
import signal

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_state = {"installed": False, "signum": 0}


class Interrupted(Exception):
    """Every rank stopped after `step` because of `signum`; a snapshot of `step` was written."""

    def __init__(self, step: int, signum: int):
        self.step, self.signum = step, signum
        super().__init__(f"interrupted at step {step} by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _handler(signum: int, frame) -> None:
    if _state["signum"]:  # the second signal: no more waiting for the step to end
        os._exit(128 + signum)
    _state["signum"] = signum


def install() -> None:
    """Record SIGTERM/SIGINT instead of dying (main thread only; call on every rank alike)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _handler)
    _state.update(installed=True, signum=0)


def uninstall() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL if sig == signal.SIGTERM else signal.default_int_handler)
    _state.update(installed=False, signum=0)


def pending() -> int:
    """The signal this rank received (0: none, or not installed). The ranks agree on it in the
    step's one check (`step_check.agree`), so all see the same answer and stop at the same step."""
    return _state["signum"] if _state["installed"] else 0


def interrupt_line(step: int | None, saved_on_signal: bool) -> str:
    """The one line a user sees when a run stops on a signal, given its newest snapshot."""
    if step is None:
        return "interrupted before the first snapshot; nothing saved; rerun the same command to start again"
    if saved_on_signal:
        return f"interrupted at step {step}; snapshot saved; rerun the same command to continue"
    return f"interrupted; the newest snapshot is step {step}; rerun the same command to continue from it"
