"""Generate docs/architecture.md from the code: the public API, the engines, the module map and
the import direction between layers, all read from `nanoddp` itself.

    python tools/architecture.py           # rewrite docs/architecture.md
    python tools/architecture.py --check   # exit 1 if docs/architecture.md is out of date

The import graph is built from the AST of every `nanoddp/**/*.py` (nothing is executed for it);
`tests/unit/test_architecture.py` uses the same functions to check for import cycles (any import:
at module level, inside a function or for type checking) and for imports that run from a lower
layer to a higher one, between the top-level parts and between the layers inside `nanoddp.comm`.
The hand-written prose (the layering rules) lives here, as text, so the page has one source.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nanoddp"
DOC = ROOT / "docs" / "architecture.md"
if str(ROOT) not in sys.path:  # `python tools/architecture.py` imports this checkout's nanoddp
    sys.path.insert(0, str(ROOT))

# Layers, lowest first: a module may import its own layer and the layers below it. `cli`,
# `__main__` and the root `nanoddp/__init__.py` (the public API re-exported) sit on top.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("base",)),  # files, RNG, processes, limits: written once, imports nothing of nanoddp above it
    ("env", ("env", "hosts", "torchrun", "groups", "launch", "tempdirs", "dataclass_cli")),
    ("models", ("models",)),
    ("comm", ("comm",)),
    ("parallel", ("parallel", "fsdp")),  # `nanoddp.fsdp` is the face of parallel/fsdp/
    ("ft", ("ft",)),
    ("train", ("train",)),
    ("apps", ("bench", "notebook", "run", "cli", "__main__", "")),
)
LAYER_OF_TOP = {top: i for i, (_, tops) in enumerate(LAYERS) for top in tops}

# nanoddp.comm's own layers, lowest first, a folder each: a module's layer is its folder (comm/__init__.py
# is the api's face; outside a folder is an error); it imports its layer and those below (any level).
# [Note: plan below the algorithms] `plan` is a table of thresholds and a pure function of them;
# the algorithms cut their pieces by its sizes, and it names them only as `Path` members.
COMM_LAYERS: tuple[tuple[str, str], ...] = (
    ("transport", "send/recv by group rank and tags, byte counting, one runner thread per group, the hang "
     "watchdog, groups that have collectives only, the simulated slow link"),
    ("plan", "`plan()` and the one table of thresholds it reads; the α–β cost model"),
    ("algorithms", "the bulk algorithms over send/recv, each readable on its own"),
    ("protocol", "the wire (the one header format, tag counter, verdict), the header round, settling a "
     "failed call, argument checks; the optional prepared rounds a loop repeats, where `plan()` says so"),
    ("api", "torch.distributed's collectives, each check -> plan -> run; the switch between ours and torch's "
     "(`backend`); `nanoddp/comm/__init__.py` is their face"),
)  # fmt: skip
COMM_LAYER_OF = {folder: i for i, (folder, _) in enumerate(COMM_LAYERS)}

# Imports that run upward on purpose, each with its reason: (importer, imported) -> why.
# The test fails on an upward import not listed here, so a new one is a decision, not a slip.
UPWARD_EXCEPTIONS: dict[tuple[str, str], str] = {}


RULES = """\
## Rules every change keeps

- **One concept per file; a class lives in one file.** A module holds one idea (the header
  round, the bucket layout, the sampler, a subcommand), its docstring's first line names it, and
  a class is never split across files. Package `__init__.py` files only re-export (at most 60
  lines); no module under `nanoddp/` or `tools/` grows past 450 lines
  (`tests/unit/test_architecture.py` checks both).
- **Imports run one way**, down the layers below (inside `nanoddp.comm` too: its own layers,
  below); no import cycle among modules, counting imports inside functions and for type checking.
- The model knows nothing of parallelism: a wrapper is applied to it from outside
  (`DistributedDataParallel(model)`, a manual strategy, `ZeroRedundancyOptimizer`, `fully_shard`).
- Gradients are averaged over the global batch: a ws-N run with per-rank batch B equals a
  single process with batch N·B, for every engine (tests compare with `assert_close`, bitwise
  where the math allows).
