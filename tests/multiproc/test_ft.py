"""`nanoddp run --on-failure continue`: a run that loses ranks ends bitwise equal to a replay.

One launch of 3 replicas lives through, in order (the script below plants each failure itself):
- step 3: replica 1 is SIGKILLed; the survivors redo step 3 at world size 2 (each replacement
  waits for the survivors' first step without it: forked from the launcher's warm server, it
  could otherwise join the very quorum that leaves its predecessor out);
- its replacement receives its state from a peer, joins, and is SIGKILLed in the step it joins
  (a failure during the join; two failures of replica 1 in a row);
- the second replacement joins and the group is back to 3;
- two steps later replica 2 hangs (SIGSTOP); the others redo that step at world size 2 once the
  collective timeout has passed; the launcher sees it mark no step while the others do, kills
  it, and its replacement joins.

Every test below reads that one run. The reference is a single-process replay written here, not
with nanoddp.ft: the same model and data, each step's global batch split over the world size that
step really had (the schedule the run reports), each piece's gradient weighted by its share and
the pieces added in rank order.
[Note: why bitwise] Each piece's forward and backward run on the same samples with the same
shapes in the run and in the replay (one thread each), so every piece's gradient is the same
bits; the run adds the weighted pieces in rank order on every rank (an all-gather, then a sum in
order), as the replay does, so the sum is the same bits too, and so is SGD's update.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch

pytest.importorskip("torchft")
from helpers import replica_pid, wait_for  # noqa: E402  (after the skip)

from nanoddp.base.processes import named_descendants
from nanoddp.base.records import read_records
from nanoddp.bench.training_run import run_training
from nanoddp.env import default_backend, device_for, loopback_interface
from nanoddp.ft.spare import PROCESS_NAME as SPARE_NAME

REPLICAS, TIMEOUT_S, BATCH, DATASET, SEED = 3, 3.0, 10, 60, 0  # 10: uneven pieces at world size 3
KILL_STEP = 3

SCRIPT = """
import os, signal, sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
from nanoddp.base.records import read_records
from nanoddp.ft import FaultTolerant, ReplicaEnv

env = ReplicaEnv.from_environ()
out = Path(sys.argv[1])

def wait_for_a_step_without_me():
    # Hold a replacement until the survivors have committed a step without it (the loss it
    # replaces recorded, then a step at world size 2): the schedule below. Forked from the
    # launcher's warm server, it could otherwise join the very quorum that leaves its predecessor out.
    while True:
        records = read_records(out, missing_ok=True)
        lost = [i for i, r in enumerate(records) if r.get("event") == "rank_lost" and env.replica in r["replicas"]]
        if len(lost) >= env.attempt and any(r.get("world_size") == 2 and "event" not in r
                                            for r in records[lost[env.attempt - 1]:]):
            return
        time.sleep(0.02)

if env.attempt > 0:
    wait_for_a_step_without_me()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # momentum: state a joiner must get
g = torch.Generator().manual_seed(1)
X, Y = torch.randn(60, 4, generator=g), torch.randn(60, 2, generator=g)
ft = FaultTolerant(model, opt, dataset_len=len(X), batch_size=10, seed=0, env=env)

def planted(name):
    (out / f"{name}-{env.replica}-{env.attempt}").write_text(f"{time.time()!r} {os.getpid()}")

for step in ft.steps(10_000):
    grown_back = [s for s in range(1, len(ft.history)) if ft.history[s] == 3 and ft.history[s - 1] == 2]
    if len(grown_back) == 2 and step >= grown_back[1] + 2:
        break  # every replica holds the same history, so all stop at the same step
    if (env.replica, env.attempt) == (1, 0) and step == 3:
        planted("killed"); os.kill(os.getpid(), signal.SIGKILL)
    if (env.replica, env.attempt) == (1, 1):  # the first step it runs is the one it joins in
        planted("killed"); os.kill(os.getpid(), signal.SIGKILL)
    if (env.replica, env.attempt) == (2, 0) and grown_back and step == grown_back[0] + 2:
        planted("stopped"); os.kill(os.getpid(), signal.SIGSTOP)
    idx = ft.batch_for(step)
    loss = torch.nn.functional.mse_loss(model(X[idx]), Y[idx])
    loss.backward()
    ft.average_gradients(loss)
    ft.commit()
    time.sleep(0.05)
