#!/usr/bin/env bash
# Re-measure the GPU-machine figures of docs/benchmarks.md, in groups that each fit
# a 10-minute window, JSON written to OUTDIR (one file per program, printed as it goes):
#
#   bash benchmarks/gpu_refresh.sh tests  OUTDIR   # pytest -m cuda                     (~3 min)
#   bash benchmarks/gpu_refresh.sh fill   OUTDIR   # neighbours, busy_loop, 16 GiB     (~7 min)
#   bash benchmarks/gpu_refresh.sh tier   OUTDIR   # full_tier 96 GiB, fill_throughput,
#                                                  # the 1- and 8-process driver probe (~6 min)
#   bash benchmarks/gpu_refresh.sh scale  OUTDIR   # fill_scaling, cold first allocation (~6 min)
#   bash benchmarks/gpu_refresh.sh copies OUTDIR   # copy_bandwidth, SM beside a matmul (~5 min)
#   bash benchmarks/gpu_refresh.sh progress OUTDIR # fill_progress, 64 GiB per arm      (~3 min)
#   bash benchmarks/gpu_refresh.sh requests OUTDIR # request_latency, where a 128 MiB request's
#                                                  # time goes, the host-only proxy     (~6 min)
#   bash benchmarks/gpu_refresh.sh store  OUTDIR   # bench store: tiers, prefix, shared (~8 min)
#
# Each command runs to its end or to the group's limit; a program killed by the
# limit leaves what it printed. The machine's description is in every JSON document.
set -uo pipefail
group=${1:?group: tests fill tier scale copies progress requests store}
out=${2:?output directory}
mkdir -p "$out"
py=${PYTHON:-python3}

run() {  # run NAME SECONDS ARGS...: one program, its stdout to NAME.json, its stderr to NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date +%T))"
    timeout "$limit" "$py" "$@" >"$out/$name.json" 2>"$out/$name.log"
    echo "   exit $? ($(date +%T))"
}

case "$group" in
tests)
    timeout 400 "$py" -m pytest -m cuda -q -p no:cacheprovider --timeout 120 -rs tests >"$out/pytest-cuda.log" 2>&1
    echo "pytest exit $?"
    tail -5 "$out/pytest-cuda.log"
    ;;
fill)
    run neighbours 330 -m aiokvtier.bench host --sections neighbours --gib 16 --repeats 2 \
        --register-units-mib 64 --vmm-units-mib 64 128
    run busy-loop 230 -m aiokvtier.bench host --sections busy_loop --gib 8 --repeats 2
    ;;
tier)
    run full-tier 200 -m aiokvtier.bench cuda --sections full_tier --full-gib 96 --settle 10
    run fill-throughput 330 -m aiokvtier.bench cuda --sections fill_throughput executor_responsiveness
    ;;
scale)
    run fill-scaling 330 -m aiokvtier.bench host --sections fill_scaling --gib 8 --repeats 2
    run cold 230 -m aiokvtier.bench cuda --sections cold --cold-gib 64 --cold-repeats 3
    ;;
copies)
    run copy-bandwidth 330 -m aiokvtier.bench cuda --sections copy_bandwidth sm_concurrent_compute
    ;;
progress)
    run fill-progress 330 -m aiokvtier.bench cuda --sections fill_progress
    ;;
requests)
    run request-latency 230 -m aiokvtier.bench cuda --sections request_latency
    run big-request-timeline 130 benchmarks/big_request_timeline.py --requests 8
    run host-request-latency 130 -m aiokvtier.bench host --sections request_latency
    ;;
store)
    run store-tiers 230 -m aiokvtier.bench store --sections tiers
    run store-prefix 130 -m aiokvtier.bench store --sections prefix
    run store-shared 200 -m aiokvtier.bench store --sections shared
    ;;
*)
    echo "unknown group $group (tests fill tier scale copies progress requests store)" >&2
    exit 2
    ;;
esac
