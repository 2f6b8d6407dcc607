"""Training metrics: the one communication timer, the trainer's writer of `metrics.jsonl` (the
format and the file are `nanoddp.base.records`'s), optional TensorBoard, and the one-line console
summary.

The comm timer (`CommWindow`, `CommTimer`, `timed_comm_hook`) is shared: the trainer's engines
time their gradient communication with it on every rank, and `nanoddp bench train` turns its
outside probes' timestamps into the same window. The files and the line are rank 0's.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanoddp.base.records import RecordWriter

logger = logging.getLogger(__name__)

# --- the communication timer ------------------------------------------------------------------


@dataclass(frozen=True)
class CommWindow:
    """One step's gradient communication: first launch, last done, and when backward's compute
    ended (None: not seen), as perf_counter seconds."""

    launched: float
    finished: float
    compute_done: float | None = None

    @property
    def comm_s(self) -> float:
        """How long communication was in flight: first launch to last done."""
        return max(self.finished - self.launched, 0.0)

    @property
    def waited_s(self) -> float | None:
        """How long the step waited for it once compute was over: last done minus compute end.
        [Note: a sync launched after compute (the manual engines) also counts backward's tail
        from the last gradient to the launch, so this may exceed `comm_s`.]"""
        if self.compute_done is None:
            return None
        return max(self.finished - self.compute_done, 0.0)


class CommTimer:
    """How long gradient communication was in flight during a step (first launch to last done),
    and how much of that was *exposed*: the step waiting on it after backward's last gradient
    was computed (the rest ran hidden under backward's compute).

    Exposed time is known where the engine sees when compute ended: nanoddp's DDP timeline (its
    last gradient hook) and the manual engines (their sync starts after backward, so all of it
    is exposed). A timed comm hook alone (traced torch DDP) gives the window only.
    """

    def __init__(self) -> None:
        self.total_s = 0.0
        self.exposed_s = 0.0
        self.exposed_known = True  # False once a step's window came without its compute end
        self._first: float | None = None
        self._last: float | None = None
        self._compute_done: float | None = None

    def launched(self) -> None:
        if self._first is None:
            self._first = time.perf_counter()

    def finished(self) -> None:
        self._last = time.perf_counter()

    def compute_done(self) -> None:
        """Backward's compute is over: whatever communication remains is waited for."""
        self._compute_done = time.perf_counter()

    def close_step(self) -> None:
        """Fold the current step's window into the totals (called once per optimizer step)."""
        if self._first is not None and self._last is not None:
            window = CommWindow(self._first, self._last, self._compute_done)
            self.total_s += window.comm_s
            if window.waited_s is None:
                self.exposed_known = False
            else:  # [Note: the log line's share hidden is a share: exposed never exceeds the window]
                self.exposed_s += min(window.waited_s, window.comm_s)
        self._first = self._last = self._compute_done = None

    def add_timeline(self, timeline: list[tuple[str, float, object]]) -> None:
        """Take the step from a nanoddp DDP `last_timeline`: first bucket launch to all done, and
        the last gradient hook (else the finalize callback) as the end of backward's compute."""
        launches = [t for event, t, _ in timeline if event == "launch"]
        done = [t for event, t, _ in timeline if event == "done"]
        ready = [t for event, t, _ in timeline if event == "grad_ready"] or [
            t for event, t, _ in timeline if event == "finalize"
        ]
        if launches and done:
            self._first, self._last = launches[0], done[-1]
            self._compute_done = ready[-1] if ready else None

    def pop(self) -> tuple[float, float | None]:
        """(comm seconds, exposed seconds or None where not measured) since the last pop."""
        total, exposed = self.total_s, self.exposed_s if self.exposed_known else None
        self.total_s, self.exposed_s, self.exposed_known = 0.0, 0.0, True
        return total, exposed


def timed_comm_hook(hook: Callable, timer: CommTimer) -> Callable:
    """`hook` (state, bucket) -> Future, telling `timer` when the first bucket launches and each
    one finishes: the one way a DDP comm hook is timed (the trainer's and the tracer's).

    No return annotation on purpose: torch DDP rejects a hook whose annotation is anything but
    `Future[Tensor]`, and an absent one is accepted.
    """

    def timed(state, bucket):
        timer.launched()

        def done(fut: torch.futures.Future):
            timer.finished()
            return fut.value()

        return hook(state, bucket).then(done)

    timed.__name__ = f"timed_{getattr(hook, '__name__', 'hook')}"
    return timed