- Every rank raises the same clear error for bad input; nothing hangs.
- Snapshots hold model, optimizer, scheduler, step, sampler position, every RNG and the config;
  they are written to a temp file, fsynced and `os.replace`d, with a checksum verified on load;
  resume from step k gives bitwise the parameters of an uninterrupted run.
- `world_size == 1` is a path, not a different object shape.
- **Each ground-floor idea once, in `nanoddp/base/`**: the atomic writer and the append-only
  writer (`files.py`), RNG capture and restore (`rng.py`), starting, stopping and becoming a
  worker process (`processes.py`), the shared timeouts (`limits.py`). The calls that make them
  (`os.replace`, `O_EXCL`, `os.killpg`, `torch.get_rng_state`, ...) appear nowhere else
  (checked by `tests/unit/test_base_services.py`).
- `env.py` is the only reader of `os.environ` for rank, world size, device and backend.
"""

INTRO = """\
# nanoddp architecture

<!-- Generated by `python tools/architecture.py` from the code; do not edit by hand.
     `tests/unit/test_architecture.py` fails when this page is out of date. -->

Data flows one way, and so do imports:

```
launch ──> env ──> data ──> model ──> parallel wrapper ──> comm ──> trainer ──> snapshot / metrics
```

Layers, lowest first (a module imports its own layer and those below it):
{layers}

Where to read first: `nanoddp/parallel/manual.py` (`SimpleDDP`, the smallest honest DDP), then
`nanoddp/parallel/ddp/wrapper.py` (the DDP engine: its opening docstring tells the life of one
iteration in order), `parallel/zero/` and `parallel/fsdp/`, then the collectives they call:
`examples/collectives.py` (send/recv, every collective, the ring all-reduce one step at a time)
and `nanoddp/comm/` from its api down (below). Each topic has its page:
[comm](comm.md), [ddp](ddp.md), [sharding](sharding.md), [trainer](trainer.md),
[notebook](notebook.md), [multinode](multinode.md), [performance](performance.md).
"""


# --- reading the code ----------------------------------------------------------------------


def module_files() -> dict[str, Path]:
    """{dotted module name: path} for every .py file under nanoddp/ (packages by their __init__)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def first_line(doc: str | None) -> str:
    """A docstring's summary on one line: its first line, continued to the end of that sentence
    when the sentence runs on (never past the first paragraph); '' when there is no docstring."""
    lines = (doc or "").strip().split("\n\n")[0].splitlines()
    summary = ""
    for line in lines:
        summary = f"{summary} {line.strip()}".strip()
        if re.search(r"[.:!?)`]$", summary) or re.search(r"(?<!e\.g)(?<!i\.e)\.\s", summary):
            break
    end = re.search(r"(?<!e\.g)(?<!i\.e)\.\s", summary)
    return summary[: end.start() + 1] if end else summary


def module_summary(path: Path) -> str:
    return first_line(ast.get_docstring(ast.parse(path.read_text())))


