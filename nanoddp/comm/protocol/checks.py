"""Argument checks for `nanoddp.comm`, and how an invalid call reaches every rank.

A collective must fail the same way on every rank, or the ranks that passed their checks wait
forever for the one that did not. So a check never raises on the calling rank alone: the
collective's body is replaced by `fail_everywhere`, which takes part in the header round like
a valid call but sends its error message instead of data. Every rank (the valid ones too) then
raises that rank's error, word for word (`wire.raise_invalid`), and the group stays usable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.distributed import ReduceOp

from nanoddp.comm.protocol import header_round, wire
from nanoddp.comm.transport.runner import GroupRunner, Work
from nanoddp.comm.transport.transport import Peers

_OP_NAMES: dict[object, str] = {
    ReduceOp.SUM: "SUM", ReduceOp.AVG: "AVG", ReduceOp.PRODUCT: "PRODUCT",
    ReduceOp.MIN: "MIN", ReduceOp.MAX: "MAX",
}  # fmt: skip
KIND = {name: code for code, name in enumerate(wire.COLLECTIVES)}
# A reduction op as callers pass it: a member (`ReduceOp.SUM`, a RedOpType) or a ReduceOp object.
Op = ReduceOp | ReduceOp.RedOpType
# What a prepared call hands `submit`: (numel for the watchdog, the body, the output tensors).
Prepared = tuple[int, Callable[[], None], list[torch.Tensor]]


def submit(runner: GroupRunner, kind: str, name: str, prepare: Callable[[], Prepared], async_op: bool) -> Work | None:
    """Check a call with `prepare()` and run its body; an invalid call fails on every rank.

    `kind` is the header's collective (what the peers compare), `name` the public name (what
    the watchdog shows). `prepare` raises TypeError/ValueError for bad arguments."""
    try:
        numel, body, result = prepare()
    except (TypeError, ValueError) as exc:
        error = exc  # `exc` is unbound after the except block; the body runs later
        numel, body, result = 0, lambda: fail_everywhere(runner.peers, kind, name, error), []
    return runner.submit(name, numel, body, result, async_op)


def fail_everywhere(peers: Peers, kind: str, name: str, exc: Exception) -> None:
    """The body of an invalid call to `name`: one header round carrying the error, then every rank raises."""
    code, message = wire.error_frame(name, exc)
    header = [KIND[kind], 0, -1, -1, -1]
    device = default_device(peers)
    header_round.one_round(peers, header, device, lambda p: message.to(device), error=code)
    raise exc  # not reached: one_round raised the shared error (kept for type checkers)


def default_device(peers: Peers) -> torch.device:
    """Where frames live when the call gave no usable tensor: CPU on gloo, the current GPU otherwise."""
    return torch.device("cpu") if peers.gloo else torch.device("cuda", torch.cuda.current_device())


def op_name(op: Op, tensor: torch.Tensor) -> str:
    key = op if isinstance(op, ReduceOp.RedOpType) else getattr(op, "op", op)
    name = _OP_NAMES.get(key)
    if name is None:
        raise ValueError(f"op must be one of ReduceOp.{', ReduceOp.'.join(wire.OPS)}; got {op!r}")
    if name == "AVG" and not tensor.is_floating_point():
        raise ValueError(f"ReduceOp.AVG needs a floating-point tensor, got {tensor.dtype}; use SUM and divide")
    return name


def check(tensor: torch.Tensor, what: str, like: torch.Tensor | None = None, numel: int | None = None,
          rule: str = "") -> None:  # fmt: skip
    """Type/dtype checks; with `like`, same dtype as `like` and `numel` elements (`rule` says why)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in wire.DTYPE_CODES:
        raise ValueError(f"{what} has unsupported dtype {tensor.dtype}; supported: {list(wire.DTYPES)}")
    if like is None:
        return
    numel = like.numel() if numel is None else numel
    if tensor.dtype != like.dtype or tensor.numel() != numel:
        raise ValueError(
            f"{what} must be {like.dtype} with {numel} elements{rule}, got {tensor.dtype} with {tensor.numel()}"
        )


def check_list(tensors: Sequence[torch.Tensor] | None, n: int, what: str, like: torch.Tensor | None) -> None:
    """One tensor per group rank; with `like`, each of its dtype and numel."""
    if tensors is None or isinstance(tensors, torch.Tensor) or len(tensors) != n:
        got = "None" if tensors is None else f"{len(tensors)} tensors"
        raise ValueError(f"{what} must be a list holding one tensor per group rank ({n}), got {got}")
    for i, t in enumerate(tensors):
        check(t, f"{what}[{i}]", like, rule=" (like the input tensor)")


def list_on_root(peers: Peers, root: int, tensors: Sequence[torch.Tensor] | None, what: str,
                 like: torch.Tensor) -> list[torch.Tensor] | None:  # fmt: skip
    """scatter/gather: `tensors` matters on the root only; check it there, ignore it elsewhere."""
    if peers.rank != root:
        return None
    check_list(tensors, peers.size, what, like)
    assert tensors is not None  # check_list raised for None
    return list(tensors)


def group_root(peers: Peers, rank: int, what: str) -> int:
    """Translate a global src/dst rank into a group rank, or raise."""
    world = peers.world_size
    if not isinstance(rank, int) or not 0 <= rank < world:
        if not peers.registered:  # no global ranks to name: src/dst are the group's own
            raise ValueError(
                f"{what} must be a rank of the group in [0, {world}) (a group torch's registry does not know, "
                f"whose src/dst are its own ranks), got {rank!r}"
            )
        raise ValueError(f"{what} must be a global rank in [0, {world}), got {rank!r}")
    if rank not in peers.global_ranks:
        raise ValueError(
            f"{what}={rank} is not a member of the group (global ranks {list(peers.global_ranks)}); "
            "src/dst are global ranks, as in torch.distributed"
        )
    return peers.global_ranks.index(rank)


def header(kind: str, tensor: torch.Tensor, op: str | None = None, root: int = -1) -> list[int]:
    op_code = wire.OPS.index(op) if op is not None else -1
    return [KIND[kind], tensor.numel(), wire.DTYPE_CODES[tensor.dtype], op_code, root]


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.nbytes


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous tensor with `tensor`'s values: a view when possible, else a copy."""
    if tensor.dim() == 1 and tensor.is_contiguous():
        return tensor  # the common case (flat buckets, 1-D buffers): no view op to pay for
    return tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)


def write_back(tensor: torch.Tensor, flat: torch.Tensor) -> None:
    """Copy a result computed in `flat` into the caller's tensor, unless `flat` is its view."""
    if flat is tensor:
        return  # `flat` gave the caller's own 1-D tensor: the result is already there
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))


def land(flat: torch.Tensor, result: torch.Tensor | None) -> None:
    """Copy a one-round result into `flat`, unless it was computed there."""
    assert result is not None, "the round gave this rank no result"  # its combine makes one for every caller
    if result.data_ptr() != flat.data_ptr():
        flat.copy_(result.view(flat.dtype))
