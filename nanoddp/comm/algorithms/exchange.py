"""all_reduce on 2 gloo ranks as one exchange of whole tensors (`plan.Path.EXCHANGE`).

Why it exists: at 2 ranks the ring moves the same bytes each way but in two dependent exchanges
with a reduction between them; for mid-size messages (up to `plan.EXCHANGE_MAX_BYTES`) one
exchange with each piece reduced as it lands costs less.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanoddp.comm.algorithms.message_pieces import message_pieces
from nanoddp.comm.algorithms.reduce import finish_avg, reduce_into
from nanoddp.comm.transport.transport import Peers


def start_exchange_reduce(peers: Peers, flat: torch.Tensor, op: str) -> Callable[[], None]:
    """all_reduce on 2 gloo ranks: each sends the other its whole tensor and reduces locally.

    The ring at 2 ranks moves the same bytes each way (half, then the reduced half back), but in
    two dependent exchanges with a reduction between them; here the link carries one exchange
    and each received piece is reduced as it lands. Two operands combine the same either way
    round (a + b == b + a in IEEE arithmetic, as min, max and product), so both ranks, and
    gloo's own ring, get bitwise the same result. Receives are posted now and the first piece
    leaves early (`plan.early_bytes`), as in `ring.start_ring`; the returned function runs the rest."""
    other = 1 - peers.rank
    early, pieces = message_pieces(peers, flat)
    incoming = peers.scratch("exchange", flat.numel(), flat.dtype, flat.device)
    recvs = [peers.irecv(incoming[a:b], other, t) for a, b, t in pieces]
    first = [peers.send_early(flat[:early], other)] if early else []

    def run() -> None:
        sends = first + [peers.post_send(flat[a:b], other, t) for a, b, t in pieces[len(first) :]]
        for (a, b, _), received, sent in zip(pieces, recvs, sends, strict=True):
            received.wait()
            sent.wait()  # the piece is read out before its sum overwrites it
            reduce_into(op, flat[a:b], incoming[a:b])
        finish_avg(op, flat, 2)

    return run
