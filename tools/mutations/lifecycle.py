"""Planted faults in process lifecycles: `nanoddp run` (`nanoddp/run/`), `nanoddp.launch`, notebook recovery and its
test harness, and how a process started by a scheduler finds its job (`nanoddp/torchrun.py`)."""

from __future__ import annotations

from mutations.fault import Mutation

FAULTS = (
    Mutation(
        "scheduler env: a variable the scheduler lacks is looked up in os.environ (MPICH: TypeError)",
        "nanoddp/torchrun.py",
        "    if name is None or name not in environ:",
        "    if name not in environ:  # type: ignore[operator]",
        ("tests/unit/test_seams_env.py", "-k", "one_job"),
    ),
    Mutation(
        "nanoddp run: the single-node store listens on every interface",
        "nanoddp/run/bootstrap.py",
        "            _bound_rendezvous(call)",
        "            pass",
        ("tests/reliability/test_loopback.py", "-k", "single_node"),
    ),
    Mutation(
        "multi-node: the store's host not decided by this host's interfaces",
        "nanoddp/hosts.py",
        "    is_local = ipaddress.ip_address(address).is_loopback or interface_of(address) is not None",
        "    is_local = ipaddress.ip_address(address).is_loopback",
        ("tests/multiproc/test_multinode_hosts.py", "-k", "hosts_reads_routes"),
    ),
    Mutation(
        "nanoddp run: workers outlive a SIGKILLed launcher",
        "nanoddp/run/bootstrap.py",
        "    die_with_parent(int(os.environ.get(AGENT_PID_VAR, os.getppid())))"
        "  # even a SIGKILLed launcher takes us along",
        "    pass",
        ("tests/reliability/test_run_lifecycle.py", "-k", "sigkilled"),
    ),
    Mutation(
        "nanoddp run: what a rank started outlives a SIGKILLed launcher",
        "nanoddp/run/bootstrap.py",
        "    take_descendants_along()  # and what the script starts goes with us",
        "    pass",
        ("tests/reliability/test_orphans.py", "-k", "nanoddp_run"),
    ),
    Mutation(
        "launch: ranks do not die with their launcher",
        "nanoddp/launch.py",
        "    die_with_launcher(launcher_pid)  # who may have died while this rank imported torch",
        "    pass",
        ("tests/reliability/test_orphans.py", "-k", "while_its_ranks_start"),
    ),
    Mutation(
        "ft launcher: a forked replica leads no session (what it starts outlives it)",
        "nanoddp/fork_server.py",
        "    os.setsid()\n",
        "",
        ("tests/reliability/test_orphans.py", "-k", "nanoddp_train and continue"),
    ),
    Mutation(
        "nanoddp train: what a worker forked by the fork server started outlives a SIGKILLed launcher",
        "nanoddp/train/launcher/cli.py",
        "    take_descendants_along(new_group=forked)",
        "    take_descendants_along(new_group=False)",
        ("tests/reliability/test_orphans.py", "-k", "nanoddp_train"),
    ),
    Mutation(
        "nanoddp run: Ctrl-C gives a traceback per rank",
        "nanoddp/run/bootstrap.py",
        "        sys.exit(128 + signal.SIGINT)",
        "        raise",
        ("tests/reliability/test_run_lifecycle.py", "-k", "SIGINT"),
    ),
    Mutation(
        "nanoddp run: a signal stop exits 1",
        "nanoddp/train/launcher/agent.py",
        "        return 128 + sig",
        "        return 1",
        ("tests/reliability/test_run_lifecycle.py", "-k", "signal_stops"),
    ),
    Mutation(
        "nanoddp run: temp dir not named by pid, never swept",
        "nanoddp/train/launcher/agent.py",
        "make_private_dir(job.scratch_prefix)",
        '__import__("tempfile").mkdtemp(prefix=job.scratch_prefix)',
        ("tests/reliability/test_run_lifecycle.py", "-k", "sigkilled"),
    ),
    Mutation(
        "nanoddp run: --fail-on-early-exit ignored",
        "nanoddp/run/finished.py",
        "        if self.fail:",
        "        if False:",
        ("tests/reliability/test_run_lifecycle.py", "-k", "fail_on_early_exit"),
    ),
    Mutation(
        "nanoddp run: an early-finished rank never reported",
        "nanoddp/run/finished.py",
        "        if self._reported or time.monotonic() - self._since < self.grace_s:",
        "        if True:",
        ("tests/reliability/test_run_lifecycle.py", "-k", "finished_early"),
    ),
    Mutation(
        "notebook recovery: old per-group runners kept after a rebuild",
        "nanoddp/notebook/recovery.py",
        "    runner.forget_groups()\n",
        "    pass\n",
        ("tests/multiproc/test_notebook_interrupt.py", "-k", "group_is_rebuilt"),
    ),
    Mutation(
        "notebook recovery: the hang watchdog not re-armed after a rebuild",
        "nanoddp/notebook/recovery.py",
        "watchdog.enable(settings[0], poll_s=settings[1], exit_on_hang=settings[2])",
        "pass",
        ("tests/multiproc/test_notebook_interrupt.py", "-k", "group_is_rebuilt"),
    ),
    Mutation(
        "notebook tests: next cell sent before the kernel is idle",
        "tests/helpers.py",
        "    reply = finish_cell(kc, msg_id, timeout)",
        "    return finish_cell(kc, msg_id, timeout)",
        ("tests/multiproc/test_notebook.py", "-k", "test_interrupt_then_kernel_death"),
    ),
    Mutation(
        "launch: a rank forked from the fork server outlives a SIGKILLed launcher",
        "nanoddp/base/processes.py",
        "    die_with(launcher_pid)\n    return True",
        "    return True",
        ("tests/multiproc/test_launch.py", "-k", "sigkilled_launcher"),
    ),
    Mutation(
        "launch: a forked rank writes to the streams the fork server started with",
        "nanoddp/fork_server.py",
        "            os.dup2(fd, target)",
        "            pass",
        ("tests/multiproc/test_launch.py", "-k", "returns or forked_rank_sees"),
    ),
    Mutation(
        "launch: a forked rank sees the environment the fork server started with",
        "nanoddp/fork_server.py",
        "        os.environ.update(self.environ)",
        "        os.environ.update(os.environ)",
        ("tests/multiproc/test_launch.py", "-k", "returns or forked_rank_sees"),
    ),
    Mutation(
        "launch: a forked rank keeps the thread count torch read when the fork server started",
        "nanoddp/launch.py",
        "            torch.set_num_threads(int(threads))",
        "            pass",
        ("tests/multiproc/test_launch.py", "-k", "forked_rank_sees"),
    ),
    Mutation(
        "launch: the fork server leaves dynamo for every rank to import at its optimizer",
        "nanoddp/fork_server.py",
        'ALWAYS_PRELOAD = ("torch._dynamo",)',
        "ALWAYS_PRELOAD: tuple[str, ...] = ()",
        ("tests/multiproc/test_launch.py", "-k", "optimizer_without"),
    ),
    Mutation(
        "launch: a rank inherits multiprocessing's temp dir as the launcher's descriptor path",
        "nanoddp/fork_server.py",
        'config["tempdir"] = os.path.realpath(config["tempdir"])',
        'config["tempdir"] = config["tempdir"]',
        ("tests/multiproc/test_launch.py", "-k", "manager_of_its_own"),
    ),
)
