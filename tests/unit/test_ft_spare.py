"""The warm spare (`python -m nanoddp.ft.spare MODULE ARGS...`): it imports MODULE, waits, and
either becomes the replica whose variables it is sent (MODULE.main(ARGS) with them set) or, when
its input ends first, exits 0 without running anything. The launcher's side of it is run end to
end in tests/multiproc/test_ft.py (a SIGKILLed replica replaced by the spare)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

TARGET = """
import os, sys
from pathlib import Path
Path(os.environ["IMPORTED_MARK"]).touch()  # the spare imported this module

def main(argv):
    print("ran", argv, sys.argv, os.environ.get("NANODDP_FT_REPLICA"), flush=True)
    return int(argv[0])
"""


def _spare(tmp_path):
    (tmp_path / "spare_target.py").write_text(TARGET)
    path = f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env = {**os.environ, "PYTHONPATH": path, "IMPORTED_MARK": str(tmp_path / "imported")}
    command = [sys.executable, "-m", "nanoddp.ft.spare", "spare_target", "3", "--flag"]
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


@pytest.mark.timeout(120)
def test_a_spare_becomes_the_replica_it_is_sent_with_its_imports_done_before(tmp_path):
    spare = _spare(tmp_path)
    deadline = time.monotonic() + 90
    while not (tmp_path / "imported").exists():  # imported with nothing sent: ready before it is needed
        assert spare.poll() is None and time.monotonic() < deadline, spare.communicate()
        time.sleep(0.05)
    out, err = spare.communicate((json.dumps({"NANODDP_FT_REPLICA": "1"}) + "\n").encode(), timeout=100)
    assert spare.returncode == 3, err.decode()[-2000:]  # main's return value is the exit code
    text = out.decode()
    assert text == "ran ['3', '--flag'] ['spare_target', '3', '--flag'] 1\n", text  # its argv, then its variables
    assert err.decode() == ""  # no warning (e.g. runpy's about a module loaded twice)


@pytest.mark.timeout(120)
def test_a_spare_that_is_never_needed_exits_0_without_running(tmp_path):
    spare = _spare(tmp_path)
    out, err = spare.communicate(b"", timeout=100)
    assert spare.returncode == 0, err.decode()[-2000:]
    assert (tmp_path / "imported").exists() and out == b"" and err == b""
