"""`nanoddp bench render`: rewrite the benchmark tables in markdown files from committed JSON.

A table between `<!-- bench:table docs/bench/X.json -->` and `<!-- /bench -->` is replaced by
`nanoddp bench report X.json`'s output; `<!-- bench:summary docs/bench/X.json ws=2 -->` by the
one-paragraph summary of that world size. Paths are relative to the repository root. Every figure
is re-derived from the JSON's raw per-step samples, so a table cannot drift from its data:
`--check` (and the test suite) fails when a file differs from what its JSON renders to.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from nanoddp.base.files import atomic_write_bytes
from nanoddp.bench.collectives import format_markdown as format_collectives
from nanoddp.bench.inputs import check_input_file, check_output_file, input_file
from nanoddp.bench.report import format_markdown, format_summary
from nanoddp.bench.wan_report import format_markdown as format_wan

BLOCK = re.compile(
    r"(?P<open><!-- bench:(?P<kind>table|summary) (?P<file>\S+)(?: ws=(?P<ws>\d+))? -->\n)"
    r"(?P<body>.*?)(?P<close><!-- /bench -->)",
    re.S,
)
DEFAULT_FILES = ("docs/performance.md",)  # the README quotes three headline figures and links here


def render_text(text: str, root: Path) -> str:
    """`text` with every bench block re-rendered from its JSON under `root`."""

    def block(match: re.Match) -> str:
        path = root / match["file"]
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"bench block names {match['file']}, which cannot be read as JSON ({e})") from None
        if not isinstance(data, dict) or "meta" not in data or "results" not in data:
            raise ValueError(
                f"{match['file']} is not a `nanoddp bench train|collectives|wan --json` file (no meta/results)"
            )
        if _is_collectives(data):
            body = format_collectives(data)  # one table: the summary is the table
        elif "summary" in data and data["results"] and "curve" in data["results"][0]:  # `bench wan`
            body = format_wan(data)
        elif match["kind"] == "table":
            body = format_markdown(data)
        else:
            body = format_summary(data, int(match["ws"] or 2))
        return f"{match['open']}{body}\n{match['close']}"

    return BLOCK.sub(block, text)


def _is_collectives(data: dict) -> bool:
    return bool(data["results"]) and "op" in data["results"][0]


def render_files(paths: list[Path], root: Path, check: bool = False) -> list[Path]:
    """Re-render every bench block in `paths`; returns the files whose text changed (with
    `check`, nothing is written). Every file is rendered before any is written, so a bad block
    in the last file leaves the first unchanged."""
    rendered = {path: render_text(path.read_text(), root) for path in paths}
    changed = [path for path, text in rendered.items() if text != path.read_text()]
    if not check:
        for path in changed:
            atomic_write_bytes(str(path), rendered[path].encode())
    return changed


def register_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "render", help="rewrite the tables in docs/performance.md from docs/bench/*.json"
    )
    parser.add_argument(
        "files", nargs="*", type=input_file, metavar="FILE.md", help=f"default: {' '.join(DEFAULT_FILES)}"
    )
    parser.add_argument("--root", default=".", help="repository root the JSON paths are relative to")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a table is out of date")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    root = Path(args.root)
    files = [Path(f) for f in args.files] or [root / f for f in DEFAULT_FILES]
    for path in files:  # every file readable, and (unless --check) replaceable, before any work
        check_input_file(str(path))
        if not args.check:
            check_output_file(str(path))
    changed = render_files(files, root, check=args.check)
    for path in changed:
        print(f"{'out of date' if args.check else 'rewrote'}: {path}")
    return 1 if args.check and changed else 0
