"""The rooted collectives — `broadcast`, `reduce`, `scatter`, `gather` — with torch.distributed's API.

src/dst are *global* ranks, as in torch.distributed; the group may be a subgroup. Small messages
travel inside the header round (`nanoddp.comm.header_round`), which at 3+ ranks is a star through group
rank 0: the check and the data share its two hops, and no pair of non-root ranks exchanges
anything. Larger ones follow the header round with a pipelined chain (broadcast, reduce) or
direct sends to or from the root (scatter, gather).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from nanoddp.comm import cached_rounds, chain, header_round, plan
from nanoddp.comm.checks import Prepared, check, fits, group_root, header, land, list_on_root, nbytes, op_name, submit
from nanoddp.comm.checks import flat as _flat
from nanoddp.comm.checks import write_back as _write_back
from nanoddp.comm.header_round import others_for, unpack
from nanoddp.comm.reduce import reduce_in_rank_order
from nanoddp.comm.runner import Work, runner_for
from nanoddp.comm.transport import Peers, wait_all

_submit, _header, _nbytes = submit, header, nbytes


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: ReduceOp = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce `tensor` over the group into global rank `dst`'s tensor (others are left as they were)."""
    runner = runner_for(group)
    if runner is None:
        return None

    def prepare() -> Prepared:
        check(tensor, "tensor")
        name = op_name(op, tensor)
        root = group_root(runner.peers, dst, "dst")
        return tensor.numel(), lambda: _reduce(runner.peers, tensor, name, root), [tensor]

    return _submit(runner, "reduce", "reduce", prepare, async_op)


def _reduce(peers: Peers, tensor: torch.Tensor, op: str, root: int) -> None:
    n, me = peers.size, peers.rank
    flat, header = _flat(tensor), _header("reduce", tensor, op, root)
    if tensor.numel() == 0 or n == 1 or not fits(peers, "reduce", tensor):
        run = chain.start_chain_reduce(peers, flat, op, root) if tensor.numel() and n > 1 else None
        cached_rounds.header_then(peers, header, tensor.device)
        if run:
            run()
    else:

        def combine(pick, p: int) -> torch.Tensor | None:
            if p != root:
                return None
            out = flat if p == me else torch.empty_like(flat)  # the star's hub reduces for another root
            reduce_in_rank_order(op, [pick(q).view(tensor.dtype) for q in range(n)], out)
            return out

        result = header_round.one_round(peers, header, tensor.device, lambda p: flat, combine=combine)
        if me == root:
            land(flat, result)
    if me == root:
        _write_back(tensor, flat)


