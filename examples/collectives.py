"""Collectives from point-to-point messages, each shown on every rank, before and after.

1. send/recv: the only primitive; everything below is built from it (`nanoddp.comm`).
2. broadcast, reduce, all_reduce, scatter, gather, all_gather, all_gather_into_tensor,
   reduce_scatter_tensor: per-rank values before -> after, checked against torch.distributed.
3. The ring all-reduce, one step at a time, driving nanoddp's own ring (`nanoddp.comm.algorithms.ring.ring`):
   n-1 share-reduce steps (each rank adds what its left neighbour sends), then n-1 share-only
   steps (finished chunks travel round). Rank r starts with 2**r in every chunk, so a chunk's
   value says whose contributions it holds: 0+1 means ranks 0 and 1 have been summed in.
4. Subgroups: a collective over the even ranks only; odd ranks are not members.

    python examples/collectives.py            # 4 ranks, gloo on CPU
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.distributed as dist

import nanoddp
from nanoddp import comm
from nanoddp.comm.algorithms import ring
from nanoddp.comm.transport.runner import runner_for
from nanoddp.groups import even_ranks_group, group_ranks
from nanoddp.parallel.replicas import gather_json


def show_all(env: nanoddp.DistEnv, title: str, value) -> list:
    """Gather one JSON value per rank (collective) and print them on rank 0, in rank order."""
    values = gather_json(value, comm)
    if env.is_master:
        print(f"-- {title}")
        for rank, v in enumerate(values):
            print(f"   rank {rank}: {v}")
    return values


def send_recv(env: nanoddp.DistEnv) -> None:
    """Every rank passes a tensor to its right neighbour: the step every collective repeats."""
    right, left = (env.rank + 1) % env.world_size, (env.rank - 1) % env.world_size
    mine, got = torch.tensor([100.0 * env.rank]), torch.zeros(1)
    works = [dist.isend(mine, right), dist.irecv(got, left)]  # post both: blocking send+recv could deadlock
    for work in works:
        work.wait()
    show_all(
        env,
        "isend to the right, irecv from the left",
        f"sent {mine.tolist()} to {right}, received {got.tolist()} from {left}",
    )


def each_collective(env: nanoddp.DistEnv) -> None:
    """Run each collective with nanoddp.comm and with torch.distributed on the same input."""
    r, n = env.rank, env.world_size
    on_root = r == 0

    def broadcast(c, t):
        c.broadcast(t, src=0)
        return t

    def reduce(c, t):
        c.reduce(t, dst=0)
        return t if on_root else t[:0]  # only dst's result is defined: show nothing elsewhere

    def all_reduce(c, t):
        c.all_reduce(t)  # op=ReduceOp.SUM; also AVG, PRODUCT, MIN, MAX
        return t

    def scatter(c, t):
        c.scatter(t, [torch.tensor([i, -i], dtype=t.dtype) for i in range(n)] if on_root else None, src=0)
        return t

    def gather(c, t):
        out = [torch.zeros_like(t) for _ in range(n)] if on_root else None
        c.gather(t, out, dst=0)
        return torch.stack(out) if on_root else t  # (n, 2) on the root

    def all_gather(c, t):
        out = [torch.zeros_like(t) for _ in range(n)]
        c.all_gather(out, t)
        return torch.stack(out)  # (n, 2)

    def all_gather_into_tensor(c, t):
        c.all_gather_into_tensor(out := t.new_zeros(n * t.numel()), t)  # (n*2,)
        return out

    def reduce_scatter_tensor(c, t):
        c.reduce_scatter_tensor(out := t.new_zeros(t.numel() // n), t)  # sum, then rank i keeps slice i
        return out

    for demo in (
        broadcast,
        reduce,
        all_reduce,
        scatter,
        gather,
        all_gather,
        all_gather_into_tensor,
        reduce_scatter_tensor,
    ):
        size = 2 * n if demo is reduce_scatter_tensor else 2
        before = torch.arange(size, dtype=torch.float32) + 10 * r  # rank r: [10r, 10r+1, ...]
        ours, reference = demo(comm, before.clone()), demo(dist, before.clone())
        show_all(env, demo.__name__, f"{before.tolist()} -> {ours.tolist()}")
        agree = gather_json(torch.equal(ours, reference), comm)
        if env.is_master:
            print(f"   same as torch.distributed on every rank: {all(agree)}")


def ring_trace(env: nanoddp.DistEnv) -> None:
    """Drive nanoddp's ring one step at a time and print every rank's chunks after each step."""
    r, n = env.rank, env.world_size
    flat = torch.full((n,), 2**r, dtype=torch.int64)  # n chunks of one element each
    chunks = list(flat.split(1))
    peers = runner_for(None).peers  # the world group as seen by nanoddp's collectives
    label = lambda v: "+".join(str(k) for k in range(n) if v >> k & 1)  # noqa: E731  2**k -> "k"
    if env.is_master:
        print(f"-- ring all-reduce on {n} ranks: n-1 = {n - 1} share-reduce steps, then {n - 1} share-only steps")
    show_all(env, "start (chunk values as the ranks summed in)", [label(v) for v in flat.tolist()])
    for j in range(n - 1):  # share-reduce: send chunk r-j right, add chunk r-j-1 from the left
        ring.ring(peers, chunks, "SUM", reduce_steps=1, gather_steps=0, shift=-j)
        what = f"rank r sends chunk (r{-j:+d}) % {n}, adds chunk (r{-j - 1:+d}) % {n}"
        show_all(env, f"share-reduce step {j + 1}: {what}", [label(v) for v in flat.tolist()])
    for g in range(n - 1):  # share-only: rank r now owns finished chunk r+1-g; pass it on, copy in
        ring.ring(peers, chunks, None, reduce_steps=0, gather_steps=1, shift=1 - g)
        what = f"rank r sends chunk (r{1 - g:+d}) % {n}, copies chunk (r{-g:+d}) % {n}"
        show_all(env, f"share-only step {g + 1}: {what}", [label(v) for v in flat.tolist()])
    reference = torch.full((n,), 2**r, dtype=torch.int64)
    dist.all_reduce(reference)
    ok = gather_json(bool(torch.equal(flat, reference)), comm)
    if env.is_master:
        print(f"   every rank holds the full sum {2**n - 1} in every chunk, equal to torch's all_reduce: {all(ok)}")


def subgroups(env: nanoddp.DistEnv) -> None:
    """`even_ranks_group()` must be called on every rank; only members may use the group."""
    group = even_ranks_group()  # None on odd ranks
    t = torch.tensor([float(env.rank)])
    if group is not None:
        comm.all_reduce(t, group=group)
        where = f"member, group rank {dist.get_rank(group)} of {group_ranks(group)}"
    else:
        where = "not a member"
    show_all(env, "all_reduce(SUM) over even_ranks_group()", f"{where}: value {env.rank} -> {t.item():g}")


def worker(env: nanoddp.DistEnv) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use", category=FutureWarning)
    sections = {
        "point to point": send_recv,
        "collectives (nanoddp.comm = torch.distributed's API)": each_collective,
        "ring all-reduce, step by step": ring_trace,
        "subgroups": subgroups,
    }
    for number, (title, section) in enumerate(sections.items(), 1):
        if env.is_master:
            print(f"== {number}. {title} ({env.world_size} ranks, {env.backend}) ==")
        section(env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4, help="ranks (the ring trace is written for 4)")
    args = parser.parse_args()
    nanoddp.launch(worker, args.nproc, backend="gloo")


if __name__ == "__main__":
    main()