placed = (env.local_rank, env.local_world_size, str(ft.device), os.environ["NCCL_SOCKET_IFNAME"])
torch.save({"params": [p.detach() for p in model.parameters()], "history": ft.history, "placed": placed},
           out / f"final-{env.replica}-{env.attempt}.pt")
ft.close()
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The one launch every test reads: its output, metrics, final states and planted events."""
    tmp = tmp_path_factory.mktemp("ft")
    script = tmp / "loop.py"
    script.write_text(textwrap.dedent(SCRIPT))
    command = [sys.executable, "-m", "nanoddp", "run", "--on-failure", "continue", "--nproc", str(REPLICAS)]
    command += ["--max-restarts", "2", "--no-warm-spare"]  # replacements forked when needed
    command += ["--collective-timeout", str(TIMEOUT_S), "--out", str(tmp), str(script), str(tmp)]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, cwd=tmp)
    finals = {p.name: torch.load(p) for p in sorted(tmp.glob("final-*.pt"))}
    records = read_records(tmp) if done.returncode == 0 else []
    planted = {p.name: p.read_text().split() for p in tmp.glob("*-*-*") if p.suffix != ".pt"}
    return {
        "done": done,
        "finals": finals,
        "records": records,
        "planted": planted,
        "wall_s": time.monotonic() - started,
    }


def _check_ran(run) -> None:
    done = run["done"]
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


# ---- the reference: a single-process replay of the schedule ------------------------------------


def _global_batch(step: int) -> torch.Tensor:
    per_epoch = DATASET // BATCH
    epoch, at = divmod(step, per_epoch)
    order = torch.randperm(DATASET, generator=torch.Generator().manual_seed(SEED + epoch))
    return order[at * BATCH : (at + 1) * BATCH]


def _pieces(world_size: int) -> list[tuple[int, int]]:
    base, extra = divmod(BATCH, world_size)
    bounds, start = [], 0
    for rank in range(world_size):
        size = base + (1 if rank < extra else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


def _weighted_grads(model, params, losses, sizes, batch) -> None:
    """The reference for one step's average, in one process: each rank's piece's gradient
    (`losses[r]()`, the mean over its `sizes[r]` samples) weighted by its share of the `batch`,
    summed in rank order, set as every parameter's gradient."""
    total = None
    for loss_of, size in zip(losses, sizes, strict=True):
        model.zero_grad(set_to_none=True)
        loss_of().backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params]) * (size / batch)
        total = flat if total is None else total + flat
    at = 0
    for p in params:
        p.grad = total[at : at + p.numel()].view_as(p).clone()
        at += p.numel()


def _replay(history: list[int]) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    X, Y = torch.randn(60, 4, generator=g), torch.randn(60, 2, generator=g)
    params = list(model.parameters())
    for step, world_size in enumerate(history):
        idx = _global_batch(step)
        losses = [lambda piece=idx[lo:hi]: torch.nn.functional.mse_loss(model(X[piece]), Y[piece])
                  for lo, hi in _pieces(world_size)]  # fmt: skip
        _weighted_grads(model, params, losses, [hi - lo for lo, hi in _pieces(world_size)], BATCH)
        opt.step()
    return [p.detach() for p in params]


# ---- the tests ---------------------------------------------------------------------------------


def test_survivors_and_joiners_equal_a_replay_bitwise(run):
    _check_ran(run)
    finals = run["finals"]
    # replica 0, the second replacement of replica 1, the replacement of replica 2 (which hung)
    assert set(finals) == {"final-0-0.pt", "final-1-2.pt", "final-2-1.pt"}, sorted(finals)
    histories = {name: final["history"] for name, final in finals.items()}
    history = histories["final-0-0.pt"]
    assert all(h == history for h in histories.values()), histories
    reference = _replay(history)
    for name, final in finals.items():
        for got, want in zip(final["params"], reference, strict=True):
            assert torch.equal(got, want), f"{name} differs from the replay: {(got - want).abs().max()}"


