"""Notebook mode: IPython magics that run cells on N distributed worker processes.

    %load_ext nanoddp.notebook
    %dist_init --num-processes 2          # [--gpu-ids 0,1] [--backend gloo|nccl] [--timeout S]
    %%distributed                          # this cell on every rank
    %%rank [0,2]                           # this cell on ranks 0 and 2 only
    %sync  %dist_status  %dist_mode  %dist_shutdown

Output: every line a worker prints is streamed into the cell as it is produced, prefixed with
`[rank k] ` (lines rather than per-rank groups, so a long training cell shows progress live).
The value of a cell's last expression is printed per rank the same way. Rich output (figures,
HTML, images) is shown for one rank only, the lowest rank that ran the cell (rank 0 for
`%%distributed`), because N copies of the same plot help nobody. If any rank raises, the cell
fails with a `DistributedCellError` that shows every failing rank's traceback; the ranks still
running get two seconds to finish (or raise the same error) and are then interrupted, so a rank
waiting for the failed one does not hang the cell.

There is no cell timeout unless you ask for one (`%dist_init --timeout S`, or `--timeout S` on
`%%distributed` / `%%rank`). The stop button interrupts the cell on every rank; the workers
keep their state. Workers talk to the kernel over an authenticated Unix socket in a private
directory (see `nanoddp.notebook.pool`) and exit by themselves if the kernel dies.

Stopping a cell in the middle of a collective (nanoddp's or torch.distributed's) would leave
the ranks mid-message, or one of them blocked in C++ where SIGINT cannot reach it. So when a
stopped or failed cell may have left communication half-done on any rank, the pool aborts it
on every rank (each worker shuts its connections to the others, which fails every pending
send, receive and collective at once) and rebuilds the default process group in place, from
a fresh rendezvous: the cell reports "process group rebuilt (generation G)", the workers keep
their variables, and the next cell's collectives work. nanoddp's DDP on the default group
keeps working (it looks the group up at each call); objects holding the old group itself (a
subgroup, torch's DDP, a wrapper given `process_group=`) must be created again. `%dist_status`
shows what each worker says about itself: idle/busy and its group's generation.

Limits: cell code is plain Python on the workers (no `%magics` or `!shell` inside a
distributed cell); output written straight to file descriptor 1/2 by C code goes to the
kernel's terminal, not the notebook; a rank busy outside communication in C code that
ignores signals cannot be stopped (the next cell says so; `%dist_init` restarts the
workers); a rank that died cannot be rebuilt in place (`%dist_init`). The abort is tested
with gloo; nccl groups are aborted with torch's `abort()`.
"""

from __future__ import annotations

import atexit
import os
import re
import shlex
import sys
from typing import Any

import torch
from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from nanoddp.notebook.display import CellInterrupted, CellRenderer, DistributedCellError, format_status
from nanoddp.notebook.magic_options import check_devices, init_parser, parse_ranks, placement, timeout_parser
from nanoddp.notebook.pool import CellOutcome, WorkerPool

# A collective on a subset of ranks waits forever for the others: worth a warning (a heuristic).
COLLECTIVE_CALL = re.compile(
    r"\b(?:all_reduce|all_gather\w*|reduce_scatter\w*|broadcast\w*|barrier|all_to_all\w*"
    r"|(?:dist|comm)\.(?:reduce|gather|scatter|send|recv)\w*|DistributedDataParallel|SimpleDDP"
    r"|verify_replicas)\s*\("
)
_MAGICS: DistributedMagics | None = None


