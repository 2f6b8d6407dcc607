"""`nanoddp train --help` lists every engine of the registry, and `--zero` is `--engine zero1`
with a deprecation line (flag and config key alike)."""

from __future__ import annotations

import logging

import pytest

from nanoddp import cli
from nanoddp.train.config import ZERO_DEPRECATION, TrainConfig, resolve_deprecated
from nanoddp.train.engines import ENGINE_REGISTRY, ENGINES
from nanoddp.train.launcher import cli as train_cli


def _train_help(monkeypatch, capsys, columns: int) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    return capsys.readouterr().out


def test_train_help_lists_every_engine_on_a_line_of_its_own(monkeypatch, capsys):
    lines = _train_help(monkeypatch, capsys, 200).splitlines()
    for name in ENGINES:
        line = [line.split() for line in lines if line.split()[:1] == [name]]
        assert line == [[name, *ENGINE_REGISTRY[name].help.split()]], name
    assert "zero1" in ENGINES and ENGINE_REGISTRY["zero1"].zero_optimizer


def test_engine_lines_wrap_under_their_text_in_a_narrow_terminal(monkeypatch, capsys):
    text = _train_help(monkeypatch, capsys, 60)
    start = text.index("  --engine ")
    block = text[start : text.index("  --model ", start)]
    for name in ENGINES:  # every engine still starts a line, with its text beside it
        assert any(line.split()[:2] == [name, ENGINE_REGISTRY[name].help.split()[0]] for line in block.splitlines())


def _load(argv: list[str]) -> TrainConfig:
    return train_cli._load_config(cli.build_parser().parse_args(["train", *argv]))


def test_zero_flag_and_config_key_are_engine_zero1_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        config = _load(["--zero"])
    assert (config.engine, config.zero) == ("zero1", False)
    assert [r.getMessage() for r in caplog.records] == [ZERO_DEPRECATION]
    assert "use --engine zero1" in ZERO_DEPRECATION and "\n" not in ZERO_DEPRECATION
    caplog.clear()
    (tmp_path / "c.toml").write_text("zero = true\n")
    with caplog.at_level(logging.WARNING):
        config = _load(["--config", str(tmp_path / "c.toml")])
    assert (config.engine, config.zero) == ("zero1", False) and len(caplog.records) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # the new way: no warning
        assert _load(["--engine", "zero1"]).engine == "zero1"
    assert not caplog.records


def test_zero_with_another_replicated_engine_keeps_that_engine(caplog):
    with caplog.at_level(logging.WARNING):
        config = resolve_deprecated(TrainConfig(engine="torch", zero=True))
    assert (config.engine, config.zero) == ("torch", True) and len(caplog.records) == 1
    assert resolve_deprecated(TrainConfig(engine="torch")) == TrainConfig(engine="torch")
