"""Rooted bulk paths: the pipelined chain (broadcast, reduce) and the direct broadcast.

Why it exists: past the header round's frames, one-to-all and all-to-one messages move along a
line from (or to) the root, root → root+1 → … → root-1, each piece forwarded as soon as it
arrives (`plan.Path.CHAIN`): the root sends each byte once, which is what counts on a real
network. For mid-size broadcasts on 3+ gloo ranks the root sends to every rank itself instead
(`plan.Path.DIRECT`): one hop, where the chain's n-1 hops each wait for a whole piece.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanoddp.comm.algorithms.message_pieces import message_pieces, piece_numel
from nanoddp.comm.algorithms.message_pieces import pieces as cut
from nanoddp.comm.algorithms.reduce import finish_avg, reduce_into
from nanoddp.comm.transport.transport import Peers, wait_all


def start_chain_broadcast(peers: Peers, flat: torch.Tensor, root: int) -> Callable[[], None]:
    """root → root+1 → … → root-1; every piece is forwarded as soon as it arrives. Receives are
    posted now, the returned function runs it (started before the header round, as `start_ring`)."""
    return _posted_now_on_gloo(peers, lambda: _start_chain_broadcast(peers, flat, root))


def start_direct_broadcast(peers: Peers, flat: torch.Tensor, root: int) -> Callable[[], None]:
    """The root sends the whole message to every other rank itself: one hop instead of the chain's
    n-1. Receives are posted now, the returned function runs it (as `start_chain_broadcast`)."""
    return _posted_now_on_gloo(peers, lambda: _start_direct_broadcast(peers, flat, root))


def _start_direct_broadcast(peers: Peers, flat: torch.Tensor, root: int) -> Callable[[], None]:
    early, pieces = message_pieces(peers, flat)
    if peers.rank != root:
        recvs = [peers.irecv(flat[a:b], root, t) for a, b, t in pieces]
        return lambda: wait_all(recvs)
    others = [p for p in range(peers.size) if p != root]
    first = [peers.send_early(flat[:early], p) for p in others] if early else []
    rest = pieces[len(first) and 1 :]
    return lambda: wait_all(first + [peers.post_send(flat[a:b], p, t) for a, b, t in rest for p in others])


def start_chain_reduce(peers: Peers, flat: torch.Tensor, op: str, root: int) -> Callable[[], None]:
    """root-1 → root-2 → … → root: each rank adds its part to the running result and passes it
    on. Only the root's `flat` is written; the others accumulate in scratch. Receives are posted
    now, the returned function runs it (started before the header round, as `start_ring`)."""
    return _posted_now_on_gloo(peers, lambda: _start_chain_reduce(peers, flat, op, root))


def _posted_now_on_gloo(peers: Peers, start: Callable[[], Callable[[], None]]) -> Callable[[], None]:
    """Post a chain's receives now on gloo; elsewhere (nccl matches by order, not by tag, so nothing
    may be posted ahead of the header round's frames) post them when it runs."""
    if peers.gloo:
        return start()
    return lambda: start()()


def _start_chain_broadcast(peers: Peers, flat: torch.Tensor, root: int) -> Callable[[], None]:
    """The chain's first piece is early data (`plan.early_bytes`): the root sends it now, so it travels
    during the header round; the others follow the verdict."""
    n, r = peers.size, peers.rank
    position = (r - root) % n
    right, left = (r + 1) % n, (r - 1) % n
    early, pieces = message_pieces(peers, flat)
    if position == 0:
        first = [peers.send_early(flat[:early], right)] if early else []
        return lambda: wait_all(first + [peers.post_send(flat[a:b], right, t) for a, b, t in pieces[len(first) :]])
    recvs = [peers.irecv(flat[a:b], left, t) for a, b, t in pieces]

    def run() -> None:
        sends = []
        for (a, b, t), work in zip(pieces, recvs, strict=True):
            work.wait()
            if position < n - 1:
                sends.append(peers.post_send(flat[a:b], right, t))
        wait_all(sends)

    return run


def _start_chain_reduce(peers: Peers, flat: torch.Tensor, op: str, root: int) -> Callable[[], None]:
    n, r = peers.size, peers.rank
    position = (r - root) % n
    toward_root, upstream = (r - 1) % n, (r + 1) % n
    pieces = cut(flat.numel(), piece_numel(flat.numel(), flat.element_size()))
    tag = peers.call_tags()[0]
    if position == n - 1:  # the far end of the chain starts with its own data
        return lambda: wait_all([peers.post_send(flat[a:b], toward_root, tag) for a, b in pieces])
    incoming = peers.scratch("chain", flat.numel(), flat.dtype, flat.device)
    recvs = [peers.irecv(incoming[a:b], upstream, tag) for a, b in pieces]

    def run() -> None:
        sends = []
        for (a, b), work in zip(pieces, recvs, strict=True):
            work.wait()
            if position == 0:
                reduce_into(op, flat[a:b], incoming[a:b])
            else:
                reduce_into(op, incoming[a:b], flat[a:b])
                sends.append(peers.post_send(incoming[a:b], toward_root, tag))
        wait_all(sends)
        if position == 0:
            finish_avg(op, flat, n)

    return run