def broadcast(
    tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Copy global rank `src`'s tensor into every other rank's `tensor`."""
    runner = runner_for(group)
    if runner is None:
        return None
    key = cached_rounds.call_key("broadcast", src, tensor)
    if again := cached_rounds.repeat_of(runner.peers, key):
        return runner.submit("broadcast", tensor.numel(), lambda: again(_flat(tensor)), [tensor], async_op)

    def prepare() -> Prepared:
        check(tensor, "tensor")
        root = group_root(runner.peers, src, "src")
        return tensor.numel(), lambda: _broadcast(runner.peers, tensor, root, key), [tensor]

    return _submit(runner, "broadcast", "broadcast", prepare, async_op)


def _pair_broadcast(pair: cached_rounds.PairRound, is_root: bool):
    """broadcast of a 1-D tensor at 2 ranks through `pair`: the root sends, the other receives."""

    def send(flat: torch.Tensor) -> None:
        pair.outgoing.copy_(flat)
        pair.run()

    def receive(flat: torch.Tensor) -> None:
        flat.copy_(pair.run())

    return send if is_root else receive


def _broadcast(peers: Peers, tensor: torch.Tensor, root: int, key: tuple | None) -> None:
    n, me = peers.size, peers.rank
    flat, header = _flat(tensor), _header("broadcast", tensor, root=root)
    if tensor.numel() == 0 or n == 1 or not fits(peers, "broadcast", tensor):
        if not tensor.numel() or n == 1:
            run = None
        elif plan.plan("broadcast", _nbytes(flat), n, peers.backend) is plan.Path.DIRECT:
            run = chain.start_direct_broadcast(peers, flat, root)
        else:
            run = chain.start_chain_broadcast(peers, flat, root)
        cached_rounds.header_then(peers, header, tensor.device)
        if run:
            run()
    elif star := cached_rounds.star_broadcast(peers, header, flat, root):
        cached_rounds.remember(peers, key, star.run)
        star.run(flat)
    elif pair := cached_rounds.pair_round(
        peers, header, flat.dtype, flat.device, *((flat.numel(), 0) if me == root else (0, flat.numel()))
    ):
        run = _pair_broadcast(pair, me == root)
        cached_rounds.remember(peers, key, run)
        run(flat)
    else:
        result = header_round.one_round(
            peers,
            header,
            tensor.device,
            lambda p: flat if me == root else None,
            combine=lambda pick, p: None if p == root else pick(root),
        )
        if me != root:
            land(flat, result)
    if me != root:
        _write_back(tensor, flat)


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Global rank `src` sends `scatter_list[i]` to group rank i's `tensor` (the list is read on src only)."""
    runner = runner_for(group)
    if runner is None:
        return None

    def prepare() -> Prepared:
        check(tensor, "tensor")
        root = group_root(runner.peers, src, "src")
        sources = list_on_root(runner.peers, root, scatter_list, "scatter_list", tensor)
        return tensor.numel(), lambda: _scatter(runner.peers, tensor, sources, root), [tensor]

    return _submit(runner, "scatter", "scatter", prepare, async_op)


def _scatter(peers: Peers, tensor: torch.Tensor, sources: list[torch.Tensor] | None, root: int) -> None:
    n, me = peers.size, peers.rank
    flat, header = _flat(tensor), _header("scatter", tensor, root=root)
    flats = [_flat(t) for t in sources] if sources is not None else [None] * n
    if tensor.numel() and fits(peers, "scatter", tensor):
        share = _nbytes(tensor)
        result = header_round.one_round(
            peers,
            header,
            tensor.device,
            lambda p: None if me != root else torch.cat(flats) if p is None else flats[p],
            select=lambda whole, p: header_round.as_bytes(whole)[p * share : (p + 1) * share],
            combine=lambda pick, p: None if p == root else pick(root),
        )
        land(flat, flats[me] if me == root else result)
    else:
        cached_rounds.header_then(peers, header, tensor.device)
        if tensor.numel() == 0:
            return
        if me == root:
            wait_all([peers.isend(flats[p], p) for p in range(n) if p != me])
            flat.copy_(flats[me])
        else:
            peers.irecv(flat, root).wait()
    _write_back(tensor, flat)


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Every rank's `tensor` into global rank `dst`'s `gather_list` (the list is used on dst only)."""
    runner = runner_for(group)
    if runner is None:
        return None

    def prepare() -> Prepared:
        check(tensor, "tensor")
        root = group_root(runner.peers, dst, "dst")
        targets = list_on_root(runner.peers, root, gather_list, "gather_list", tensor)
        return tensor.numel(), lambda: _gather(runner.peers, tensor, targets, root), targets or []

    return _submit(runner, "gather", "gather", prepare, async_op)


def _gather(peers: Peers, tensor: torch.Tensor, targets: list[torch.Tensor] | None, root: int) -> None:
    n, me = peers.size, peers.rank
    flat, header = _flat(tensor), _header("gather", tensor, root=root)
    flats = [_flat(t) for t in targets] if me == root else None
    if tensor.numel() and n > 1 and fits(peers, "gather", tensor):
        others = others_for(n)
        result = header_round.one_round(
            peers, header, tensor.device, lambda p: flat, combine=lambda pick, p: others(pick, p) if p == root else None
        )
        if me == root:
            unpack(result, [flats[q] for q in range(n) if q != me])
    else:
        cached_rounds.header_then(peers, header, tensor.device)
        if tensor.numel() and me != root:
            peers.isend(flat, root).wait()
        elif tensor.numel() and n > 1:
            wait_all([peers.irecv(flats[p], p) for p in range(n) if p != me])
    if me != root:
        return
    flats[me].copy_(flat)
    for out, f in zip(targets, flats, strict=True):
        _write_back(out, f)
