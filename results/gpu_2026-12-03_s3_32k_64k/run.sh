#!/usr/bin/env bash
# One H200, in order of importance, each group kept as
# soon as it ends: 64k ours (attention not nested, lean norms + LM head, 8 MLP chunks, offloading); 32k stock+offload
# and ours; NeMo-RL PR #926's rows at 5,500 and 8,192 tokens; the kernel probe.
source launch/gpu_env.sh
python3 launch/bench_memory.py --mode emulate --seq-tokens 65536 --steps 2 --timeout 250 --out /tmp/len64k \
    --configs layer+lean+chunked8+head+offload
keep len64k
python3 launch/bench_memory.py --mode emulate --seq-tokens 32768 --steps 2 --timeout 120 --out /tmp/len32k \
    --configs stock+offload,layer+lean+chunked8+head+offload
keep len32k
python3 launch/bench_memory.py --mode emulate --seq-tokens 5500,8192 --steps 2 --timeout 60 --out /tmp/seed_rows \
    --configs attn_mlp,norm_attn_mlp,norm_attn_mlp+alloc64
keep seed_rows
timeout 40 python3 launch/probe_kernels.py --tokens 24576 --attn-seq 65536 --out "$OUT/probe_kernels.json" > /dev/null
