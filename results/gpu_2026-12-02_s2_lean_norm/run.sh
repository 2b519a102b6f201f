#!/usr/bin/env bash
# One H200: lean norms at 12k / 32k / 64k.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site .whl/deepspeed-*.tar.gz || exit 1
export PYTHONPATH=/tmp/site:$PYTHONPATH PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 100 python3 launch/bench_memory.py --mode emulate --seq-tokens 12288 --steps 2 \
    --configs stock+offload,layer+attn+lean+chunked4+offload --timeout 80 --out /tmp/len12k
timeout 100 python3 launch/bench_memory.py --mode emulate --seq-tokens 32768 --steps 2 \
    --configs layer+attn+lean+chunked8+offload --timeout 95 --out /tmp/len32k
timeout 380 python3 launch/bench_memory.py --mode emulate --snapshot --seq-tokens 65536 --steps 2 \
    --configs layer+attn+lean+chunked8+offload,layer+lean+chunked8+offload --timeout 230 --out /tmp/len64k
for d in len12k len32k len64k; do mkdir -p $OUT/$d; cp /tmp/$d/results.json /tmp/$d/results.md /tmp/$d/bench.log $OUT/$d/ 2>/dev/null; done
