"""The rooted collectives — `broadcast`, `reduce`, `scatter`, `gather` — with torch.distributed's API.

src/dst are *global* ranks, as in torch.distributed; the group may be a subgroup. Small messages
travel inside the header round (`nanoddp.comm.protocol.header_round`), which at 3+ ranks is a star through group
rank 0: the check and the data share its two hops, and no pair of non-root ranks exchanges
anything. Larger ones follow the header round with a pipelined chain (broadcast, reduce) or
direct sends to or from the root (scatter, gather). Each is check -> plan -> run, as the
collectives in `nanoddp.comm.api.collectives`; `nanoddp.comm.plan.plan` decides which.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from nanoddp.comm.algorithms import chain, tree, van_de_geijn
from nanoddp.comm.algorithms.reduce import reduce_in_rank_order
from nanoddp.comm.plan.plan import Path, plan
from nanoddp.comm.protocol import cached_rounds, header_round
from nanoddp.comm.protocol.cached_rounds import header_then
from nanoddp.comm.protocol.checks import (
    Op,
    Prepared,
    check,
    group_root,
    header,
    land,
    list_on_root,
    nbytes,
    op_name,
    submit,
)
from nanoddp.comm.protocol.checks import flat as _flat
from nanoddp.comm.protocol.checks import write_back as _write_back
from nanoddp.comm.protocol.header_round import others_for, unpack
from nanoddp.comm.protocol.wire import as_bytes
from nanoddp.comm.transport.collectives_only import or_torch_on_collectives_only
from nanoddp.comm.transport.runner import Work, runner_for
from nanoddp.comm.transport.transport import Peers, wait_all

_submit, _header, _nbytes = submit, header, nbytes


@or_torch_on_collectives_only("reduce")
def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: Op = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce `tensor` over the group into global rank `dst`'s tensor (others are left as they were)."""
    runner = runner_for(group, "reduce")
    if runner is None:
        return None

    def prepare() -> Prepared:
        check(tensor, "tensor")
        name = op_name(op, tensor)
        root = group_root(runner.peers, dst, "dst")
        return tensor.numel(), lambda: _reduce(runner.peers, tensor, name, root), [tensor]

    return _submit(runner, "reduce", "reduce", prepare, async_op)


def _reduce(peers: Peers, tensor: torch.Tensor, op: str, root: int) -> None:
    n, me, device = peers.size, peers.rank, tensor.device
    data, head = _flat(tensor), _header("reduce", tensor, op, root)
    path = plan("reduce", _nbytes(tensor), n, peers.backend, cpu=tensor.is_cpu)
    if path is Path.LOCAL:
        return
    if path is Path.HEADER_ONLY:
        header_then(peers, head, device, None)
    elif path is Path.CHAIN:
        header_then(peers, head, device, chain.start_chain_reduce(peers, data, op, root))
    else:  # IN_FRAMES

        def combine(pick, p: int) -> torch.Tensor | None:
            if p != root:
                return None
            out = data if p == me else torch.empty_like(data)  # the star's hub reduces for another root
            reduce_in_rank_order(op, [pick(q).view(tensor.dtype) for q in range(n)], out)
            return out

        result = header_round.one_round(peers, head, device, lambda p: data, combine=combine)
        if me == root:
            land(data, result)
    if me == root:
        _write_back(tensor, data)


