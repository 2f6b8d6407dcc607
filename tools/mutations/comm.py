"""Planted faults in the collectives (`nanoddp/comm/`): reductions, rounds, plans, algorithms."""

from __future__ import annotations

from mutations.fault import Mutation

FAULTS = (
    Mutation(
        "watchdog: a hang on a simulated slow link blamed on the ranks",
        "nanoddp/comm/transport/watchdog.py",
        "    if backlog is not None and model is not None and backlog.messages:",
        "    if False:",
        ("tests/multiproc/test_watchdog.py", "-k", "slow_link"),
    ),
    Mutation(
        "ring reduction: pipelined ring drops the received piece",
        "nanoddp/comm/algorithms/ring.py",
        "reduce_into(op, piece, scratch[j % 2, a:b])",
        "pass",
        ("tests/multiproc/test_comm_precision.py", "-k", "ring"),
    ),
    Mutation(
        "ring reduction: fp16/bf16 accumulated in their own dtype",
        "nanoddp/comm/algorithms/reduce.py",
        "acc_dtype = torch.float32 if out.dtype in LOW_PRECISION else out.dtype",
        "acc_dtype = out.dtype",
        ("tests/multiproc/test_comm_precision.py", "-k", "low_precision"),
    ),
    Mutation(
        "failed round: what the call posted before its verdict is dropped, not settled",
        "nanoddp/comm/protocol/wire.py",
        "            settle(peers)\n",
        "            pass\n",
        ("tests/multiproc/test_comm_mismatch.py", "-k", "late_early_piece"),
    ),
    Mutation(
        "exit: a runner's thread keeps its group (and gloo's threads) into finalization",
        "nanoddp/comm/transport/runner.py",
        "return  # `close()` asked",
        "continue  # `close()` asked",
        ("tests/multiproc/test_run.py", "-k", "gloo_thread"),
    ),
    Mutation(
        "watchdog: a polled async torch collective is never released",
        "nanoddp/comm/transport/watchdog.py",
        "future.add_done_callback(lambda _: end(token))",
        "pass",
        ("tests/multiproc/test_watchdog.py", "-k", "completes"),
    ),
    Mutation(
        "star broadcast: the hub skips the last rank's header",
        "nanoddp/comm/protocol/cached_rounds.py",
        "if rows != self._expected:",
        "if rows[:-1] != self._expected[:-1]:",
        ("tests/multiproc/test_comm_paths.py", "-k", "star_hub"),
    ),
    Mutation(
        "frames: not re-made when a threshold change resizes them",
        "nanoddp/comm/protocol/wire.py",
        "        if bufs is None or bufs.capacity != capacity:\n",
        "        if bufs is None:\n",
        ("tests/multiproc/test_comm_paths.py", "-k", "threshold_change"),
    ),
    Mutation(
        "plan: the exchange limit off by one",
        "nanoddp/comm/plan/plan.py",
        "nbytes <= EXCHANGE_MAX_BYTES",
        "nbytes < EXCHANGE_MAX_BYTES",
        ("tests/unit/test_plan.py",),
    ),
    Mutation(
        "halving/doubling: no rank sits out when folding",
        "nanoddp/comm/algorithms/halving_doubling.py",
        "        return None if rel % 2 else rel // 2",
        "        return rel // 2",
        ("tests/unit/test_halving_doubling.py",),
    ),
    Mutation(
        "halving/doubling: a folded rank gets its partner's block, not its own",
        "nanoddp/comm/algorithms/halving_doubling.py",
        "back = lay.whole if all_reduce else lay.bounds[rel + 1]",
        "back = lay.whole if all_reduce else lay.bounds[rel]",
        # every rank contributed to the partner's block too: only the positions tell them apart
        ("tests/unit/test_halving_doubling.py", "-k", "reduce_scatter"),
    ),
    Mutation(
        "halving/doubling: AVG divides by the wrong count",
        "nanoddp/comm/algorithms/halving_doubling.py",
        "finish_avg(op, buf[s.finish[0] : s.finish[1]], n)",
        "finish_avg(op, buf[s.finish[0] : s.finish[1]], n - 1)",
        ("tests/multiproc/test_comm_algorithms.py::test_new_paths_match_torch_on_every_rank[6]",),
    ),
    Mutation(
        "binomial tree: the wrong parent",
        "nanoddp/comm/algorithms/tree.py",
        "    return v - (1 << (v.bit_length() - 1))",
        "    return v - 1",
        ("tests/unit/test_halving_doubling.py",),
    ),
    Mutation(
        "plan: the cost model picks the dearest path",
        "nanoddp/comm/plan/plan.py",
        "        if (c := cost_model.cost(path.name, op, nbytes, world_size)) < best_cost:",
        "        if (c := cost_model.cost(path.name, op, nbytes, world_size)) > best_cost:",
        ("tests/unit/test_plan.py",),
    ),
    Mutation(
        "background sender: keeps the last message it posted alive",
        "nanoddp/comm/transport/transport.py",
        "        _post(sends.get(), send_on)",
        "        queued = sends.get()\n        _post(queued, send_on)",
        ("tests/multiproc/test_comm_memory.py",),
    ),
    Mutation(
        "reduce_scatter ring: partial sums made in the caller's input",
        "nanoddp/comm/algorithms/ring.py",
        "                combine_into(op, chunks[c][a:b], piece, piece)",
        "                piece = piece if last else chunks[c][a:b]  # partial sums in the input\n"
        "                combine_into(op, chunks[c][a:b], into[a:b], piece)",
        ("tests/multiproc/test_comm_algorithms.py", "-k", "ring_reduce_scatter"),
    ),
    Mutation(
        "cost model: halving/doubling's fold forgotten",
        "nanoddp/comm/plan/cost_model.py",
        "            return h + 2 * lg + 2 * f, 4 * (p - 1) / p * m + 2 * f * m",
        "            return h + 2 * lg, 4 * (p - 1) / p * m",
        ("tests/unit/test_plan.py",),
    ),
    Mutation(
        "transport: a send not counted in sent_bytes (comm_bytes)",
        "nanoddp/comm/transport/transport.py",
        "    count_sent(tensor)\n    if _SHAPER is None:",
        "    if _SHAPER is None:",
        ("tests/multiproc/test_trainer_lowcomm.py", "-k", "comm_bytes"),
    ),
    Mutation(
        "transport: sent_bytes counts elements, not bytes (float32 traffic 4x low)",
        "nanoddp/comm/transport/transport.py",
        "        _SENT_BYTES += tensor.numel() * tensor.element_size()\n",
        "        _SENT_BYTES += tensor.numel()\n",
        ("tests/multiproc/test_comm_algorithms.py", "-k", "sent_bytes"),
    ),
    Mutation(
        "link: a second simulated link ignored (the first stays in force)",
        "nanoddp/comm/transport/transport.py",
        "        _SHAPER.model = model  # one thread",
        "        pass  # one thread",
        ("tests/multiproc/test_link_shaper.py", "-k", "second_link"),
    ),
    Mutation(
        "rank-order all-reduce: each chunk summed in reverse rank order",
        "nanoddp/comm/api/rank_order.py",
        "list(copies.view(size, mine).unbind(0))",
        "list(copies.view(size, mine).unbind(0))[::-1]",
        ("tests/multiproc/test_comm_rank_order.py",),
    ),
    Mutation(
        "unregistered group: its rank taken from the default group",
        "nanoddp/comm/transport/membership.py",
        "Membership(group.rank(), size,",
        "Membership(dist.get_rank(), size,",
        ("tests/multiproc/test_comm_unregistered_group.py",),
    ),
)
