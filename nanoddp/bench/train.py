"""`nanoddp bench train`: every engine on the same model and global batch, side by side.

All engines of one world size live in the SAME processes (one launch per world size), each
with its own replica and optimizer. After warm-up they take turns in blocks of a few timed
steps (A B C, C B A, A B C, ...), so a burst of load on the shared machine hits every engine
alike. A step's time is the slowest rank's; rows report the median and spread over steps.

Per step, on every rank, the worker records wall times of forward, backward, the manual
engines' after-backward sync and the optimizer step, plus:

- comm time: how long gradient communication was in flight (first bucket launched -> last
  one done; the whole sync call for the manual engines);
- exposed comm: how long the training thread waited for it once the last gradient had been
  computed (backward() return minus the last post-accumulate-grad hook; the whole sync for
  the manual engines). overlap = 1 - exposed / comm is the share hidden under backward.

Memory per rank is what a process running only that engine would peak at: the RSS (CUDA:
allocated bytes) before any engine, plus the engine's resident growth (weights, grads,
buckets, optimizer state), plus the high-water mark above that during its steps (activations).
By default (`--memory alone`) each engine is measured again in a launch of its own, fresh
processes running it alone: in the shared processes the first engine built pays for what the
later ones reuse (allocator arenas, communication buffers), tens of MB by build order.
Linux's VmHWM is reset before each block (/proc/self/clear_refs), and glibc is told to return
freed large blocks to the OS, so RSS follows the allocations. The resident part is also counted
tensor by tensor after warm-up (`held_bytes`: the storages holding this rank's parameters, its
gradients and its optimizer state), for `--memory-plot`'s stacked bars.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

import nanoddp
from nanoddp.bench.machine import Memory, command_line, git_commit, machine_description, tune_malloc
from nanoddp.bench.probe import GradClock, bucket_layout, bytes_written, step_window
from nanoddp.bench.report import summarise
from nanoddp.models import GPT, count_parameters, gpt_config
from nanoddp.train.engines import AMP_DTYPES, ENGINE_REGISTRY, Engine, ManualEngine, build_engine, shard_model
from nanoddp.train.engines import ENGINES as TRAIN_ENGINES
from nanoddp.train.engines.fsdp import HSDPEngine
from nanoddp.train.metrics import CommTimer
from nanoddp.train.trace import TraceSession, build_traced_engine, region

logger = logging.getLogger(__name__)

TORCHCOMM = "nanoddp_torchcomm"  # our DDP engine over torch.distributed's collectives (comm_backend="torch")
# The trainer's engines (one registry, train.engines) plus the variants only a benchmark runs:
# single-process DataParallel, ZeRO-1 under our DDP, our DDP over torch's collectives, and
# torch's own FSDP2 (`torch.distributed.fsdp.fully_shard`, each block then the root): the peer
# of our `fsdp` engine.
TORCH_FSDP = "torch_fsdp"
ENGINES = (*TRAIN_ENGINES, "dp", TORCHCOMM, TORCH_FSDP)
ALLCORES = "single_allcores"  # `single` with every core: the other baseline for scaling efficiency
# Every rank trains its own replica on its per-rank batch and never syncs: what ws processes
# reach with free communication, so scaling lost to compute (smaller batches, cores and memory
# bandwidth shared by the processes) is told apart from scaling lost to communication.
NOCOMM = "nocomm"


class _Runner:
    """One engine on this rank: its own replica, optimizer and per-step timing probes."""

    def __init__(self, name: str, env: nanoddp.DistEnv, spec: dict, traced: bool = False):
        self.name, self.env, self.spec = name, env, spec
        self.active = name != "dp" or env.rank == 0  # DataParallel is one process: rank 0's
        self.samples: list[dict] = []
        dtype = AMP_DTYPES.get(spec["amp"], torch.bfloat16)
        self.autocast = torch.autocast(env.device.type, dtype=dtype, enabled=spec["amp"] != "off")  # as the trainer
        self.persistent_bytes = self.transient_bytes = 0
        self.held: dict[str, int] = {}
        if not self.active:
            return
        torch.manual_seed(0)
        cfg = gpt_config(spec["model"], **spec["overrides"])
        module = GPT(cfg).to(env.device)
        self.clock = GradClock(module)  # hooks registered before any wrapper's, so they fire first
        self.layout: list[list[int]] | None = None  # the wrapper's buckets, read after warm-up
        self.engine, self.ddp = self._build(name, module, env, traced, spec["amp"])
        if not traced:  # no engine times itself: the probes time every engine from outside
            self.engine.comm = None
            if self.ddp is not None:
                self.ddp.record_timeline = False
        if not isinstance(self.engine, _DPEngine):
            _forward_loss(self.engine)
        params = [p for p in module.parameters() if p.requires_grad]
        if name in ENGINE_REGISTRY and ENGINE_REGISTRY[name].zero_optimizer:
            self.optimizer: torch.optim.Optimizer = nanoddp.ZeroRedundancyOptimizer(params, torch.optim.AdamW, lr=3e-4)
        else:
            self.optimizer = torch.optim.AdamW(params, lr=3e-4)
        # localsgd/diloco step their periodic sync around it, at their default --sync-every
        if isinstance(self.engine, Engine):
            defaults = SimpleNamespace(**self.engine.option_defaults)
            self.optimizer = self.engine.wrap_optimizer(self.optimizer, defaults)
        batch = spec["global_batch"] // (1 if name == "dp" else env.world_size)
        g = torch.Generator().manual_seed(env.rank)
        tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g).to(env.device)
        self.x, self.y = tokens[:, :-1], tokens[:, 1:]  # (B, T), (B, T)

    def held_bytes(self) -> dict[str, int]:
        """Bytes of the storages behind this rank's parameters, gradients and optimizer state,
        each storage once (zero2's pieces share the whole buffer; a shard's pieces share one
        chunk). Taken after a step: the gradients are still there."""
        params = list(self.engine.module.parameters())
        state = [v for per_param in self.optimizer.state.values() for v in per_param.values() if torch.is_tensor(v)]
        return {
            "params": _storage_bytes(params),
            "grads": _storage_bytes([p.grad for p in params]),
            "optimizer_state": _storage_bytes(state),
        }

    def read_layout(self) -> None:
        """After warm-up (buckets are rebuilt after the first iteration): the bucket layout."""
        self.layout = bucket_layout(self.engine.model, self.clock)

    @staticmethod
    def _build(name: str, module, env: nanoddp.DistEnv, traced: bool, amp: str):
        """(engine, our DDP wrapper or None). `dp` and torch's FSDP2 are built here, the rest by
        the engine registry. `amp`: the FSDPs all-gather and compute in it (fp32 reduce), as the trainer's."""
        if name == "dp":
            devices = [env.device] * env.world_size  # N replicas in threads of this one process
            wrapper = nanoddp.DataParallel(module, device_ids=devices)
            return _DPEngine(wrapper, module), None
        if name == TORCHCOMM:  # separates the engine's own cost from our collectives' cost
            device_ids = [env.device.index] if env.device.type == "cuda" else None
            ddp = nanoddp.DistributedDataParallel(module, device_ids=device_ids, comm_backend="torch")
            ddp.record_timeline = env.world_size > 1
            return Engine(name, ddp, module, comm=CommTimer()), ddp
        if name == TORCH_FSDP:
            from torch.distributed.fsdp import MixedPrecisionPolicy
            from torch.distributed.fsdp import fully_shard as torch_fully_shard

            policy = MixedPrecisionPolicy(AMP_DTYPES.get(amp), torch.float32 if amp != "off" else None)
            for block in module.blocks:
                torch_fully_shard(block, mp_policy=policy)
            return Engine(name, torch_fully_shard(module, mp_policy=policy), module), None
        if name == NOCOMM:  # the module itself, never synced (build_engine refuses `single` at ws > 1)
            return Engine(name, module, module), None
        base = "single" if name == ALLCORES else name
        if name in ("fsdp", "hsdp"):  # the trainer's units (hsdp: a node per group); build_engine takes it as is
            shard_model(module, env, amp=amp, mesh=HSDPEngine.mesh_for(env, None) if name == "hsdp" else None)
        engine = (build_traced_engine if traced else build_engine)(base, module, env)
        # our DDP wrapper, if this engine has one: the probes read its buckets, and its own
        # timeline is switched off when they time it (__init__)
        ours = engine.model if isinstance(engine.model, nanoddp.DistributedDataParallel) else None
        return engine, ours

    def step(self) -> dict:
        """One training step; returns its phase times in seconds."""
        threads = torch.get_num_threads()
        if self.name == ALLCORES:
            torch.set_num_threads(self.spec["allcores_threads"])
        sent0 = bytes_written()
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        self.clock.reset()
        with self.engine.micro_step(sync=True):
            with region("forward"), self.autocast:
                loss = self.engine.forward_loss(self.x, self.y)
            t1 = time.perf_counter()
            with region("backward"):
                loss.backward()
            t2 = time.perf_counter()
        t3 = time.perf_counter()
        with region("optimizer step"):
            self.optimizer.step()
        self.engine.end_step()
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)
        t4 = time.perf_counter()
        sent1 = bytes_written()
        torch.set_num_threads(threads)
        sent = None if sent0 is None or sent1 is None or self.env.device.type == "cuda" else sent1 - sent0
        sample = {"step_s": t4 - t0, "forward_s": t1 - t0, "backward_s": t2 - t1, "sync_s": t3 - t2,
                  "optimizer_s": t4 - t3, **self._comm(t2, t3),
                  "bytes_sent": sent}  # fmt: skip
        return {k: v if isinstance(v, int) or v is None else round(v, 7) for k, v in sample.items()}

    def _comm(self, backward_end: float, sync_end: float) -> dict:
        """Gradient comm window and exposed comm of the step just taken, from the outside probes
        (report.DEFINITIONS). None where no gradient crosses a process boundary."""
        if self.env.world_size == 1 or self.name in ("dp", NOCOMM):
            return {"comm_s": None, "exposed_comm_s": None}
        syncs_after = isinstance(self.engine, ManualEngine)
        window = step_window(self.clock, self.layout, backward_end, sync_end, syncs_after)
        if window is None:
            return {"comm_s": None, "exposed_comm_s": None}
        return {"comm_s": window.comm_s, "exposed_comm_s": window.waited_s}


