#!/usr/bin/env bash
# Session 3, call A (one H200): the lean LM head at 12k, mode (a), beside stock and stock+offload; the empty_cache
# lever; the LM-head backward probe. Run from the repo root with $OUT set; .whl carried (../shared/device).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
    --target /tmp/site .whl/deepspeed-*.tar.gz
export PYTHONPATH=/tmp/site:$PYTHONPATH PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
keep() { mkdir -p "$OUT/$1"; cp /tmp/$1/results.json /tmp/$1/results.md /tmp/$1/memory_vs_length.png \
    /tmp/$1/bench.log "$OUT/$1/" 2>/dev/null; }
python3 launch/probe_kernels.py --tokens 24576 --attn-seq 65536 --out "$OUT/probe_kernels.json" > /dev/null
python3 launch/bench_memory.py --mode emulate --seq-tokens 12288 --steps 2 --timeout 80 --out /tmp/len12k \
    --configs stock,stock+offload,layer+norm_attn_mlp+head+offload,layer+attn+lean+chunked4+head+offload,layer+lean+chunked4+head+offload,norm_attn_mlp+empty_cache
keep len12k
python3 launch/bench_memory.py --mode emulate --seq-tokens 12288 --steps 2 --timeout 90 --snapshot --out /tmp/snap12k \
    --configs layer+attn+lean+chunked4+head+offload
keep snap12k
