#!/usr/bin/env bash
# One H200: 64k snapshot of stock+offload vs the chunked best, then 32k.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site .whl/deepspeed-*.tar.gz || exit 1
export PYTHONPATH=/tmp/site:$PYTHONPATH PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv; free -g | head -2
timeout 400 python3 launch/bench_memory.py --mode emulate --snapshot --seq-tokens 65536 --steps 2 \
    --configs stock+offload,layer+norm_attn+chunked8+offload --timeout 240 --out /tmp/len64k
timeout 165 python3 launch/bench_memory.py --mode emulate --seq-tokens 32768 --steps 2 \
    --configs stock+offload,layer+norm_attn+chunked8+offload --timeout 110 --out /tmp/len32k
for d in len64k len32k; do mkdir -p $OUT/$d; cp /tmp/$d/results.json /tmp/$d/results.md /tmp/$d/bench.log /tmp/$d/memory_vs_length.png $OUT/$d/ 2>/dev/null; done
