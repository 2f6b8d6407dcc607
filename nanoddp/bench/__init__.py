"""`nanoddp bench`'s face: the command group and the shared helpers, re-exported.

`nanoddp bench ...` benchmarks nanoddp against torch.distributed, side by side. The command
group is in `nanoddp.bench.commands`, what the benchmarks share (`--nproc`, `--json/--plot`,
atomic writes) in `nanoddp.bench.common`, each benchmark in its own module (`collectives`,
`zero`, `train`, `restarts`).
"""

from nanoddp.bench.commands import BENCHMARK_MODULES, register_cli
from nanoddp.bench.common import add_output_args, parse_world_sizes, save_figure, write_json

__all__ = ["BENCHMARK_MODULES", "add_output_args", "parse_world_sizes", "register_cli", "save_figure", "write_json"]
