"""Helpers the tests share: run a function on N gloo ranks, batch many checks into one launch,
and the references several test files compare against (DDP models and data, a tiny trainer run,
notebook kernels). Tests import these by name; no test file imports another test file.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import nbformat
import torch
import torch.nn as nn
from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient
from torch.testing import assert_close

import nanoddp
from nanoddp import LaunchError
from nanoddp.env import DistEnv
from nanoddp.models import GPT, MLPClassifier, gpt_config
from nanoddp.models.gpt import sample_next
from nanoddp.train.config import TrainConfig
from nanoddp.train.trainer import Trainer

# ---- processes: run a function on N gloo ranks ------------------------------------------------


def _single_threaded(fn, env, *args):
    torch.set_num_threads(1)  # 2 cores shared by up to 4 ranks: oversubscription is the enemy
    return fn(env, *args)


# Ranks fork from multiprocessing's fork server, which imports these once per test session
# (conftest.py sets it up): a launch then costs a fraction of a second instead of an import of
# torch per rank, which was most of the suite's time. `helpers` itself cannot be preloaded (the
# server ignores our sys.path on Python 3.11), so what it imports is named instead, and the
# nanoddp modules the tests' ranks use (`import nanoddp` alone imports nothing: its names load on
# first use). Every fork server imports dynamo too (`fork_server.ALWAYS_PRELOAD`).
FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "nanoddp.fsdp",
    "nanoddp.parallel.ddp.wrapper",
    "nanoddp.parallel.zero.stage1",
    "nanoddp.train.trainer",
    "nanoddp.cli",  # and the launchers the tests fork (`run_training(..., forked=True)`)
    "nanoddp.train.launcher.cli",
    "nanoddp.ft.supervisor",
    "nbformat",
    "jupyter_client",
    "nbclient",
]


def run_on_ranks(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    """Run `fn(env, *args)` on `world_size` gloo processes; return every rank's result.

    Any rank's exception is re-raised here as `nanoddp.LaunchError` carrying its traceback, and
    every child is stopped before this returns, pass or fail. The ranks are forked from the fork
    server (`launch`'s default), which imported what conftest.py names once per session.
    """
    return nanoddp.launch(
        functools.partial(_single_threaded, fn),
        world_size,
        args=args,
        backend="gloo",
        timeout=timeout,
    )


# ---- many named checks in one launch, each reported on its own -------------------------------
#
# Process start-up costs seconds, so DDP/strategy tests batch their cases per world size. Each
# rank appends one JSON line per finished case to a file; the parent reads the files even when
# the launch failed or timed out, so a hang in one backend's cases (run last) does not hide the
# results of the cases that ran before it.

Case = tuple[str, Callable[..., None]]


def run_cases(env, cases: Sequence[Case], out_dir: str) -> None:
    """Worker side: run every case (fn(env)), recording 'ok' or the traceback, in order."""
    path = Path(out_dir, f"rank{env.rank}.jsonl")
    with path.open("a") as out:
        for name, fn in cases:
            try:
                fn(env)
                error = None
            except Exception:
                error = traceback.format_exc()
            out.write(json.dumps({"case": name, "error": error}) + "\n")
            out.flush()


class SuiteResults:
    """Parent side: per-case outcomes of every rank, plus the launch error if there was one."""

    def __init__(self, world_size: int, out_dir: Path, launch_error: BaseException | None):
        self.world_size = world_size
        self.launch_error = launch_error
        self.by_case: dict[str, dict[int, str | None]] = {}
        for rank in range(world_size):
            path = out_dir / f"rank{rank}.jsonl"
            if path.exists():
                for line in path.read_text().splitlines():
                    record = json.loads(line)
                    self.by_case.setdefault(record["case"], {})[rank] = record["error"]

    def check(self, case: str) -> None:
        """Fail the calling test unless `case` passed on every rank."""
        outcomes = self.by_case.get(case, {})
        missing = [r for r in range(self.world_size) if r not in outcomes]
        if missing:
            raise AssertionError(f"case {case!r} never finished on ranks {missing}; launch: {self.launch_error}")
        failures = {r: e for r, e in outcomes.items() if e is not None}
        if failures:
            rank, error = next(iter(failures.items()))
            raise AssertionError(f"case {case!r} failed on ranks {sorted(failures)}; rank {rank}:\n{error}")


def suites_by_world_size(
    worker: Callable, tmp_path_factory, name: str, timeout: float
) -> Callable[[int], SuiteResults]:
    """For a module-scoped fixture: `get(world_size)` launches `worker` once per world size and
    caches its results, so every parametrized case of that world size reads the same run."""
    results: dict[int, SuiteResults] = {}

    def get(world_size: int) -> SuiteResults:
        if world_size not in results:
            out_dir = tmp_path_factory.mktemp(f"{name}-ws{world_size}")
            results[world_size] = run_suite(worker, world_size, out_dir, timeout=timeout)
        return results[world_size]

    return get


def run_suite(worker: Callable, world_size: int, out_dir: Path, *args, timeout: float = 240.0) -> SuiteResults:
    """Launch `worker(env, *args, out_dir)` on `world_size` ranks and collect per-case results."""
    out_dir.mkdir(parents=True, exist_ok=True)
    error = None
    try:
        run_on_ranks(worker, world_size, *args, str(out_dir), timeout=timeout)
    except (LaunchError, TimeoutError) as exc:
        error = exc
    return SuiteResults(world_size, out_dir, error)


# ---- DDP references: models, data, a one-process run -----------------------------------------
BACKENDS = ("torch", "nanoddp")


B, T = 2, 16  # per-rank batch; GPT sequence length (the tiny preset allows up to 64)


TIGHT = {"rtol": 1e-5, "atol": 1e-6}


STEPS, CHECKED_STEPS = 3, (1, 3)


def build(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "gpt":
        return GPT(gpt_config("tiny"))  # the DDP tutorials' TinyTransformerLM, 3.4 M parameters
    return MLPClassifier(in_features=32, hidden=64, num_classes=10, depth=3)


def global_batch(kind: str, rows: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "gpt":
        return torch.randint(0, 512, (rows, T), generator=g), torch.randint(0, 512, (rows, T), generator=g)
    return torch.randn(rows, 32, generator=g), torch.randint(0, 10, (rows,), generator=g)


def shard(t: torch.Tensor, rank: int, size: int = B) -> torch.Tensor:
    return t[rank * size : (rank + 1) * size]


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@functools.lru_cache(maxsize=4)
def single_process_params(kind: str, world_size: int) -> dict[int, list[torch.Tensor]]:
    """Parameters of a one-process run on the concatenated N*B batch, after CHECKED_STEPS."""
    model = build(kind)
    opt = sgd(model.parameters())
    snapshots = {}
    for step in range(1, STEPS + 1):
        x, y = global_batch(kind, B * world_size, step)
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
        if step in CHECKED_STEPS:
            snapshots[step] = [p.detach().clone() for p in model.parameters()]
    return snapshots


def assert_same_params(model: nn.Module, expected: list[torch.Tensor], what: str) -> None:
    for (name, p), ref in zip(model.named_parameters(), expected, strict=True):
        assert_close(p.detach(), ref, **TIGHT, msg=lambda m, name=name: f"{what}: {name}: {m}")


def assert_same_grads(a: nn.Module, b: nn.Module, what: str, **tol) -> None:
    tol = tol or TIGHT
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), f"{what}: {name}: grad None on one side only"
        if p.grad is not None:
            assert_close(p.grad, q.grad, **tol, msg=lambda m, name=name: f"{what}: {name}: {m}")


class Branchy(nn.Module):
    """`branch` is used only when asked (rank 0 asks), `never` is never used."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.branch = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x, use_branch: bool):
        h = torch.tanh(self.trunk(x))  # (B, 8)
        if use_branch:
            h = self.branch(h)
        return self.head(h).pow(2).mean()


def branchy_reference(world_size: int, step: int) -> Branchy:
    """Average over ranks of each rank's own gradient, a locally unused parameter counting 0."""
    torch.manual_seed(0)
    reference = Branchy()
    x = torch.randn(world_size * B, 8, generator=torch.Generator().manual_seed(step))
    for rank in range(world_size):
        (reference(shard(x, rank), rank == 0) / world_size).backward()
    return reference


# ---- a tiny trainer run ------------------------------------------------------------------------
# A model and data small enough that a step costs milliseconds. 1900 bytes of stdlib text give
# 112 training windows (an epoch is 14 steps at batch 8) and 5 validation windows (odd, so the
# ranks' validation shards are uneven).
TINY = TrainConfig(
    engine="torch",
    data="text",
    text_max_bytes=1900,
    seq_len=16,
    d_model=32,
    n_layers=2,
    n_heads=2,
    d_ff=64,
    batch_size=8,
    steps=4,
    lr=3e-3,
    warmup_steps=2,
    grad_clip=0.05,
    log_every=1,
    eval_every=0,
    eval_samples=0,
    snapshot_every=0,
    resume="never",
    progress=False,
)


def train_tiny(config: TrainConfig, env: DistEnv, stop_after: int | None = None) -> Trainer:
    trainer = Trainer.from_config(config, env)
    trainer.train(stop_after=stop_after)
    return trainer


def trainer_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.module.state_dict().items()}


