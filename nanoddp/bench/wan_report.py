"""What a `nanoddp bench wan` report says: each run's figures, the comparison, the table and the plot.

`nanoddp.bench.wan` runs the trainings and collects each run's metrics.jsonl records; everything
here is derived from those records alone, so `bench render` can rebuild a committed JSON's table
and the text cannot drift from the data. The engines compared are `nanoddp` (our DDP: its final
validation loss is the target), `torch` (torch's DDP), `diloco` and `nocomm` (the same DiLoCo run
that never syncs: the compute bound).
"""

from __future__ import annotations

import statistics
from typing import Any

from nanoddp.base.records import step_records
from nanoddp.bench.common import save_figure


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """From one run's metrics.jsonl records: its validation curve as [step, training seconds, val
    loss] (training seconds: the step times summed up to that step), total training time, the
    bytes rank 0 sent (sum of `comm_bytes`) and the final validation loss."""
    train_s, last_step, curve, comm_bytes = 0.0, 0, [], 0
    for record in step_records(records):
        train_s += record["step_time_s"] * (record["step"] - last_step)  # the mean over its window
        last_step = record["step"]
        comm_bytes += record.get("comm_bytes") or 0
        if record.get("val_loss") is not None:
            curve.append([record["step"], train_s, record["val_loss"]])
    if not curve:
        raise ValueError("metrics.jsonl holds no val_loss: the run must evaluate (--eval-every)")
    return {"steps": last_step, "train_s": train_s, "comm_bytes": comm_bytes, "final_val_loss": curve[-1][2],
            "curve": curve}  # fmt: skip


def time_to_reach(curve: list[list[float]], target: float) -> float | None:
    """Training seconds at the first evaluation whose loss is <= `target` (None: never reached)."""
    return next((train_s for _, train_s, loss in curve if loss <= target), None)


def best_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per engine and link, the first trial's run with the lowest final validation loss (of an
    `--lrs` sweep; without one, the only run), in the order the runs came."""
    kept: dict[tuple[str, bool], dict[str, Any]] = {}
    for r in first_trial(runs):
        key = (r["engine"], r["shaped"])
        if key not in kept or r["final_val_loss"] < kept[key]["final_val_loss"]:
            kept[key] = r
    return [r for r in runs if kept.get((r["engine"], r["shaped"])) is r]


def first_trial(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The sweep's runs: those of `--trials`' first trial (a report from before `--trials` has
    only those)."""
    return [r for r in runs if r.get("trial", 0) == 0]


def trials_of(runs: list[dict[str, Any]], kept: dict[str, Any]) -> list[dict[str, Any]]:
    """Every trial of a kept run (the same engine, link and lr), in trial order."""
    key = (kept["engine"], kept["shaped"], kept.get("lr"))  # reports from before `--lrs` have no lr
    same = [r for r in runs if (r["engine"], r["shaped"], r.get("lr")) == key]
    return sorted(same, key=lambda r: r.get("trial", 0))


def median_time(trials: list[dict[str, Any]], key: str = "train_s") -> float:
    """A kept run's time over its trials: the median (the one run's, without `--trials`)."""
    return statistics.median(r[key] for r in trials)


def median_reach(trials: list[dict[str, Any]], target: float) -> float | None:
    """The median over trials of the training seconds to `target` (None: a trial never reached it)."""
    reached = [time_to_reach(r["curve"], target) for r in trials]
    return None if any(s is None for s in reached) else statistics.median(s for s in reached if s is not None)


def paired_ratios(over: list[dict[str, Any]], under: list[dict[str, Any]]) -> list[float]:
    """Trial by trial, `over`'s training time over `under`'s: runs of one trial ran side by side."""
    return [a["train_s"] / b["train_s"] for a, b in zip(over, under, strict=True)]