def _storage_bytes(tensors: list) -> int:
    """Bytes of the distinct non-empty storages behind `tensors` (a DTensor counts its local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class _DPEngine:
    """DataParallel behind the Engine interface: gradients are summed by autograd, no sync."""

    def __init__(self, model, module):
        self.model, self.module, self.comm = model, module, None

    def micro_step(self, sync: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _, losses = self.model(x, y)
        return self.model.reduce_loss(losses)

    def end_step(self) -> None:
        pass


def _forward_loss(engine):
    """Give a trainer Engine the `forward_loss` that _DPEngine has (the model returns (logits, loss))."""

    def forward_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return engine.model(x, y)[1]

    engine.forward_loss = forward_loss
    return engine


def _engine_names_at(n: int, engines: list[str]) -> list[str]:
    """The engines a world size of n runs: `single` only at ws 1, its `nocomm` twin above."""
    names = [e for e in engines if not (e == "single" and n > 1)]
    return names + ([NOCOMM] if "single" in engines and n > 1 else [])


def _engine_names(env: nanoddp.DistEnv, spec: dict) -> list[str]:
    """`_engine_names_at`, plus what depends on this rank's hardware."""
    names = _engine_names_at(env.world_size, spec["engines"])
    if env.device.type == "cuda":  # one process per GPU: DataParallel would need ws GPUs here
        names = [e for e in names if e != "dp" or env.world_size <= torch.cuda.device_count()]
    if "single" in names and env.world_size == 1 and env.device.type == "cpu" and spec["allcores_threads"] > 1:
        names.append(ALLCORES)
    return names