@or_torch_on_collectives_only("broadcast")
def broadcast(
    tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Copy global rank `src`'s tensor into every other rank's `tensor`."""
    runner = runner_for(group, "broadcast")
    if runner is None:
        return None

    def prepare() -> Prepared:
        check(tensor, "tensor")
        root = group_root(runner.peers, src, "src")
        return tensor.numel(), lambda: _broadcast(runner.peers, tensor, root), [tensor]

    return _submit(runner, "broadcast", "broadcast", prepare, async_op)


def _broadcast(peers: Peers, tensor: torch.Tensor, root: int) -> None:
    n, me, device = peers.size, peers.rank, tensor.device
    data, head = _flat(tensor), _header("broadcast", tensor, root=root)
    path = plan("broadcast", _nbytes(tensor), n, peers.backend, cpu=tensor.is_cpu)
    if path is Path.LOCAL:
        return
    if path is Path.PAIR or path is Path.STAR:
        cached_rounds.broadcast(peers, head, data, root)
    elif path is Path.HEADER_ONLY:
        header_then(peers, head, device, None)
    elif path is Path.DIRECT:
        header_then(peers, head, device, chain.start_direct_broadcast(peers, data, root))
    elif path is Path.CHAIN:
        header_then(peers, head, device, chain.start_chain_broadcast(peers, data, root))
    elif path is Path.TREE:
        header_then(peers, head, device, tree.start_tree_broadcast(peers, data, root))
    elif path is Path.SCATTER_ALLGATHER:
        header_then(peers, head, device, van_de_geijn.start_scatter_allgather_broadcast(peers, data, root))
    else:  # IN_FRAMES
        result = header_round.one_round(
            peers,
            head,
            device,
            lambda p: data if me == root else None,
            combine=lambda pick, p: None if p == root else pick(root),
        )
        if me != root:
            land(data, result)
    if me != root:
        _write_back(tensor, data)


@or_torch_on_collectives_only("scatter")
def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Global rank `src` sends `scatter_list[i]` to group rank i's `tensor` (the list is read on src only)."""
    runner = runner_for(group, "scatter")
    if runner is None:
        return None

    def prepare() -> Prepared:
        check(tensor, "tensor")
        root = group_root(runner.peers, src, "src")
        sources = list_on_root(runner.peers, root, scatter_list, "scatter_list", tensor)
        return tensor.numel(), lambda: _scatter(runner.peers, tensor, sources, root), [tensor]

    return _submit(runner, "scatter", "scatter", prepare, async_op)


def _scatter(peers: Peers, tensor: torch.Tensor, sources: list[torch.Tensor] | None, root: int) -> None:
    n, me, device = peers.size, peers.rank, tensor.device
    data, head = _flat(tensor), _header("scatter", tensor, root=root)
    flats = [_flat(t) for t in sources] if sources is not None else []  # the root's only (list_on_root)
    path = plan("scatter", _nbytes(tensor), n, peers.backend, cpu=tensor.is_cpu)
    if path is Path.HEADER_ONLY:
        header_then(peers, head, device, None)
        return
    if path is Path.LOCAL:
        data.copy_(flats[me])
    elif path is Path.IN_FRAMES:
        share = _nbytes(tensor)
        result = header_round.one_round(
            peers,
            head,
            device,
            lambda p: None if me != root else torch.cat(flats) if p is None else flats[p],
            select=lambda whole, p: as_bytes(whole)[p * share : (p + 1) * share],
            combine=lambda pick, p: None if p == root else pick(root),
        )
        land(data, flats[me] if me == root else result)
    else:  # DIRECT
        header_then(peers, head, device, None)
        if me == root:
            wait_all([peers.isend(flats[p], p) for p in range(n) if p != me])
            data.copy_(flats[me])
        else:
            peers.irecv(data, root).wait()
    _write_back(tensor, data)


@or_torch_on_collectives_only("gather")
def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Every rank's `tensor` into global rank `dst`'s `gather_list` (the list is used on dst only)."""
    runner = runner_for(group, "gather")
    if runner is None:
        return None

    def prepare() -> Prepared:
        check(tensor, "tensor")
        root = group_root(runner.peers, dst, "dst")
        targets = list_on_root(runner.peers, root, gather_list, "gather_list", tensor)
        return tensor.numel(), lambda: _gather(runner.peers, tensor, targets, root), targets or []

    return _submit(runner, "gather", "gather", prepare, async_op)


def _gather(peers: Peers, tensor: torch.Tensor, targets: list[torch.Tensor] | None, root: int) -> None:
    n, me, device = peers.size, peers.rank, tensor.device
    data, head = _flat(tensor), _header("gather", tensor, root=root)
    flats = [_flat(t) for t in targets] if targets is not None else []  # the root's only (list_on_root)
    path = plan("gather", _nbytes(tensor), n, peers.backend, cpu=tensor.is_cpu)
    if path is Path.IN_FRAMES:
        others = others_for(n)
        result = header_round.one_round(
            peers, head, device, lambda p: data, combine=lambda pick, p: others(pick, p) if p == root else None
        )
        if me == root:
            unpack(result, [flats[q] for q in range(n) if q != me])
    elif path is Path.HEADER_ONLY:
        header_then(peers, head, device, None)
    elif path is Path.DIRECT:
        header_then(peers, head, device, None)
        if me != root:
            peers.isend(data, root).wait()
        else:
            wait_all([peers.irecv(flats[p], p) for p in range(n) if p != me])
    if me != root:
        return
    assert targets is not None  # list_on_root gives the root its list
    flats[me].copy_(data)
    for out, f in zip(targets, flats, strict=True):
        _write_back(out, f)