def generate_by_full_recompute(
    model: GPT, idx: torch.Tensor, new_tokens: int, temperature: float, top_k: int | None, generator: torch.Generator
) -> torch.Tensor:
    """Generation without a cache, the reference for `GPT.stream` and `nanoddp sample`: every new
    token from a full forward over the last seq_len tokens."""
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(idx[:, -model.cfg.seq_len :])[:, -1, :]  # (B, V)
            idx = torch.cat([idx, sample_next(logits, temperature, top_k, generator)], dim=1)
    return idx


# ---- a small one-process run, as a config and as flags -----------------------------------------
SMALL = TrainConfig(
    engine="single", data="text", text_max_bytes=1900, seq_len=16, d_model=32, n_layers=2, n_heads=2, d_ff=64,
    batch_size=8, steps=3, warmup_steps=1, log_every=1, eval_every=0, eval_samples=0, snapshot_every=1,
    progress=False,
)  # fmt: skip


# The same run on the command line (`--engine single` runs one process).
FLAGS = [
    "--engine", "single", "--text-max-bytes", "1900", "--seq-len", "16", "--d-model", "32", "--n-layers", "2",
    "--n-heads", "2", "--d-ff", "64", "--batch-size", "8", "--steps", "3", "--warmup-steps", "1",
    "--snapshot-every", "1", "--eval-every", "0", "--no-progress",
]  # fmt: skip


