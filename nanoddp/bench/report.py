"""From `bench train`'s raw per-step samples to rows, the markdown tables and a plot.

Kept apart from the measuring code so that `nanoddp bench report FILE.json` and `nanoddp bench
render` can re-derive every figure from a saved JSON's raw samples, on any machine, without
running anything.
"""

from __future__ import annotations

import logging
import statistics
import textwrap

from nanoddp.bench.common import save_figure

logger = logging.getLogger(__name__)

MB = 1 << 20
# Dense peak FLOP/s per device for float32 math on CUDA cores (no TF32), for MFU. A name not
# listed here gets no MFU rather than a guessed one.
PEAK_FP32_FLOPS = {"H200": 67e12, "H100": 67e12, "A100": 19.5e12, "L40S": 91.6e12, "A10G": 31.2e12}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low, high = int(position), min(int(position) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# One definition per column, for every engine; printed under every table (`format_markdown`)
# and quoted in docs/performance.md. The probes are in nanoddp.bench.probe.
DEFINITIONS = (
    "comm ms = gradient communication per step, rank mean: from the first gradient bucket handed to "
    "the collective layer (DDP engines: the moment bucket 0's last gradient hook runs; manual engines: "
    "the start of their after-backward sync) until the last reduced gradient is in place (DDP engines: "
    "backward() returns, their end-of-backward callback has written the gradients; manual engines: the "
    "sync returns). exposed ms = time from the last gradient hook to that same end: what backward() "
    "(plus, for manual engines, the sync call) waits after the last gradient is computed. overlap = "
    "1 − exposed ÷ comm, the share hidden under backward (≤ 0 %: nothing hidden; a manual engine starts "
    "its sync after backward, so its exposed time is its comm time plus backward's tail). MB sent/step = "
    "bytes the rank passed to write()/writev() during the step (/proc/self/io wchar), which is how "
    "gloo's TCP transport sends: every collective of the step (gradients, buffer broadcasts, nanoddp's "
    "used-parameter all-reduce and header frames, zero's parameter broadcast in optimizer.step), framing "
    "included; rank mean; – where the transport is not visible (nccl). "
    "Measured from outside, the same way for every engine: torch DDP runs stock (no comm hook, its C++ "
    "all-reduce path), nanoddp DDP without its timeline; gradient times come from post-accumulate-grad "
    "hooks that every engine's parameters carry, plus each wrapper's bucket layout. Not torch DDP's own "
    "runtime stats (_get_ddp_logging_data: torch's reducer only, sampled on some iterations) nor the "
    "profiler (per-op overhead, and it sees our collectives only as send/recv on a worker thread)."
)
OTHER_COLUMNS = (
    "scaling eff. = samples/s ÷ (ws × single-process samples/s); nocomm = every rank trains on its share "
    "of the batch without any gradient sync: the ceiling that compute alone leaves; peak MB/rank = what a "
    "process running only that engine peaks at (RSS on CPU, CUDA allocated on GPU)."
)


def _mean(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present and len(present) == len(values) else None


def _per_step(ranks: list[dict]) -> list[dict]:
    """Merge ranks step by step: a step lasts as long as its slowest rank; the rest is the rank mean."""
    merged = []
    for steps in zip(*(r["samples"] for r in ranks), strict=True):
        row = {key: _mean([s.get(key) for s in steps]) for key in steps[0]}
        row["step_s"] = max(s["step_s"] for s in steps)
        merged.append(row)
    return merged


def _row(engine: str, n: int, ranks: list[dict], meta: dict) -> dict:
    steps = _per_step(ranks)
    step_s = [s["step_s"] for s in steps]
    median = statistics.median(step_s)
    communicates = all(s["comm_s"] is not None for s in steps)
    comm = sum(s["comm_s"] for s in steps) if communicates else 0.0
    exposed = sum(s["exposed_comm_s"] for s in steps) if communicates else 0.0
    sent = [s.get("bytes_sent") for s in steps]
    seq_len = meta["model_config"]["seq_len"]
    row = {
        "engine": engine, "world_size": n, "steps": len(steps),
        "step_time_s": median, "step_time_p10_s": _quantile(step_s, 0.1),
        "step_time_p90_s": _quantile(step_s, 0.9),
        "spread": (_quantile(step_s, 0.9) - _quantile(step_s, 0.1)) / median,
        "samples_per_s": meta["global_batch"] / median,
        "tokens_per_s": meta["global_batch"] * seq_len / median,
        **{k: statistics.median(s[k] for s in steps) for k in ("forward_s", "backward_s", "sync_s", "optimizer_s")},
        "comm_time_s": comm / len(steps), "exposed_comm_s": exposed / len(steps),
        "overlap_fraction": (1.0 - exposed / comm) if comm > 0 else None,
        "bytes_sent_per_step": _mean(sent),  # None unless every step counted its bytes
        "peak_mem_bytes_per_rank": max(r["base_bytes"] + r["persistent_bytes"] + r["transient_bytes"]
                                       for r in ranks),
        "engine_resident_bytes_per_rank": max(r["persistent_bytes"] for r in ranks),
    }  # fmt: skip
    parts = _memory_parts(ranks)
    if parts is not None:  # a JSON from before the parts were counted re-derives its own rows
        row["memory_bytes_per_rank"] = parts
    row["compute_s"] = median - min(row["exposed_comm_s"], median)
    if not communicates:  # no gradient crossed a process boundary: no comm figures to report
        row.update(comm_time_s=None, exposed_comm_s=None, overlap_fraction=None)
    return row


MEMORY_PARTS = ("params", "grads", "optimizer_state", "transient_peak")


def _memory_parts(ranks: list[dict]) -> dict[str, int] | None:
    """Per-rank memory by part, each the largest over ranks: the tensors held after a step
    (parameters, gradients, optimizer state) and the high-water mark above them during steps.
    None for a JSON from before the parts were counted."""
    if any("held_bytes" not in r for r in ranks):
        return None
    parts = {k: max(r["held_bytes"][k] for r in ranks) for k in MEMORY_PARTS[:3]}
    return {**parts, "transient_peak": max(r["transient_bytes"] for r in ranks)}


def _mfu(row: dict, meta: dict) -> float | None:
    gpu = meta.get("gpu") if meta.get("device") == "cuda" else None
    peak = next((flops for name, flops in PEAK_FP32_FLOPS.items() if gpu and name in gpu), None)
    if peak is None:
        return None
    cfg = meta["model_config"]
    # 6 N per token (forward + backward matmuls) + attention scores, as in the PaLM appendix.
    flops_per_token = 6 * meta["parameters"] + 12 * cfg["n_layers"] * cfg["seq_len"] * cfg["d_model"]
    devices = 1 if row["engine"] in ("single", "dp") else row["world_size"]
    return row["tokens_per_s"] * flops_per_token / (devices * peak)


def results_of(data: dict) -> list[dict]:
    """The rows of a `bench train --json` file, re-derived from its raw per-step samples (a file
    without them, from before they were kept, gives its stored rows)."""
    if "raw" not in data:
        return data["results"]
    return summarise({int(n): per_rank for n, per_rank in data["raw"].items()}, data["meta"])


def summarise(per_ws: dict[int, list[dict]], meta: dict) -> list[dict]:
    """Rows for every (world size, engine), with ratios against torch DDP and the ws=1 baselines."""
    rows = []
    for n, per_rank in per_ws.items():
        for engine in per_rank[0]:
            ranks = [r[engine] for r in per_rank if engine in r]
            rows.append(_row(engine, n, ranks, meta))
    find = {(r["engine"], r["world_size"]): r for r in rows}
    allcores = find.get(("single_allcores", 1))
    for row in rows:
        base = find.get(("single", 1)) or find.get((row["engine"], 1))
        row["scaling_efficiency"] = row["samples_per_s"] / (row["world_size"] * base["samples_per_s"]) if base else None
        row["speedup_vs_allcores"] = row["samples_per_s"] / allcores["samples_per_s"] if allcores else None
        torch_row = find.get(("torch", row["world_size"]))
        row["vs_torch_ddp"] = row["samples_per_s"] / torch_row["samples_per_s"] if torch_row else None
        row["mfu"] = _mfu(row, meta)
    return rows


def _no_minus_zero(fraction: float | None) -> float | None:
    """-0.3 % prints as "0%", not "-0%" (a manual engine's overlap is just below zero)."""
    return 0.0 if fraction is not None and round(fraction * 100) == 0 else fraction


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "–" if value is None else format(value * scale, spec)


def caption(meta: dict) -> str:
    gpu = f", {meta['gpu']}" if meta.get("gpu") and meta.get("device") == "cuda" else ""
    before, after = meta.get("load_average_before"), meta.get("load_average_after")
    load = f"; 1-min load average {before[0]:.1f} before, {after[0]:.1f} after" if before and after else ""
    return (
        f"Measured on {meta['cpu']} ({meta['cpus']} cores, {meta['memory_gb']} GB RAM){gpu}, "
        f"torch {meta['torch']}, {meta.get('backend', '?')}; GPT {meta['model']} "
        f"({meta['parameters'] / 1e6:.2f} M parameters, seq {meta['model_config']['seq_len']}), "
        f"global batch {meta['global_batch']}, AdamW fp32, {meta['threads_per_rank']} thread(s) per rank; "
        f"median of {meta['steps']} steps per engine, engines interleaved in blocks of {meta['block']}{load}."
        + _provenance(meta)
    )


def _provenance(meta: dict) -> str:
    """Date, commit and command line of the run (files from before they were recorded: none)."""
    if not meta.get("command"):
        return ""
    return f" {meta['date'][:10]}, commit {meta.get('git_commit')}: `{meta['command']}`."


def format_summary(data: dict, world_size: int = 2) -> str:
    """The README's one-paragraph summary of one world size: each engine's ratio to torch DDP."""
    meta = data["meta"]
    rows = {r["engine"]: r for r in results_of(data) if r["world_size"] == world_size}
    if "torch" not in rows:
        raise ValueError(f"no torch DDP row at world size {world_size} to compare with; run with --engines ...,torch")

    def ratio(engine: str, label: str) -> str | None:
        row = rows.get(engine)
        if row is None:
            return None
        overlap = _no_minus_zero(row["overlap_fraction"])
        hidden = "" if overlap is None else f", overlap {overlap:.0%}"
        return f"{label} {row['vs_torch_ddp']:.2f}×{hidden}"

    torch_overlap = rows["torch"]["overlap_fraction"]
    labels = (
        ("nanoddp", "nanoddp DDP"),
        ("nanoddp_torchcomm", "nanoddp DDP over torch's collectives"),
        ("zero1", "ZeRO-1"),
        ("allreduce", "manual all-reduce"),
        ("rs_ag", "manual reduce-scatter + all-gather"),
        ("zero2", "ZeRO-2"),
        ("fsdp", "nanoddp FSDP"),
        ("torch_fsdp", "torch FSDP2"),
        ("nocomm", "no sync at all (the compute ceiling)"),
    )
    parts = [ratio(e, label) for e, label in labels]
    if "fsdp" in rows and "torch_fsdp" in rows:  # the sharding peers, head to head
        ours, theirs = rows["fsdp"], rows["torch_fsdp"]
        speed = ours["samples_per_s"] / theirs["samples_per_s"]
        mb = [row["peak_mem_bytes_per_rank"] / 2**20 for row in (ours, theirs)]
        parts.append(f"nanoddp FSDP ÷ torch FSDP2 {speed:.2f}× samples/s, peak {mb[0]:.0f} vs {mb[1]:.0f} MB/rank")
    load = meta.get("load_average_before")
    busy = load is not None and load[0] > meta["cpus"]  # more runnable threads than cores
    text = (
        f"- **Training, {meta['cpus']}-core CPU, {meta.get('backend', '?')}, GPT {meta['model']} "
        f"({meta['parameters'] / 1e6:.1f} M parameters), global batch {meta['global_batch']}, "
        f"{meta['date'][:10]}{f', 1-min load {load[0]:.1f}' if load else ''}:** samples/s at {world_size} "
        f"processes relative to stock torch DDP (overlap {torch_overlap:.0%}): "
        + "; ".join(p for p in parts if p)
        + (". The host was shared and busy: these ratios are noise-dominated (docs/performance.md)." if busy else ".")
    )
    return textwrap.fill(text, width=100, subsequent_indent="  ", break_on_hyphens=False)  # a markdown list item


def format_markdown(data: dict) -> str:
    """The README table: one row per (world size, engine)."""
    meta, rows = data["meta"], results_of(data)
    gpu = any(r.get("mfu") is not None for r in rows)
    head = [
        "engine",
        "ws",
        "samples/s",
        "step ms (p10–p90)",
        "tokens/s",
        "vs torch DDP",
        "scaling eff.",
        "comm ms",
        "exposed ms",
        "overlap",
        "MB sent/step",
        "peak MB/rank",
    ] + (["MFU"] if gpu else [])
    lines = [caption(meta), "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: (r["world_size"], r["engine"] != "single", r["engine"])):
        cells = [
            r["engine"], str(r["world_size"]), f"{r['samples_per_s']:.1f}",
            f"{r['step_time_s'] * 1e3:.0f} ({r['step_time_p10_s'] * 1e3:.0f}–{r['step_time_p90_s'] * 1e3:.0f})",
            f"{r['tokens_per_s']:,.0f}", _fmt(r["vs_torch_ddp"], ".2f"), _fmt(r["scaling_efficiency"], ".0%"),
            _fmt(r["comm_time_s"], ".1f", 1e3),
            _fmt(r["exposed_comm_s"], ".1f", 1e3),
            _fmt(_no_minus_zero(r["overlap_fraction"]), ".0%"), _fmt(r["bytes_sent_per_step"], ".1f", 1 / MB),
            f"{r['peak_mem_bytes_per_rank'] / MB:.0f}",
        ] + ([_fmt(r.get("mfu"), ".1%")] if gpu else [])  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", DEFINITIONS, "", OTHER_COLUMNS]
    return "\n".join(lines)


def write_plot(path: str, data: dict) -> None:
    """Left: samples/s vs world size per engine (dashed: linear scaling of one process). Right:
    per-step time split into compute and exposed communication, one bar per (engine, ws > 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, meta = results_of(data), data["meta"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 1.6]})
    sizes = sorted({r["world_size"] for r in rows})
    for engine in dict.fromkeys(r["engine"] for r in rows):
        sel = sorted((r for r in rows if r["engine"] == engine), key=lambda r: r["world_size"])
        style = "o" if len(sel) == 1 else "o-"
        left.plot([r["world_size"] for r in sel], [r["samples_per_s"] for r in sel], style, label=engine)
    single = next((r for r in rows if r["engine"] == "single" and r["world_size"] == 1), None)
    if single:
        left.plot(sizes, [n * single["samples_per_s"] for n in sizes], "k:", label="linear scaling")
    left.set(xlabel="world size (processes)", ylabel="throughput (samples/s)", xticks=sizes,
             title=f"GPT {meta['model']}, global batch {meta['global_batch']}")  # fmt: skip
    left.grid(True, alpha=0.3)
    left.legend(fontsize=8)
    bars = [r for r in rows if r["world_size"] > 1] or rows
    labels = [f"{r['engine']}\nws={r['world_size']}" for r in bars]
    compute = [r["compute_s"] * 1e3 for r in bars]
    exposed = [min(r["exposed_comm_s"] or 0.0, r["step_time_s"]) * 1e3 for r in bars]
    right.bar(labels, compute, label="compute (+ hidden comm)", color="tab:blue")
    right.bar(labels, exposed, bottom=compute, label="exposed comm", color="tab:red")
    right.set(ylabel="median step time (ms)", title="where a step's time goes")
    right.tick_params(axis="x", labelsize=7, labelrotation=40)
    for label in right.get_xticklabels():
        label.set_horizontalalignment("right")  # long engine names must not run into each other
    right.legend(fontsize=8)
    fig.suptitle(textwrap.fill(caption(meta), 180), fontsize=7)
    fig.tight_layout()
    save_figure(path, fig)


def write_memory_plot(path: str, data: dict) -> dict[str, dict[str, float]]:
    """Stacked bars of per-rank memory (MiB) by part, one bar per (engine, ws > 1; or every row
    when there is no ws > 1). Returns {part: {bar label: height}}, read back from the drawn bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results_of(data) if r.get("memory_bytes_per_rank")]
    if not rows:
        raise ValueError("this bench JSON has no per-part memory (measured before it was counted): run it again")
    rows = [r for r in rows if r["world_size"] > 1] or rows
    rows.sort(key=lambda r: (r["world_size"], r["engine"]))
    labels = [f"{r['engine']}\nws={r['world_size']}" for r in rows]
    width = max(7.0, 1.1 * len(rows)) + 2.5  # + the legend's column
    fig, ax = plt.subplots(figsize=(width, 5.2))
    bottom = [0.0] * len(rows)
    names = {"params": "parameters", "grads": "gradients", "optimizer_state": "optimizer state",
             "transient_peak": "transient peak (RSS above the held tensors)"}  # fmt: skip
    containers = {}
    for part in MEMORY_PARTS:
        heights = [r["memory_bytes_per_rank"][part] / MB for r in rows]
        containers[part] = ax.bar(labels, heights, bottom=bottom, label=names[part])
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set(ylabel="MiB per rank (largest rank)", title="per-rank memory by engine")
    ax.tick_params(axis="x", labelsize=7, labelrotation=40)
    for label in ax.get_xticklabels():
        label.set_horizontalalignment("right")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over one
    fig.suptitle(textwrap.fill(caption(data["meta"]), int(15 * width)), fontsize=7)  # ~15 chars/inch
    fig.tight_layout()
    drawn = {
        part: {label: patch.get_height() for label, patch in zip(labels, container.patches, strict=True)}
        for part, container in containers.items()
    }
    save_figure(path, fig)
    return drawn
