#!/usr/bin/env bash
# Session 3, call C (one H200): 32k, mode (a), stock+offload and ours; the seed's rows at 5,500 and 8,192 tokens.
source launch/gpu_env.sh
python3 launch/bench_memory.py --mode emulate --seq-tokens 32768 --steps 2 --timeout 130 --out /tmp/len32k \
    --configs stock+offload,layer+lean+chunked8+head+offload
keep len32k
python3 launch/bench_memory.py --mode emulate --seq-tokens 5500,8192 --steps 2 --timeout 70 --out /tmp/seed_rows \
    --configs attn_mlp,norm_attn_mlp,norm_attn_mlp+alloc64
keep seed_rows