def top_of(module: str) -> str:
    """The top-level part a module belongs to: 'comm' for nanoddp.comm.algorithms.ring, '' for nanoddp."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_of(module: str) -> int:
    return LAYER_OF_TOP[top_of(module)]


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    where: str  # "module" (runs at import), "function" (inside a def) or "typing" (TYPE_CHECKING)
    line: int


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is a nanoddp module."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    """Every import of a nanoddp module in `path`: `from pkg import module` resolves to the
    module, `from pkg import name` to the package, relative imports to their absolute name."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges: list[Edge] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inner = "function" if where == "module" else where
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.body:
                    visit_one(sub, "typing")
                for sub in child.orelse:
                    visit_one(sub, where)
                continue
            visit_one(child, inner)

    def visit_one(node: ast.AST, where: str) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name, modules)
                if target:
                    edges.append(Edge(module, target, where, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else _resolve(base, modules)
                if target:
                    edges.append(Edge(module, target, where, node.lineno))
        visit(node, where)

    visit(ast.parse(path.read_text()), "module")
    return [e for e in edges if e.target != module]


def import_graph() -> list[Edge]:
    modules = module_files()
    return [edge for name, path in modules.items() for edge in imports_of(name, path, modules)]


def import_cycles(edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module, over every import: one inside a
    function or under TYPE_CHECKING breaks no cycle at run time, but the two modules still need
    each other to be read."""
    graph: dict[str, set[str]] = defaultdict(set)
    for e in edges:
        graph[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan, recursion depth = the longest import chain
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return cycles


def upward_imports(edges: list[Edge]) -> list[Edge]:
    """Imports (at any level) from a lower layer to a higher one."""
    return [e for e in edges if layer_of(e.source) < layer_of(e.target)]


def comm_part(module: str) -> str | None:
    """A module's name inside nanoddp.comm ('algorithms.ring' for nanoddp.comm.algorithms.ring,
    '' for the package itself); None outside it."""
    if module == "nanoddp.comm":
        return ""
    return module.removeprefix("nanoddp.comm.") if module.startswith("nanoddp.comm.") else None


def comm_layer_of(part: str) -> int:
    """The COMM_LAYERS index of a `comm_part`: its folder's; the face (part '') is the api's."""
    folder = part.split(".")[0] if part else "api"
    if folder not in COMM_LAYER_OF:
        raise ValueError(f"nanoddp.comm.{part} is in no layer: move it into one of {list(COMM_LAYER_OF)}")
    return COMM_LAYER_OF[folder]


def comm_upward_imports(edges: list[Edge]) -> list[Edge]:
    """Imports (at any level) inside nanoddp.comm from a lower COMM_LAYERS layer to a higher one."""
    upward = []
    for e in edges:
        source, target = comm_part(e.source), comm_part(e.target)
        if source is not None and target is not None and comm_layer_of(source) < comm_layer_of(target):
            upward.append(e)
    return upward


# --- reading the public API ----------------------------------------------------------------


def api_rows() -> list[tuple[str, str, str]]:
    """(name, kind, one-line summary) for every name in `nanoddp.__all__`."""
    nanoddp = importlib.import_module("nanoddp")
    rows = []
    for name in nanoddp.__all__:
        obj = getattr(nanoddp, name)
        if inspect.ismodule(obj):
            kind, doc = f"module `{obj.__name__}`", obj.__doc__
        elif inspect.isclass(obj):
            kind, doc = f"class, `{obj.__module__}`", obj.__doc__
        elif callable(obj):
            kind, doc = f"function, `{obj.__module__}`", obj.__doc__
        else:
            kind, doc = "value", f"The package version, `{obj}`." if name == "__version__" else repr(obj)
        rows.append((name, kind, first_line(doc)))
    return rows


def _engine_table(doc: str | None) -> dict[str, str]:
    """Rows of the `| engine | wraps | sync |` table in the engines module docstring."""
    rows = {}
    for line in (doc or "").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"`[\w-]+`", cells[0]):
            rows[cells[0].strip("`")] = f"wraps the model in {cells[1]}; gradient sync: {cells[2]}"
    return rows


def engine_rows() -> list[tuple[str, str]]:
    """(name, description) for every engine of the registry: its `--help` line, then what the
    engines module's table says it wraps and how it syncs."""
    engines = importlib.import_module("nanoddp.train.engines")
    table = _engine_table(engines.__doc__)
    rows = []
    for name, kind in engines.ENGINE_REGISTRY.items():
        rows.append((name, "; ".join(part for part in (kind.help, table.get(name)) if part)))
    return rows


# --- rendering -----------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    modules = module_files()
    edges = import_graph()
    layer_lines = "\n".join(
        f"{i + 1}. **{label}**: " + ", ".join(f"`{t or 'nanoddp/__init__.py'}`" for t in tops)
        for i, (label, tops) in enumerate(LAYERS)
    )
    out = [INTRO.format(layers=layer_lines)]

    out.append("## Public API: `nanoddp.__all__`\n\n| name | what | summary |\n|---|---|---|")
    out += [f"| `{n}` | {kind} | {_cell(s)} |" for n, kind, s in api_rows()]

    out.append("\n## Engines: `nanoddp.train.engines.ENGINES`\n")
    out.append(
        "`nanoddp train --engine NAME`, `TrainConfig.engine` and `nanoddp bench train` read this one registry.\n"
    )
    out.append("| engine | description |\n|---|---|")
    out += [f"| `{n}` | {_cell(d)} |" for n, d in engine_rows()]

    out.append("\n## Import direction between layers (computed from the imports)\n")
    out.append(
        "Each row: a top-level part of `nanoddp`, the parts its modules import when they are imported, "
        "and those imported only inside functions. Built from the AST of every module; no part imports "
        "a higher layer unless listed below."
    )
    out.append("\n| part | layer | imports | only inside functions |\n|---|---|---|---|")
    tops = sorted({top_of(m) for m in modules}, key=lambda t: (LAYER_OF_TOP[t], t))
    for top in tops:
        at_module = {top_of(e.target) for e in edges if top_of(e.source) == top and e.where == "module"} - {top}
        in_funcs = {top_of(e.target) for e in edges if top_of(e.source) == top} - at_module - {top}

        def names(parts: set[str]) -> str:
            ordered = sorted(parts, key=lambda t: (LAYER_OF_TOP[t], t))
            return ", ".join(f"`{p or 'nanoddp'}`" for p in ordered) or "–"

        label = LAYERS[LAYER_OF_TOP[top]][0]
        out.append(f"| `{top or 'nanoddp/__init__.py'}` | {label} | {names(at_module)} | {names(in_funcs)} |")
    upward = upward_imports(edges)
    if upward:
        out.append("\nImports that run upward, each on purpose:\n")
        for e in sorted(upward, key=lambda e: (e.source, e.target)):
            why = UPWARD_EXCEPTIONS.get((e.source, e.target), "not yet explained: see tests/unit/test_architecture.py")
            out.append(f"- `{e.source}` → `{e.target}` ({e.where}-level): {why}")
    cycles = import_cycles(edges)
    if cycles:
        out.append("\nImport cycles among modules (any import), to be removed:\n")
        out += [f"- {' ⇄ '.join(f'`{m}`' for m in c)}" for c in cycles]

    out.append("\n" + RULES)
    out.append(_render_comm_layers(modules))

    out.append("## Module map\n\nEvery package and module, with the first line of its docstring.")

    def group(item: tuple[str, Path]) -> str:
        return "" if item[1].parent == PACKAGE else top_of(item[0])

    current = None
    for name, path in sorted(modules.items(), key=lambda item: (group(item) != "", group(item), item[1])):
        if group((name, path)) != current:
            current = group((name, path))
            heading = f"nanoddp/{current}/" if current else "nanoddp/ (root modules)"
            out.append(f"\n### `{heading}`\n\n| module | summary |\n|---|---|")
        rel = path.relative_to(ROOT).as_posix()
        out.append(f"| `{rel}` | {_cell(module_summary(path)) or '–'} |")
    return "\n".join(out) + "\n"


def _render_comm_layers(modules: dict[str, Path]) -> str:
    """The section on nanoddp.comm's own layers, top first, as a reader meets them."""
    lines = [
        "## Inside `nanoddp.comm`: layers\n",
        "One folder per layer under `nanoddp/comm/`, top first, the order to read it in: each layer "
        "imports only the ones below it (checked, at any import level), and the plain algorithms read "
        "on their own. `nanoddp/comm/__init__.py` is the api's face. [comm.md](comm.md) walks through them.\n",
        "| layer | what it holds | modules |\n|---|---|---|",
    ]
    for folder, what in reversed(COMM_LAYERS):
        files = ", ".join(
            f"`{path.name}`"
            for name, path in sorted(modules.items(), key=lambda item: item[1])
            if name.startswith(f"nanoddp.comm.{folder}.")
        )
        lines.append(f"| `{folder}/` | {_cell(what)} | {files} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the page is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC.relative_to(ROOT)} is out of date: run `python tools/architecture.py`")
            return 1
        print(f"{DOC.relative_to(ROOT)} is up to date")
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