# ---- `nanoddp train --on-failure continue`: a tiny GPT, its replay, its replicas ----------------
# Flags of a run whose step takes milliseconds; a launch costs seconds (the quorum service and
# one process per replica that imports torch).
FT_TINY_GPT = [
    "--text-max-bytes", "1900", "--seq-len", "16", "--d-model", "32", "--n-layers", "2", "--n-heads", "2",
    "--d-ff", "64", "--batch-size", "12", "--warmup-steps", "2", "--seed", "0", "--log-every", "1",
    "--no-progress", "--collective-timeout", "10",
]  # fmt: skip


def replay_continue_run(
    history: list[int],
    *,
    replicas: int = 3,
    lr: float | None = None,
    losses: list[float] | None = None,
) -> dict[str, torch.Tensor]:
    """The built-in job of `FT_TINY_GPT` in this process, as `--on-failure continue` runs it: each
    step's global batch split over the world size the step really had (`history`), the weighted
    pieces summed in rank order, clipped, AdamW, the schedule; a step whose loss is not finite on
    some piece changes no weight (`--on-nan skip`). `replicas`: the run's, which set its thread count. `losses`, if
    given, receives each step's loss as its record holds it: the weighted piece losses summed
    in rank order, as the replicas sum them with the gradients (`WeightedPieceSum`)."""
    from nanoddp.ft.global_batches import GlobalBatches, piece_weight, share
    from nanoddp.train.config import threads_per_rank
    from nanoddp.train.recipe import build_job

    config = TrainConfig(
        text_max_bytes=1900, seq_len=16, d_model=32, n_layers=2, n_heads=2, d_ff=64, batch_size=12,
        warmup_steps=2, seed=0, steps=len(history), lr=lr,
    )  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(threads_per_rank(config, replicas))  # what the replicas ran with: matmuls split by it
    job = build_job(config)
    model, opt, params = job.module, job.optimizer, [p for p in job.module.parameters() if p.requires_grad]
    batches = GlobalBatches(len(job.train_set), 12, 0)
    try:
        for step, world_size in enumerate(history):
            total, loss_sum, finite = None, None, True
            for rank in range(world_size):
                piece = batches.indices(step)[share(12, rank, world_size)]
                model.zero_grad(set_to_none=True)
                loss = model(*torch.utils.data.default_collate([job.train_set[i] for i in piece.tolist()]))[-1]
                finite = finite and bool(loss.isfinite())
                loss.backward()
                flat = torch.cat([p.grad.reshape(-1) for p in params]) * piece_weight(12, rank, world_size)
                total = flat if total is None else total + flat
                weighted = loss.detach().reshape(1) * piece_weight(12, rank, world_size)
                loss_sum = weighted if loss_sum is None else loss_sum + weighted
            if losses is not None:
                losses.append(float(loss_sum))
            if finite:
                at = 0
                for p in params:
                    p.grad = total[at : at + p.numel()].view_as(p).clone()
                    at += p.numel()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
            job.scheduler.step()
    finally:
        torch.set_num_threads(threads)
    return model.state_dict()


