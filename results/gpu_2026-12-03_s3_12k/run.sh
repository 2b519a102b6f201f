#!/usr/bin/env bash
# One H200: the lean LM head at 12k, per-rank emulation, beside stock and stock+offload; the empty_cache
# lever; the kernel probe (LM-head backward at 12k, attention backends at 64k); a snapshot of the leanest config.
source launch/gpu_env.sh
python3 launch/probe_kernels.py --tokens 24576 --attn-seq 65536 --out "$OUT/probe_kernels.json" > /dev/null
python3 launch/bench_memory.py --mode emulate --seq-tokens 12288 --steps 2 --timeout 80 --out /tmp/len12k \
    --configs stock,stock+offload,layer+norm_attn_mlp+head+offload,layer+attn+lean+chunked4+head+offload,layer+lean+chunked4+head+offload,norm_attn_mlp+empty_cache
keep len12k
python3 launch/bench_memory.py --mode emulate --seq-tokens 12288 --steps 2 --timeout 90 --snapshot --out /tmp/snap12k \
    --configs layer+attn+lean+chunked4+head+offload
keep snap12k
