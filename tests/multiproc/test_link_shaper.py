"""The simulated slow link (`nanoddp.comm.transport.link`) on 2 gloo ranks, one launch.

- a send of a known byte count arrives no sooner than latency + 8n / bandwidth after it was
  handed over, and within 10 % of it (the model's delay is ~0.9 s, so a loaded machine's
  scheduling jitter of tens of ms stays well inside); the caller is not held back meanwhile;
- two messages queued back to back on one link arrive one transfer time apart (the token bucket);
- all_reduce under shaping, by every path that runs at 2 ranks (the frames round, the exchange and
  the ring: a header round with a bulk phase, its early piece sent from the calling thread, its
  bulk pieces by the shaper's thread), equals torch.distributed's all_reduce bitwise (two
  addends: the sum does not depend on their order);
- a bad NANODDP_LINK_* value is one clear ValueError, the same on both ranks, raised by the first
  collective on a group; and the parsing itself, in this process;
- a second link named in the environment before a new group's first collective replaces the
  first: a send then arrives no sooner than the second link's model says.

Times come from `time.monotonic()`, one clock for every process of the machine (Linux).
"""

from __future__ import annotations

import functools
import os
import time

import pytest
import torch
import torch.distributed as dist
from helpers import run_cases, suites_by_world_size

import nanoddp.comm as ndc
from nanoddp.comm.plan import plan
from nanoddp.comm.plan.plan import Path
from nanoddp.comm.transport.link import BANDWIDTH_VAR, LATENCY_VAR, link_from_environ, parse_bandwidth, parse_latency
from nanoddp.comm.transport.transport import link_model, send_on

BANDWIDTH, LATENCY = "10mbit", "100ms"
BITS_PER_S, LATENCY_S = 10e6, 0.1
TAG = 0x6E64F0  # a tag no collective uses
MB = 1_000_000


def _ask_times(t0: float, arrivals: list[float], n: int) -> tuple[float, list[float]]:
    """Rank 0's send time and rank 1's arrival times, on both ranks (through torch's own, unshaped
    collectives)."""
    row = torch.tensor([t0, *arrivals] if arrivals else [t0] * (1 + n), dtype=torch.float64)
    rows = [torch.empty_like(row) for _ in range(2)]
    dist.all_gather(rows, row)
    return rows[0][0].item(), rows[1][1:].tolist()


def _send_and_time(env, sizes: list[int]) -> tuple[float, list[float], float]:
    """Rank 0 hands `sizes` bytes to `send_on`, one message each, back to back; rank 1 receives
    them. Returns (send time, arrival times, seconds the sends held the caller)."""
    world = dist.group.WORLD
    assert world is not None
    tensors = [torch.arange(n, dtype=torch.int64).to(torch.uint8) for n in sizes]
    buffers = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    received = [world.recv([b], 0, TAG) for b in buffers] if env.rank == 1 else []
    dist.barrier()  # torch's own: unshaped; the receives are posted before the clock starts
    t0, held, arrivals = time.monotonic(), 0.0, []
    if env.rank == 0:
        sends = [send_on(world, t, 1, TAG) for t in tensors]
        held = time.monotonic() - t0
        for work in sends:
            work.wait()
    else:
        for work, buffer, tensor in zip(received, buffers, tensors, strict=True):
            work.wait()
            arrivals.append(time.monotonic())
            assert torch.equal(buffer, tensor)
    t0, arrivals = _ask_times(t0, arrivals, len(sizes))
    return t0, arrivals, held


def case_one_send_takes_latency_plus_transfer(env):
    nbytes = MB  # 0.8 s on the wire + 0.1 s latency
    t0, (arrived,), held = _send_and_time(env, [nbytes])
    model = LATENCY_S + 8 * nbytes / BITS_PER_S
    delay = arrived - t0
    assert model <= delay <= 1.1 * model, f"arrived after {delay:.3f}s, the model says {model:.3f}s"
    assert held < 0.1 * model, f"send_on held its caller {held:.3f}s: the shaper must not sleep on it"


def case_back_to_back_messages_queue_on_the_link(env):
    half = MB // 2  # each 0.4 s on the wire: they arrive at 0.5 s and 0.9 s
    t0, arrivals, _ = _send_and_time(env, [half, half])
    first, second = (a - t0 for a in arrivals)
    want_first, want_second = LATENCY_S + 8 * half / BITS_PER_S, LATENCY_S + 2 * 8 * half / BITS_PER_S
    assert want_first <= first <= 1.1 * want_first, f"first arrived after {first:.3f}s, want {want_first:.3f}s"
    assert want_second <= second <= 1.1 * want_second, f"second arrived after {second:.3f}s, want {want_second:.3f}s"


def _all_reduce_equals_torch(env, numel: int, path: Path | None, async_op: bool = False):
    saved = dict(plan.FORCED)
    plan.FORCED.clear()
    if path is not None:
        plan.FORCED["all_reduce"] = path
    try:
        g = torch.Generator().manual_seed(10 + env.rank)
        x = torch.randn(numel, generator=g)
        want = x.clone()
        dist.all_reduce(want)  # torch's, on the same gloo group, unshaped
        started = time.monotonic()
        work = ndc.all_reduce(x, async_op=async_op)
        if async_op:  # handed to the group's runner: the caller goes on at once
            assert time.monotonic() - started < LATENCY_S, "an async all_reduce held its caller"
            work.wait()
        took = time.monotonic() - started
    finally:
        plan.FORCED.clear()
        plan.FORCED.update(saved)
    assert torch.equal(x, want), f"differs by {(x - want).abs().max().item():.3g}"
    # at least one latency (the frames round) and, with a bulk phase, another and its bytes
    assert took >= LATENCY_S, f"the all_reduce took {took:.3f}s on a {LATENCY} link: not shaped"


