"""Settling a failed call: every message it posted before its verdict completes before it raises.

Why it exists: a bulk path posts its receives, and sends its early piece (`plan.early_bytes`),
before the header round says whether the ranks agree, so that data moves during the round. When
the round raises, those handles must not simply be dropped. gloo cannot take that for a message
already under way: a piece whose receive buffer is gone is never read, and nothing behind it on
that connection is read either; a send dropped before the peer asked for it leaves a dead entry
that wedges the sender's side when the peer's receive shows up. The next collective over that
link would then wait forever (at 3 ranks the verdict comes from the hub while the early piece
comes from the left neighbour on another connection, and may arrive after it:
tests/multiproc/test_comm_mismatch.py, test_a_failed_calls_late_early_piece_does_not_wedge_the_link).

So every rank of a failed round, and only of a failed round (its error is the same everywhere, so
all of them are here), tells every other rank what it posted towards it: per tag, how many sends
and receives of how many bytes (`Peers.unsettled`). Then each receive the peer will never send to
gets an empty message (gloo completes a receive with fewer bytes than its buffer), each send the
peer has no receive for gets a receive into a throwaway buffer, and every handle is waited for.
Afterwards nothing of the failed call is left in gloo: no dead buffer, and no posted receive that a
later call under a recycled tag could meet. A matched early piece does land where it was headed,
so a call that raised may have written the first piece of its output.
"""

from __future__ import annotations

import torch

from nanoddp.comm.transport.transport import Peers, Waitable, send_on, wait_all

TAG_SETTLE = 0x6E6403  # our own tag: the records of a failed call's posted messages
MAX_KINDS = 8  # (send or receive, tag) kinds per peer per call; a call uses at most four
RECORD = 1 + 4 * MAX_KINDS  # int64s: the count of kinds, then (is a send, tag, count, bytes) each

Posted = dict[tuple[bool, int], tuple[int, int]]  # (is a send, tag) -> (messages, largest bytes)


def settle(peers: Peers) -> None:
    """Complete every message `peers.unsettled` holds, together with every other rank of the group;
    called by each rank of a round that raised the same error everywhere (`wire.counted`)."""
    posted, peers.unsettled = peers.unsettled, []
    others = [p for p in range(peers.size) if p != peers.rank]
    mine: dict[int, Posted] = {p: {} for p in others}
    for peer, tag, nbytes, is_send, _ in posted:
        count, largest = mine[peer].get((is_send, tag), (0, 0))
        mine[peer][(is_send, tag)] = (count + 1, max(largest, nbytes))
    inboxes = {p: torch.empty(RECORD, dtype=torch.int64) for p in others}
    records: list[Waitable] = [peers.group.recv([inboxes[p]], p, TAG_SETTLE) for p in others]
    records += [send_on(peers.group, _encode(mine[p]), p, TAG_SETTLE) for p in others]
    wait_all(records)
    closing: list[Waitable] = []
    for p in others:
        theirs = _decode(inboxes[p])
        for (is_send, tag), (count, nbytes) in theirs.items():
            if is_send:  # p's sends to me that no receive of mine will take: take them here
                unmatched = count - mine[p].get((False, tag), (0, 0))[0]
                closing += [
                    peers.group.recv([torch.empty(nbytes, dtype=torch.uint8)], p, tag) for _ in range(unmatched)
                ]
            else:  # p's receives from me that no send of mine will fill: fill them with nothing
                unmatched = count - mine[p].get((True, tag), (0, 0))[0]
                closing += [send_on(peers.group, torch.empty(0, dtype=torch.uint8), p, tag) for _ in range(unmatched)]
    wait_all([*(work for *_, work in posted), *closing])


def _encode(kinds: Posted) -> torch.Tensor:
    assert len(kinds) <= MAX_KINDS, f"a call posted {len(kinds)} kinds of message to one peer"
    record = torch.zeros(RECORD, dtype=torch.int64)
    record[0] = len(kinds)
    for i, ((is_send, tag), (count, nbytes)) in enumerate(kinds.items()):
        record[1 + 4 * i : 5 + 4 * i] = torch.tensor([int(is_send), tag, count, nbytes])
    return record


def _decode(record: torch.Tensor) -> Posted:
    values = record.tolist()
    rows = [values[1 + 4 * i : 5 + 4 * i] for i in range(values[0])]
    return {(bool(is_send), tag): (count, nbytes) for is_send, tag, count, nbytes in rows}