def compare(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per link, each engine at its best (`best_runs`), DiLoCo against DDP: the loss gap at the same
    samples, the bytes ratio, and the training time each engine takes to DDP's final validation
    loss and to the loss both reach (the worse of the two finals), with their ratios (None: DiLoCo
    never reached it); where torch's DDP ran, its training time over DiLoCo's and over ours (the
    same steps: the steps/s ratios); where the no-communication run ran, DiLoCo's steps/s over its
    own; after a sweep, the lr each engine was kept at. Under `--trials` the times are medians over
    the trials and each ratio the median of the trials' own (runs of one trial ran side by side)."""
    summary: dict[str, Any] = {}
    best = best_runs(runs)
    for shaped in (True, False):
        at = {r["engine"]: r for r in best if r["shaped"] == shaped}
        ddp, torch_ddp, diloco, nocomm = at.get("nanoddp"), at.get("torch"), at.get("diloco"), at.get("nocomm")
        if ddp is None or diloco is None:
            continue
        timed = {engine: trials_of(runs, r) for engine, r in at.items()}
        target, common = ddp["final_val_loss"], max(ddp["final_val_loss"], diloco["final_val_loss"])
        present = [e for e in ("nanoddp", "torch", "diloco") if e in at]
        to_target = {e: median_reach(timed[e], target) for e in present}
        to_common = {e: median_reach(timed[e], common) for e in present}
        name = "shaped" if shaped else "unshaped"
        summary[name] = {
            "trials": len(timed["diloco"]),
            "val_loss_gap": diloco["final_val_loss"] / target - 1,  # at the same steps, hence samples
            "bytes_ratio": ddp["comm_bytes"] / diloco["comm_bytes"] if diloco["comm_bytes"] else None,
            "time_to_ddp_final_s": to_target,
            "time_to_ddp_final_speedup": _quotient(to_target["nanoddp"], to_target["diloco"]),
            "common_val_loss": common,
            "time_to_common_s": to_common,
            "time_to_common_speedup": _quotient(to_common["nanoddp"], to_common["diloco"]),
            "train_time_speedup": statistics.median(paired_ratios(timed["nanoddp"], timed["diloco"])),
        }
        if torch_ddp is not None:
            summary[name]["torch_ddp_over_diloco"] = statistics.median(paired_ratios(timed["torch"], timed["diloco"]))
            summary[name]["torch_ddp_over_nanoddp"] = statistics.median(paired_ratios(timed["torch"], timed["nanoddp"]))
        if nocomm is not None:  # the same steps: DiLoCo's steps/s over the compute bound's
            by_trial = paired_ratios(timed["nocomm"], timed["diloco"])
            summary[name]["diloco_over_nocomm"] = statistics.median(by_trial)
            summary[name]["diloco_over_nocomm_range"] = [min(by_trial), max(by_trial)]
        if any(r.get("lr") is not None for r in at.values()):
            summary[name]["lr"] = {engine: r["lr"] for engine, r in at.items()}
    return summary


def _quotient(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.1f} MB"


def _seconds(s: float | None) -> str:
    return "not reached" if s is None else f"{s:,.0f} s"


def _ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:,.1f}×"


def _engine_name(engine: str, meta: dict[str, Any]) -> str:
    if engine in ("nanoddp", "torch"):
        return f"DDP (`{engine}`)"
    streaming = [f"F={meta['fragments']}"] if meta.get("fragments") not in (None, 1) else []
    streaming += [f"τ={meta['sync_delay']}"] if meta.get("sync_delay") else []
    streaming += [f"α={meta['mix']}"] if meta.get("mix") else []
    streaming += [str(meta["pseudo_grad_dtype"])] if meta.get("pseudo_grad_dtype") not in (None, "fp32") else []
    name = " ".join(["Streaming DiLoCo" if streaming else "DiLoCo", f"H={meta['sync_every']}", *streaming])
    return f"{name}, no sync" if engine == "nocomm" else name


def _link_name(meta: dict[str, Any], shaped: bool) -> str:
    """`100mbit, 20ms` / `loopback` under the shaper (files from before `--link` are the shaper's);
    `100mbit veth (tbf)` / `veth, full speed` under netns."""
    if meta.get("link", "shaper") == "netns":
        return f"{meta['bandwidth']} veth (tbf)" if shaped else "veth, full speed"
    return f"{meta['bandwidth']}, {meta['latency']}" if shaped else "loopback"


