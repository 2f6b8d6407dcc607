"""Broadcast down a binomial tree: the small- and mid-message broadcast on many ranks.

Why it exists: past the header round's frames the direct broadcast makes the root send the
message n-1 times, one after another, and the chain takes n-1 dependent hops. In a binomial tree
every rank that has the message passes it on, so the number of ranks holding it doubles each
round: ceil(log2 n) rounds, and no rank sends more than ceil(log2 n) copies
(`plan.Path.TREE`; where it pays is `cost_model`'s answer).

Relative rank v = (group rank - root) mod n. v > 0 receives from its parent, v minus its highest
set bit, and sends to v + 2^k for every 2^k > v with v + 2^k < n: the largest subtree first, since
it has the most rounds still to go. Data is copied, never reduced: every rank ends with the
root's bytes. gloo only (`plan` chooses it there): the receive is posted before the header round,
under this call's tag (`Peers.call_tags`), so the parent's send starts the moment it is made.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanoddp.comm.transport.transport import Peers, wait_all


def parent(v: int) -> int:
    """The relative rank that sends to relative rank v > 0."""
    return v - (1 << (v.bit_length() - 1))


def children(v: int, n: int) -> list[int]:
    """The relative ranks v sends to, largest subtree first."""
    out, k = [], v.bit_length()
    while v + (1 << k) < n:
        out.append(v + (1 << k))
        k += 1
    return out[::-1]


def start_tree_broadcast(peers: Peers, flat: torch.Tensor, root: int) -> Callable[[], None]:
    """Broadcast `flat` from group rank `root`; the receive is posted now, the returned function runs it."""
    n = peers.size
    v = (peers.rank - root) % n
    tag = peers.call_tags()[0]
    received = peers.irecv(flat, (parent(v) + root) % n, tag) if v else None
    below = [(c + root) % n for c in children(v, n)]

    def run() -> None:
        if received is not None:
            received.wait()
        wait_all([peers.isend(flat, child, tag) for child in below])

    return run
