"""What losing a whole host costs a run: `nanoddp bench restarts --hosts N`.

Machines, not processes, are what fail in a cluster, so here a failure is a host: N network
namespace hosts (`nanoddp.bench.netns_hosts`: each its own address on one bridge, the traffic
crossing a real interface), P processes each (`--host-nproc`, default 1) training one engine
(`--host-engine`, default nanoddp; hsdp shards over a host's P processes in both modes),
`nanoddp train` on every host with `--nnodes N --node-rank K --rdzv-endpoint HOST0:PORT`. The
last host is killed whole (SIGKILL to every process in its namespace: its launcher, its ranks,
anything they started) once the run has logged step
`KILL_AT_STEP` (after its first snapshot), and its launcher is started again at once with the
same command, as a replaced machine would be. The modes:

- `restart`: `--on-failure restart`; every host's torchrun agent restarts its worker, they meet
  again with the restarted host and resume from the newest snapshot;
- `continue`: `--on-failure continue --min-replicas 1`; the other hosts go on without the lost
  one at once, and the restarted host joins at a step boundary, healed live from a peer (each of
  its processes from the peer host's process that holds the same shard: a host is one replica
  group, `--group-size`'s default across hosts).

As in `failure_cost` (one machine, one rank lost), each trial runs every mode once untouched and
once with the kill, interleaved, and the cost is the difference of the two wall times; for
`continue` the killed run's own records also say how long the survivors waited to commit without
the lost host (`stall_s`, and `extra_s`, that less an ordinary step: `failure_cost`'s note on
figures the host's load does not drown). Needs root and iproute2's `ip` (`unavailable_reason`).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nanoddp.base.processes import end_tree
from nanoddp.base.records import last_step, read_records
from nanoddp.bench.common import ChildFailed
from nanoddp.bench.failure_cost import interleaved_trials, mode_summary, seen_by_survivors
from nanoddp.bench.netns_hosts import NetnsHosts, unavailable_reason

# failure_cost's job (the built-in GPT, a snapshot every 20), with room after the kill for the
# restarted host to start (seconds of imports, data and model) and join
TRAIN_ARGS = [
    "--steps", "200", "--snapshot-every", "20", "--seq-len", "32", "--batch-size", "12",
    "--text-max-bytes", "200000", "--log-every", "10", "--eval-every", "0", "--no-progress",
    "--max-restarts", "1", "--collective-timeout", "30",
]  # fmt: skip
MODE_ARGS = {"restart": ["--on-failure", "restart"], "continue": ["--on-failure", "continue", "--min-replicas", "1"]}
KILL_AT_STEP = 30  # after the first snapshot (step 20), before the second (step 40)
PORT = 29520  # inside the namespaces this benchmark made: nothing else listens there
RUN_TIMEOUT_S = 600
POLL_S = 0.02


def layout_args(nproc: int, engine: str) -> list[str]:
    """What every host runs besides `TRAIN_ARGS`: its processes and the engine."""
    return ["--nproc", str(nproc), "--engine", engine]


def _command(hosts: NetnsHosts, layout: list[str], mode: str, host: int, out: Path) -> list[str]:
    """Host `host`'s launcher of the run in `mode`, run inside its namespace."""
    endpoint = f"{hosts.addresses[0]}:{PORT}"
    node = ["--nnodes", str(len(hosts.names)), "--node-rank", str(host), "--rdzv-endpoint", endpoint]
    argv = [sys.executable, "-m", "nanoddp", "train", *TRAIN_ARGS, *layout, *MODE_ARGS[mode], *node, "--out", str(out)]
    return hosts.command(host, argv)


