"""Config dataclasses -> argparse flags and config files, with no silent defaults.

A config is a `@dataclass(kw_only=True)` whose fields each carry a docstring (a string literal
on the line after the field). From it we generate `--flag` options whose help is that
docstring, and we load TOML/JSON files into it. Precedence: defaults < file < command line.
An unknown key in a file is an error that names the key, not something silently ignored.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import re
import sys
import textwrap
import types
import typing
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")  # a dataclass type: build_config reads its fields


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, following in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _resolved_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


class KeepLinesHelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, but a help text's own line breaks stay: each line is wrapped on its
    own. An indented `name  text` line (a list of choices, one per line) wraps under its text;
    a help without line breaks looks exactly as argparse draws it."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        if "\n" not in text:
            return super()._split_lines(text, width)
        lines: list[str] = []
        for line in text.splitlines():
            item = re.match(r"(\s+)\S+\s{2,}", line)  # "  name  explanation"
            indent = item.group(1) if item else ""
            hang = " " * item.end() if item else ""
            lines += textwrap.wrap(line.strip(), width, initial_indent=indent, subsequent_indent=hang) or [""]
        return lines


def add_dataclass_args(
    parser: argparse.ArgumentParser,
    cls: type,
    exclude: tuple[str, ...] = (),
    extra_help: dict[str, str] | None = None,
) -> None:
    """Add one `--field-name` option per field. Options left off the command line are absent
    from the namespace (default SUPPRESS), which is how a config file's values survive.
    `extra_help[field]` is appended to that field's help on lines of its own (shown as lines
    under `KeepLinesHelpFormatter`)."""
    docs = field_docs(cls)
    hints = _resolved_types(cls)
    for f in dataclasses.fields(cls):
        if f.name in exclude or not f.init:
            continue
        tp, optional = _unwrap_optional(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = docs.get(f.name, "")
        if default is not None:
            help_text = f"{help_text} (default: {default})".strip()
        if extra_help and f.name in extra_help:
            help_text = f"{help_text}\n{extra_help[f.name]}"
        flag = "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        if tp is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if typing.get_origin(tp) is Literal:
            kwargs["choices"] = list(typing.get_args(tp))
            kwargs["type"] = type(typing.get_args(tp)[0])
        elif typing.get_origin(tp) in (list, tuple):
            kwargs["nargs"] = "+"
            kwargs["type"] = typing.get_args(tp)[0]
        else:
            kwargs["type"] = tp
        if optional and "choices" not in kwargs:
            kwargs["metavar"] = f.name.upper()
        parser.add_argument(flag, **kwargs)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML or JSON config file into a dict (keys may use '-' or '_')."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    if path.suffix == ".toml":
        data = tomllib.loads(text)
    elif path.suffix == ".json":
        data = json.loads(text)
    else:
        raise ValueError(f"config file {str(path)!r} must end in .toml or .json")
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a table/object at top level")
    return {key.replace("-", "_"): value for key, value in data.items()}


def build_config(cls: type[T], values: dict[str, Any], source: str = "config") -> T:
    """Instantiate `cls` from `values`, rejecting unknown keys by name and coercing lists."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {source} for {cls.__name__}; valid keys: {sorted(names)}")
    hints = _resolved_types(cls)
    coerced = {}
    for key, value in values.items():
        tp, optional = _unwrap_optional(hints[key])
        if typing.get_origin(tp) in (tuple, list) and isinstance(value, (list, tuple)):
            value = typing.get_origin(tp)(value)
        _check_type(key, value, tp, optional, source)
        coerced[key] = value
    return cls(**coerced)


def _check_type(key: str, value: Any, tp: Any, optional: bool, source: str) -> None:
    """Reject a value of the wrong type (e.g. steps = "ten" in a TOML file) by name."""
    if value is None and optional:
        return
    if typing.get_origin(tp) is Literal:
        if value not in typing.get_args(tp):
            raise ValueError(f"{key} in {source} must be one of {list(typing.get_args(tp))}, got {value!r}")
        return
    plain = typing.get_origin(tp) or tp
    accepted = (int, float) if plain is float else (plain,)
    if isinstance(plain, type) and (not isinstance(value, accepted) or (plain is not bool and isinstance(value, bool))):
        raise ValueError(f"{key} in {source} must be {plain.__name__}, got {value!r}")


def config_from_args(cls: type[T], args: argparse.Namespace, config_file: str | None = None) -> T:
    """defaults < config file < flags given on the command line."""
    values: dict[str, Any] = {}
    if config_file:
        values.update(load_config_file(config_file))
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    values.update({k: v for k, v in vars(args).items() if k in names})
    source = f"config file {config_file!r} or flags" if config_file else "flags"
    return build_config(cls, values, source=source)


def to_dict(config: Any) -> dict[str, Any]:
    """A JSON-friendly dict of a config (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))


def to_argv(config: Any) -> list[str]:
    """Flags that reproduce `config` (fields left at their default are omitted): the inverse of
    `config_from_args`, for a child process that parses its own."""
    argv: list[str] = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if value == field.default or value is None:
            continue
        flag = "--" + field.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + field.name.replace("_", "-"))
        else:
            argv += [flag, str(value)]
    return argv