def replay_engine_run(
    env: DistEnv,
    history: list[int],
    engine: str,
    replicas: int,
    amp: str = "off",
    grad_accum: int = 1,
    losses: list[float] | None = None,
) -> dict[str, torch.Tensor]:
    """Run on G gloo ranks (`run_on_ranks(replay_engine_run, G, ...)`, G = `--group-size`: the
    members of one replica group, 1 by default): the built-in job of `FT_TINY_GPT` trained with
    `engine` as the restart path builds it (the registry's class over the G-rank world), each step
    as `--on-failure continue --engine ENGINE` runs it over the world sizes of `history`: every
    replica's piece in turn (cut into G x `--grad-accum` contiguous micro-batches, member g taking
    the g-th run of `--grad-accum`, each micro-loss weighted by its size over the mean
    micro-batch's, `--amp` autocast; the engine averages over the G members as in the run), the
    engine's `cross_replica_grads()` weighted by the piece's share and added in replica order,
    written back, `finish_cross_replica()`, the engine's clip, AdamW (through the trainer's
    GradScaler for fp16), the schedule. Returns the whole model's state; `losses`, if given,
    receives each step's loss as its record holds it (each replica's, its members' averaged in rank
    order, weighted and summed in replica order: `FaultTolerantTrainer._piece_loss`, `WeightedPieceSum`)."""
    from nanoddp.comm.api.rank_order import all_reduce_in_rank_order
    from nanoddp.ft.global_batches import GlobalBatches, piece_weight, share
    from nanoddp.parallel.grad_scaler import ShardedGradScaler
    from nanoddp.train.config import threads_per_rank
    from nanoddp.train.engines import AMP_DTYPES, build_engine, prepare_model
    from nanoddp.train.recipe import build_job

    config = TrainConfig(
        engine=engine, amp=amp, grad_accum=grad_accum, text_max_bytes=1900, seq_len=16, d_model=32, n_layers=2,
        n_heads=2, d_ff=64, batch_size=12, warmup_steps=2, seed=0, steps=len(history),
    )  # fmt: skip
    group_size = env.world_size
    torch.set_num_threads(threads_per_rank(config, replicas * group_size))  # as in the run: matmuls split by it
    job = build_job(config)
    prepare_model(config, job.module, job.optimizer, env)
    built = build_engine(engine, job.module, env)
    optimizer = built.wrap_optimizer(job.optimizer, config)
    built.use_cross_replica()
    # DDP's shards follow its buckets, which it rebuilds at its second forward: another replica's
    # piece in the same step may have other buckets. Summing the whole averaged gradients instead
    # adds the same elements in the same order, whatever the buckets.
    whole_grads = group_size > 1 and getattr(built, "cross_shards", None) is not None

    def summed() -> list[torch.Tensor]:  # the buffers a replica's pieces are summed in
        return [p.grad.view(-1) for p in built.module.parameters()] if whole_grads else built.cross_replica_grads()

    per_rank_grads = built.sharded or built.local_gradients  # the trainer's choice of scaler
    scaler = (ShardedGradScaler if per_rank_grads else torch.amp.GradScaler)("cpu", enabled=amp == "fp16")
    batches = GlobalBatches(len(job.train_set), 12, 0)
    for step, world_size in enumerate(history):
        total, loss_sum = None, None
        for rank in range(world_size):
            piece = batches.indices(step)[share(12, rank, world_size)]
            optimizer.zero_grad(set_to_none=True)
            member = torch.zeros(())
            units = group_size * grad_accum
            for micro in range(env.rank * grad_accum, (env.rank + 1) * grad_accum):
                indices = piece[share(len(piece), micro, units)]
                weight = len(indices) * units / len(piece)
                batch = torch.utils.data.default_collate([job.train_set[i] for i in indices.tolist()])
                with built.micro_step(micro == (env.rank + 1) * grad_accum - 1):
                    with torch.autocast("cpu", dtype=AMP_DTYPES.get(amp, torch.bfloat16), enabled=amp != "off"):
                        loss = built.model(*batch)[-1]  # GPT returns (logits, loss)
                    scaler.scale((loss if weight == 1.0 else loss * weight) / grad_accum).backward()
                member += loss.detach().float() * weight
            member /= grad_accum
            if group_size > 1:
                all_reduce_in_rank_order(member.view(1), None)
                member /= group_size
            weighted = member.reshape(1) * piece_weight(12, rank, world_size)
            loss_sum = weighted if loss_sum is None else loss_sum + weighted
            if whole_grads:  # the group's average gathered now: the same elements, in parameter order
                built.finish_cross_replica()
            flat = torch.cat(summed()) * piece_weight(12, rank, world_size)
            total = flat if total is None else total + flat
            built.end_step()  # as each replica's step ends (DDP: its shards go)
        at = 0
        for buffer in summed():
            buffer.copy_(total[at : at + buffer.numel()])
            at += buffer.numel()
        if not whole_grads:
            built.finish_cross_replica()
        if losses is not None:
            losses.append(float(loss_sum))
        scaler.unscale_(optimizer)
        built.clip_grad_norm_(1.0)
        scaler.step(optimizer)
        scaler.update()
        job.scheduler.step()
    return built.state_dict()


