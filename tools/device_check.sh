#!/usr/bin/env bash
# The checks that need a machine this project's VM is not: run once on a lent GPU machine with
# 16 CPU cores (torch preinstalled there, no internet), from the repository root:
#
#     OUT=/some/dir bash tools/device_check.sh      # every step's output and JSON under $OUT
#     QUICK=1 bash tools/device_check.sh            # the same steps, small, on any machine
#
# Why one script: such a machine is lent for minutes, all tries together; each step has its own
# time limit (together under ten minutes), so one that hangs or runs long cannot take the
# others' time, and a step that fails still leaves the steps after it to run.
#
# Steps: what the machine has; the CUDA tests (skipped on the VM); the whole suite on the
# machine's torch (another version: which tests fail says what the torch floor in
# pyproject.toml may be); then, one thread per rank, `bench collectives` and `bench train` at
# 2, 4, 8 and 16 ranks, the scale two cores cannot show (docs/performance.md); last, a host lost
# under `--on-failure continue` on the GPU (`bench restarts --hosts 2`: two network-namespace
# hosts of one process each share the GPU, NCCL_HOSTID telling nccl they are two machines, so
# every group is nccl and the lost host's communicator is aborted; restart's cost beside it;
# needs root). The JSON goes into docs/bench/ beside the 2-core files, named by the core count.
set -u
OUT=${OUT:-device-out}
mkdir -p "$OUT"
CORES=$(nproc)  # names the JSON, as docs/bench/*-2core.json
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${QUICK:-}" ]; then
    NPROC=2 ITERS=2 STEPS=2 SIZES="64K 1M" SUITE="tests/unit" LIMIT_SUITE=240 LIMIT_BENCH=240 LIMIT_FT=240
else
    NPROC=2,4,8,16 ITERS=10 STEPS=10 SIZES="64K 1M 4M 16M 64M" SUITE="tests" LIMIT_SUITE=180 LIMIT_BENCH=120
    LIMIT_FT=120
fi
PARALLEL=()  # the whole suite fits its limit only spread over the cores (pytest-xdist, if there)
if [ -z "${QUICK:-}" ] && python -c "import xdist" 2>/dev/null; then PARALLEL=(-n 8); fi

step() {  # step NAME SECONDS COMMAND...: run it under a limit, log to $OUT/NAME.log, note the outcome
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc in $((SECONDS - start)) s (limit $limit s)" | tee -a "$OUT/steps.txt"
}

step machine 30 python -c '
import os, platform, sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cpus", os.cpu_count(), platform.machine())
print("cuda", torch.cuda.is_available(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
print("nccl", torch.distributed.is_nccl_available(), "gloo", torch.distributed.is_gloo_available())'
step cuda-tests 90 python -m pytest -q -rfs -p no:cacheprovider tests/unit/test_dp.py tests/multiproc/test_dist.py
step suite "$LIMIT_SUITE" python -m pytest -q -rf -p no:cacheprovider ${PARALLEL[@]+"${PARALLEL[@]}"} "$SUITE" \
    --ignore tests/unit/test_dp.py --ignore tests/multiproc/test_dist.py  # ran as cuda-tests
# shellcheck disable=SC2086  # SIZES is a list of words
step bench-collectives "$LIMIT_BENCH" python -m nanoddp bench collectives --nproc "$NPROC" --iters "$ITERS" \
    --sizes $SIZES --floor --json "$OUT/collectives-${CORES}core.json"
# --memory shared: the timed launch's memory figures, not a launch per engine (device minutes)
step bench-train "$LIMIT_BENCH" python -m nanoddp bench train --nproc "$NPROC" --global-batch 128 --steps "$STEPS" \
    --engines nanoddp,torch,zero2,fsdp,torch_fsdp --memory shared --json "$OUT/train-${CORES}core.json"
step ft-host-kill "$LIMIT_FT" python -m nanoddp bench restarts --trials 0 --cost-trials 1 --hosts 2 --host-nproc 1 \
    --json "$OUT/ft-host-failure-${CORES}core.json"
# which backend continue's runs used (the start-up line, kept per run): nccl where the GPU took them
step ft-host-kill-backend 10 python -c '
import json, sys
runs = json.load(open(sys.argv[1]))["host_failure_cost"]["results"]
said = sorted({str(run.get("backend")) for run in runs if run.get("mode") == "continue"})
print("continue ran over", said)
sys.exit(0 if said == ["nccl"] else 1)' "$OUT/ft-host-failure-${CORES}core.json"
echo "outputs in $OUT"
