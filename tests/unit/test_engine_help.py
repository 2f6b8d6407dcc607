"""`nanoddp train --help` lists every engine of the registry, each on a line of its own."""

from __future__ import annotations

import pytest

from nanoddp import cli
from nanoddp.train.engines import ENGINE_REGISTRY, ENGINES


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


def test_zero1_is_the_one_way_to_zero_no_zero_flag_or_key(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--zero"])
    assert "unrecognized arguments: --zero" in capsys.readouterr().err
    (tmp_path / "c.toml").write_text("zero = true\n")
    assert cli.main(["train", "--config", str(tmp_path / "c.toml")]) == 2
    assert "unknown key(s) ['zero']" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--group-size", "2"], "--group-size (ranks per replica group) applies to --engine hsdp (and, under "
         "--on-failure continue, nanoddp, zero1 and zero2), not 'nanoddp'"),
        (["--engine", "fsdp", "--group-size", "2"], "continue, nanoddp, zero1 and zero2), not 'fsdp'"),
        (["--engine", "hsdp", "--nproc", "4", "--group-size", "3"], "--group-size 3 (ranks per replica group) must "
         "divide the world size 4 into equal groups; use a divisor of 4"),
        (["--engine", "hsdp", "--group-size", "0"], "--group-size 0 (ranks per replica group) must divide"),
        (["--engine", "hsdp", "--nproc", "2", "--nnodes", "2", "--group-size", "3", "--rdzv-endpoint", "127.0.0.1:1"],
         "--group-size 3 (ranks per replica group) must divide the world size 4"),
    ],
)  # fmt: skip
def test_group_size_is_refused_in_one_line_before_anything_starts(argv, message, capsys):
    assert cli.main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
