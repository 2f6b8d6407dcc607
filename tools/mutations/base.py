"""Planted faults in the ground floor (`nanoddp/base/`): RNG capture and restore, and the run
record (`metrics.jsonl`)."""

from __future__ import annotations

from mutations.fault import Mutation

FAULTS = (
    Mutation(
        "ft: a joiner keeps its own torch RNG, not its source's",
        "nanoddp/base/rng.py",
        '    torch.set_rng_state(state["torch"])\n',
        "    pass\n",
        ("tests/unit/test_ft_packed_state.py", "-k", "live_state"),
    ),
    Mutation(
        "rng: numpy's generator not restored (a healed or resumed rank draws anew)",
        "nanoddp/base/rng.py",
        '        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))\n',
        "        pass\n",
        ("tests/unit/test_ft_packed_state.py", "-k", "live_state"),
    ),
    Mutation(
        "records: truncate_after keeps the events past the step (a redone step's events twice)",
        "nanoddp/base/records.py",
        '    kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]\n',
        '    kept = [ln for ln in lines if ln.strip() and ("event" in ln or json.loads(ln)["step"] <= step)]\n',
        ("tests/unit/test_records.py", "-k", "truncate"),
    ),
    Mutation(
        "records: a record off the format is written unchecked",
        "nanoddp/base/records.py",
        "        check_record(record)\n",
        "        pass\n",
        ("tests/unit/test_records.py", "-k", "refused"),
    ),
)
