"""The import layers of `nanoddp` and the import graph that checks them, read from the code.

Split from `architecture.py` (which renders docs/architecture.md from these) so that the rules and
the reading of the code are one idea and the page is another. The graph is built from the AST of
every `nanoddp/**/*.py` (nothing is executed for it): any import counts, at module level, inside a
function or for type checking. `tests/unit/test_architecture.py` checks it has no cycle and no
import from a lower layer to a higher one, between the top-level parts and between the layers
inside `nanoddp.comm`.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nanoddp"

# Layers, lowest first: a module may import its own layer and the layers below it. `cli`,
# `__main__` and the root `nanoddp/__init__.py` (the public API re-exported) sit on top.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("base",)),  # files, the run record, RNG, processes, limits: written once, imports nothing above
    ("env", ("env", "hosts", "torchrun", "groups", "launch", "fork_server", "tempdirs", "dataclass_cli")),
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
