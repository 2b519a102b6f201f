#!/usr/bin/env bash
# Session 3, call B (one H200): 64k, mode (a): stock+offload and ours (attention not nested, lean norms and LM head,
# 8 MLP chunks, offloading) in the same invocation.
source launch/gpu_env.sh
python3 launch/bench_memory.py --mode emulate --seq-tokens 65536 --steps 2 --timeout 260 --out /tmp/len64k \
    --configs layer+lean+chunked8+head+offload,stock+offload
keep len64k
