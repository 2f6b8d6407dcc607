"""What `nanoddp train --on-failure continue` covers, checked by the launcher before any process starts.

Each check is one line naming the flag, the rule and the way out (`--on-failure restart`, or the
engine that fits). The replica's own code (`nanoddp.train.ft_trainer`) reads the same names.
"""

from __future__ import annotations

from nanoddp.train.config import TrainConfig, filled

CONTINUE_ENGINES = ("nanoddp", "zero1", "zero2", "hsdp", "fsdp", "localsgd", "diloco")
LOWCOMM_ENGINES = ("localsgd", "diloco")  # a quorum per round of --sync-every steps (`nanoddp.ft.rounds`)


def check_continue(config: TrainConfig) -> None:
    """What `--on-failure continue` covers today; anything else is refused with the way out."""
    if config.engine not in CONTINUE_ENGINES:
        raise ValueError(
            f"--on-failure continue supports --engine {', '.join(CONTINUE_ENGINES)}, got {config.engine!r}; "
            "use one of those, or --on-failure restart"
        )
    if config.group_size not in (None, 1) and config.engine in LOWCOMM_ENGINES:
        raise ValueError(
            f"--group-size {config.group_size} with --engine {config.engine}: under --on-failure continue each "
            f"{config.engine} replica is one process (--group-size 1); drop it, or use --engine "
            "nanoddp|zero1|zero2|hsdp for replica groups of several processes"
        )
    if config.engine in LOWCOMM_ENGINES:
        check_continue_rounds(config)
    unsupported = {"compile": config.compile, "trace": config.trace is not None}
    named = [name for name, used in unsupported.items() if used]
    if named:
        flags = ", ".join("--" + name.replace("_", "-") for name in named)
        raise ValueError(f"--on-failure continue does not support {flags} yet: drop them or use --on-failure restart")


def continue_group_size(config: TrainConfig, nproc: int, across_hosts: bool) -> int:
    """The processes of each replica under `--on-failure continue`: `--group-size`, else a
    host's `nproc` across hosts (machines are what fail: a host is one replica group, sharded or
    data-parallel inside, healed whole from a peer host), else 1 (one node: one process per
    replica, so that a lost process costs only its own replica). localsgd and diloco: 1.

    fsdp shards the model over every process: one node's `nproc` are then one replica, whose lost
    process takes shards that exist nowhere else (the run resumes from the newest snapshot:
    `FaultTolerantTrainer` says so at start-up). A replica group lives on one host, so fsdp across
    hosts is refused, with the way out."""
    if config.engine == "fsdp":
        if across_hosts or config.group_size is not None:
            given = "across hosts" if across_hosts else f"with --group-size {config.group_size}"
            raise ValueError(
                f"--engine fsdp {given} under --on-failure continue: fsdp shards the model over every process, "
                "and a replica group is one host's processes; use --engine hsdp (sharded inside each host, whole "
                "across hosts: a lost host costs no state), or --on-failure restart"
            )
        return nproc
    if config.group_size is not None:
        return config.group_size
    return nproc if across_hosts and config.engine not in LOWCOMM_ENGINES else 1


def check_continue_rounds(config: TrainConfig) -> None:
    """localsgd and diloco under continue: a quorum per sync (`nanoddp.ft.rounds`: Streaming
    DiLoCo's fragments, delay and mix, any `--pseudo-grad-dtype`), and the boundary work at the
    syncs that end a round."""
    sync_every = filled(config.sync_every)
    for flag, every in (("--snapshot-every", config.snapshot_every), ("--eval-every", config.eval_every)):
        if every > 0 and every % sync_every:
            raise ValueError(
                f"{flag} {every} with --engine {config.engine} --sync-every {sync_every} under --on-failure continue: "
                f"snapshots and evaluations happen at syncs, where the replicas agree; use a multiple of {sync_every} "
                "(or 0)"
            )


def check_growth(config: TrainConfig, most_processes: int) -> None:
    """Under continue each replica's piece of a step's global batch is split over its processes'
    --grad-accum micro-batches: at the most processes the run may grow to, every micro-batch must
    hold a sample."""
    batch_size, per_step = filled(config.batch_size), most_processes * config.grad_accum
    if batch_size < per_step:
        raise ValueError(
            f"batch_size={batch_size} (global) cannot be split over {most_processes} processes (replicas x "
            f"--group-size) x grad_accum {config.grad_accum} = {per_step} (the most the run may grow to); use "
            f"--batch-size {per_step} or more"
        )
