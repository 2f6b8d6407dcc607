"""The notebook stop button in the middle of a nanoddp collective, through a real Jupyter kernel.

SIGINT reaches a worker's main thread only between bytecodes: a rank blocked in a collective
(in C++, waiting for a peer that will not come) does not stop, and ranks interrupted half-way
through one leave messages posted. Either way the pool must come back usable by itself: every
rank idle, the process group rebuilt, the next cell's collectives right, the variables kept.

The scenarios take turns on one kernel and pool (a kernel and two workers cost seconds of CPU
each to start): each must leave the pool recovered, which is its check, and the next starts
from there, its group one generation further. One that fails ends the pool, so that a stuck one
does not leak into the next check: that one starts a fresh kernel.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from contextlib import contextmanager

import psutil
import pytest
from helpers import WORLD_SIZE, finish_cell_until_idle, kernel_kwargs, run_cell
from jupyter_client import KernelManager

# Each worker announces from a helper thread when its main thread (the cell) is inside
# nanoddp.comm, so the test interrupts only once the collective is really in flight. 16 MiB:
# the pipelined ring, many messages per call.
SETUP = """%%distributed
import os, sys, threading, time
import nanoddp
import nanoddp.comm as comm
keep = f"kept by rank {rank}"
big = torch.ones(2**22)
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
ddp = nanoddp.DistributedDataParallel(model, bucket_cap_mb=1)  # on the default group
x = torch.randn(64, 512) + rank
def step():
    model.zero_grad()
    ddp(x).sum().backward()
step()
def in_comm(frame):
    while frame is not None:
        if f"{os.sep}nanoddp{os.sep}comm{os.sep}" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False
def announce():
    while not in_comm(sys._current_frames().get(threading.main_thread().ident)):
        time.sleep(0.01)
    print("in collective", flush=True)
"""
# rank 1 sleeps, so rank 0 blocks in the first all_reduce, waiting for it
ONE_RANK_BLOCKED = """%%distributed
threading.Thread(target=announce, daemon=True).start()
if rank == 1:
    time.sleep(600)
while True:
    comm.all_reduce(big)
"""
# the same with async_op: the interrupt lands in Work.wait(), while the group's runner thread
# stays blocked in the collective, owning its posted receives
ASYNC_BLOCKED = """%%distributed
threading.Thread(target=announce, daemon=True).start()
if rank == 1:
    time.sleep(600)
while True:
    comm.all_reduce(big, async_op=True).wait()
"""
# DDP training: rank 0 blocks in backward, its gradient buckets in flight on the runner thread
DDP_BLOCKED = """%%distributed
threading.Thread(target=announce, daemon=True).start()
if rank == 1:
    time.sleep(600)
while True:
    step()
"""
# both ranks loop inside the collective: the interrupt lands in the middle of its messages
BOTH_INSIDE = """%%distributed
threading.Thread(target=announce, daemon=True).start()
while True:
    comm.all_reduce(big)
"""
# The reference: 1 + 2 on the new group, by nanoddp and by torch.distributed's own all_reduce;
# and the DDP wrapper built before the rebuild (default group: looked up at each call) gives
# the average of the ranks' local gradients, by torch.distributed. Tolerance: the default for
# float32, as DDP may divide by the world size before or after summing.
AFTER = """%%distributed --timeout 60
s = torch.tensor([float(rank + 1)])
comm.all_reduce(s)
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
ring = torch.full((2**22,), float(rank + 1))
comm.all_reduce(ring)
print("sums", s.item(), t.item(), torch.equal(ring, torch.full_like(ring, 3.0)), keep)
step()
grads = [p.grad.clone() for p in model.parameters()]
model.zero_grad()
model(x).sum().backward()
expected = [p.grad.clone() for p in model.parameters()]
for g in expected:
    dist.all_reduce(g)
    g /= world_size
torch.testing.assert_close(grads, expected)
print("ddp ok")
"""
CASES = {
    "one_rank_blocked": (ONE_RANK_BLOCKED, [0]),
    "async_blocked": (ASYNC_BLOCKED, [0]),
    "ddp_blocked": (DDP_BLOCKED, [0]),
    "both_inside": (BOTH_INSIDE, [0, 1]),
}


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _left_after(pids: list[int], wait_s: float) -> list[int]:
    """The processes of `pids` still there after waiting up to `wait_s` for them all to end."""
    deadline = time.monotonic() + wait_s
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if not _gone(p)]


def _ok(kc, code: str, timeout: float = 120) -> str:
    """Run a cell that must succeed. A request that reaches ipykernel while it still drops the
    queue after the previous cell's error comes back "aborted", not run: send it again."""
    for _ in range(5):
        reply, text = run_cell(kc, code, timeout=timeout)
        if reply["status"] != "aborted":
            break
        time.sleep(0.2)
    assert reply["status"] == "ok", f"{code!r} failed: {reply.get('ename')}: {reply.get('evalue')}\n{text}"
    return text


