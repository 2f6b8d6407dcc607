"""all_to_all, barriers and batched point-to-point, with torch.distributed's signatures.

`all_to_all_single` / `all_to_all`: rank i sends its j-th part to rank j, which stores it as
its i-th part. Split sizes may differ per pair, so the header round carries each rank's full
send and receive counts (2n integers); every rank then holds the whole n x n table and checks
that what i sends to j is what j expects from i, so a mismatch raises the same error
everywhere. The data then moves in one round of direct sends/receives, straight into the
caller's output (views where the output is contiguous).

`barrier` is a header round with no payload: once it returns, every rank has heard from every
other. `monitored_barrier` is rank 0 collecting one message from each rank under a timeout,
then answering each with the list of late ranks, so every rank can name them.
"""

from __future__ import annotations

import datetime
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from nanoddp.comm.protocol import cached_rounds, header_round, wire
from nanoddp.comm.protocol.checks import KIND, Prepared, check, check_list, default_device, flat, submit, write_back
from nanoddp.comm.protocol.wire import DTYPE_CODES
from nanoddp.comm.transport import watchdog
from nanoddp.comm.transport.collectives_only import or_torch_on_collectives_only
from nanoddp.comm.transport.membership import membership
from nanoddp.comm.transport.runner import GroupRunner, Work, runner_for
from nanoddp.comm.transport.transport import Peers, posted, wait_all

TAG_ARRIVE = 0x6E6411  # monitored_barrier: rank -> group rank 0
TAG_RELEASE = 0x6E6412  # monitored_barrier: group rank 0 -> rank
DEFAULT_BARRIER_TIMEOUT = datetime.timedelta(minutes=30)  # torch's default for gloo
T = TypeVar("T")


@or_torch_on_collectives_only("all_to_all_single")
def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Split `input` along dim 0 (equally, or by `input_split_sizes`), send part j to group rank
    j, and concatenate what arrives from ranks 0..n-1 along dim 0 into `output`."""
    runner = runner_for(group, "all_to_all_single")
    if runner is None:
        return None

    def prepare() -> Prepared:
        n = runner.peers.size
        check(input, "input")
        check(output, "output")
        if output.dtype != input.dtype:
            raise ValueError(f"output must have input's dtype {input.dtype}, got {output.dtype}")
        sends = _row_bounds(input, input_split_sizes, n, "input")
        recvs = _row_bounds(output, output_split_sizes, n, "output")
        if _row_numel(input) != _row_numel(output) and input.numel() and output.numel():
            raise ValueError(f"input rows {tuple(input.shape[1:])} and output rows {tuple(output.shape[1:])} differ")

        def body() -> None:
            src, dst = flat(input), flat(output)
            _all_to_all(runner.peers, [src[a:b] for a, b in sends], [dst[a:b] for a, b in recvs])
            write_back(output, dst)

        return input.numel(), body, [output]

    return submit(runner, "all_to_all", "all_to_all_single", prepare, async_op)


@or_torch_on_collectives_only("all_to_all")
def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Send `input_tensor_list[j]` to group rank j; receive rank i's into `output_tensor_list[i]`."""
    runner = runner_for(group, "all_to_all")
    if runner is None:
        return None

    def prepare() -> Prepared:
        n = runner.peers.size
        check_list(input_tensor_list, n, "input_tensor_list", None)
        check_list(output_tensor_list, n, "output_tensor_list", None)
        dtypes = {t.dtype for t in [*input_tensor_list, *output_tensor_list]}
        if len(dtypes) != 1:
            raise ValueError(f"all input and output tensors must share one dtype, got {sorted(map(str, dtypes))}")
        outputs, inputs = list(output_tensor_list), list(input_tensor_list)

        def body() -> None:
            dsts = [flat(t) for t in outputs]
            _all_to_all(runner.peers, [flat(t) for t in inputs], dsts)
            for out, f in zip(outputs, dsts, strict=True):
                write_back(out, f)

        return sum(t.numel() for t in inputs), body, outputs

    return submit(runner, "all_to_all", "all_to_all", prepare, async_op)


def _row_numel(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape[1:])


