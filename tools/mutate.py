"""Mutation check: plant plausible bugs in the core, one at a time, and see which test catches each.

    python tools/mutate.py            # every mutation, a markdown table at the end
    python tools/mutate.py -k ring    # only mutations whose name contains "ring"
    python tools/mutate.py --jobs 3   # three at a time, each in its own copy (2 cores: about 2x faster)
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
import threading
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


_RUNNING: set[int] = set()  # the sessions (pids = process group ids) of the pytest runs under way


def _kill_running() -> None:
    """Every pytest run under way, its whole session: on Ctrl-C the judging threads are left, and
    their runs must not outlive this process nor write into the copies being removed."""
    for pgid in list(_RUNNING):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


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
    _RUNNING.add(proc.pid)
    try:
        returncode = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of a finished run, or the whole run
        proc.wait()
        _RUNNING.discard(proc.pid)
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


class _Baselines:
    """Each target test's unmutated outcome, run once however many jobs need it: the first job to
    ask runs it in its own tree (unmutated between its mutations); the others wait for that."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.lock = threading.Lock()
        self.done: dict[tuple[str, ...], threading.Event] = {}
        self.outcome: dict[tuple[str, ...], str] = {}

    def get(self, tree: Path, env: dict[str, str], test: tuple[str, ...]) -> str:
        with self.lock:
            first = test not in self.done
            if first:
                self.done[test] = threading.Event()
        if first:
            self.outcome[test] = _pytest(tree, env, test, self.timeout)
            self.done[test].set()
        self.done[test].wait()
        return self.outcome[test]


def _judge(tree: Path, env: dict[str, str], mutation: Mutation, baselines: _Baselines) -> str:
    """One mutation in `tree` (restored afterwards): 'yes' / 'NO' / why it could not be judged."""
    baseline = baselines.get(tree, env, mutation.test)
    if baseline != "pass":
        print(f"   –  {mutation.name}: the unmutated test gives {baseline}", flush=True)
        return f"– (unmutated test: {baseline})"
    start = time.monotonic()
    try:
        original = _apply(tree, mutation)
    except ValueError as e:  # the code moved on: the mutation list needs updating
        print(f"   –  {e}", flush=True)
        return f"– (not applied: {e})"
    try:
        outcome = _pytest(tree, env, mutation.test, baselines.timeout)
    finally:
        (tree / mutation.path).write_text(original)
    verdict = {"fail": "yes", "pass": "NO", "timeout": "yes (hang)"}.get(outcome, f"– ({outcome})")
    print(f"{verdict:>4}  {mutation.name}  ({time.monotonic() - start:.0f} s)", flush=True)
    return verdict


def run(mutations: list[Mutation], timeout: float, jobs: int = 1) -> list[tuple[Mutation, str]]:
    """Each mutation -> its verdict, on temporary copies: `jobs` copies, one mutation at a time in
    each (their tests wait on ranks and timeouts much of the time, as the suite's do, so a second
    and third copy use cores that one would leave idle)."""
    verdicts: dict[int, str] = {}
    queue = list(enumerate(mutations))
    queue_lock, stopping = threading.Lock(), threading.Event()
    baselines = _Baselines(timeout)
    with tempfile.TemporaryDirectory(prefix="nanoddp-mutate-") as tmp:  # removed on any exit
        trees = [Path(tmp) / f"tree{job}" for job in range(jobs)]
        for tree in trees:
            tree.mkdir()
            _copy_tree(tree)

        def work(tree: Path) -> None:
            env = _env(tree)
            while True:
                with queue_lock:
                    if not queue or stopping.is_set():
                        return
                    index, mutation = queue.pop(0)
                verdicts[index] = _judge(tree, env, mutation, baselines)

        threads = [threading.Thread(target=work, args=(tree,), daemon=True) for tree in trees]
        for thread in threads:
            thread.start()
        try:
            for thread in threads:
                while thread.is_alive():  # joined in slices, so that Ctrl-C reaches this thread
                    thread.join(timeout=1)
        except BaseException:
            stopping.set()
            _kill_running()
            raise
    return [(mutation, verdicts[index]) for index, mutation in enumerate(mutations)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default="", help="only mutations whose name contains this (comma: any of these)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per pytest run")
    parser.add_argument("--jobs", type=int, default=1, help="mutations judged at once, each in its own copy")
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
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    rows = run(chosen, args.timeout, args.jobs)
    print("\n| mutation | file | catching test | caught |\n|---|---|---|---|")
    for m, verdict in rows:
        print(f"| {m.name} | {m.path} | `{' '.join(m.test)}` | {verdict} |")
    return 0 if all(v.startswith("yes") for _, v in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