# --- the log line and the files -----------------------------------------------------------------


def _si(value: float) -> str:
    """155 -> '155', 9900 -> '9.9k', 2.5e6 -> '2.5M', 0.96 -> '0.96' (a big model on a CPU)."""
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.1f}{suffix}"
    return f"{value:.0f}" if abs(value) >= 10 else f"{value:.2g}"


def _ms(seconds: float) -> str:
    """0.0243 -> '24 ms', 0.0012 -> '1.2 ms'."""
    ms = seconds * 1e3
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.1f} ms"


def format_comm(comm_s: float | None, exposed_s: float | None) -> str | None:
    """`comm 24 ms exposed (90 % hidden)`: what the step waited for after backward's compute, and
    the share of communication that ran under it. `comm 240 ms` where exposure is not measured."""
    if comm_s is None:
        return None
    if exposed_s is None:
        return f"comm {_ms(comm_s)}"
    text = f"comm {_ms(exposed_s)} exposed"
    if comm_s > 0:
        hidden = min(max(1.0 - exposed_s / comm_s, 0.0), 1.0)
        text += f" ({100 * hidden:.0f} % hidden)"
    return text


def format_log_line(record: dict[str, Any]) -> str:
    """`step 120 | loss 2.31 | lr 3.0e-04 | 41.2 ms | 155 samples/s | 9.9k tok/s | comm 24 ms exposed
    (90 % hidden)` (times per step)."""
    parts = [
        f"step {record['step']}",
        "loss skipped" if record["loss"] is None else f"loss {record['loss']:.4f}",
        f"lr {record['lr']:.1e}",
        f"{record['step_time_s'] * 1e3:.1f} ms",
        f"{_si(record['samples_per_s'])} samples/s",
    ]
    if record.get("tokens_per_s") is not None:  # None: the dataset does not say what a token is
        parts.append(f"{_si(record['tokens_per_s'])} tok/s")
    comm = format_comm(record.get("comm_time_s"), record.get("comm_exposed_s"))
    if comm is not None:
        parts.append(comm)
    if record.get("val_loss") is not None:
        parts.append(f"val {record['val_loss']:.4f}")
    return " | ".join(parts)


class MetricsLogger:
    """Append records to `run_dir/metrics.jsonl` (`records.RecordWriter`), and TensorBoard
    scalars if asked."""

    def __init__(self, run_dir: str | Path, kind: str = "jsonl"):
        self._records = RecordWriter(run_dir)
        self.path = self._records.path
        self._tensorboard = None
        if kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        elif kind != "jsonl":
            raise ValueError(f"metrics must be 'jsonl' or 'tensorboard', got {kind!r}")

    def truncate_after(self, step: int) -> None:
        """Drop records past `step`: a resumed run re-does those steps and logs them again."""
        self._records.truncate_after(step)

    def write(self, record: dict[str, Any]) -> None:
        self._records.write(record)
        if self._tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tensorboard.add_scalar(key, value, record["step"])
            self._tensorboard.flush()

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()


class Window:
    """Loss and wall time accumulated between two log lines."""

    def __init__(self, start_step: int):
        self.start_step = start_step
        self.steps = 0
        self.loss_steps = 0  # steps whose loss counts: a skipped step's (non-finite) does not
        self.loss_sum = torch.zeros(())
        self.comm_bytes = 0  # what this rank's step collectives sent over the window
        self.started = time.perf_counter()
        self.paused_s = 0.0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - started

    def add_loss(self, loss: torch.Tensor | None, comm_bytes: int = 0) -> None:
        """One step done, with its loss (None: a step whose update was skipped, see step_check)
        and the bytes its collectives sent from this rank."""
        self.steps += 1
        self.comm_bytes += comm_bytes
        if loss is not None:
            self.loss_sum = self.loss_sum.to(loss.device) + loss.float()
            self.loss_steps += 1

    def elapsed_s(self) -> float:
        return max(time.perf_counter() - self.started - self.paused_s, 1e-9)


def redirect_logging(progress) -> contextlib.AbstractContextManager:
    """Route log lines through tqdm.write while the bar is visible, so they don't tear it."""
    if progress.disable:
        return contextlib.nullcontext()
    from tqdm.contrib.logging import logging_redirect_tqdm

    return logging_redirect_tqdm()