def _row_bounds(tensor: torch.Tensor, splits: Sequence[int] | None, n: int, what: str) -> list[tuple[int, int]]:
    """Element ranges of the n parts of `tensor` along dim 0, equal or by `splits` (rows)."""
    if tensor.dim() == 0:
        raise ValueError(f"{what} must have at least one dimension to split along dim 0, got a scalar")
    rows = tensor.shape[0]
    if splits is None or len(splits) == 0:
        if rows % n:
            raise ValueError(f"{what} has {rows} rows, not divisible by the group size {n}; pass {what}_split_sizes")
        splits = [rows // n] * n
    splits = list(splits)
    if len(splits) != n or any(not isinstance(s, int) or s < 0 for s in splits) or sum(splits) != rows:
        raise ValueError(
            f"{what}_split_sizes must be {n} non-negative ints summing to {what}.shape[0] = {rows}, got {splits}"
        )
    row, bounds, start = _row_numel(tensor), [], 0
    for s in splits:
        bounds.append((start * row, (start + s) * row))
        start += s
    return bounds


def _all_to_all(peers: Peers, sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> None:
    """sends[j] (1-D) goes to group rank j; recvs[i] (1-D) receives group rank i's part for us."""
    n, me = peers.size, peers.rank
    dtype, device = sends[0].dtype, sends[0].device
    counts = torch.tensor([t.numel() for t in sends] + [t.numel() for t in recvs], dtype=torch.int64, device=device)
    header = [KIND["all_to_all"], 0, DTYPE_CODES[dtype], -1, -1]
    every = header_round.one_round(
        peers,
        header,
        device,
        lambda p: counts,
        combine=lambda pick, p: torch.cat([wire.as_bytes(pick(q)) for q in range(n)]),
        same_for_all=True,
    )
    assert every is not None  # combine gives every rank the table
    table = wire.as_bytes(every).view(torch.int64).view(n, 2 * n).tolist()  # (n, 2n): every rank's counts
    wrong = [(i, j) for i in range(n) for j in range(n) if table[i][j] != table[j][n + i]]
    if wrong:
        shown = "; ".join(
            f"rank {i} sends {table[i][j]} to rank {j}, which expects {table[j][n + i]}" for i, j in wrong
        )
        raise ValueError(
            f"nanoddp.comm.all_to_all: split sizes disagree ({shown}; group ranks, elements); "
            "input_split_sizes[j] on rank i must equal output_split_sizes[i] on rank j"
        )
    recvs[me].copy_(sends[me])
    others = [p for p in range(n) if p != me]
    works = peers.exchange(
        [(sends[p], p) for p in others if sends[p].numel()], [(recvs[p], p) for p in others if recvs[p].numel()]
    )
    wait_all(works)


@or_torch_on_collectives_only("barrier")
def barrier(
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    device_ids: list[int] | None = None,
    timeout: datetime.timedelta | None = None,
) -> Work | None:
    """Return once every rank of the group has entered the barrier. `device_ids` is accepted for
    torch's signature (frames live on the group's device); with `timeout`, a blocking barrier
    raises TimeoutError on this rank when it is not done in time (the group is then unusable)."""
    runner = runner_for(group, "barrier")
    if runner is None:
        return None

    def prepare() -> Prepared:
        if timeout is not None and not isinstance(timeout, datetime.timedelta):
            raise TypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
        return 0, lambda: _header_round(runner.peers, "barrier"), []

    work = submit(runner, "barrier", "barrier", prepare, async_op=async_op or timeout is not None)
    if async_op or timeout is None:
        return work
    assert work is not None  # submitted with async_op=True: a handle
    work.wait(timeout.total_seconds())
    return None


def _header_round(peers: Peers, kind: str) -> None:
    cached_rounds.header_then(peers, [KIND[kind], 0, -1, -1, -1], default_device(peers))


def agree(runner: GroupRunner, kind: str, check_call: Callable[[], T]) -> T:
    """Run `check_call()` (local checks), then a header round as collective `kind`: if the call
    raised on any rank, every rank raises that error; else return its value."""
    box: dict[str, T] = {}

    def prepare() -> Prepared:
        box["value"] = check_call()
        return 0, lambda: _header_round(runner.peers, kind), []

    submit(runner, kind, kind, prepare, async_op=False)
    return box["value"]


@or_torch_on_collectives_only("monitored_barrier")
def monitored_barrier(
    group: dist.ProcessGroup | None = None,
    timeout: datetime.timedelta | float | None = None,
    wait_all_ranks: bool = False,
) -> None:
    """A barrier that names who is missing (gloo's, as in torch; here over point-to-point).

    Group rank 0 waits up to `timeout` for a message from every rank, then answers each with the
    list of ranks that were late. If any were, rank 0 raises RuntimeError naming the first (or,
    with `wait_all_ranks`, every) missing global rank, and every other rank raises the same list
    once rank 0's answer reaches it; a late rank gets its answer when it finally arrives, so the
    group stays consistent. The other ranks wait up to 2 x `timeout` for rank 0 (it may spend
    `timeout` waiting for the others first), then raise on their own.
    """
    runner = runner_for(group, "monitored_barrier")
    if runner is None:
        return
    if timeout is None:
        timeout = DEFAULT_BARRIER_TIMEOUT
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    if not seconds > 0 or math.isinf(seconds):
        raise ValueError(f"timeout must be a positive, finite duration, got {timeout!r}")
    peers = runner.peers
    runner.submit("monitored_barrier", 0, lambda: _monitored(peers, seconds, wait_all_ranks), [], async_op=False)


def _monitored(peers: Peers, seconds: float, wait_all_ranks: bool) -> None:
    n, me = peers.size, peers.rank
    if n == 1:
        return
    device = default_device(peers)
    late = torch.zeros(n, dtype=torch.int64, device=device)  # (n,): 1 = that group rank was late
    if me != 0:
        sent = peers.isend(torch.zeros(1, dtype=torch.uint8, device=device), 0, TAG_ARRIVE)
        released = _waited_in_thread(peers.irecv(late, 0, TAG_RELEASE))
        if not released.wait(2 * seconds):
            raise RuntimeError(
                f"nanoddp.comm.monitored_barrier: global rank {peers.global_ranks[0]} (group rank 0) did not "
                f"answer within 2 x {seconds:g}s; it is stuck or gone"
            )
        sent.wait()
        _raise_if_late(peers, late.tolist(), seconds)
        return
    arrived = {
        p: _waited_in_thread(peers.irecv(torch.empty(1, dtype=torch.uint8, device=device), p, TAG_ARRIVE))
        for p in range(1, n)
    }
    deadline = time.monotonic() + seconds
    for p, event in arrived.items():
        if not event.wait(max(deadline - time.monotonic(), 0.0)):
            late[p] = 1
            if not wait_all_ranks:
                break
    for p, event in arrived.items():  # answer everyone, the late ones whenever they arrive
        if event.is_set():
            peers.isend(late, p, TAG_RELEASE).wait()
        else:
            threading.Thread(target=_answer_late, args=(peers, p, late, event), daemon=True).start()
    _raise_if_late(peers, late.tolist(), seconds)


def _raise_if_late(peers: Peers, late: list[int], seconds: float) -> None:
    missing = [peers.global_ranks[p] for p, flag in enumerate(late) if flag]
    if missing:
        raise RuntimeError(
            f"nanoddp.comm.monitored_barrier: global rank(s) {missing} did not arrive within {seconds:g}s "
            f"(reported by global rank {peers.global_ranks[0]})"
        )


def _waited_in_thread(work: dist.Work) -> threading.Event:
    """An event set once `work` completes: gloo's own timed wait closes the connection on timeout
    and its `is_completed()` stays False until waited on, so a thread does the waiting."""
    done = threading.Event()

    def wait() -> None:
        try:
            work.wait()
            done.set()
        except RuntimeError:  # the group is being torn down; nobody waits on this any more
            pass

    threading.Thread(target=wait, name="nanoddp-monitored-barrier", daemon=True).start()
    return done


def _answer_late(peers: Peers, p: int, late: torch.Tensor, arrived: threading.Event) -> None:
    arrived.wait()
    peers.isend(late, p, TAG_RELEASE).wait()


def batch_isend_irecv(p2p_op_list: list[dist.P2POp]) -> list[_WatchedP2P]:
    """Post a list of `torch.distributed.P2POp`s as one round and return their works, in order.

    On gloo every receive is posted before any send (a gloo send waits for the receiver to
    announce its receive, so this order cannot deadlock); other backends group them as torch
    does. Each op is known to the hang watchdog until its work is waited on."""
    if not isinstance(p2p_op_list, (list, tuple)) or not all(isinstance(p, dist.P2POp) for p in p2p_op_list):
        raise ValueError("batch_isend_irecv needs a list of torch.distributed.P2POp")
    if not p2p_op_list:
        return []
    groups = {id(p.group) for p in p2p_op_list}
    if len(groups) != 1:
        raise ValueError("all ops of one batch_isend_irecv must use the same group, as in torch.distributed")
    group = p2p_op_list[0].group
    member = membership(group)
    ranks = member.watch_key
    if member.backend != "gloo":
        works = dist.batch_isend_irecv(list(p2p_op_list))
        return [
            _WatchedP2P(w, watchdog.begin("batch_isend_irecv", p.tensor.numel(), ranks))
            for w, p in zip(works, p2p_op_list, strict=True)
        ]
    order = sorted(range(len(p2p_op_list)), key=lambda i: p2p_op_list[i].op is not dist.irecv)  # receives first
    watched: dict[int, _WatchedP2P] = {}
    for i in order:
        p = p2p_op_list[i]
        token = watchdog.begin("batch_isend_irecv", p.tensor.numel(), ranks)
        post = dist.irecv if p.op in (dist.irecv, dist.recv) else dist.isend
        peer = {"group_src" if post is dist.irecv else "group_dst": p.group_peer}
        watched[i] = _WatchedP2P(posted(post(p.tensor, group=p.group, tag=p.tag, **peer)), token)
    return [watched[i] for i in range(len(p2p_op_list))]


class _WatchedP2P:
    """A torch Work whose watchdog entry ends when it is waited on."""

    def __init__(self, work: dist.Work, token: int | None) -> None:
        self._work, self._token = work, token

    def wait(self, *args) -> bool:
        try:
            return self._work.wait(*args)
        finally:
            watchdog.end(self._token)

    def get_future(self) -> torch.futures.Future:
        """torch's future, ending the watchdog entry once it completes (for callers that never wait)."""

        def release(done: torch.futures.Future):
            watchdog.end(self._token)
            return done.value()

        return self._work.get_future().then(release)

    def __getattr__(self, name: str):  # is_completed, is_success, ...
        return getattr(self._work, name)
