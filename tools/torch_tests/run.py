"""Run torch's own DDP and FSDP2 test files out of tree, with torch and with nanoddp swapped in.

"Drop-in" has to mean torch's tests pass with our classes under torch's names. This runner
takes a pytorch checkout (the v2.13.0 tag, matching the installed torch; only its test/ folder
is read), runs the chosen files with pytest once as they are ("torch") and once with
`swap/sitecustomize.py` replacing torch's DistributedDataParallel and FSDP2 names by
nanoddp's ("nanoddp"), and writes per-test outcomes as JSON plus a Markdown comparison.

    python tools/torch_tests/run.py --torch-src /tmp/torch-src             # both runs
    python tools/torch_tests/run.py --torch-src /tmp/torch-src --swap -k ddp
    python tools/torch_tests/run.py --render                               # table from JSON

The swap is checked, not assumed: every rank of a multi-process test writes which classes it
saw (see sitecustomize), and a file's run with --swap fails if any rank saw torch's.
torch's test files are never copied into this repository.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "torch_tests.json"
DDP_TESTS = "DistributedDataParallel or ddp or DDP or comm_hook or Reducer or reducer"
# file -> (extra environment, default -k): test_distributed_spawn runs torch's big DDP suite
# (torch.testing._internal.distributed.distributed_test, shipped in the wheel) on gloo.
FILES = {
    "test/distributed/_composable/fsdp/test_fully_shard_state.py": ({}, None),
    # The heaviest parity sweeps (8 ranks, hundreds of subtests) are left out by default: on
    # a shared 2-core host each runs past any sensible per-test timeout, for torch and for us.
    "test/distributed/_composable/fsdp/test_fully_shard_training.py": (
        {},
        "not (multi_group or gradient_accumulation or nd_mesh or hsdp or activation_checkpointing"
        " or tp_ep or 1f1b or cudagraph)",
    ),
    "test/distributed/_composable/fsdp/test_fully_shard_init.py": ({}, None),
    "test/distributed/_composable/fsdp/test_fully_shard_comm.py": ({}, None),
    # The c10d files test process groups as well; only their DDP cases are ours to compare.
    "test/distributed/test_c10d_gloo.py": ({}, DDP_TESTS),
    "test/distributed/test_c10d_common.py": ({}, DDP_TESTS),
    "test/distributed/test_c10d_spawn_gloo.py": ({}, DDP_TESTS),
    "test/distributed/test_distributed_spawn.py": (
        {"BACKEND": "gloo", "WORLD_SIZE": "2"},
        "DistributedDataParallel or ddp or DDP",
    ),
}
MODES = {"torch": False, "nanoddp": True}


def run_file(src: Path, rel: str, swap: bool, keyword: str | None, timeout_s: int) -> dict:
    """One pytest run of one file; returns {test id: {outcome, message, seconds}} and checks."""
    extra_env, default_k = FILES.get(rel, ({}, None))
    path = src / rel
    with tempfile.TemporaryDirectory(prefix="torch-tests-") as tmp:
        junit, log = Path(tmp, "junit.xml"), Path(tmp, "ranks.jsonl")
        Path(tmp, "barrier").touch()  # test_distributed_spawn's rendezvous folder
        env = {
            **os.environ,
            # test_distributed_spawn names its class from INIT_METHOD ("...NoInitFile" for
            # env://), and its setUpClass sets INIT_METHOD to a file:// path before the ranks
            # spawn: start with a file:// one so parent and ranks agree on the class name.
            "INIT_METHOD": f"file://{tmp}/init_file",
            **extra_env,
            "TEMP_DIR": tmp,
            "PYTHONPATH": os.pathsep.join([str(HERE / "swap"), str(path.parent), os.environ.get("PYTHONPATH", "")]),
            "NANODDP_TORCH_TESTS": "1",
            "NANODDP_TORCH_TESTS_SWAP": "1" if swap else "0",
            "NANODDP_TORCH_TESTS_LOG": str(log),
            "OMP_NUM_THREADS": "1",
        }
        cmd = [sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
        cmd += [f"--timeout={timeout_s}", "-o", "junit_family=xunit1"]
        if keyword or default_k:
            cmd += ["-k", keyword or default_k]
        started = time.monotonic()
        # Own session: when pytest ends (or a per-test timeout kills it), every rank it
        # spawned is killed with its group, so no rank outlives the run.
        proc = subprocess.Popen(cmd, cwd=path.parent, env=env, start_new_session=True)
        try:
            proc.wait()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        tests = parse_junit(junit) if junit.exists() else {}
        ranks = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return {"seconds": round(time.monotonic() - started, 1), "tests": tests, "swap_check": check_swap(ranks, swap)}


def parse_junit(junit: Path) -> dict:
    """Per-test outcome from pytest's junit XML: passed / failed / error / skipped."""
    tests = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}.{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = first_error(node)
                break
        tests[name] = {"outcome": outcome, "message": message, "seconds": float(case.get("time", 0))}
    return tests


def first_error(node: ET.Element) -> str:
    """The exception line of a failure: the last `SomeError: ...` line of its traceback (a
    rank's own error, not the "Process 0 exited" summary), else pytest's message."""
    lines = [re.sub(r"^E\s+", "", ln.strip()) for ln in (node.text or "").splitlines()]
    errors = [ln for ln in lines if ln.split(":")[0].rsplit(".", 1)[-1].endswith(("Error", "Exception", "Interrupt"))]
    errors = [ln for ln in errors if "exited with exception" not in ln and "exited with error code" not in ln]
    return (errors[-1] if errors else (node.get("message") or "").strip().split("\n")[0])[:300]


def check_swap(ranks: list[dict], swap: bool) -> dict:
    """Every rank that ran a test saw nanoddp's classes (with --swap) or torch's (without)."""
    wrong = [r for r in ranks if r["ddp"].startswith("nanoddp") != swap]
    wrong += [r for r in ranks if r["fully_shard"] and r["fully_shard"].startswith("nanoddp") != swap]
    return {"ranks": len(ranks), "wrong": wrong[:5], "ok": not wrong}


def render(results: dict) -> str:
    """Markdown: a count line and the per-test differences of each file."""
    lines = []
    for rel, modes in results.items():
        theirs, ours = modes.get("torch", {}).get("tests", {}), modes.get("nanoddp", {}).get("tests", {})
        names = sorted(set(theirs) | set(ours))
        passed_torch = [n for n in names if theirs.get(n, {}).get("outcome") == "passed"]
        passed_ours = [n for n in passed_torch if ours.get(n, {}).get("outcome") == "passed"]
        # Most of torch's distributed tests skip themselves without GPUs: count them apart.
        skipped = [n for n in names if theirs.get(n, {}).get("outcome") == "skipped"]
        lines += [f"### `{rel}`", ""]
        lines += ["| tests run | skipped (torch, CPU) | pass with torch | pass with nanoddp | ranks checked (swap) |"]
        lines += ["| --- | --- | --- | --- | --- |"]
        check = modes.get("nanoddp", {}).get("swap_check", {})
        ranks = f"{check.get('ranks', 0)} ({'ok' if check.get('ok') else 'FAILED'})"
        counts = f"| {len(names)} | {len(skipped)} | {len(passed_torch)} | {len(passed_ours)} | {ranks} |"
        lines += [counts, ""]
        differ = [n for n in passed_torch if n not in passed_ours]
        if differ:
            lines += ["| test | with nanoddp |", "| --- | --- |"]
            for n in differ:
                got = ours.get(n, {"outcome": "not run", "message": ""})
                message = re.sub(r"^E\s+", "", got["message"]).replace("|", "/")
                lines.append(f"| `{n}` | {got['outcome']}: {message} |")
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch-src", type=Path, help="a pytorch checkout at the installed torch's tag")
    parser.add_argument(
        "--swap", action=argparse.BooleanOptionalAction, default=None, help="only ours / only torch (default both)"
    )
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument("--files", nargs="*", default=list(FILES), help="paths under --torch-src")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--render", action="store_true", help="print the table from --results and stop")
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text()) if args.results.exists() else {}
    if not args.render:
        if args.torch_src is None:
            parser.error("--torch-src is required unless --render")
        modes = [m for m, s in MODES.items() if args.swap is None or s == args.swap]
        for rel in args.files:
            for mode in modes:
                outcome = run_file(args.torch_src, rel, MODES[mode], args.keyword, args.timeout)
                # A -k run refreshes only the tests it ran: merge, do not replace (and keep
                # counting the ranks whose swap was checked across the runs).
                old = results.setdefault(rel, {}).get(mode)
                if args.keyword and old:
                    outcome["tests"] = {**old["tests"], **outcome["tests"]}
                    was, now = old["swap_check"], outcome["swap_check"]
                    outcome["swap_check"] = {
                        "ranks": was["ranks"] + now["ranks"],
                        "wrong": (was["wrong"] + now["wrong"])[:5],
                        "ok": was["ok"] and now["ok"],
                    }
                results[rel][mode] = outcome
                args.results.parent.mkdir(parents=True, exist_ok=True)
                args.results.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
                if MODES[mode] and not outcome["swap_check"]["ok"]:
                    print(
                        f"swap not in effect in some rank of {rel}: {outcome['swap_check']['wrong']}", file=sys.stderr
                    )
                    return 1
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
