"""The `nanoddp` command and the config-dataclass machinery behind its flags."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Literal

import pytest

import nanoddp
from nanoddp import dataclass_cli as config
from nanoddp.cli import main


@dataclass(kw_only=True)
class DemoConfig:
    steps: int = 10
    """How many optimizer steps to run."""
    lr: float = 3e-4
    """Peak learning rate."""
    engine: Literal["nanoddp", "torch"] = "nanoddp"
    """Gradient synchronisation engine."""
    compile: bool = False
    """Wrap the model in torch.compile."""
    nproc: tuple[int, ...] = (1, 2)
    """World sizes to try."""
    out: str | None = None
    """Output directory."""


def _parse(argv, config_file=None):
    parser = argparse.ArgumentParser()
    config.add_dataclass_args(parser, DemoConfig)
    return config.config_from_args(DemoConfig, parser.parse_args(argv), config_file)


def test_flags_are_generated_with_docstring_help():
    parser = argparse.ArgumentParser()
    config.add_dataclass_args(parser, DemoConfig)
    text = parser.format_help()
    assert "--steps STEPS" in text and "How many optimizer steps to run. (default: 10)" in text
    assert "--compile, --no-compile" in text and "{nanoddp,torch}" in text


def test_precedence_defaults_file_flags(tmp_path):
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text("steps = 50\nlr = 0.1\nnproc = [2, 4]\n")
    cfg = _parse(["--lr", "0.5", "--compile"], str(cfg_file))
    assert cfg == DemoConfig(steps=50, lr=0.5, compile=True, nproc=(2, 4))
    assert _parse([]) == DemoConfig()


def test_unknown_config_key_is_rejected_by_name(tmp_path):
    cfg_file = tmp_path / "c.json"
    cfg_file.write_text(json.dumps({"steps": 5, "learning_rate": 1.0}))
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['learning_rate'\] in config file"):
        _parse([], str(cfg_file))


def test_wrong_type_in_config_file_is_rejected(tmp_path):
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('steps = "ten"\n')
    with pytest.raises(ValueError, match="steps in config file .* must be int, got 'ten'"):
        _parse([], str(cfg_file))
    cfg_file.write_text('engine = "horovod"\n')
    with pytest.raises(ValueError, match=r"engine .* must be one of \['nanoddp', 'torch'\], got 'horovod'"):
        _parse([], str(cfg_file))


def test_missing_config_file_and_bad_suffix(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        config.load_config_file(tmp_path / "nope.toml")
    (tmp_path / "c.yaml").write_text("a: 1")
    with pytest.raises(ValueError, match="must end in .toml or .json"):
        config.load_config_file(tmp_path / "c.yaml")


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"nanoddp {nanoddp.__version__}"
    assert main([]) == 2
    assert "commands" in capsys.readouterr().out


def test_check_command_end_to_end():
    proc = subprocess.run(
        [sys.executable, "-m", "nanoddp", "check", "--nproc", "2", "--backend", "gloo"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2 and all("all_reduce(rank) = 1 ok" in line for line in lines)
