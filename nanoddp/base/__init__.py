"""Ground-floor services every layer above calls, each written once: files, the run record
(`metrics.jsonl`), RNG, processes, limits."""

from nanoddp.base.files import UnsafePath, append_text, atomic_torch_save, atomic_write_bytes, open_private
from nanoddp.base.limits import PG_TIMEOUT_MARGIN_S, STOP_GRACE_S
from nanoddp.base.processes import child_run, die_with_parent, finish, stop, take_descendants_along
from nanoddp.base.records import RecordWriter, read_records
from nanoddp.base.rng import capture_rng_state, restore_rng_state

__all__ = [
    "PG_TIMEOUT_MARGIN_S",
    "RecordWriter",
    "STOP_GRACE_S",
    "UnsafePath",
    "append_text",
    "atomic_torch_save",
    "atomic_write_bytes",
    "capture_rng_state",
    "child_run",
    "die_with_parent",
    "finish",
    "open_private",
    "read_records",
    "restore_rng_state",
    "stop",
    "take_descendants_along",
]
