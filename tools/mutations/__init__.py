"""The planted faults `tools/mutate.py` runs: one per bug class the suite must catch.

Each names the file, an exact text that occurs once in it, its faulty replacement, and the one
test (file and -k) that should fail on it. A fault whose text no longer occurs is reported as
"not applied" by the runner: the code moved on and the entry needs updating. One module per
layer of the code: `base`, `comm`, `parallel`, `train`, `ft`, `bench`, `lifecycle`.
"""

from __future__ import annotations

from mutations import base, bench, comm, ft, lifecycle, parallel, train
from mutations.fault import Mutation

MUTATIONS: tuple[Mutation, ...] = (
    *base.FAULTS,
    *comm.FAULTS,
    *parallel.FAULTS,
    *train.FAULTS,
    *ft.FAULTS,
    *bench.FAULTS,
    *lifecycle.FAULTS,
)

__all__ = ["MUTATIONS", "Mutation"]
