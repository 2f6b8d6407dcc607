"""The planted faults `tools/mutate.py` runs: one per bug class the suite must catch.

Each names the file, an exact text that occurs once in it, its faulty replacement, and the one
test (file and -k) that should fail on it. A fault whose text no longer occurs is reported as
"not applied" by the runner: the code moved on and the entry needs updating.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    test: tuple[str, ...]  # pytest arguments: the one file (and -k) that should catch it


MUTATIONS = (
    Mutation(
        "ring reduction: pipelined ring drops the received piece",
        "nanoddp/comm/ring.py",
        "reduce_into(op, piece, scratch[j % 2, a:b])",
        "pass",
        ("tests/multiproc/test_comm_precision.py", "-k", "ring"),
    ),
    Mutation(
        "ring reduction: fp16/bf16 accumulated in their own dtype",
        "nanoddp/comm/reduce.py",
        "acc_dtype = torch.float32 if out.dtype in LOW_PRECISION else out.dtype",
        "acc_dtype = out.dtype",
        ("tests/multiproc/test_comm_precision.py", "-k", "low_precision"),
    ),
    Mutation(
        "bucket averaging: DDP sums instead of averaging",
        "nanoddp/parallel/ddp/reducer.py",
        "bucket.buffer.mul_(1.0 / self.divisor)",  # the default path (gradients copied into buckets)
        "pass",
        ("tests/multiproc/test_ddp_no_sync_values.py", "-k", "nanoddp"),
    ),
    Mutation(
        "no_sync: DDP reduces inside no_sync too",
        "nanoddp/parallel/ddp/wrapper.py",
        "reducer.sync_this_backward = torch.is_grad_enabled() and self.require_backward_grad_sync",
        "reducer.sync_this_backward = torch.is_grad_enabled()",
        ("tests/multiproc/test_ddp_no_sync_values.py", "-k", "nanoddp"),
    ),
    Mutation(
        "sampler resume: position not restored",
        "nanoddp/train/data/sampler.py",
        'self.position = int(state["position"])',
        "self.position = 0",
        ("tests/unit/test_data.py", "-k", "resume"),
    ),
    Mutation(
        "checksum: snapshot digest never compared",
        "nanoddp/train/checkpoint/snapshot.py",
        "if hashlib.sha256(payload).hexdigest() != digest:",
        "if False:",
        ("tests/unit/test_snapshot.py", "-k", "corrupted"),
    ),
    Mutation(
        "ZeRO broadcast: owners' updated parameters not sent",
        "nanoddp/parallel/zero/partition.py",
        "self.comm.broadcast(flat, src=self.global_ranks[owner], group=self.group)",
        "pass",
        # the whole-parameter partition is the one that broadcasts; its suite case checks values
        ("tests/multiproc/test_zero2_fsdp.py", "-k", "ws3 and zero1_parameter and not uneven"),
    ),
    Mutation(
        "ZeRO all-gather: updated shards not gathered",
        "nanoddp/parallel/zero/partition.py",
        "self.comm.all_gather_into_tensor(full, shard, group=self.group)",
        "pass",
        ("tests/multiproc/test_zero.py", "-k", "matches_plain_optimizer and 2"),
    ),
    Mutation(
        "bench exposed time: reported as 0 (a faked 100 % overlap)",
        "nanoddp/bench/train.py",
        '"exposed_comm_s": end - last_grad',
        '"exposed_comm_s": 0.0 * (end - last_grad)',
        ("tests/multiproc/test_bench_measure.py",),
    ),
    Mutation(
        "bench exposed time: reported as the whole comm window (0 % overlap)",
        "nanoddp/bench/train.py",
        '"exposed_comm_s": end - last_grad',
        '"exposed_comm_s": end - start',
        ("tests/multiproc/test_bench_measure.py",),
    ),
    Mutation(
        "sharded grads: ZeRO-2/FSDP sum instead of averaging",
        "nanoddp/parallel/sharded/flat.py",
        "shard_grad.div_(self.world_size)",
        "pass",
        ("tests/multiproc/test_zero2_fsdp.py", "-k", "average_of_the_ranks"),
    ),
    Mutation(
        "watchdog: a polled async torch collective is never released",
        "nanoddp/comm/watchdog.py",
        "future.add_done_callback(lambda _: end(token))",
        "pass",
        ("tests/multiproc/test_watchdog.py", "-k", "completes"),
    ),
    Mutation(
        "save_state: numpy values not converted, unloadable values written",
        "nanoddp/train/checkpoint/user_state.py",
        'entry["state"] = _loadable(entry["state"], where)',
        "pass",
        ("tests/reliability/test_save_state_types.py", "-k", "numpy or refused"),
    ),
    Mutation(
        "load_state: a file weights_only refuses is not skipped",
        "nanoddp/train/checkpoint/user_state.py",
        "found = _newest_loadable(path) if _rank() == 0 else None",
        "found = snapshot.find_latest_valid(path) if _rank() == 0 else None",
        ("tests/reliability/test_save_state_types.py", "-k", "skips"),
    ),
    Mutation(
        "Trainer: an optimizer over another model's parameters accepted",
        "nanoddp/train/options.py",
        "if foreign == len(params) and params:",
        "if False:",
        ("tests/reliability/test_trainer_ownership.py", "-k", "optimizer"),
    ),
    Mutation(
        "Trainer: a failed construction keeps its run-dir lock",
        "nanoddp/train/trainer.py",
        "release_run_dir(self._lock_fd, failed=True)",
        "pass",
        ("tests/reliability/test_trainer_ownership.py", "-k", "construction"),
    ),
    Mutation(
        "Trainer: a failed run leaves the directory it made",
        "nanoddp/train/options.py",
        "if failed and out is not None and rundir.remove_if_empty(out, also=SETUP_FILES):",
        "if False:",
        ("tests/reliability/test_trainer_ownership.py", "-k", "fit_removes"),
    ),
    Mutation(
        "run dir lock: followed through a symlink",
        "nanoddp/train/checkpoint/rundir.py",
        "os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK",
        "os.O_CLOEXEC | os.O_NONBLOCK",
        ("tests/reliability/test_trainer_ownership.py", "-k", "symlink"),
    ),
    Mutation(
        "nanoddp run: the single-node store listens on every interface",
        "nanoddp/run/bootstrap.py",
        "            _loopback_rendezvous(call)",
        "            pass",
        ("tests/reliability/test_loopback.py", "-k", "single_node"),
    ),
    Mutation(
        "star broadcast: the hub skips the last rank's header",
        "nanoddp/comm/cached_rounds.py",
        "if rows != self._expected:",
        "if rows[:-1] != self._expected[:-1]:",
        ("tests/multiproc/test_comm_paths.py", "-k", "star_hub"),
    ),
    Mutation(
        "remembered calls: kept after a threshold change",
        "nanoddp/comm/wire.py",
        "bufs.repeats.clear()",
        "pass",
        ("tests/multiproc/test_comm_paths.py", "-k", "dropped"),
    ),
    Mutation(
        "plan: the exchange limit off by one",
        "nanoddp/comm/plan.py",
        "nbytes <= EXCHANGE_MAX_BYTES",
        "nbytes < EXCHANGE_MAX_BYTES",
        ("tests/unit/test_plan.py",),
    ),
    Mutation(
        "trainer fp16: clipping before unscaling",
        "nanoddp/train/trainer.py",
        "self.scaler.unscale_(self.optimizer)  # fp16: clip the true gradients (else a no-op)\n"
        "            self.engine.clip_grad_norm_(self.config.grad_clip)",
        "self.engine.clip_grad_norm_(self.config.grad_clip)\n            self.scaler.unscale_(self.optimizer)",
        ("tests/multiproc/test_trainer_faults.py", "-k", "fp16"),
    ),
    Mutation(
        "trainer: the loss not divided by grad_accum",
        "nanoddp/train/trainer.py",
        "self.scaler.scale(loss / self.config.grad_accum).backward()",
        "self.scaler.scale(loss).backward()",
        ("tests/multiproc/test_trainer_faults.py", "-k", "accumulated"),
    ),
    Mutation(
        "sharded evaluation: filler forwards skipped (caught as a hang)",
        "nanoddp/train/trainer.py",
        "for _ in range(most - forwards):",
        "for _ in range(0):",
        ("tests/multiproc/test_trainer_faults.py", "-k", "sharded_eval"),
    ),
    Mutation(
        "config fingerprint: seed ignored",
        "nanoddp/train/checkpoint/rundir.py",
        '        "grad_accum",\n    }',
        '        "grad_accum",\n        "seed",\n    }',
        ("tests/multiproc/test_trainer_faults.py", "-k", "seed"),
    ),
    Mutation(
        "save_state: a torch DistributedSampler's epoch not restored",
        "nanoddp/train/checkpoint/user_state.py",
        'obj.set_epoch(state["epoch"])',
        "obj.set_epoch(0)",
        ("tests/multiproc/test_state.py", "-k", "torch_distributed_sampler"),
    ),
    Mutation(
        "gather_for_metrics: dataset_len equal to the number gathered rejected",
        "nanoddp/train/gather.py",
        "not 0 <= dataset_len <= total",
        "not 0 <= dataset_len < total",
        ("tests/multiproc/test_gather_for_metrics.py", "-k", "only_trims"),
    ),
    Mutation(
        "resume: a changed --steps silently ignored",
        "nanoddp/train/trainer.py",
        "        note = follow_steps_on_resume(",
        "        note = None and follow_steps_on_resume(",
        ("tests/multiproc/test_trainer_faults.py", "-k", "steps"),
    ),
    Mutation(
        "resume: the schedule not re-stretched to the new --steps",
        "nanoddp/train/recipe.py",
        "        schedule.total = steps\n",
        "        pass\n",
        ("tests/multiproc/test_trainer_faults.py", "-k", "restretches"),
    ),
    Mutation(
        "fsdp: gradients summed instead of averaged",
        "nanoddp/parallel/sharded/fsdp_unit.py",
        "op = dist.ReduceOp.AVG if factor is None else dist.ReduceOp.SUM",
        "op = dist.ReduceOp.SUM",
        ("tests/multiproc/test_fsdp2_parity.py", "-k", "2"),
    ),
    Mutation(
        "fsdp: backward prefetch never happens",
        "nanoddp/parallel/sharded/fsdp_state.py",
        "        return self._after(self.backward_order, state)",
        "        return []",
        ("tests/multiproc/test_fsdp_prefetch.py",),
    ),
    Mutation(
        "HSDP: no all-reduce across replicas",
        "nanoddp/parallel/sharded/fsdp_unit.py",
        "            self.comm.all_reduce(output, op=op, group=replicas)",
        "            pass",
        ("tests/multiproc/test_fsdp2_hsdp.py",),
    ),
    Mutation(
        "fsdp: every rank takes the first rows",
        "nanoddp/parallel/sharded/fsdp_param.py",
        "start = min(mesh.shard_rank * self.rows, self.shape[0])",
        "start = 0",
        ("tests/multiproc/test_fsdp2_parity.py", "-k", "2"),
    ),
    Mutation(
        "fsdp: gradients reduced in param_dtype",
        "nanoddp/parallel/sharded/fsdp_unit.py",
        "return self.mp.reduce_dtype or self.mp.param_dtype or",
        "return self.mp.param_dtype or self.mp.reduce_dtype or",
        ("tests/multiproc/test_fsdp2_parity.py", "-k", "2"),
    ),
    Mutation(
        "fsdp: load_state_dict(assign=True) shards not adopted",
        "nanoddp/parallel/sharded/fsdp_init.py",
        "        module.register_load_state_dict_post_hook(unit.adopt_registered)",
        "        pass",
        ("tests/multiproc/test_fsdp2_example.py",),
    ),
    Mutation(
        "nanoddp run: workers outlive a SIGKILLed launcher",
        "nanoddp/run/bootstrap.py",
        "    die_with_parent(int(os.environ.get(AGENT_PID_VAR, os.getppid())))"
        "  # even a SIGKILLed launcher takes us along",
        "    pass",
        ("tests/reliability/test_run_lifecycle.py", "-k", "sigkilled"),
    ),
    Mutation(
        "nanoddp run: Ctrl-C gives a traceback per rank",
        "nanoddp/run/bootstrap.py",
        "        sys.exit(128 + signal.SIGINT)",
        "        raise",
        ("tests/reliability/test_run_lifecycle.py", "-k", "SIGINT"),
    ),
    Mutation(
        "nanoddp run: a signal stop exits 1",
        "nanoddp/run/cli.py",
        "        return 128 + sig",
        "        return 1",
        ("tests/reliability/test_run_lifecycle.py", "-k", "signal_stops"),
    ),
    Mutation(
        "nanoddp run: temp dir not named by pid, never swept",
        "nanoddp/run/cli.py",
        'make_private_dir("nanoddp-run-")',
        '__import__("tempfile").mkdtemp(prefix="nanoddp-run-")',
        ("tests/reliability/test_run_lifecycle.py", "-k", "sigkilled"),
    ),
    Mutation(
        "nanoddp run: --fail-on-early-exit ignored",
        "nanoddp/run/finished.py",
        "        if self.fail:",
        "        if False:",
        ("tests/reliability/test_run_lifecycle.py", "-k", "fail_on_early_exit"),
    ),
    Mutation(
        "nanoddp run: an early-finished rank never reported",
        "nanoddp/run/finished.py",
        "        if self._reported or time.monotonic() - self._since < self.grace_s:",
        "        if True:",
        ("tests/reliability/test_run_lifecycle.py", "-k", "finished_early"),
    ),
    Mutation(
        "notebook tests: next cell sent before the kernel is idle",
        "tests/helpers.py",
        "    reply = finish_cell(kc, msg_id, timeout)",
        "    return finish_cell(kc, msg_id, timeout)",
        ("tests/multiproc/test_notebook.py", "-k", "test_interrupt_then_kernel_death"),
    ),
    Mutation(
        "sharded checkpoint: a rank trusts its own outcome",
        "nanoddp/train/checkpoint/shard_files.py",
        "    first = next((o for o in outcomes if o is not None), None)\n",
        "    first = mine\n",
        ("tests/multiproc/test_sharded_state.py", "-k", "damaged"),
    ),
    Mutation(
        "sharded checkpoint: resharding reads the wrong offsets",
        "nanoddp/train/checkpoint/pieces.py",
        "values[pos - lo : take - lo]",
        "values[pos - start : take - start]",
        ("tests/multiproc/test_sharded_state.py", "-k", "round_trip"),
    ),
    Mutation(
        "sharded checkpoint: sharded objects saved as rank 0's",
        "nanoddp/train/checkpoint/user_state.py",
        "sharded.kind_of(obj, modules.get(name), registry) or _kind(obj)",
        "_kind(obj)",
        ("tests/multiproc/test_sharded_state.py", "-k", "two_ranks"),
    ),
    Mutation(
        "sharded checkpoint: the manifest's checksum ignored",
        "nanoddp/train/checkpoint/shard_files.py",
        'if payload_digest(path) != entry["sha256"]:',
        "if False:",
        ("tests/multiproc/test_sharded_state.py", "-k", "replaced"),
    ),
)
