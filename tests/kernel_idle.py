"""Waiting for a kernel to be done with a cell, for tests that start the next cell right after.

ipykernel sends a failed cell's reply *before* it arms the abort of queued execute requests
(`stop_on_error`), and disarms it with a message of its own put behind whatever is queued by
then. A client that sends the next cell as soon as the reply arrives can land in that window,
and its cell is answered `aborted` without running; a loaded machine makes the window long
enough to hit. The kernel publishes the cell's `idle` status only after both steps, so a client
that waits for it (as `helpers.run_cell` does) is never caught.
"""

from __future__ import annotations

import time

from helpers import finish_cell

# A cell that widens ipykernel's reply-then-arm window to a second, so that a client which does
# not wait for `idle` is caught every time rather than now and then.
WIDEN_ABORT_WINDOW = (
    "import time as _time\n"
    "_kernel = get_ipython().kernel\n"
    "_arm_abort = _kernel._abort_queues\n"
    "_kernel._abort_queues = lambda *args, **kwargs: (_time.sleep(1.0), _arm_abort(*args, **kwargs))[-1]\n"
)


def finish_cell_until_idle(kc, msg_id: str, timeout: float = 60) -> dict:
    """The reply of an already-started execution, returned once the kernel is idle after it."""
    deadline = time.monotonic() + timeout
    reply = finish_cell(kc, msg_id, timeout)
    while True:
        msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return reply
