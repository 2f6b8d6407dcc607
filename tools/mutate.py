"""Mutation check: plant plausible bugs in the core, one at a time, and see which test catches each.

    python tools/mutate.py            # every mutation, a markdown table at the end
    python tools/mutate.py -k ring    # only mutations whose name contains "ring"
    python tools/mutate.py --list

Works on a copy of the committed tree (`git archive HEAD` into a temporary directory), never on
the live checkout: the copy is what gets mutated and tested (PYTHONPATH points at it, and the
script checks that `import nanoddp` really resolves there), and the whole directory is removed
at the end, on Ctrl-C too. Each target test first runs unmutated (a test that fails anyway
proves nothing); a mutation counts as caught when its targeted test then fails (pytest exit 1).
Run it before closing a change to the core; a mutation that is not caught needs a test.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from mutations import MUTATIONS, Mutation  # noqa: E402  (tools/ is not a package)


def _copy_tree(dest: Path) -> None:
    """The committed tree (HEAD) into `dest`: a consistent state, whatever is being edited."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", "HEAD"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    where = subprocess.run([sys.executable, "-c", "import nanoddp; print(nanoddp.__file__)"], cwd=tree, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    if not Path(where).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"nanoddp imports from {where}, not from the copy {tree}; mutations would not apply")
    return env


def _pytest(tree: Path, env: dict[str, str], args: tuple[str, ...], timeout: float) -> str:
    """'pass', 'fail' (tests failed), 'timeout' or 'error' (collection/usage: exit 2-5).

    pytest runs in its own session, and the whole process group (its rank processes too) is
    killed on a timeout or Ctrl-C: nothing it started outlives it.
    """
    # pytest-timeout's per-test limit raised to ours: a loaded host must not read as "caught"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-n",
        "0",
        "-p",
        "no:cacheprovider",
        f"--timeout={timeout:.0f}",
        *args,
    ]
    proc = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    try:
        returncode = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of a finished run, or the whole run
        proc.wait()
    return {0: "pass", 1: "fail"}.get(returncode, f"error (exit {returncode})")


def _apply(tree: Path, mutation: Mutation) -> str:
    path = tree / mutation.path
    text = path.read_text()
    if text.count(mutation.old) != 1:
        raise ValueError(
            f"{mutation.name}: {mutation.old!r} occurs {text.count(mutation.old)} times in {mutation.path}"
        )
    path.write_text(text.replace(mutation.old, mutation.new))
    return text


def run(mutations: list[Mutation], timeout: float) -> list[tuple[Mutation, str]]:
    """Each mutation -> 'yes' / 'NO' / why it could not be judged, on a temporary copy."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="nanoddp-mutate-") as tmp:  # removed on any exit
        tree = Path(tmp)
        _copy_tree(tree)
        env = _env(tree)
        baseline: dict[tuple[str, ...], str] = {}
        for mutation in mutations:
            if mutation.test not in baseline:
                baseline[mutation.test] = _pytest(tree, env, mutation.test, timeout)
            if baseline[mutation.test] != "pass":
                rows.append((mutation, f"– (unmutated test: {baseline[mutation.test]})"))
                print(f"   –  {mutation.name}: the unmutated test gives {baseline[mutation.test]}", flush=True)
                continue
            start = time.monotonic()
            try:
                original = _apply(tree, mutation)
            except ValueError as e:  # the code moved on: the mutation list needs updating
                rows.append((mutation, f"– (not applied: {e})"))
                print(f"   –  {e}", flush=True)
                continue
            try:
                outcome = _pytest(tree, env, mutation.test, timeout)
            finally:
                (tree / mutation.path).write_text(original)
            verdict = {"fail": "yes", "pass": "NO", "timeout": "yes (hang)"}.get(outcome, f"– ({outcome})")
            rows.append((mutation, verdict))
            print(f"{verdict:>4}  {mutation.name}  ({time.monotonic() - start:.0f} s)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default="", help="only mutations whose name contains this (comma: any of these)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per pytest run")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if any(k in m.name for k in args.k.split(","))]
    if args.list:
        for m in chosen:
            print(f"{m.name}  [{m.path}]  ->  pytest {' '.join(m.test)}")
        return 0
    if not chosen:
        parser.error(f"no mutation name contains {args.k!r}; see --list")
    # SIGTERM as Ctrl-C, so the temporary tree is removed however the run is stopped
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    rows = run(chosen, args.timeout)
    print("\n| mutation | file | catching test | caught |\n|---|---|---|---|")
    for m, verdict in rows:
        print(f"| {m.name} | {m.path} | `{' '.join(m.test)}` | {verdict} |")
    return 0 if all(v.startswith("yes") for _, v in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
