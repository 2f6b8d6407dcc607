"""Planted faults in the benchmarks (`nanoddp/bench/`, their hosts and links) and the models'
generation (`nanoddp sample`)."""

from __future__ import annotations

from mutations.fault import Mutation

FAULTS = (
    Mutation(
        "generation: a cached step attends one key short (misses itself)",
        "nanoddp/models/gpt.py",
        ".tril(diagonal=past)",
        ".tril(diagonal=past - 1)",
        ("tests/unit/test_generation.py", "-k", "cached_forward"),
    ),
    Mutation(
        "generation: a cached token gets the first position's embedding",
        "nanoddp/models/gpt.py",
        "self.pos_emb[start : start + T]",
        "self.pos_emb[:T]",
        ("tests/unit/test_generation.py", "-k", "full_recompute_tokens"),
    ),
    Mutation(
        "bench: a number flag lets nan and inf through (checked by `<` alone)",
        "nanoddp/bench/inputs.py",
        "        if not (math.isfinite(value) and minimum <= value <= maximum):",
        "        if value < minimum or value > maximum:",
        ("tests/reliability/test_bench_refusals.py", "-k", "max-delay"),
    ),
    Mutation(
        "netns link: shape() caps every veth at a tenth of the rate asked for",
        "nanoddp/bench/netns_hosts.py",
        "                _tc(*tbf_args(veth, bits_per_s))\n",
        "                _tc(*tbf_args(veth, bits_per_s / 10))\n",
        ("tests/reliability/test_netns_link.py",),
    ),
    Mutation(
        "bench wan: node 0 waits on after node 1 failed",
        "nanoddp/bench/wan.py",
        "                if peer.returncode != 0:\n                    end_tree(node0_proc)\n",
        "                if peer.returncode != 0:\n                    pass\n",
        ("tests/reliability/test_bench_refusals.py", "-k", "netns_node"),
    ),
    Mutation(
        "bench wan: both netns nodes claim node rank 0",
        "nanoddp/bench/wan.py",
        "    return [train_argv(engine, args, outs[k], node_launch(endpoint, k), lr) for k in (0, 1)]\n",
        "    return [train_argv(engine, args, outs[k], node_launch(endpoint, 0), lr) for k in (0, 1)]\n",
        ("tests/unit/test_bench_wan_link.py", "-k", "two_nodes"),
    ),
    Mutation(
        "bench wan: --train-args reach `nanoddp train` unchecked",
        "nanoddp/bench/wan.py",
        "    check_runs(args)\n",
        "    pass\n",
        ("tests/reliability/test_bench_refusals.py", "-k", "train-args"),
    ),
    Mutation(
        "bench wan: the no-communication run's first fragment leaves at the last step",
        "nanoddp/bench/wan.py",
        "        never = (args.fragments or 1) * (args.steps + (args.sync_delay or 0) + 1)\n",
        "        never = (args.fragments or 1) * (args.steps + 1)\n",
        ("tests/unit/test_bench_wan_sweep.py", "-k", "never_syncing"),
    ),
    Mutation(
        "bench wan: torch's DDP and the no-sync run take the sweep's last lr, not their twin's best",
        "nanoddp/bench/wan.py",
        '            engine_lrs = [r["lr"] for r in best_runs(runs) if r["engine"] == twin] or [None]\n',
        '            engine_lrs = [r["lr"] for r in runs if r["engine"] == twin][-1:] or [None]\n',
        ("tests/unit/test_bench_wan_sweep.py", "-k", "twin"),
    ),
    Mutation(
        "bench wan: under --trials the no-sync ratio is the first trial's, not the median of the trials'",
        "nanoddp/bench/wan_report.py",
        '            summary[name]["diloco_over_nocomm"] = statistics.median(by_trial)\n',
        '            summary[name]["diloco_over_nocomm"] = by_trial[0]\n',
        ("tests/unit/test_bench_wan_sweep.py", "-k", "trials"),
    ),
    Mutation(
        "bench wan: trials rerun the kept engines in one order every time",
        "nanoddp/bench/wan.py",
        "        for r in kept if trial % 2 == 0 else kept[::-1]:\n",
        "        for r in kept:\n",
        ("tests/unit/test_bench_wan_sweep.py", "-k", "trials"),
    ),
    Mutation(
        "netns hosts: a child forked into a host stays in the machine's network",
        "nanoddp/bench/netns_hosts.py",
        "enter=functools.partial(enter_netns, self.names[host])",
        "enter=None",
        ("tests/multiproc/test_multinode_hosts.py", "-k", "static_backend"),
    ),
    Mutation(
        "netns hosts: a bridge whose namespaces are gone is never swept",
        "nanoddp/bench/netns_hosts.py",
        "    for token in bridges - live_tokens:\n",
        "    for token in set():\n",
        ("tests/reliability/test_reliability_leftovers.py", "-k", "namespace_hosts_left"),
    ),
)
