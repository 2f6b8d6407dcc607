"""torchft's Manager log as a replica shows it: a failed group rebuild in one line, no traceback
and no C++ frames (the replica says what it means at the step boundary); other errors in full."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("torchft")

from nanoddp.ft.manager import torchft_modules  # noqa: E402  (after the skip)


def _logged(message: str, caplog) -> str:
    torchft_modules()  # installs the filter on torchft.manager's logger
    caplog.clear()
    try:
        raise RuntimeError("The client socket has timed out\nException raised from throwTimeoutError\nframe #0: c10")
    except RuntimeError as exc:
        logging.getLogger("torchft.manager").exception(f"[replica_1:abc/0 - step 0] {message}: {exc}")
    return caplog.text


def test_a_failed_group_rebuild_is_one_line(caplog):
    text = _logged("got exception in pg configure", caplog)
    assert "got exception in pg configure: The client socket has timed out\n" in text
    assert "Traceback" not in text and "frame #0" not in text, text


def test_another_error_keeps_its_traceback(caplog):
    text = _logged("got exception in recovery", caplog)
    assert "Traceback" in text and "frame #0" in text, text
