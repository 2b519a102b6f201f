#!/usr/bin/env bash
# Issue 4's rows not yet measured, as two device calls of under 600 s each (one H200, mode (a)). Run from the repo
# root on the GPU machine with `.whl` carried: `bash launch/gpu_pending.sh a`, then `bash launch/gpu_pending.sh b`.
# Then copy $OUT's folders to results/gpu_<date>_<tag>/ with a COMMAND.md, and merge (README, "Benchmarks").
set -u
source launch/gpu_env.sh
case "${1:-}" in
a)  # 128k, the leanest configuration with pageable offload: the planner predicts 83.3 GB allocated / 130.0 GB
    # reserved of 139, and 107 GB of pageable host memory (pinned would need 183 GB; the host has 128 GiB).
    # stock+offload at 128k is not run: its pinned offload alone exceeds this host's memory.
    python3 launch/bench_memory.py --mode emulate --seq-tokens 131072 --steps 2 --timeout 540 --out /tmp/len128k \
        --configs layer+lean+chunked8+head+offload_pageable
    keep len128k ;;
b)  # expandable_segments, the seed's lever not yet measured: at 12k beside stock (same invocation), and at 64k on
    # the leanest configuration (its 23 GB fragmentation gap) beside stock+offload.
    python3 launch/bench_memory.py --mode emulate --seq-tokens 12288 --steps 2 --timeout 90 --out /tmp/len12k \
        --configs stock,norm_attn_mlp+expandable
    keep len12k
    python3 launch/bench_memory.py --mode emulate --seq-tokens 65536 --steps 2 --timeout 230 --out /tmp/len64k \
        --configs layer+lean+chunked8+head+offload+expandable,stock+offload
    keep len64k ;;
*)  echo "usage: bash launch/gpu_pending.sh a|b" >&2; exit 2 ;;
esac
