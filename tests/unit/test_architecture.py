"""The architecture the docs describe is the one the code has.

docs/architecture.md is what `tools/architecture.py` generates from the code; it names every
public name and every engine; imports run down the layers (between the top-level parts, and
between nanoddp.comm's own layers) and form no cycle, whatever the level of the import; files stay
small (one concept per file). Nothing is launched: the import graph comes from the AST.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INIT_MAX_LINES = 60
MODULE_MAX_LINES = 450


def _load_generator():
    spec = importlib.util.spec_from_file_location("nanoddp_tools_architecture", ROOT / "tools" / "architecture.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


arch = _load_generator()
layers = sys.modules["layers"]  # the import layers and graph, which the generator imports from tools/layers.py


@pytest.fixture(scope="module")
def edges():
    return layers.import_graph()


def test_architecture_page_is_what_the_generator_writes():
    assert arch.DOC.read_text() == arch.render(), (
        "docs/architecture.md is out of date: run `python tools/architecture.py`"
    )


def test_architecture_page_names_every_public_name_and_every_engine():
    import nanoddp
    from nanoddp.train.engines import ENGINES

    text = arch.DOC.read_text()
    missing = [name for name in nanoddp.__all__ if f"| `{name}` |" not in text]
    assert not missing, f"docs/architecture.md does not name {missing}"
    missing = [name for name in ENGINES if f"| `{name}` |" not in text]
    assert not missing, f"docs/architecture.md does not name the engines {missing}"


def test_import_graph_resolves_from_package_import_module(edges):
    """`from nanoddp.train import signals` is an edge to the module, not to the package."""
    targets = {e.target for e in edges if e.source == "nanoddp.train.trainer"}
    assert "nanoddp.train.signals" in targets and "nanoddp.env" in targets


def test_no_import_cycle_among_modules(edges):
    cycles = layers.import_cycles(edges)
    assert not cycles, "import cycles (any level): " + "; ".join(" <-> ".join(c) for c in cycles)


def _edge(source: str, target: str, where: str):
    """An import inside nanoddp.comm, modules named by folder and file ('protocol.wire')."""
    return layers.Edge(f"nanoddp.comm.{source}", f"nanoddp.comm.{target}", where, 1)


def test_a_cycle_counts_imports_inside_functions_and_for_type_checking():
    """Two modules that need each other form a cycle whatever the level of either import."""
    wire, settle = "protocol.wire", "protocol.settle"
    for where in ("function", "typing"):
        edges = [_edge(wire, settle, "module"), _edge(settle, wire, where)]
        assert layers.import_cycles(edges) == [["nanoddp.comm.protocol.settle", "nanoddp.comm.protocol.wire"]], where
    assert not layers.import_cycles([_edge(wire, settle, "module"), _edge(settle, "transport.transport", "function")])


def test_comm_imports_run_down_its_layers(edges):
    upward = layers.comm_upward_imports(edges)
    assert not upward, (
        "imports from a lower nanoddp.comm layer to a higher one (tools/architecture.py, "
        "COMM_LAYERS): " + "; ".join(f"{e.source} -> {e.target} (line {e.line}, {e.where}-level)" for e in upward)
    )


def test_an_upward_import_inside_comm_is_caught_at_any_level():
    for where in ("module", "function", "typing"):
        assert layers.comm_upward_imports([_edge("algorithms.ring", "api.collectives", where)]), where
    assert layers.comm_upward_imports([layers.Edge("nanoddp.comm.transport.runner", "nanoddp.comm", "function", 1)])
    same_or_down = [
        _edge("api.collectives", "algorithms.ring", "module"),
        _edge("algorithms.ring", "algorithms.pieces", "module"),
        layers.Edge("nanoddp.comm.api.backend", "nanoddp.comm", "function", 1),  # the face is the api's
    ]
    assert not layers.comm_upward_imports(same_or_down)


def test_comm_layers_are_its_folders():
    """Each COMM_LAYERS layer is a folder of nanoddp/comm/ and every comm module sits in one:
    a module directly in nanoddp/comm/ is an error, not a layer of its own."""
    layer = {m: layers.comm_layer_of(part) for m in layers.module_files() if (part := layers.comm_part(m)) is not None}
    assert layer["nanoddp.comm"] == layer["nanoddp.comm.api.collectives"] == layers.COMM_LAYER_OF["api"]
    folders = {p.name for p in (ROOT / "nanoddp" / "comm").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(layers.COMM_LAYER_OF), "nanoddp/comm/'s folders are its layers (COMM_LAYERS)"
    with pytest.raises(ValueError, match="nanoddp.comm.ring is in no layer"):
        layers.comm_upward_imports([layers.Edge("nanoddp.comm.ring", "nanoddp.comm.transport.transport", "module", 1)])


def test_imports_run_from_higher_layers_to_lower_ones(edges):
    upward = [e for e in layers.upward_imports(edges) if (e.source, e.target) not in layers.UPWARD_EXCEPTIONS]
    assert not upward, "imports from a lower layer to a higher one: " + "; ".join(
        f"{e.source} -> {e.target} (line {e.line}, {e.where}-level)" for e in upward
    )


def test_every_module_belongs_to_a_layer():
    unknown = sorted(m for m in layers.module_files() if layers.top_of(m) not in layers.LAYER_OF_TOP)
    assert not unknown, f"add these to tools/architecture.py's LAYERS: {unknown}"


def test_package_inits_only_re_export():
    inits = sorted((ROOT / "nanoddp").rglob("__init__.py"))
    long = {str(p.relative_to(ROOT)): n for p in inits if (n := len(p.read_text().splitlines())) > INIT_MAX_LINES}
    assert not long, f"__init__.py files over {INIT_MAX_LINES} lines (move the code into a module): {long}"


def test_no_module_over_the_line_limit():
    files = sorted([*(ROOT / "nanoddp").rglob("*.py"), *(ROOT / "tools").rglob("*.py")])
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MODULE_MAX_LINES}
    assert not long, f"modules over {MODULE_MAX_LINES} lines (one concept per file: split them): {long}"


# A file's name says what it holds; the same name in two folders makes a reader ask which one is
# meant. These repeat on purpose, each for the reason given.
REPEATED_FILE_NAMES = {
    "cli.py": "the `nanoddp` command (nanoddp/) and the torchrun agent's side of `nanoddp train` (launcher/)",
    "join.py": "each wrapper's side of torch's Join protocol (parallel/ddp/, parallel/zero/)",
    "manual.py": "the manual strategies (parallel/) and the engine of that name (train/engines/)",
    "fsdp.py": "`nanoddp.fsdp`, FSDP2's public names, and the engine of that name (train/engines/)",
    "collectives.py": "the comm API's everyday collectives and the benchmark named after them (bench/)",
}


def test_a_file_name_repeats_across_folders_only_for_a_stated_reason():
    folders: dict[str, list[str]] = {}
    for path in sorted((ROOT / "nanoddp").rglob("*.py")):
        if path.name not in ("__init__.py", "__main__.py"):
            folders.setdefault(path.name, []).append(str(path.parent.relative_to(ROOT)))
    repeated = {name for name, where in folders.items() if len(where) > 1}
    assert repeated <= set(REPEATED_FILE_NAMES), {name: folders[name] for name in repeated - set(REPEATED_FILE_NAMES)}


def test_what_every_rank_imports_leaves_dynamo_and_dtensor_unimported():
    """Every rank, launcher and CLI call imports these: what they import is start-up time paid by
    all of them. torch's compiler stack (a second of CPU) is imported by those that compile, and
    DTensor (most of a second) by those that shard ([Note: DTensor on first use])."""
    modules = ["nanoddp", "nanoddp.cli", "nanoddp.train.trainer", "nanoddp.train.launcher.cli", "nanoddp.ft"]
    probe = f"import sys; [__import__(m) for m in {modules!r}]; "
    probe += "print([m for m in ('torch._dynamo', 'torch.distributed.tensor') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_the_face_gives_every_public_name():
    """`fully_shard` loads on first use; it and every other name must resolve, `import *` too."""
    probe = (
        "import nanoddp; ns = {}; exec('from nanoddp import *', ns); "
        "print(sorted(n for n in nanoddp.__all__ if n not in ns or getattr(nanoddp, n) is not ns[n]))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"