@contextmanager
def _pool_in_kernel(tmp_path):
    """A real kernel with 2 workers and SETUP run; yields (kernel manager, client, worker pids).
    At the end the kernel is SIGKILLed and every worker must be gone (killed here if not)."""
    km = KernelManager(**kernel_kwargs(tmp_path))
    km.start_kernel(cwd=str(tmp_path))
    kc = km.client()
    kc.start_channels()
    pids: list[int] = []
    try:
        kc.wait_for_ready(timeout=120)
        _ok(kc, f"%load_ext nanoddp.notebook\n%dist_init --num-processes {WORLD_SIZE}")
        text = _ok(kc, "from nanoddp.notebook import current_pool\nprint('pids', current_pool().pids())")
        pids.extend(int(p) for p in re.findall(r"\d+", text.split("pids", 1)[1]))
        _ok(kc, SETUP)
        yield km, kc, pids
    finally:
        kc.stop_channels()
        os.kill(km.provisioner.pid, signal.SIGKILL)  # the workers follow their kernel
        km.shutdown_kernel(now=True)
        leftover = _left_after(pids, 30)
        for pid in leftover:  # do not leave them to the next test, whatever failed above
            os.kill(pid, signal.SIGKILL)
    assert not leftover, f"worker processes {leftover} outlived the kernel"


class _Pools:
    """The kernel and pool the scenarios share (`_pool_in_kernel`), made when one asks for it."""

    def __init__(self, tmp_path_factory) -> None:
        self._factory, self._stack = tmp_path_factory, contextlib.ExitStack()
        self._current: tuple | None = None
        self.generation = 1  # of the pool's process group: each rebuild adds one

    @contextmanager
    def take(self):
        """The pool for one scenario; if the scenario fails, the pool ends with it."""
        if self._current is None:
            self._current, self.generation = self._stack.enter_context(_pool_in_kernel(self._factory.mktemp("k"))), 1
        try:
            yield self._current
        except BaseException:
            self.close(shut_down=False)
            raise

    def close(self, shut_down: bool = True) -> None:
        """End the pool, through %dist_shutdown if it is well (no worker may be left)."""
        if self._current is None:
            return
        _, kc, pids = self._current
        self._current = None
        try:
            if shut_down:
                _ok(kc, "%dist_shutdown")
                assert not _left_after(pids, 30), "workers left after %dist_shutdown"
        finally:
            self._stack.close()


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    shared = _Pools(tmp_path_factory)
    yield shared
    shared.close()


def _check_recovered(kc, pids: list[int], generation: int) -> None:
    """Every rank idle in a group rebuilt as `generation`, collectives and the old DDP right,
    the same processes."""
    status = _ok(kc, "%dist_status")  # each worker's own account of itself
    for rank in range(WORLD_SIZE):
        assert re.search(rf"^{rank}\s+{pids[rank]}\s+cpu\s+idle\s+\d+ MiB$", status, re.M), status
    after = _ok(kc, AFTER)
    for rank in range(WORLD_SIZE):
        assert f"[rank {rank}] sums 3.0 3.0 True kept by rank {rank}\n" in after, after
        assert f"[rank {rank}] ddp ok\n" in after, after
    expected = ", ".join(f"rank {r} generation {generation} (rebuilt)" for r in range(WORLD_SIZE))
    assert f"process group: {expected}" in status, status
    same = _ok(kc, "%%distributed\nimport os\nos.getpid()")  # the same processes, not restarted
    assert sorted(int(p) for p in re.findall(r"\[rank \d\] (\d+)\n", same)) == sorted(pids)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", sorted(CASES))
def test_stop_button_mid_collective_rebuilds_the_group(pools, case):
    cell, announcing = CASES[case]
    with pools.take() as (km, kc, pids):
        inside = lambda t: all(f"[rank {r}] in collective" in t for r in announcing)  # noqa: E731
        msg_id, _ = run_cell(kc, cell, until=inside)
        time.sleep(1.0)  # let rank 0 settle into its blocking wait (the case SIGINT cannot reach)
        km.interrupt_kernel()
        reply = finish_cell_until_idle(kc, msg_id, timeout=120)  # then the next cell is never aborted
        assert reply["status"] == "error" and reply["ename"] == "CellInterrupted", reply
        pools.generation += 1
        _check_recovered(kc, pids, pools.generation)
        assert f"process group rebuilt (generation {pools.generation})" in reply["evalue"], reply["evalue"]