def _run(hosts: NetnsHosts, layout: list[str], mode: str, kill: bool, out: Path) -> dict[str, Any]:
    """One run of `mode` on every host; with `kill`, the last host killed whole once step
    KILL_AT_STEP is logged and its launcher started again. Every launcher must exit 0."""
    last = len(hosts.names) - 1
    logs = [open(out.parent / f"{out.name}-host{h}.log", "w") for h in range(len(hosts.names))]  # noqa: SIM115
    start = time.monotonic()
    launchers = [
        subprocess.Popen(
            _command(hosts, layout, mode, h, out), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        for h, log in enumerate(logs)
    ]
    killed_after = killed_at = None
    try:
        deadline = start + RUN_TIMEOUT_S
        while kill and killed_at is None and launchers[last].poll() is None and time.monotonic() < deadline:
            if last_step(out) >= KILL_AT_STEP:
                hosts.kill(last)
                killed_after, killed_at = time.monotonic() - start, time.time()
                launchers[last].wait(timeout=30)
                launchers[last] = subprocess.Popen(_command(hosts, layout, mode, last, out), stdout=logs[last],
                                                   stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
            time.sleep(POLL_S)
        codes: list[int | None] = [proc.wait(timeout=max(1.0, deadline - time.monotonic())) for proc in launchers]
    except subprocess.TimeoutExpired:
        codes = [proc.poll() for proc in launchers]
    finally:
        for proc in launchers:
            end_tree(proc)
        for log in logs:
            log.close()
    wall = time.monotonic() - start
    if any(code != 0 for code in codes):
        tails = "\n".join(Path(log.name).read_text()[-2000:] for log in logs)
        raise ChildFailed(f"mode {mode}: a host's launcher failed (exits {codes}):\n{tails}")
    if kill and killed_at is None:
        raise ChildFailed(f"mode {mode}: the run ended before step {KILL_AT_STEP} was logged; no host killed")
    seen = seen_by_survivors(read_records(out), killed_at) if killed_at is not None else {}
    said = re.search(r"(?:per replica|processes) over (\w+)", Path(logs[0].name).read_text())
    backend = said.group(1) if said else None  # continue's start-up line (`ft_trainer.engine_line`)
    return {"wall_s": round(wall, 2), "killed_after_s": killed_after, "backend": backend, **seen}


def check(host_count: int) -> None:
    """The one error for a host count or a machine this benchmark cannot use (before any work)."""
    reason = unavailable_reason()
    if reason is not None:
        raise ValueError(f"--hosts needs network namespaces, and {reason}: run as root, or leave --hosts out")
    if host_count < 2:
        raise ValueError(f"--hosts {host_count}: losing a host takes at least 2 (one to lose, one to go on)")


def measure(trials: int, host_count: int, nproc: int = 1, engine: str = "nanoddp") -> dict:
    """`trials` interleaved (clean, killed) pairs per mode on `host_count` namespace hosts of
    `nproc` processes training `engine`; every run directory and the hosts are removed."""
    check(host_count)
    load_before = list(os.getloadavg())
    layout = layout_args(nproc, engine)
    with NetnsHosts(host_count) as hosts, tempfile.TemporaryDirectory(prefix="nanoddp-host-cost-") as root:
        run = functools.partial(_run, hosts, layout)
        results = interleaved_trials(trials, list(MODE_ARGS), run, Path(root))
    return {
        "meta": {
            "train_args": [*TRAIN_ARGS, *layout], "mode_args": MODE_ARGS, "hosts": host_count,
            "kill_at_step": KILL_AT_STEP,
            "victim": f"host {host_count - 1}, every process", "trials": trials, "cpus": os.cpu_count(),
            "load_average_before": load_before, "date": time.strftime("%Y-%m-%d"),
        },
        "results": results,
        "summary": summarize(results),
    }  # fmt: skip


def summarize(results: list[dict]) -> dict[str, Any]:
    """Each mode's median cost and range; continue's median stall and extra wait; and the ratios
    of continue's to restart's median cost, stall and extra wait."""
    summary: dict[str, Any] = {mode: mode_summary(results, mode) for mode in MODE_ARGS}
    restart = summary["restart"]["median_cost_s"]
    for key, value in (("cost", summary["continue"]["median_cost_s"]), ("stall", summary["continue"]["median_stall_s"]),
                       ("extra", summary["continue"]["median_extra_s"])):  # fmt: skip
        # a cost at or below 0 (the killed run was lucky with the host's load) has no ratio
        summary[f"continue_{key}_over_restart_cost"] = (
            round(value / restart, 3) if value is not None and value > 0 and restart > 0 else None
        )
    return summary


def describe(report: dict) -> str:
    """One line per mode, then continue's stall against restart's cost."""
    meta, s = report["meta"], report["summary"]
    lines = []
    for mode in MODE_ARGS:
        m = s[mode]
        stall = "" if m["median_stall_s"] is None else f"; the other hosts' stall {m['median_stall_s']:.2f} s"
        lines.append(
            f"--on-failure {mode:<8}: a host lost ({meta['hosts']} hosts) costs {m['median_cost_s']:.1f} s "
            f"(median of {meta['trials']}; {m['min_cost_s']:.1f} to {m['max_cost_s']:.1f} s){stall}"
        )
    ratio = s["continue_stall_over_restart_cost"]
    if ratio is not None:
        lines.append(f"continue's stall / restart's cost: {ratio:.3f}")
    return "\n".join(lines)
