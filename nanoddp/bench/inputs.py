"""What a benchmark is given, checked before it measures anything.

A benchmark measures for minutes, then writes what it found. A flag it reads late fails late: an
output path in a missing or read-only directory after every measurement (the results lost), a
delay of `nan` a minute in, with a child training on. So every benchmark's flags are checked
where argparse reads them, by the types here: a count is an integer in its range, a number is
finite and in its range, an output file or directory is one the atomic writer
(`nanoddp.base.files`) will be able to write, and nothing is created to find that
out. Every benchmark's parser is a `BenchParser`, so a refusal, from a type here or from a
benchmark's own check, is one line (`nanoddp bench NAME: error: ...`) and exit code 2.
"""

from __future__ import annotations

import argparse
import math
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from nanoddp.base.files import UnsafePath, open_directory, refuse_planted


class BenchParser(argparse.ArgumentParser):
    """A benchmark's parser: a usage error is one line, not the usage and a traceback, and an
    unknown flag is refused here (argparse would hand it up to `nanoddp`'s own parser)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def refuse(self, exc: Exception, code: int = 2) -> int:
        """A benchmark stopped short (its own check refused, a child run failed): the reason
        after the benchmark's name, no traceback; returns the exit code."""
        print(f"{self.prog}: error: {exc}", file=sys.stderr)
        return code


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """`--help` gives each flag's default, unless its help already says it or it has none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default in ("", argparse.SUPPRESS)
        if unset or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def count(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    return parse


def number(minimum: float, maximum: float = math.inf) -> Callable[[str], float]:
    """An argparse type: a finite float in [`minimum`, `maximum`] (nan passes every `<` check, so
    it is refused by name)."""
    rule = f">= {minimum:g}" if maximum == math.inf else f"in [{minimum:g}, {maximum:g}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and minimum <= value <= maximum):
            raise argparse.ArgumentTypeError(f"must be a finite number {rule}, got {text!r}")
        return value

    return parse


def output_file(text: str) -> str:
    """An argparse type: a file path the atomic writer can replace (`check_output_file`)."""
    return _as_type(check_output_file, text)


def output_dir(text: str) -> str:
    """An argparse type: a directory path files can be written under (`check_output_dir`)."""
    return _as_type(check_output_dir, text)


def input_file(text: str) -> str:
    """An argparse type: an existing, readable regular file."""
    return _as_type(check_input_file, text)


def check_output_file(text: str) -> None:
    """Raise ValueError unless `text` is a file the atomic writer can replace: in an existing,
    writable directory, and not a directory, a link or anything but a regular file itself."""
    path = Path(text)
    if path.is_dir():
        raise ValueError(f"{text} is a directory; give a file path inside it")
    _check_writable_dir(path.parent, text)
    refuse_planted(path)  # UnsafePath, a ValueError


def check_output_dir(text: str) -> None:
    """Raise ValueError unless `text` is a directory, or can be made one under its nearest
    existing parent (it is created when the first file is written, not now)."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{text} is a file, not a directory; give a directory path")
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    _check_writable_dir(existing, text)


def check_input_file(text: str) -> None:
    """Raise ValueError unless `text` is an existing regular file this process can read."""
    path = Path(text)
    if not path.is_file():
        raise ValueError(f"{text} {'is a directory' if path.is_dir() else 'does not exist'}; give an existing file")
    try:
        path.open("rb").close()
    except OSError as exc:
        raise ValueError(f"{text} cannot be read ({exc.strerror})") from None


def _as_type(check: Callable[[str], None], text: str) -> str:
    """`check` as an argparse type: its ValueError becomes the flag's error (argparse would put
    a generic "invalid value" in its place)."""
    try:
        check(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _check_writable_dir(directory: Path, text: str) -> None:
    """Raise ValueError unless `directory` exists and a file can be made in it, found out with an
    unnamed temporary file (O_TMPFILE where the filesystem has it): nothing is left behind."""
    try:
        is_dir = stat.S_ISDIR(directory.stat().st_mode)
    except OSError:
        is_dir = None
    if not is_dir:
        what = f"the directory {directory} does not exist" if is_dir is None else f"{directory} is not a directory"
        raise ValueError(f"{text}: {what}; create it or choose another path")
    try:
        with open_directory(directory):  # the writer's own rule on a symlinked directory
            pass
        with tempfile.TemporaryFile(dir=directory):
            pass
    except UnsafePath as exc:
        raise ValueError(f"{text}: {exc}") from None
    except OSError as exc:
        raise ValueError(f"{text}: cannot write in {directory} ({exc.strerror}); choose a writable directory") from None
