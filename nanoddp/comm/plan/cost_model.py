"""The α–β cost model `plan` uses to choose between algorithms: time = α·steps + β·bytes.

Why it exists: which algorithm wins depends on the world size as much as on the message size,
and the world sizes where the choice matters (8, 16 ranks) cannot be measured on the 2-core
development host. So each path is described by two numbers on its critical path: its dependent
steps (each one a message's latency plus the Python and gloo scheduling around it, α) and the bytes
the busiest rank sends plus receives (β per byte, reductions included). α and β are fitted to
paired measurements at 2 and 4 ranks (`fit`; the values, the machine and predicted vs measured
are in docs/comm.md, "How plan() chooses: the α–β model"), and the model extrapolates the
crossovers to larger groups. The header round every bulk path opens with counts as steps: one
exchange at 2 ranks, a star (up, then down) above.

`nbytes` is one rank's share, as in `plan.plan`.
"""

from __future__ import annotations

from collections.abc import Iterable

ALPHA_S = 228e-6  # seconds per dependent step (fitted, docs/comm.md)
BETA_S_PER_BYTE = 0.48e-9  # seconds per byte through the busiest rank, in + out (fitted)


def _log2(n: int) -> int:
    return n.bit_length() - 1


def _fold(n: int) -> tuple[int, int, int]:
    """(p, log2 p, 1 if ranks fold in and out else 0) for halving/doubling on n ranks."""
    p = 1 << _log2(n)
    return p, _log2(p), int(n > p)


def _header_steps(n: int) -> int:
    return 1 if n == 2 else 2


def _star_bytes(op: str, m: float, n: int) -> float:
    """Bytes through the hub of a one-round star (data in the frames, 3+ ranks)."""
    k = n - 1
    return {
        "all_reduce": 2 * k * m,
        "all_gather": k * m + k * k * m,  # n-1 shares up, every other rank's shares down to each
        "reduce_scatter": k * n * m + k * m,  # whole inputs up, one share down to each
        "broadcast": n * m,
        "reduce": n * m,
        "scatter": k * n * m,
        "gather": k * n * m,
    }[op]


def shape(path: str, op: str, nbytes: int, n: int) -> tuple[int, float]:
    """(dependent steps, bytes through the busiest rank) of `op` by `path` (a `plan.Path` name)."""
    m = float(nbytes)
    if path in ("IN_FRAMES", "PAIR", "STAR"):
        return (1, (m if op == "broadcast" else 2 * m)) if n == 2 else (2, _star_bytes(op, m, n))
    h, p, lg, f = _header_steps(n), *_fold(n)
    whole = n * m  # the gathered / scattered buffer
    if path == "EXCHANGE":
        return h + 1, 2 * m
    if path == "RING":
        if op == "all_reduce":
            return h + 2 * (n - 1), 4 * (n - 1) / n * m
        return h + n - 1, 2 * (n - 1) * m
    if path == "HALVING_DOUBLING":
        if op == "all_reduce":
            return h + 2 * lg + 2 * f, 4 * (p - 1) / p * m + 2 * f * m
        return h + lg + 2 * f, 2 * (p - 1) / p * whole + f * (whole + m)
    if path == "CHAIN":
        return h + n - 1, 2 * m if op == "broadcast" else 3 * m
    if path == "DIRECT":
        return h + 1, (n - 1) * m
    if path == "TREE":
        return h + (n - 1).bit_length(), (n - 1).bit_length() * m  # ceil(log2 n) rounds and copies
    if path == "SCATTER_ALLGATHER":
        return h + 1 + lg + f, 2 * (p - 1) / p * m + f * m
    raise ValueError(f"no cost for path {path!r}")


def cost(path: str, op: str, nbytes: int, n: int, alpha: float | None = None, beta: float | None = None) -> float:
    """Predicted seconds of `op` with `nbytes` per rank on `n` ranks by `path`."""
    steps, moved = shape(path, op, nbytes, n)
    return (ALPHA_S if alpha is None else alpha) * steps + (BETA_S_PER_BYTE if beta is None else beta) * moved


def fit(samples: Iterable[tuple[str, str, int, int, float]]) -> tuple[float, float]:
    """Least-squares (α, β) from measured (path, op, nbytes, n, seconds), each sample weighted by
    1/seconds (relative error: small and large messages count alike)."""
    rows = [(*shape(path, op, nbytes, n), t) for path, op, nbytes, n, t in samples]
    # normal equations of sum ((a*s + b*x - t) / t)^2
    ss = sum((s / t) ** 2 for s, _, t in rows)
    sx = sum(s * x / t**2 for s, x, t in rows)
    xx = sum((x / t) ** 2 for _, x, t in rows)
    st = sum(s / t for s, _, t in rows)
    xt = sum(x / t for _, x, t in rows)
    det = ss * xx - sx * sx
    return (st * xx - xt * sx) / det, (ss * xt - sx * st) / det