def format_markdown(report: dict[str, Any]) -> str:
    """The table (one row per run; after an `--lrs` sweep, with its lr, the kept ones in bold) and
    one line per link on the goals, derived from the runs' own figures (`compare`), so the text
    cannot drift from the data."""
    runs = report["results"]
    meta, summary = report["meta"], compare(runs)
    swept, kept = any(r.get("lr") is not None for r in runs), best_runs(runs)
    lr_head, lr_rule = ("| lr ", "|---") if swept else ("", "")
    rows = [f"| link | engine {lr_head}| steps | training time | wall time | bytes sent (rank 0) | final val loss "
            "| training time to DDP's final val loss |", f"|---|---{lr_rule}|---|---|---|---|---|---|"]  # fmt: skip
    for r in first_trial(runs):  # a kept run's row gives the medians over its trials
        engine, trials = _engine_name(r["engine"], meta), trials_of(runs, r)
        ddp = next(k for k in kept if k["engine"] == "nanoddp" and k["shaped"] == r["shaped"])
        reached = median_reach(trials, ddp["final_val_loss"])
        lr = "" if not swept else f"**{_lr(r['lr'])}** | " if any(r is k for k in kept) else f"{_lr(r['lr'])} | "
        rows.append(f"| {_link_name(meta, r['shaped'])} | {engine} | {lr}{r['steps']:,} | "
                    f"{_timed(trials, 'train_s')} | {_timed(trials, 'wall_s')} | {_mb(r['comm_bytes'])} | "
                    f"{r['final_val_loss']:.4f} | {_seconds(reached)} |")  # fmt: skip
    lines = ["\n".join(rows), ""]
    for name, s in summary.items():
        link = _link_name(meta, name == "shaped")
        speedup = s["time_to_ddp_final_speedup"]
        reach = (f"reaches DDP's final val loss {_ratio(speedup)} sooner" if speedup is not None
                 else f"does not reach DDP's final val loss in {meta['steps']:,} steps")  # fmt: skip
        common = s["time_to_common_s"]
        both = (f"to {s['common_val_loss']:.4f}, the val loss both reach, DDP takes {_seconds(common['nanoddp'])} "
                f"and DiLoCo {_seconds(common['diloco'])} ({_ratio(s['time_to_common_speedup'])})")  # fmt: skip
        lines.append(f"- {link}: {_at_best(s)}DiLoCo's final val loss is {s['val_loss_gap']:+.1%} from DDP's at the "
                     f"same samples, with {_ratio(s['bytes_ratio'])} fewer bytes; it {reach}; {both}; training time "
                     f"{_ratio(s['train_time_speedup'])} shorter{_against_torch(s)}{_against_nocomm(s)}.")  # fmt: skip
    return "\n".join(lines).rstrip()


def _timed(trials: list[dict[str, Any]], key: str) -> str:
    """A time cell: the one run's, or the median over trials with their range."""
    if len(trials) == 1:
        return _seconds(trials[0][key])
    times = [r[key] for r in trials]
    return f"{_seconds(median_time(trials, key))} ({min(times):,.0f}–{max(times):,.0f} s, {len(times)} trials)"


def _lr(lr: float | None) -> str:
    return "default" if lr is None else f"{lr:g}"


def _at_best(s: dict[str, Any]) -> str:
    """`each at its best lr (DDP 1e-3, DiLoCo 2e-3): ` after a sweep; nothing without one."""
    if "lr" not in s:
        return ""
    return f"each at its best lr (DDP {_lr(s['lr']['nanoddp'])}, DiLoCo {_lr(s['lr']['diloco'])}): "


def _against_nocomm(s: dict[str, Any]) -> str:
    if "diloco_over_nocomm" not in s:
        return ""
    text = f"; DiLoCo's steps/s is {s['diloco_over_nocomm']:.3f}× those of the same run with no communication"
    if s.get("trials", 1) == 1:
        return text
    low, high = s["diloco_over_nocomm_range"]
    return f"{text} (the median of {s['trials']} interleaved trials; {low:.3f}× to {high:.3f}×)"


def _against_torch(s: dict[str, Any]) -> str:
    if "torch_ddp_over_diloco" not in s:
        return ""
    return (f"; torch's DDP on the same link takes {_ratio(s['torch_ddp_over_diloco'])} DiLoCo's training time "
            f"and {_ratio(s['torch_ddp_over_nanoddp'])} ours")  # fmt: skip


def plot(report: dict[str, Any], path: str) -> None:
    """Validation loss against training time (left) and against steps (right), one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta = report["meta"]
    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in best_runs(report["results"]):  # each engine at its best lr
        name, link = _engine_name(r["engine"], meta).replace("`", ""), _link_name(meta, r["shaped"])
        steps, seconds, losses = zip(*r["curve"], strict=True)
        style = {
            "linestyle": "-" if r["shaped"] else "--",
            "color": {"nanoddp": "C0", "torch": "C2", "nocomm": "C3"}.get(r["engine"], "C1"),
        }
        by_time.plot(seconds, losses, label=f"{name}, {link}", **style)
        by_step.plot(steps, losses, label=f"{name}, {link}", **style)
    by_time.set(xlabel="training time (s)", ylabel="validation loss", xscale="log")
    by_step.set(xlabel="step (same samples per step)", ylabel="validation loss")
    by_time.legend(fontsize=8)
    fig.suptitle(f"nanoddp bench wan: GPT, 2 ranks, {meta['steps']} steps ({meta['date']})")
    fig.tight_layout()
    save_figure(path, fig)
