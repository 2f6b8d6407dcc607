"""The magics' arguments: `%dist_init`'s flags, `--timeout`, `%%rank`'s rank list and where each
rank runs.

Parsed here, in the kernel, so a mistake fails at once as one `UsageError` line, before any
worker starts or any cell is sent.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

from IPython.core.error import UsageError

from nanoddp import env as nd

DEFAULT_PG_TIMEOUT_S = 1800.0  # torch's default: a notebook rank may legitimately wait long


def parse_ranks(spec: str, world_size: int) -> list[int]:
    """ "[0,2]", "0,2", "0 2" or "1" -> sorted ranks, each checked against the world size."""
    body = spec.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    tokens = [t for t in re.split(r"[,\s]+", body) if t]
    if not tokens:
        raise UsageError(f"%%rank needs ranks, e.g. %%rank [0,2] or %%rank 1; got {spec!r}")
    try:
        ranks = sorted({int(t) for t in tokens})
    except ValueError:
        raise UsageError(f"ranks must be integers like [0,2], got {spec!r}") from None
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise UsageError(f"ranks {bad} are outside the pool's ranks 0..{world_size - 1}")
    return ranks


def placement(num_processes: int, gpu_ids: str | None, backend: str | None) -> tuple[str, list[str]]:
    """(backend, one device per rank) from the %dist_init flags."""
    if gpu_ids:
        try:
            ids = [int(x) for x in gpu_ids.split(",") if x.strip()]
        except ValueError:
            raise UsageError(f"--gpu-ids must be integers like 0,1, got {gpu_ids!r}") from None
        if len(ids) != num_processes:
            raise UsageError(f"--gpu-ids lists {len(ids)} GPUs for {num_processes} processes; give one each")
        return backend or "nccl", [f"cuda:{i}" for i in ids]
    backend = backend or nd.default_backend(num_processes)
    return backend, [str(nd.device_for(backend, rank)) for rank in range(num_processes)]


def check_devices(devices: Sequence[str], gpu_count: int) -> None:
    """Fail in the kernel, at once, when a rank's GPU does not exist (not N worker tracebacks)."""
    wanted = sorted({int(d.split(":")[1]) for d in devices if d.startswith("cuda:")})
    missing = [i for i in wanted if i >= gpu_count]
    if missing:
        raise UsageError(
            f"GPUs {missing} do not exist: this machine has {gpu_count} (torch.cuda.device_count()); "
            "pick --gpu-ids below that, or use --backend gloo without --gpu-ids to run on the CPU"
        )


class _Parser(argparse.ArgumentParser):
    def __init__(self, prog: str):
        super().__init__(prog=prog, add_help=False)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}\n{self.format_usage()}")


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def timeout_parser(prog: str) -> _Parser:
    parser = _Parser(prog)
    parser.add_argument("--timeout", type=_positive_float, default=None)
    return parser


def init_parser() -> _Parser:
    parser = _Parser("%dist_init")
    parser.add_argument("--num-processes", "-n", type=int, required=True)
    parser.add_argument("--gpu-ids", default=None)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None)
    parser.add_argument("--timeout", type=_positive_float, default=None)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--pg-timeout", type=_positive_float, default=DEFAULT_PG_TIMEOUT_S)
    return parser