def replica_pid(launcher, replica: int, attempt: int | None = None) -> int | None:
    """The pid of replica `replica`'s process under `launcher` (a psutil.Process of `nanoddp
    train --on-failure continue`), its `attempt`-th replacement if given; None if there is none."""
    from nanoddp.ft.replica_env import replica_processes

    for (found, tried), proc in replica_processes(launcher).items():
        if found == replica and attempt in (None, tried):
            return proc.pid
    return None


class OutputReader:
    """A child's output (its stdout pipe), read on a thread so that it never blocks on a full pipe."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.text = proc, ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        self.text = self.proc.stdout.read()

    def done(self) -> str:
        """All it wrote (the child has ended, or its pipe closed)."""
        self._reader.join(timeout=30)
        return self.text


def lighthouse_on(hosts, host: int, port: int) -> tuple[str, subprocess.Popen]:
    """torchft's Lighthouse started on namespace host `host` (a `NetnsHosts`) at `port`, with the
    run's own clocks (`nanoddp.ft.quorum_service`) and `--min_replicas 1`, as docs/ft.md says to run
    it where node 0 may be lost: (its `address:port` for `--lighthouse`, its process)."""
    from nanoddp.ft.quorum_service import HEARTBEAT_MS, JOIN_MS, TICK_MS

    address = f"{hosts.addresses[host]}:{port}"
    service = hosts.popen(host, [str(Path(sys.executable).parent / "torchft_lighthouse"), "--bind", address,
                                 "--min_replicas", "1", "--join_timeout_ms", str(JOIN_MS), "--heartbeat_timeout_ms",
                                 str(HEARTBEAT_MS), "--quorum_tick_ms", str(TICK_MS)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    return address, service


def wait_for(what: Callable, deadline: float, step_s: float = 0.005):
    """`what()` once it is truthy; an AssertionError at `deadline` (time.monotonic)."""
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        time.sleep(step_s)
    raise AssertionError(f"timed out waiting for {what.__doc__ or what}")


# ---- notebook kernels ---------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parent.parent  # the repository


KERNEL_NAME = "nanoddp-test"


WORLD_SIZE = 2


def kernel_kwargs(tmp_path: Path) -> dict:
    """Keyword arguments for a KernelManager whose kernel is this venv's python."""
    spec_dir = tmp_path / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "nanoddp tests",
        "language": "python",
        "env": {"IPYTHONDIR": str(tmp_path / "ipython")},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return {
        "kernel_name": KERNEL_NAME,
        "kernel_spec_manager": KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")]),
        "connection_file": str(tmp_path / "connection.json"),
    }