def test_each_replica_and_replacement_takes_its_own_local_rank_and_device(run):
    """On one node replica k is the node's k-th process, its replacements too (warm or forked):
    the GPU it would own under nccl (torchrun's LOCAL_RANK rule, `nanoddp.env`), and nccl's
    sockets stay on loopback as gloo's do."""
    _check_ran(run)
    placed = {name: final["placed"] for name, final in run["finals"].items()}
    expected = {}
    for name in placed:
        replica = int(name.split("-")[1])
        device = device_for(default_backend(REPLICAS), replica)
        expected[name] = (replica, REPLICAS, str(device), loopback_interface())
    assert placed == expected


def test_schedule_loses_and_regains_ranks(run):
    _check_ran(run)
    history = run["finals"]["final-0-0.pt"]["history"]
    assert history[:KILL_STEP] == [3] * KILL_STEP, history
    assert history[KILL_STEP] == 2, "step 3 was redone at world size 2"
    back = history.index(3, KILL_STEP)
    assert history[back : back + 2] == [3, 3] and history[back + 2] == 2, history  # the hang at back + 2
    again = history.index(3, back + 2)  # the hung replica's replacement
    assert history[back + 2 : again] == [2] * (again - back - 2) and history[again:] == [3, 3], history


def test_metrics_records_events_and_world_size(run):
    _check_ran(run)
    records, history = run["records"], run["finals"]["final-0-0.pt"]["history"]
    steps = [r for r in records if "event" not in r]
    assert [r["step"] for r in steps] == list(range(1, len(history) + 1))  # counted from 1, as the trainer's
    assert [r["world_size"] for r in steps] == history
    events = [(r["event"], r["world_size"], r["replicas"]) for r in records if "event" in r]
    assert events == [
        ("rank_lost", 2, [1]),  # killed at step 3
        ("rank_joined", 3, [1]),  # the first replacement joins...
        ("rank_lost", 2, [1]),  # ...and dies in that step
        ("rank_joined", 3, [1]),  # the second replacement
        ("rank_lost", 2, [2]),  # the hang
        ("rank_joined", 3, [2]),  # its replacement, once the launcher killed it
    ], events
    assert [r["step"] for r in records if "event" in r][0] == KILL_STEP + 1  # the loop's index + 1
    done = run["done"]
    lines = [line for line in done.stderr.splitlines() if "nanoddp.ft: rank_" in line]
    assert len(lines) == len(events), lines  # one log line per change


def _first_commit_after(records, when: float) -> float:
    return min(r["time"] for r in records if "time" in r and r["time"] > when)


def test_a_lost_rank_costs_the_survivors_seconds(run):
    """SIGKILL: the others notice at once (the socket closes; a rank whose collective failed closes
    its own, so no survivor waits for the timeout) and wait for the quorum; SIGSTOP: the collective
    times out first. Bounds: the timeout and quorum clocks (1 s), plus a loaded machine."""
    _check_ran(run)
    planted, records = run["planted"], run["records"]
    killed_at = float(planted["killed-1-0"][0])
    stopped_at = float(planted["stopped-2-0"][0])
    kill_cost = _first_commit_after(records, killed_at) - killed_at
    hang_cost = _first_commit_after(records, stopped_at) - stopped_at
    print(f"kill -> next commit {kill_cost:.2f}s, hang -> next commit {hang_cost:.2f}s, run {run['wall_s']:.1f}s")
    assert kill_cost < TIMEOUT_S, "a SIGKILLed peer must not cost the collective timeout"
    assert TIMEOUT_S <= hang_cost < TIMEOUT_S + 10.0


def test_nothing_outlives_the_run(run):
    _check_ran(run)
    for name, (_, pid) in run["planted"].items():
        if psutil.pid_exists(int(pid)):
            status = psutil.Process(int(pid)).status()
            assert status == psutil.STATUS_ZOMBIE, f"{name}: pid {pid} still {status}"
    assert run["done"].stderr.count("replica 2 marked no step for") == 1  # the launcher ended the hung one, said once


