"""The pipelined ring: reduce-scatter then all-gather around group ranks 0→1→…→n-1→0.

Why it exists: it is the bulk path of all_reduce, all_gather and reduce_scatter past the header
round's frames (`plan.Path.RING`). Each rank sends and receives 2(n-1)/n of the message, the
bandwidth-optimal volume. Each chunk is cut into pieces (`nanoddp.comm.algorithms.message_pieces`); a piece is
forwarded the moment it has been received (and reduced), so sending, receiving and adding all
overlap, and the last reduce-scatter step flows straight into the first all-gather step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from nanoddp.comm.algorithms.message_pieces import balanced_bounds, piece_numel, pieces_after
from nanoddp.comm.algorithms.reduce import combine_into, finish_avg, reduce_into
from nanoddp.comm.plan import plan
from nanoddp.comm.transport.transport import Peers, Waitable, wait_all

__all__ = ["balanced_bounds", "ring", "start_reduce_scatter_ring", "start_ring"]


def ring(
    peers: Peers,
    chunks: Sequence[torch.Tensor],
    op: str | None,
    reduce_steps: int,
    gather_steps: int,
    shift: int,
) -> None:
    """Run the ring now (see `start_ring`)."""
    start_ring(peers, chunks, op, reduce_steps, gather_steps, shift)()


def start_ring(
    peers: Peers,
    chunks: Sequence[torch.Tensor],
    op: str | None,
    reduce_steps: int,
    gather_steps: int,
    shift: int,
) -> Callable[[], None]:
    """Post the ring's first receives now; the returned function runs it: `reduce_steps`
    reduce-scatter steps then `gather_steps` all-gather steps, in place.

    `chunks` are n 1-D contiguous tensors (sizes may differ, even be 0). At step j this rank
    sends chunk (rank - j + shift) to its right neighbour and receives chunk (rank - j - 1 +
    shift) from its left; during reduce-scatter the received piece is reduced into the chunk,
    during all-gather it lands in the chunk directly. What is received at step j is exactly
    what is sent at step j+1, so each piece is forwarded as soon as it is ready. After n-1
    reduce steps this rank holds the finished chunk (rank + 1 + shift).

    Callers start the ring before the header round and run it after: a gloo send only starts
    once the receiver has announced the matching receive, and that announcement then travels
    during the header round instead of after it (a round that raised settles them first:
    `nanoddp.comm.protocol.settle`).
    """
    if peers.size == 1:
        return lambda: None
    if peers.gloo:
        return _start_pipelined_ring(peers, chunks, op, reduce_steps, gather_steps, shift)
    return lambda: _lockstep_ring(peers, chunks, op, reduce_steps, gather_steps, shift)


def _start_pipelined_ring(
    peers: Peers, chunks: Sequence[torch.Tensor], op: str | None, reduce_steps: int, gather_steps: int, shift: int
) -> Callable[[], None]:
    """The ring on gloo: every receive posted before any data moves, pieces forwarded one by one.

    A gloo send only starts once the receiver has announced its receive, so receives are
    posted early: all-gather receives go straight into their chunks, all up front. That is
    safe although this rank may still be sending from the same chunk: the finished value of a
    piece cannot arrive before our own contribution to it has been received downstream, i.e.
    before our send has been read. Reduce-scatter receives use scratch slots (their own tag,
    so they match independently of the all-gather ones), posted a step ahead.
    """
    n, r = peers.size, peers.rank
    right, left = (r + 1) % n, (r - 1) % n
    steps = reduce_steps + gather_steps
    longest = max(c.numel() for c in chunks)
    early, pieces, early_tag = _cut(peers, chunks)
    slots = min(reduce_steps, 2)
    scratch = peers.scratch("ring", slots * longest, chunks[0].dtype, chunks[0].device).view(slots, longest)
    chunk_at = [(r - j - 1 + shift) % n for j in range(steps)]  # chunk received at step j
    reduce_tag, gather_tag = peers.call_tags()
    tag_at = [reduce_tag if j < reduce_steps else gather_tag for j in range(steps)]

    def tag_of(j: int, i: int) -> int:  # piece i of step j
        return early_tag if early_tag is not None and j == 0 and i == 0 else tag_at[j]

    def post_recvs(j: int) -> list[dist.Work]:
        c = chunk_at[j]
        target = scratch[j % 2] if j < reduce_steps else chunks[c]
        return [peers.irecv(target[a:b], left, tag_of(j, i)) for i, (a, b) in enumerate(pieces[c])]

    recvs = {j: post_recvs(j) for j in range(reduce_steps, steps)}
    recvs.update({j: post_recvs(j) for j in range(min(reduce_steps, 2))})
    first = (r + shift) % n
    early_send = [peers.send_early(chunks[first][:early], right)] if early else []

    def run() -> None:
        sends: list[Waitable] = early_send + [
            peers.post_send(chunks[first][a:b], right, tag_at[0]) for a, b in pieces[first][len(early_send) :]
        ]
        for j in range(steps):
            if j > 0 and j + 1 < reduce_steps:  # slot (j+1) % 2 was freed by step j-1
                recvs[j + 1] = post_recvs(j + 1)
            c = chunk_at[j]
            for (a, b), work in zip(pieces[c], recvs.pop(j), strict=True):
                work.wait()
                piece = chunks[c][a:b]
                if j < reduce_steps:
                    assert op is not None  # reduce steps belong to a reduction
                    reduce_into(op, piece, scratch[j % 2, a:b])
                    if j == reduce_steps - 1:
                        finish_avg(op, piece, n)
                if j + 1 < steps:
                    sends.append(peers.post_send(piece, right, tag_at[j + 1]))
        wait_all(sends)

    return run


def _cut(peers: Peers, chunks: Sequence[torch.Tensor]) -> tuple[int, list[list[tuple[int, int]]], int | None]:
    """(early elements, each chunk's pieces, the early piece's tag or None), the same on every rank.

    Every chunk's first piece is early data (`plan.early_bytes`, sized by the smallest chunk,
    which all ranks agree on): step 0 sends it at once, so it travels during the header round."""
    itemsize = chunks[0].element_size()
    step = piece_numel(max(c.numel() for c in chunks), itemsize)
    early = plan.early_bytes(min(c.numel() for c in chunks) * itemsize, peers.gloo) // itemsize  # elements
    early_tag = peers.early_tag(early * itemsize) if early else None
    return early, [pieces_after(c.numel(), early, step) for c in chunks], early_tag


def start_reduce_scatter_ring(
    peers: Peers, chunks: Sequence[torch.Tensor], op: str, out: torch.Tensor
) -> Callable[[], None]:
    """reduce_scatter on gloo as a ring that leaves its input as it found it: `out` = chunk
    `rank` reduced over the group; `chunks` (n 1-D tensors of out's size) are only read.

    The ring of `start_ring` reduces into the chunks themselves, so reduce_scatter would first
    copy its whole input (n chunks) to keep the caller's. Here each step's partial result is
    made in the slot its piece was received into, slot = own chunk op received (the operands and
    their order of `start_ring`'s, so the result is bitwise the same), and sent on from there;
    the last step receives into `out` itself and reduces there. At most three slots of one chunk
    instead of the copy (none at 2 ranks, where the one step is the last): a slot is received
    into at step j, sent from at step j+1, and received into again at step j+3, once that send
    is done. Receives are posted now, the returned function runs the rest."""
    n, r = peers.size, peers.rank
    right, left, steps = (r + 1) % n, (r - 1) % n, n - 1
    early, pieces, early_tag = _cut(peers, chunks)
    m = out.numel()
    slots = min(steps - 1, 3)  # the steps before the last
    scratch = peers.scratch("ring", slots * m, out.dtype, out.device).view(slots, m) if slots else out[:0].view(0, m)
    chunk_at = [(r - j - 2) % n for j in range(steps)]  # chunk received at step j (the last: chunk r)
    tag = peers.call_tags()[0]

    def landing(j: int) -> torch.Tensor:
        return out if j == steps - 1 else scratch[j % slots]

    def post_recvs(j: int) -> list[dist.Work]:
        cut, into = pieces[chunk_at[j]], landing(j)
        return [peers.irecv(into[a:b], left, early_tag if early_tag is not None and j == i == 0 else tag)
                for i, (a, b) in enumerate(cut)]  # fmt: skip

    # One step per slot, and the last step's if it follows them; the rest in step order (a peer's
    # pieces on one tag are matched to receives in the order posted) as slots free up.
    recvs = {j: post_recvs(j) for j in range(steps if steps == slots + 1 else slots)}
    first = (r - 1) % n
    early_send = [peers.send_early(chunks[first][:early], right)] if early else []

    def run() -> None:
        from_input = [peers.post_send(chunks[first][a:b], right, tag) for a, b in pieces[first][len(early_send) :]]
        sent_from: dict[int, list[Waitable]] = {-1: [*early_send, *from_input]}  # step j's sends, by j
        for j in range(steps):
            if j + 1 < steps and j + 1 not in recvs:
                if j + 1 < steps - 1:  # slot (j+1) % 3 was received into at step j-2
                    wait_all(sent_from.pop(j - 2))  # and sent from during it: free once that is done
                recvs[j + 1] = post_recvs(j + 1)
            c, last, into = chunk_at[j], j == steps - 1, landing(j)
            sent_from[j] = []
            for (a, b), work in zip(pieces[c], recvs.pop(j), strict=True):
                work.wait()
                piece = into[a:b]
                combine_into(op, chunks[c][a:b], piece, piece)
                if last:
                    finish_avg(op, piece, n)
                else:
                    sent_from[j].append(peers.post_send(piece, right, tag))
        for works in sent_from.values():
            wait_all(works)

    return run


def _lockstep_ring(
    peers: Peers, chunks: Sequence[torch.Tensor], op: str | None, reduce_steps: int, gather_steps: int, shift: int
) -> None:
    """The ring on nccl: one grouped send+receive per step (an ungrouped receive posted before
    the send to the same peer deadlocks nccl, and nccl matches by order, not by tag)."""
    n, r = peers.size, peers.rank
    right, left = (r + 1) % n, (r - 1) % n
    longest = max(c.numel() for c in chunks)
    incoming = peers.scratch("ring", longest, chunks[0].dtype, chunks[0].device)
    for j in range(reduce_steps + gather_steps):
        sent, c = chunks[(r - j + shift) % n], (r - j - 1 + shift) % n
        target = incoming[: chunks[c].numel()] if j < reduce_steps else chunks[c]
        wait_all(peers.exchange([(sent, right)], [(target, left)]))
        if j < reduce_steps:
            assert op is not None  # reduce steps belong to a reduction
            reduce_into(op, chunks[c], target)
            if j == reduce_steps - 1:
                finish_avg(op, chunks[c], n)
