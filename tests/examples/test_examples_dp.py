"""examples/dataparallel.py runs end to end and says what it should (as a real subprocess)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dataparallel.py"


def test_dataparallel_example_runs_and_reports():
    batch, seq, vocab, steps = 5, 16, 512, 3
    cmd = [
        sys.executable,
        str(EXAMPLE),
        "--devices",
        "cpu,cpu,cpu",
        "--batch",
        str(batch),
        "--seq",
        str(seq),
        "--steps",
        str(steps),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # Part 1: torch.chunk split (2, 2, 1) and gradients equal to the full-batch backward.
    assert f"({batch}, {seq}) -> [(2, {seq}), (2, {seq}), (1, {seq})]" in out
    assert "is_leaf=False" in out
    diff = float(re.search(r"max \|grad - full-batch grad\| = (\S+)", out).group(1))
    assert diff < 1e-5
    # Part 2: the full logits (B, T, V) float32 vs one float32 loss per replica.
    gathered = {
        name: int(n.replace(",", ""))
        for name, n in re.findall(r"^(logits gathered|loss in forward)\s*:\s*([\d,]+) bytes", out, re.M)
    }
    assert gathered == {"logits gathered": batch * seq * vocab * 4, "loss in forward": 3 * 4}
    two_losses = re.findall(r"bytes gathered to cpu \| loss (\S+)", out)
    assert len(two_losses) == 2 and abs(float(two_losses[0]) - float(two_losses[1])) < 1e-5
    # Part 3: training with loss in forward makes progress on its batch.
    losses = [float(x) for x in re.findall(r"^step \d+ \| loss (\S+)", out, re.M)]
    assert len(losses) == steps and losses[-1] < losses[0]