def test_continue_refuses_what_it_cannot_place_and_the_agents_options():
    """Across hosts is accepted (tests/multiproc/test_ft_hosts.py); a launch that names no quorum
    service for its hosts, and torchrun-agent options, are one line before anything starts."""
    from nanoddp.run.ft_launch import run_fault_tolerant

    launch = {"nnodes": "1", "node_rank": 0, "rdzv_endpoint": "", "lighthouse": "", "min_replicas": None}
    args = argparse.Namespace(**{**launch, "nnodes": "2"})
    with pytest.raises(ValueError, match="--on-failure continue across hosts .* needs --rdzv-endpoint HOST:PORT"):
        run_fault_tolerant(args, 2)
    args = argparse.Namespace(**launch, log_dir="logs", fail_on_early_exit=False)
    with pytest.raises(ValueError, match="--log-dir applies to --on-failure restart"):
        run_fault_tolerant(args, 2)


# ---- `nanoddp train --on-failure continue` -----------------------------------------------------

TINY_GPT = [
    "--text-max-bytes", "1900", "--seq-len", "16", "--d-model", "32", "--n-layers", "2", "--n-heads", "2",
    "--d-ff", "64", "--batch-size", "12", "--warmup-steps", "2", "--seed", "0", "--snapshot-every", "0",
    "--eval-every", "0", "--log-every", "1", "--no-progress",
]  # fmt: skip
# 150: the replacement joins within a few dozen steps of the kill on a loaded machine (each step takes
# ~20 ms here, the warm spare's start a second or so); more steps cost little next to the launch
TRAIN_STEPS, TRAIN_KILL_AFTER = 150, 3


