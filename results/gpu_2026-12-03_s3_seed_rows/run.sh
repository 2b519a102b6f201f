#!/usr/bin/env bash
# One H200: NeMo-RL PR #926's rows at 5,500 and 8,192 tokens, then
# the kernel probe.
source launch/gpu_env.sh
python3 launch/bench_memory.py --mode emulate --seq-tokens 5500,8192 --steps 2 --timeout 60 --out /tmp/seed_rows \
    --configs attn_mlp,norm_attn_mlp,norm_attn_mlp+alloc64
keep seed_rows
timeout 30 python3 launch/probe_kernels.py --tokens 24576 --attn-seq 65536 --out "$OUT/probe_kernels.json" > /dev/null