def _warm_lazy_imports(env: nanoddp.DistEnv) -> None:
    """torch DDP pulls in torch._dynamo on first use: ~100 MB that no engine should be charged."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    probe = torch.nn.Linear(2, 2).to(env.device)
    TorchDDP(probe)(torch.ones(1, 2, device=env.device)).sum().backward()
    nanoddp.DistributedDataParallel(probe)(torch.ones(1, 2, device=env.device)).sum().backward()


def _bench_worker(env: nanoddp.DistEnv, spec: dict) -> dict:
    """All engines on this rank, interleaved in blocks; returns per-step samples and memory."""
    torch.set_num_threads(spec["threads_per_rank"])
    tune_malloc()
    _warm_lazy_imports(env)
    memory = Memory(env.device)
    base = memory.now()
    runners = []
    for name in _engine_names(env, spec):
        before = memory.now()
        runner = _Runner(name, env, spec)
        if runner.active:
            memory.reset()
            for _ in range(spec["warmup"]):
                runner.step()
            runner.persistent_bytes = memory.now() - before
            runner.transient_bytes = memory.peak() - memory.now()
            runner.held = runner.held_bytes()
            runner.read_layout()
        runners.append(runner)
    rounds = math.ceil(spec["steps"] / spec["block"])
    for r in range(rounds):
        for runner in runners if r % 2 == 0 else reversed(runners):
            dist.barrier()
            if not runner.active:
                continue
            start = memory.now()
            memory.reset()
            for _ in range(min(spec["block"], spec["steps"] - r * spec["block"])):
                runner.samples.append(runner.step())
            runner.transient_bytes = max(runner.transient_bytes, memory.peak() - start)
    dist.barrier()
    if spec["trace_dir"]:
        _trace_engines(env, spec, [r.name for r in runners])
    return {r.name: {"samples": r.samples, "base_bytes": base, "persistent_bytes": r.persistent_bytes,
                     "transient_bytes": r.transient_bytes, "held_bytes": r.held}
            for r in runners if r.active}  # fmt: skip


def _trace_engines(env: nanoddp.DistEnv, spec: dict, names: list[str]) -> None:
    """A few profiled steps per engine, each on a fresh replica whose buckets draw on the timeline."""
    for name in names:
        dist.barrier()
        runner = _Runner(name, env, spec, traced=True)
        if not runner.active:
            continue
        file_name = f"{name}-ws{env.world_size}-rank{{rank}}.trace.json"
        with TraceSession(spec["trace_dir"], env.rank, steps=2, skip=2, name=file_name) as session:
            for _ in range(4):
                runner.step()
                session.step()
    dist.barrier()


def run_benchmark(nprocs: list[int], engines: list[str], model: str = "tiny", global_batch: int = 32,
                  steps: int = 30, warmup: int = 3, block: int = 5, threads_per_rank: int = 1,
                  trace_dir: str | None = None, overrides: dict | None = None,
                  backend: str | None = None, amp: str = "off", memory: str = "alone") -> dict:  # fmt: skip
    """Measure every engine at every world size; returns {"meta": ..., "results": [row, ...]}.

    `memory`: "alone" measures each engine's memory in a launch of its own (see the module
    docstring), "shared" takes it from the timed launch."""
    _check(nprocs, engines, global_batch, steps, warmup, block, threads_per_rank, memory)
    # One backend for every world size, so rows compare like with like (nccl needs a GPU per rank).
    backend = backend or nanoddp.env.default_backend(max(nprocs))
    spec: dict[str, Any]  # read by every rank's _Runner; its values are of many types
    spec = {"engines": list(engines), "model": model, "overrides": dict(overrides or {}),
            "global_batch": global_batch, "steps": steps, "warmup": max(warmup, 2), "block": block,
            "threads_per_rank": threads_per_rank, "allcores_threads": os.cpu_count() or 1,
            "trace_dir": trace_dir, "amp": amp}  # fmt: skip
    cfg = gpt_config(model, **spec["overrides"])
    meta = {**machine_description(), "model": model, "model_config": cfg.__dict__,
            "parameters": count_parameters(GPT(cfg)),
            "parameter_tensors": len(list(GPT(cfg).parameters())), "global_batch": global_batch, "steps": steps,
            "warmup": spec["warmup"], "block": block, "threads_per_rank": threads_per_rank,
            "optimizer": "AdamW", "dtype": "float32", "amp": amp, "date": datetime.now(timezone.utc).isoformat(),
            "load_average_before": os.getloadavg(), "backend": backend, "command": command_line(),
            "git_commit": git_commit(), "memory": memory,
            "device": "cuda" if backend == "nccl" else "cpu"}  # fmt: skip
    per_ws = {}
    for n in nprocs:
        logger.info("world size %d: %s", n, ", ".join(_engine_names_at(n, spec["engines"])))
        per_rank = nanoddp.launch(_bench_worker, n, args=(spec,), backend=backend)
        if memory == "alone":
            _measure_memory_alone(per_rank, spec, backend)
        per_ws[n] = per_rank
    meta["load_average_after"] = os.getloadavg()
    # raw: every per-step sample of every rank, so a table can be re-derived (report.results_of)
    raw = {str(n): per_rank for n, per_rank in per_ws.items()}
    return {"meta": meta, "results": summarise(per_ws, meta), "raw": raw}


MEMORY_MODES = ("alone", "shared")
_MEMORY_KEYS = ("base_bytes", "persistent_bytes", "transient_bytes", "held_bytes")


def _measure_memory_alone(per_rank: list[dict], spec: dict, backend: str) -> None:
    """Overwrite each engine's memory figures in `per_rank` with those of a launch that runs
    that engine alone: warm-up and one block of steps, the same probes as the timed launch."""
    for name in per_rank[0]:  # every engine this world size ran (`dp` runs on rank 0 only)
        alone = {**spec, "engines": [name], "steps": spec["block"], "trace_dir": None}
        measured = nanoddp.launch(_bench_worker, len(per_rank), args=(alone,), backend=backend)
        for mine, theirs in zip(per_rank, measured, strict=True):
            if name in theirs:
                mine[name].update({key: theirs[name][key] for key in _MEMORY_KEYS})


def _check(nprocs, engines, global_batch, steps, warmup, block, threads_per_rank, memory) -> None:
    if not nprocs or any(n < 1 for n in nprocs):
        raise ValueError(f"--nproc needs world sizes >= 1, got {nprocs}")
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        raise ValueError(f"unknown engine(s) {unknown}; choose from {list(ENGINES)}")
    for n in nprocs:
        if global_batch % n:
            raise ValueError(f"--global-batch {global_batch} must be divisible by every world size, not by {n}")
    for flag, value in (("steps", steps), ("block", block), ("threads-per-rank", threads_per_rank)):
        if value < 1:
            raise ValueError(f"--{flag} must be >= 1, got {value}")
    if warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {warmup}")
    if memory not in MEMORY_MODES:
        raise ValueError(f"memory must be one of {MEMORY_MODES}, got {memory!r}")