def _listening(launcher: psutil.Process) -> list[str]:
    """The addresses the launcher and every process under it listen on."""
    found = []
    for proc in [launcher, *launcher.children(recursive=True)]:
        try:
            found += [c.laddr.ip for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            continue
    return found


def _replay_train(history: list[int]) -> dict[str, torch.Tensor]:
    """The built-in GPT job, one process: each step's batch split over that step's world size,
    weighted pieces summed in rank order, clipped, AdamW and the warmup-cosine schedule."""
    from nanoddp.train.config import TrainConfig, threads_per_rank
    from nanoddp.train.data.datasets import build_datasets

    config = TrainConfig(
        text_max_bytes=1900, seq_len=16, d_model=32, n_layers=2, n_heads=2, d_ff=64, batch_size=12,
        warmup_steps=2, seed=0, steps=TRAIN_STEPS,
    )  # fmt: skip
    train_set, _, spec = build_datasets(config.data, 16, config.val_fraction, 1900, model="gpt")
    threads = torch.get_num_threads()
    torch.set_num_threads(threads_per_rank(config, 3))  # what the replicas ran with: matmuls split by it
    try:
        return _replay_steps(config, train_set, spec, history)
    finally:
        torch.set_num_threads(threads)


def _replay_steps(config, train_set, spec, history: list[int]) -> dict[str, torch.Tensor]:
    from nanoddp.train.config import build_model, filled
    from nanoddp.train.recipe import WarmupCosine, make_optimizer

    torch.manual_seed(0)
    model = build_model(config, spec)
    opt = make_optimizer(model, config)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(2, TRAIN_STEPS, config.min_lr_ratio))
    params = [p for p in model.parameters() if p.requires_grad]
    order_len, batch = len(train_set), filled(config.batch_size)
    for step, world_size in enumerate(history):
        epoch, at = divmod(step, order_len // batch)
        idx = torch.randperm(order_len, generator=torch.Generator().manual_seed(epoch))[at * batch : (at + 1) * batch]
        bounds = [(r * batch // world_size, (r + 1) * batch // world_size) for r in range(world_size)]  # 12: even
        batches = [torch.utils.data.default_collate([train_set[i] for i in idx[lo:hi].tolist()]) for lo, hi in bounds]
        losses = [lambda b=b: model(*b)[-1] for b in batches]  # GPT returns (logits, loss)
        _weighted_grads(model, params, losses, [hi - lo for lo, hi in bounds], batch)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
    return model.state_dict()


def _first_in_line(launcher: psutil.Process, deadline: float) -> None:
    """Raise the warm spare's CPU priority (root only; else nothing), so that on a loaded machine
    the replacement's start is not starved by the survivors' steps: it joins while they have
    steps left. Every thread's, and so every thread it starts (they inherit it)."""
    spare = wait_for(lambda: named_descendants(launcher, SPARE_NAME).get(""), deadline)
    with contextlib.suppress(psutil.Error, PermissionError):
        for thread in spare.threads():
            os.setpriority(os.PRIO_PROCESS, thread.id, -10)


def test_train_continue_survives_a_kill_bitwise(tmp_path):
    """3 replicas of the built-in GPT job; replica 1 is SIGKILLed from outside after step 3: the
    other two redo the step, the warm spare (started with the run) takes replica 1's place and
    its state from a peer, and model.pt equals a replay of the schedule."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "nanoddp", "train", "--on-failure", "continue", "--nproc", "3"]
    command += ["--steps", str(TRAIN_STEPS), "--collective-timeout", "10", "--max-restarts", "1", "--out", str(out)]
    command += TINY_GPT

    def kill_replica_1(proc) -> list[str] | None:
        """The addresses listening when replica 1 was SIGKILLed after TRAIN_KILL_AFTER records (None: not killed).
        [Note: the kill in time] Replica 1's pid is found once, before its steps (a scan of the
        launcher's processes is slow on a loaded machine, and a scan per poll let the run reach
        step 24 of 40 before the kill, too late for the replacement to join); it is held
        (SIGSTOP) before the listeners are read, so the others cannot pass the step they are
        in until it is killed: the steps left after the kill do not depend on the test's speed."""
        launcher, deadline = psutil.Process(proc.pid), time.monotonic() + 120
        pid = wait_for(lambda: proc.poll() is None and replica_pid(launcher, 1), deadline)
        _first_in_line(launcher, deadline)
        while proc.poll() is None and time.monotonic() < deadline:
            if len(read_records(out, missing_ok=True)) >= TRAIN_KILL_AFTER:
                os.kill(pid, signal.SIGSTOP)
                listening = _listening(launcher)  # the quorum service, the replicas' servers, gloo
                os.kill(pid, signal.SIGKILL)
                return listening
            time.sleep(0.005)
        return None

    # each step waits on a simulated 20 ms link (nanoddp's sends only: no CPU, bitwise the same
    # sums), so the steps left after the kill last seconds of wall time on any machine, while
    # the replacement's start and heal are what a loaded machine slows down
    slow_link = dict(os.environ, NANODDP_LINK_LATENCY="20ms")
    run = run_training(command, out, timeout_s=120, during=kill_replica_1, env=slow_link, forked=True)
    listening, output = run.acted, run.output
    assert listening is not None and run.returncode == 0, output[-5000:]
    assert listening and all(ip in ("127.0.0.1", "::1") for ip in listening), listening  # private to this machine
    records = run.records
    history = [r["world_size"] for r in records if "event" not in r]
    design_keys = {"step", "loss", "lr", "step_time_s", "samples_per_s", "tokens_per_s", "comm_time_s", "comm_bytes"}
    assert all(design_keys <= r.keys() and r["tokens_per_s"] > 0 for r in records if "event" not in r)
    assert len(history) == TRAIN_STEPS and history[0] == 3 and history[-1] == 3, history
    changes = [(r["event"], r["world_size"], r["replicas"]) for r in records if r.get("event", "eval") != "eval"]
    assert changes[:2] == [("rank_lost", 2, [1]), ("rank_joined", 3, [1])], changes
    # After the kill's pair, only lateness: a live replica late to a quorum on a loaded machine (a busy
    # fresh-clone run saw replica 0) is left out of a step and heals back at the next, the same process
    # (the launcher replaced none but replica 1). The replay below replays such steps too.
    late = list(zip(changes[2::2], changes[3::2], strict=False))
    assert len(changes) % 2 == 0 and all(
        lost[:2] == ("rank_lost", 2) and joined == ("rank_joined", 3, lost[2]) for lost, joined in late
    ), changes
    spare_line = "nanoddp train: replica 1 failed (killed by SIGKILL); the warm spare is replacement 1"
    assert spare_line in output and re.findall(r"replica \d+ failed", output) == ["replica 1 failed"], output[-3000:]
    got = torch.load(out / "model.pt")
    want = _replay_train(history)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name}: {(got[name] - want[name]).abs().max()}"


def test_train_continue_refuses_what_it_does_not_cover():
    from nanoddp.train.config import TrainConfig
    from nanoddp.train.ft_checks import check_continue, continue_group_size

    with pytest.raises(
        ValueError, match="supports --engine nanoddp, zero1, zero2, hsdp, fsdp, localsgd, diloco, got 'single'"
    ):
        check_continue(TrainConfig(engine="single", on_failure="continue"))
    with pytest.raises(ValueError, match="does not support --compile yet"):
        check_continue(TrainConfig(compile=True, on_failure="continue"))
    # fsdp shards over every process: one node's are one replica; across hosts (or cut in groups) refused
    fsdp = TrainConfig(engine="fsdp", on_failure="continue")
    check_continue(fsdp)
    assert continue_group_size(fsdp, 4, across_hosts=False) == 4
    with pytest.raises(ValueError, match="--engine fsdp across hosts under .*--engine hsdp .*--on-failure restart"):
        continue_group_size(fsdp, 4, across_hosts=True)
    with pytest.raises(ValueError, match="--engine fsdp with --group-size 2 under --on-failure continue"):
        continue_group_size(TrainConfig(engine="fsdp", group_size=2, on_failure="continue"), 4, across_hosts=False)
    # replica groups of several processes: the per-step engines, not the rounds ones
    check_continue(TrainConfig(engine="hsdp", group_size=2, on_failure="continue"))
    with pytest.raises(ValueError, match="--group-size 2 with --engine localsgd: .* each localsgd replica is one"):
        check_continue(TrainConfig(engine="localsgd", group_size=2, on_failure="continue"))
    check_continue(TrainConfig(engine="hsdp", grad_accum=2, amp="bf16", on_failure="continue"))  # accepted
    # localsgd/diloco: a quorum per round (nanoddp.ft.rounds), whole-model syncs, boundary work at syncs
    check_continue(TrainConfig(engine="localsgd", sync_every=3, snapshot_every=6, eval_every=0, on_failure="continue"))
    check_continue(TrainConfig(engine="diloco", on_failure="continue"))  # the defaults: 50, 100, 100
    check_continue(TrainConfig(engine="diloco", pseudo_grad_dtype="int8", on_failure="continue"))  # compressed syncs
    # Streaming DiLoCo: a quorum per fragment's sync, its sum behind the inner steps with a delay
    streaming = {"fragments": 2, "sync_delay": 1, "mix": 0.5, "sync_every": 4}
    check_continue(TrainConfig(engine="diloco", on_failure="continue", **streaming))
    for flag in ("snapshot_every", "eval_every"):
        with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} 10 with --engine localsgd --sync-every 4 .* "
                                             "use a multiple of 4"):  # fmt: skip
            check_continue(TrainConfig(engine="localsgd", sync_every=4, on_failure="continue", **{flag: 10}))


# ---- the data rule, against torch's own split -------------------------------------------------


def test_a_step_batch_splits_like_tensor_split_and_weights_sum_to_one():
    """`share` is torch.tensor_split's rule (the first n % ws pieces one longer), so every sample
    of a step is seen exactly once at any world size; the weights are the pieces' shares."""
    from nanoddp.ft.global_batches import GlobalBatches, piece_weight, share

    batches = GlobalBatches(dataset_len=DATASET, batch_size=BATCH, seed=SEED)
    for step in (0, 5, 6, 13):  # 6 steps per epoch: 6 and 13 are in later epochs
        assert torch.equal(batches.indices(step), _global_batch(step))
        for world_size in range(1, BATCH + 1):
            want = torch.tensor_split(batches.indices(step), world_size)
            got = [batches.indices(step)[share(BATCH, rank, world_size)] for rank in range(world_size)]
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (step, world_size)
            assert sum(piece_weight(BATCH, rank, world_size) for rank in range(world_size)) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="cannot be split over 11 ranks"):
        share(BATCH, 0, BATCH + 1)
