"""Each ground-floor service is written once, in nanoddp/base/, and everything above calls it.

A second copy is how the bugs this layer removed began: `ft/` wrote its own RNG capture (without
numpy, so a healed rank drew differently from a resumed one), and four launchers each had a
SIGTERM-grace-SIGKILL loop with its own wait. So the calls that make a service (a rename over a
file, an exclusive create, a process-group signal, an RNG's state) may appear only inside
nanoddp/base/; the AST of every other module is searched for them. Nothing is run.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BASE_ONLY: dict[str, str] = {
    "os.replace": "a rename over a file: the atomic writer, base/files.py",
    "os.O_EXCL": "an exclusive create: the atomic writer's temporary file, base/files.py",
    "os.O_APPEND": "an append: the append-only writer, base/files.py (append_text, open_private)",
    "os.fsync": "durability: the atomic writer, base/files.py",
    "os.killpg": "signalling a process group: base/processes.py (stop, signal_group)",
    "libc.prctl": "dying with the parent: base/processes.py (die_with_parent)",
    "random.getstate": "RNG capture: base/rng.py",
    "random.setstate": "RNG restore: base/rng.py",
    "torch.get_rng_state": "RNG capture: base/rng.py",
    "torch.set_rng_state": "RNG restore: base/rng.py",
    "torch.cuda.get_rng_state_all": "RNG capture: base/rng.py",
    "torch.cuda.set_rng_state_all": "RNG restore: base/rng.py",
    "np.random.get_state": "RNG capture: base/rng.py",
    "np.random.set_state": "RNG restore: base/rng.py",
}
# uses outside base/ that are no copy of a service: (module, name) -> why
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("nanoddp.train.checkpoint.rundir", "os.replace"): "moves a run's earlier outputs aside whole, writes nothing",
    ("nanoddp.models.smollm2", "os.replace"): "renames a converted model's directory into the cache",
    ("nanoddp.train.launcher.cli", "os.O_APPEND"): "the flag it hands files.open_private for a rank's log",
}


def _module_files() -> dict[str, Path]:
    spec = importlib.util.spec_from_file_location("nanoddp_tools_architecture", ROOT / "tools" / "architecture.py")
    arch = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = arch  # dataclasses look their module up there
    spec.loader.exec_module(arch)
    return sys.modules["layers"].module_files()  # tools/layers.py, imported by the generator


def _dotted(node: ast.Attribute) -> str | None:
    """'os.killpg' for the expression `os.killpg`; None unless it is names and attributes only."""
    parts: list[str] = []
    inner: ast.expr = node
    while isinstance(inner, ast.Attribute):
        parts.append(inner.attr)
        inner = inner.value
    return ".".join([inner.id, *reversed(parts)]) if isinstance(inner, ast.Name) else None


def base_only_uses(module: str, source: str) -> list[tuple[str, int]]:
    """(name, line) of each BASE_ONLY name `source` (module `module`) uses, outside nanoddp.base."""
    if module == "nanoddp.base" or module.startswith("nanoddp.base."):
        return []
    names = ((_dotted(node), node.lineno) for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute))
    return [(name, line) for name, line in names if name in BASE_ONLY and (module, name) not in EXCEPTIONS]


def test_no_second_copy_of_a_base_service():
    copies = [
        f"{module}:{line}: {name} ({BASE_ONLY[name]})"
        for module, path in _module_files().items()
        for name, line in base_only_uses(module, path.read_text())
    ]
    assert not copies, "outside nanoddp/base/, call the one service instead:\n" + "\n".join(copies)


def test_the_search_finds_a_copy_and_leaves_base_and_the_exceptions_alone():
    copy = "import os, signal\ndef stop(pid):\n    os.killpg(pid, signal.SIGKILL)\n"
    assert base_only_uses("nanoddp.ft.supervisor", copy) == [("os.killpg", 3)]
    assert base_only_uses("nanoddp.base.processes", copy) == []
    rng = "import torch, random\nstate = {'torch': torch.get_rng_state(), 'python': random.getstate()}\n"
    assert sorted(base_only_uses("nanoddp.ft.live_state", rng)) == [("random.getstate", 2), ("torch.get_rng_state", 2)]
    assert base_only_uses("nanoddp.models.smollm2", "import os\nos.replace('a', 'b')\n") == []


def _names_in(path: Path | None) -> set[str | None]:
    if path is None:  # the module is gone
        return set()
    return {_dotted(node) for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute)}


def test_every_exception_is_still_used():
    modules = _module_files()
    stale = [(module, name) for module, name in EXCEPTIONS if name not in _names_in(modules.get(module))]
    assert not stale, f"exceptions no module needs any more (remove them): {stale}"


# --- one metrics.jsonl parser ------------------------------------------------------------------
# `metrics.jsonl` is read through `nanoddp.base.records` (read_records) everywhere: a file that
# names it and parses JSON by hand is a second parser, which drifts from the writer's format.
RECORDS_MODULE = Path("nanoddp") / "base" / "records.py"
# files that name metrics.jsonl and parse other JSON: path -> what they parse
OTHER_JSON: dict[str, str] = {
    "tests/unit/test_bench_failure_cost.py": "the committed measurement of docs/bench/ft/",
    "tools/probes/hostile_writes.py": "each probe job's outcome line",
}


def parses_metrics_by_hand(source: str) -> list[int]:
    """The lines of `source`'s `json.loads` calls when it also names `metrics.jsonl`, else []."""
    if "metrics.jsonl" not in source:
        return []
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and _dotted(node) == "json.loads"]  # fmt: skip


def test_no_second_metrics_jsonl_parser():
    files = [p for top in ("nanoddp", "tests", "tools", "examples") for p in sorted((ROOT / top).rglob("*.py"))]
    parsers = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in files
        if path.relative_to(ROOT) != RECORDS_MODULE and str(path.relative_to(ROOT)) not in OTHER_JSON
        for line in parses_metrics_by_hand(path.read_text())
    ]
    assert not parsers, "read metrics.jsonl with nanoddp.base.records.read_records instead:\n" + "\n".join(parsers)


def test_the_parser_search_finds_a_hand_parser_only_beside_metrics_jsonl():
    by_hand = 'import json\nrecords = [json.loads(x) for x in open("run/metrics.jsonl")]\n'
    assert parses_metrics_by_hand(by_hand) == [2]
    assert parses_metrics_by_hand('import json\nconfig = json.loads(open("run/config.json").read())\n') == []


def test_every_other_json_file_still_parses_json_beside_metrics_jsonl():
    stale = [path for path in OTHER_JSON if not parses_metrics_by_hand((ROOT / path).read_text())]
    assert not stale, f"files the metrics.jsonl parser check no longer needs to pass over (remove them): {stale}"
