"""Bad input stops `nanoddp train` in the launcher, before any worker starts: one line naming the
value, the rule and the fix, and exit code 2. Runs in this process; nothing is launched."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from helpers import FLAGS, SMALL

from nanoddp import cli
from nanoddp.env import DistEnv
from nanoddp.train.checkpoint import snapshot
from nanoddp.train.trainer import Trainer


def _refused(argv: list[str], capsys) -> str:
    """Run `nanoddp train argv`; it must exit 2 with exactly one line on stderr; return it."""
    assert cli.main(["train", *FLAGS, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nanoddp: error: "), err
    return err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lr", "nan"], "lr must be a finite number, got nan"),
        (["--grad-clip", "nan"], "grad_clip must be a finite number, got nan"),  # not "clipping off"
        (["--collective-timeout", "inf"], "collective_timeout must be a finite number, got inf"),
        (["--d-model", "30", "--n-heads", "4"], "d_model=30 must be divisible by n_heads=4"),
    ],
)
def test_bad_values_are_one_line(argv, message, capsys, tmp_path):
    assert message in _refused([*argv, "--out", str(tmp_path / "run")], capsys)
    assert not (tmp_path / "run").exists()  # a refused run leaves no directory behind


def test_bad_paths_are_one_line(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    err = _refused(["--data", str(empty), "--out", str(tmp_path / "a")], capsys)
    assert f"data '{empty}' is empty" in err
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert f"--out {a_file} is a file" in _refused(["--out", str(a_file)], capsys)
    assert "is not a nanoddp snapshot" in _refused(["--out", str(tmp_path / "b"), "--resume", str(a_file)], capsys)


def test_snapshot_of_another_model_shape_is_refused(tmp_path, capsys):
    Trainer.from_config(
        replace(SMALL, out=str(tmp_path / "src"), resume="never"), DistEnv.single_process("gloo")
    ).train()
    path = snapshot.snapshot_path(tmp_path / "src" / "snapshots", 3)
    state = snapshot.load(path)
    model = state["objects"]["model"]["state"]
    model["tok_emb.weight"] = model["tok_emb.weight"][:, :16]  # same config, other shapes
    bad = snapshot.save(tmp_path / "other.pt", state)
    err = _refused(["--out", str(tmp_path / "run"), "--resume", str(bad)], capsys)
    assert f"snapshot {bad} does not fit this model (tok_emb.weight: (256, 16) vs (256, 32))" in err


def test_malformed_config_files_are_named(tmp_path, capsys):
    toml, js = tmp_path / "c.toml", tmp_path / "c.json"
    toml.write_text("steps = [\n")
    js.write_text('{"steps": ')
    assert f"config file '{toml}' is not valid toml" in _refused(["--config", str(toml)], capsys)
    assert f"config file '{js}' is not valid json" in _refused(["--config", str(js)], capsys)
    js.write_text(json.dumps({"steps": 3}))  # and a good one still loads (refused later, by --lr)
    assert "lr must be" in _refused(["--config", str(js), "--lr", "inf"], capsys)


def test_unknown_flag_prints_the_train_usage(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--bogus"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.startswith("usage: nanoddp train") and "nanoddp train: error: unrecognized arguments: --bogus" in err


def test_sample_rejects_top_k_0_and_bad_temperature(tmp_path, capsys):
    Trainer.from_config(
        replace(SMALL, out=str(tmp_path), steps=1, resume="never"), DistEnv.single_process("gloo")
    ).train()
    assert cli.main(["sample", "--run", str(tmp_path), "--top-k", "0"]) == 2
    assert "--top-k must be >= 1" in capsys.readouterr().err
    assert cli.main(["sample", "--run", str(tmp_path), "--temperature", "nan"]) == 2
    assert "--temperature must be a finite number > 0" in capsys.readouterr().err