@magics_class
class DistributedMagics(Magics):
    """The magics and the one worker pool they drive. UI code: it prints for the user."""

    def __init__(self, shell: Any):
        super().__init__(shell)
        self.pool: WorkerPool | None = None
        self.cell_timeout_s: float | None = None
        self.distributed_mode = False

    # ------------------------------------------------------------ pool lifecycle
    @line_magic
    def dist_init(self, line: str) -> None:
        """%dist_init --num-processes N [--gpu-ids 0,1] [--backend gloo|nccl] [--timeout S]
        [--num-threads T] [--pg-timeout S]: start N fresh workers (replacing any pool)."""
        args = init_parser().parse_args(shlex.split(line))
        if args.num_processes < 1:
            raise UsageError(f"--num-processes must be >= 1, got {args.num_processes}")
        backend, devices = placement(args.num_processes, args.gpu_ids, args.backend)
        check_devices(devices, torch.cuda.device_count())
        num_threads = args.num_threads or max(1, (os.cpu_count() or 1) // args.num_processes)
        if self.pool is not None:
            print("Stopping the previous workers...")
            self._stop_pool()
        threads = f"{num_threads} thread{'s' if num_threads > 1 else ''} each"
        print(f"Starting {args.num_processes} workers ({backend}, {threads})...")
        pool = WorkerPool(args.num_processes, backend, devices, num_threads, args.pg_timeout)
        pool.start()
        self.pool, self.cell_timeout_s = pool, args.timeout
        print(format_status(pool.status()))
        print(
            "Run cells with %%distributed (all ranks), %%rank [0,2] (some), or %dist_mode (every cell).\n"
            "Worker names: rank, local_rank, world_size, device, env (DistEnv), dist, torch, get, display."
        )

    @line_magic
    def dist_shutdown(self, line: str) -> None:
        """%dist_shutdown: stop every worker (leave the group, exit; killed if they hang)."""
        if self.pool is None:
            print("No workers running.")
            return
        pids = self.pool.pids()
        self._stop_pool()
        print(f"Stopped {len(pids)} workers (pids {', '.join(map(str, pids))}).")

    def _stop_pool(self) -> None:
        pool, self.pool, self.distributed_mode = self.pool, None, False
        if pool is not None:
            pool.shutdown()

    def close(self) -> None:
        """At kernel exit: the workers would notice anyway, but leaving cleanly is faster."""
        self._stop_pool()

    @line_magic
    def dist_status(self, line: str) -> None:
        """%dist_status: pid, device, idle/busy/dead and memory of every worker."""
        if self.pool is None:
            print("No workers running; start them with %dist_init --num-processes N.")
            return
        print(format_status(self.pool.status(CellRenderer(display_rank=0))))
        print(f"distributed mode: {'on' if self.distributed_mode else 'off'}")

    # ------------------------------------------------------------ running cells
    @cell_magic
    def distributed(self, line: str, cell: str) -> None:
        """%%distributed [--timeout S]: run the cell on every rank."""
        args = timeout_parser("%%distributed").parse_args(shlex.split(line))
        pool = self._require_pool()
        self._run(cell, list(range(pool.num_processes)), args.timeout)

    @cell_magic
    def rank(self, line: str, cell: str) -> None:
        """%%rank [0,2] [--timeout S]: run the cell on the listed ranks only."""
        spec, _, options = line.partition("--")
        args = timeout_parser("%%rank").parse_args(shlex.split("--" + options) if options else [])
        pool = self._require_pool()
        ranks = parse_ranks(spec, pool.num_processes)
        if len(ranks) < pool.num_processes and COLLECTIVE_CALL.search(cell):
            print(
                f"Warning: this cell seems to call a collective but runs on ranks {ranks} only; the other "
                "ranks will not join it, so it would wait until the process-group timeout. "
                "Use %%distributed for collectives.",
                file=sys.stderr,
            )
        self._run(cell, ranks, args.timeout)

    @line_magic
    def sync(self, line: str) -> None:
        """%sync [--timeout S]: a barrier across all workers."""
        args = timeout_parser("%sync").parse_args(shlex.split(line))
        pool = self._require_pool()
        renderer = CellRenderer(display_rank=0)
        outcome = pool.barrier(renderer, timeout_s=args.timeout or self.cell_timeout_s)
        self._raise_failures(outcome, list(range(pool.num_processes)), renderer)
        print(f"All {pool.num_processes} ranks reached the barrier.")

    @line_magic
    def dist_mode(self, line: str) -> None:
        """%dist_mode [on|off]: run every plain cell (not %magics or !shell) on all ranks."""
        choice = line.strip().lower()
        if choice not in ("", "on", "off"):
            raise UsageError(f"%dist_mode takes on, off or nothing (toggle), got {line.strip()!r}")
        wanted = (not self.distributed_mode) if not choice else choice == "on"
        if wanted:
            self._require_pool()
        self.distributed_mode = wanted
        if wanted:
            print("Distributed mode on: plain cells run on every rank (%magics still run here).")
        else:
            print("Distributed mode off: cells run in this kernel again.")

    def transform_input(self, lines: list[str]) -> list[str]:
        """IPython input transformer: in distributed mode, a plain cell becomes %%distributed."""
        if not self.distributed_mode:
            return lines
        text = "".join(lines).strip()
        if not text or text[0] in "%!" or text.endswith("?"):
            return lines
        return ["%%distributed\n", *lines]

    def _require_pool(self) -> WorkerPool:
        if self.pool is None:
            raise UsageError("no workers: start them with %dist_init --num-processes N")
        return self.pool

    def _run(self, code: str, ranks: list[int], timeout_s: float | None) -> None:
        pool = self._require_pool()
        renderer = CellRenderer(display_rank=min(ranks))
        timeout_s = timeout_s or self.cell_timeout_s
        assert self.shell is not None  # registered by load_ipython_extension, with the kernel's shell
        outcome = pool.run(code, ranks, renderer, cell=self.shell.execution_count, timeout_s=timeout_s)
        renderer.results(outcome.reports)
        self._raise_failures(outcome, ranks, renderer, timeout_s)

    def _raise_failures(
        self, outcome: CellOutcome, ranks: list[int], renderer: CellRenderer, timeout_s: float | None = None
    ) -> None:
        """Make the cell fail (so nbclient and "run all" stop) if any rank did not finish cleanly.

        Only the ranks that raised or died get a traceback section; ranks that were stopped
        because of them are named in the summary.
        """
        sys.stdout.flush()
        sys.stderr.flush()
        unfinished = sorted(set(ranks) - set(outcome.reports) - set(outcome.died))
        failed = outcome.failed_ranks
        details = {r: outcome.reports[r]["error"]["traceback"] for r in failed if r in outcome.reports}
        details.update({r: f"worker died: {why}\n" for r, why in outcome.died.items()})
        busy_note = ""
        if outcome.rebuilt is not None:  # collectives were aborted on every rank (pool.rebuild)
            busy_note = (
                f"; process group rebuilt (generation {outcome.rebuilt}): in-flight collectives were "
                "aborted on every rank, variables kept; objects holding the old group (subgroups, torch DDP) "
                "must be created again"
            )
        elif outcome.recovery_error is not None:
            busy_note = f"; {outcome.recovery_error}"
        elif unfinished:  # e.g. blocked in C code that ignores signals
            busy_note = (
                f"; ranks {unfinished} are still busy: the next cell tries to stop them first, "
                "%dist_init restarts the workers"
            )
        if outcome.interrupted:
            raise CellInterrupted(f"interrupted on ranks {ranks}{busy_note}")
        if outcome.timed_out:
            for r in unfinished:
                details[r] = "still running: did not stop within the grace period\n"
            raise DistributedCellError(f"cell timed out after {timeout_s}s and was interrupted{busy_note}", details)
        if not failed:
            return
        first = outcome.reports.get(failed[0], {}).get("error")
        what = f"{first['ename']}: {first['evalue']}" if first else details[failed[0]].strip()
        stopped = sorted(r for r, rep in outcome.reports.items() if rep["status"] == "interrupted")
        stopped_note = f"; stopped ranks {stopped}" if stopped else ""
        hint = "; restart the pool with %dist_init" if outcome.died and not unfinished else ""
        raise DistributedCellError(
            f"failed on ranks {failed} (rank {failed[0]}: {what}){stopped_note}{busy_note}{hint}", details
        )


def current_pool() -> WorkerPool | None:
    """The worker pool of the loaded extension (None before %dist_init or after shutdown)."""
    return None if _MAGICS is None else _MAGICS.pool


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext nanoddp.notebook`: register the magics and the distributed-mode transformer."""
    global _MAGICS
    magics = DistributedMagics(ipython)
    ipython.register_magics(magics)
    # Cleanup transforms run before IPython spots cell magics, so the %%distributed we
    # prepend in distributed mode is handled like one the user typed.
    ipython.input_transformers_cleanup.append(magics.transform_input)
    atexit.register(magics.close)
    _MAGICS = magics


def unload_ipython_extension(ipython: Any) -> None:
    """`%unload_ext nanoddp.notebook`: stop the workers and remove the transformer."""
    global _MAGICS
    if _MAGICS is None:
        return
    _MAGICS.close()
    atexit.unregister(_MAGICS.close)
    if _MAGICS.transform_input in ipython.input_transformers_cleanup:
        ipython.input_transformers_cleanup.remove(_MAGICS.transform_input)
    _MAGICS = None