def execute_notebook(nb: nbformat.NotebookNode, tmp_path: Path, cwd: Path, timeout: int = 300) -> None:
    """Run every cell with nbclient on our kernel; raises CellExecutionError on a failed cell
    (cells tagged "raises-exception" may fail)."""

    class Client(NotebookClient):
        def create_kernel_manager(self):
            self.km = AsyncKernelManager(**kernel_kwargs(tmp_path))
            return self.km

    Client(nb, timeout=timeout, resources={"metadata": {"path": str(cwd)}}).execute()


def cell_text(cell) -> str:
    """Everything a cell showed as text: streams, results, and error tracebacks."""
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("display_data", "execute_result"):
            parts.append(out.data.get("text/plain", ""))
        elif out.output_type == "error":
            parts.append("\n".join(out.traceback))
    return "".join(parts)


def cell_error(cell):
    errors = [out for out in cell.outputs if out.output_type == "error"]
    return errors[0] if errors else None


# ----------------------------------------------------------------------------- interrupt & kernel death
def run_cell(kc, code: str, timeout: float = 120, until=None):
    """Execute `code`; return (reply content, stdout+stderr text). `until(text)` -> True triggers
    an early return after that output appears (the cell keeps running)."""
    msg_id = kc.execute(code)
    text = ""
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            text += content["text"]
            if until is not None and until(text):
                return msg_id, text
        elif kind == "status" and content["execution_state"] == "idle":
            break
    # The reply to *this* request: the shell channel may still hold an older one (a second
    # kernel_info reply that `wait_for_ready` asked for on a loaded machine), and taking the next
    # message would then hand every later cell its predecessor's reply.
    return finish_cell(kc, msg_id, timeout), text


def finish_cell(kc, msg_id: str, timeout: float = 60):
    """Wait for the reply of an already-started execution."""
    deadline = time.monotonic() + timeout
    while True:
        reply = kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"]


# Waiting for a kernel to be done with a cell, for tests that start the next cell right after.
#
# ipykernel sends a failed cell's reply *before* it arms the abort of queued execute requests
# (`stop_on_error`), and disarms it with a message of its own put behind whatever is queued by
# then. A client that sends the next cell as soon as the reply arrives can land in that window,
# and its cell is answered `aborted` without running; a loaded machine makes the window long
# enough to hit. The kernel publishes the cell's `idle` status only after both steps, so a client
# that waits for it (as `helpers.run_cell` does) is never caught.
# A cell that widens ipykernel's reply-then-arm window to a second, so that a client which does
# not wait for `idle` is caught every time rather than now and then.
WIDEN_ABORT_WINDOW = (
    "import time as _time\n"
    "_kernel = get_ipython().kernel\n"
    "_arm_abort = _kernel._abort_queues\n"
    "_kernel._abort_queues = lambda *args, **kwargs: (_time.sleep(1.0), _arm_abort(*args, **kwargs))[-1]\n"
)


def finish_cell_until_idle(kc, msg_id: str, timeout: float = 60) -> dict:
    """The reply of an already-started execution, returned once the kernel is idle after it."""
    deadline = time.monotonic() + timeout
    reply = finish_cell(kc, msg_id, timeout)
    while True:
        msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return reply
