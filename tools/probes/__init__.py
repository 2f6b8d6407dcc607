"""The reliability probes behind `python tools/reliability_probes.py`, one module per family.

`watched` and `context` run and clean up a probe's subprocesses, `observe` and `verdicts` turn
what they did into a row, `registry` holds the table, `runner` drives it; the families
(`run_dir`, `interrupts`, `collectives`, `before_workers`, `private`, `no_leftovers`) are the
probes themselves.
"""