@pytest.mark.timeout(600)
def test_cell_timeout_in_a_collective_on_a_subset_rebuilds_the_group(pools):
    """No stop button: the cell timeout stops a collective that only rank 0 joined (%%rank)."""
    with pools.take() as (_, kc, pids):
        reply, text = run_cell(kc, "%%rank [0] --timeout 3\ncomm.all_reduce(big)")
        assert reply["status"] == "error" and reply["ename"] == "DistributedCellError", (reply, text)
        assert "cell timed out after 3.0s" in reply["evalue"], reply["evalue"]
        pools.generation += 1
        assert f"process group rebuilt (generation {pools.generation})" in reply["evalue"], reply["evalue"]
        _check_recovered(kc, pids, pools.generation)


# ----------------------------------------------------------------------------- the mechanism alone
WATCHDOG_SETTINGS = (300.0, 0.5, False)  # timeout, poll, exit_on_hang: never fires here


def _abort_then_rebuild(env, store_dir: str) -> tuple[bool, str, float, float, bool, bool]:
    """Rank 0 blocks in a receive that rank 1 never sends; rank 1 aborts. Then both rebuild.

    Before: the hang watchdog armed and the group's collective runner thread started (an async
    nanoddp collective). After the rebuild the old runner's thread must have ended (it held the
    dead group) and a new watchdog must watch the new group with the same settings."""
    import threading

    import torch
    import torch.distributed as dist

    import nanoddp.comm as comm
    from nanoddp.comm.transport import watchdog
    from nanoddp.notebook.recovery import abort_collectives, peer_sockets, rebuild_group

    old_dog = watchdog.enable(WATCHDOG_SETTINGS[0], poll_s=WATCHDOG_SETTINGS[1], exit_on_hang=WATCHDOG_SETTINGS[2])
    comm.all_reduce(torch.ones(2), async_op=True).wait()
    old_thread = comm.runner_for(None)._thread
    assert old_thread is not None and old_thread.is_alive()
    pids = [None] * env.world_size
    dist.all_gather_object(pids, os.getpid())
    held = dist.group.WORLD  # something still holds the group: the abort must not depend on it
    found = len(peer_sockets(pids))
    error = ""
    if env.rank == 0:
        try:
            dist.irecv(torch.empty(4), src=1, tag=99).wait()  # nobody sends: only the abort ends it
        except RuntimeError as exc:
            error = str(exc)
    else:
        # (a thread, like the worker's inbox; the moment does not matter: rank 0 waits until it).
        # Joined before the rebuild: a late abort would cut the new group's connections too.
        aborter = threading.Timer(0.5, abort_collectives, args=(pids, env.backend))
        aborter.start()
        aborter.join()
    rebuild_group(env, f"file://{store_dir}/store-g2", 60.0, pids)
    assert dist.group.WORLD is not held
    t = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(t)
    c = torch.full((2**20,), float(env.rank + 1))  # 4 MiB: the ring, on the new group
    comm.all_reduce(c)
    old_thread.join(timeout=10.0)
    dog = watchdog.active()
    rearmed = (
        dog is not None
        and dog is not old_dog
        and dog.store is not old_dog.store
        and (dog.timeout_s, dog.poll_s, dog.exit_on_hang) == WATCHDOG_SETTINGS
    )
    watchdog.disable()
    return found == 1, error, t.item(), c.unique().item(), not old_thread.is_alive(), rearmed


def test_abort_fails_a_blocked_receive_and_the_group_is_rebuilt(tmp_path):
    from helpers import run_on_ranks

    results = run_on_ranks(_abort_then_rebuild, 2, str(tmp_path), timeout=120)
    for found, _, total, ring, runner_ended, watchdog_rearmed in results:
        assert found and total == 3.0 and ring == 3.0, results  # 1 + 2, exact in float32
        assert runner_ended, "the old group's runner thread outlived the rebuild (it holds the dead group)"
        assert watchdog_rearmed, "the hang watchdog was not re-armed on the new group with its settings"
    assert "Connection closed" in results[0][1], results[0][1]  # gloo's words for the shut socket
