#!/usr/bin/env bash
# Measurements not yet made, as device calls of under 600 s each on one H200. Run from the repo root on the GPU
# machine with `.whl` carried: `bash launch/gpu_pending.sh a|b|c`. Then copy $OUT's folders to results/<date>_<tag>/
# with a COMMAND.md, and merge (README, "Benchmarks").
set -u
source launch/gpu_env.sh
case "${1:-}" in
a)  # per-rank emulation, 128k, the leanest configuration with pageable offload: the planner predicts 83.3 GB
    # allocated / 130.0 GB reserved of 139, and 107 GB of pageable host memory (pinned would need 183 GB; the host has
    # 128 GiB). stock+offload at 128k is not run: its pinned offload alone exceeds this host's memory.
    python3 launch/bench_memory.py --mode emulate --seq-tokens 131072 --steps 2 --timeout 540 --out /tmp/len128k \
        --configs layer+lean+chunked8+head+offload_pageable
    keep len128k ;;
b)  # real path (ZeRO-3, 8 layers), 64k: TRL's own offloading (the peer setup) and expandable segments beside ours
    python3 launch/bench_memory.py --mode zero3 --layers 8 --seq-tokens 65536 --steps 2 --timeout 130 --out /tmp/rp64k \
        --configs layer+lean+chunked8+head+offload,stock+offload,layer+lean+chunked8+head+offload+expandable
    keep rp64k ;;
c)  # real path (ZeRO-3, 8 layers), 32k: stock, TRL's offloading, ours
    python3 launch/bench_memory.py --mode zero3 --layers 8 --seq-tokens 32768 --steps 3 --timeout 120 --out /tmp/rp32k \
        --configs stock,stock+offload,layer+lean+chunked8+head+offload
    keep rp32k ;;
*)  echo "usage: bash launch/gpu_pending.sh a|b|c" >&2; exit 2 ;;
esac