def case_bad_value_is_one_clear_error(env):
    os.environ[BANDWIDTH_VAR] = "fast"
    try:
        group = dist.new_group([0, 1])
        with pytest.raises(ValueError, match=r"NANODDP_LINK_BANDWIDTH must be a number and a unit.*got 'fast'"):
            ndc.all_reduce(torch.ones(4), group=group)
    finally:
        os.environ[BANDWIDTH_VAR] = BANDWIDTH


SECOND_LATENCY, SECOND_LATENCY_S = "400ms", 0.4


def case_a_second_link_replaces_the_first(env):
    os.environ[LATENCY_VAR] = SECOND_LATENCY
    try:
        group = dist.new_group([0, 1])
        ndc.all_reduce(torch.ones(4), group=group)  # a group's first collective reads the environment
    finally:
        os.environ[LATENCY_VAR] = LATENCY
    model = link_model()
    assert model is not None and (model.bandwidth_bits_per_s, model.latency_s) == (BITS_PER_S, SECOND_LATENCY_S)
    nbytes = 100_000  # 0.08 s on the wire: 0.48 s on the second link, 0.18 s on the first
    t0, (arrived,), _ = _send_and_time(env, [nbytes])
    want = SECOND_LATENCY_S + 8 * nbytes / BITS_PER_S
    assert arrived - t0 >= want, f"arrived after {arrived - t0:.3f}s, the second link says {want:.3f}s"


def case_the_link_is_the_environment(env):
    model = link_model()
    assert model is not None and (model.bandwidth_bits_per_s, model.latency_s) == (BITS_PER_S, LATENCY_S)


CASES = [
    ("all_reduce_frames", functools.partial(_all_reduce_equals_torch, numel=16, path=None)),
    ("the_link_is_the_environment", case_the_link_is_the_environment),
    ("one_send_takes_latency_plus_transfer", case_one_send_takes_latency_plus_transfer),
    ("back_to_back_messages_queue_on_the_link", case_back_to_back_messages_queue_on_the_link),
    ("all_reduce_exchange", functools.partial(_all_reduce_equals_torch, numel=64 * 1024, path=Path.EXCHANGE)),
    ("all_reduce_ring", functools.partial(_all_reduce_equals_torch, numel=64 * 1024, path=Path.RING)),
    (
        "all_reduce_ring_async",
        functools.partial(_all_reduce_equals_torch, numel=64 * 1024, path=Path.RING, async_op=True),
    ),  # fmt: skip
    ("bad_value_is_one_clear_error", case_bad_value_is_one_clear_error),
    ("a_second_link_replaces_the_first", case_a_second_link_replaces_the_first),  # last: it changes the link
]


def shaper_suite(env, out_dir):
    # Before the first collective: a group reads the link from the environment when first used.
    os.environ[BANDWIDTH_VAR], os.environ[LATENCY_VAR] = BANDWIDTH, LATENCY
    run_cases(env, CASES, out_dir)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return suites_by_world_size(shaper_suite, tmp_path_factory, "link-shaper", timeout=120)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", [name for name, _ in CASES])
def test_link_shaper(suite, case):
    suite(2).check(case)


@pytest.mark.parametrize(
    ("text", "bits_per_s"),
    [("100mbit", 1e8), ("1gbit", 1e9), ("500kbit", 5e5), ("12.5MB/s", 1e8), ("800kB/s", 6.4e6), ("2Mbit/s", 2e6)],
)
def test_bandwidth_forms(text, bits_per_s):
    assert parse_bandwidth(text) == pytest.approx(bits_per_s, rel=1e-12)


@pytest.mark.parametrize(("text", "seconds"), [("20ms", 0.02), ("0.5s", 0.5), ("250us", 250e-6), ("0", 0.0)])
def test_latency_forms(text, seconds):
    assert parse_latency(text) == pytest.approx(seconds, rel=1e-12)


@pytest.mark.parametrize("text", ["fast", "100", "100mb", "0mbit", "-5mbit", "100 mbit/h"])
def test_bad_bandwidth_names_the_variable_and_the_value(text):
    with pytest.raises(ValueError, match=rf"^NANODDP_LINK_BANDWIDTH must be .*got {text!r}$"):
        link_from_environ({BANDWIDTH_VAR: text})


@pytest.mark.parametrize("text", ["20", "soon", "20 min", "-1ms"])
def test_bad_latency_names_the_variable_and_the_value(text):
    with pytest.raises(ValueError, match=rf"^NANODDP_LINK_LATENCY must be .*got {text!r}$"):
        link_from_environ({LATENCY_VAR: text})


def test_no_variable_no_link():
    assert link_from_environ({}) is None
    model = link_from_environ({LATENCY_VAR: "20ms"})
    assert model is not None and model.bandwidth_bits_per_s == float("inf") and model.latency_s == 0.02
