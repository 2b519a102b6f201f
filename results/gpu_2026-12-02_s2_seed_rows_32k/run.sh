#!/usr/bin/env bash
# One H200: NeMo-RL PR #926's rows at 12,288 and ours at 32k.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site .whl/deepspeed-*.tar.gz || exit 1
export PYTHONPATH=/tmp/site:$PYTHONPATH PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
timeout 150 python3 launch/bench_memory.py --mode emulate --seq-tokens 32768 --steps 2 \
    --configs layer+attn+lean+chunked8+offload --timeout 140 --out /tmp/len32k
timeout 120 python3 launch/bench_memory.py --mode emulate --seq-tokens 12288 --steps 2 \
    --configs attn_mlp,norm_attn_mlp+alloc64 --timeout 58 --out /tmp/seed12k
for d in len32k seed12k; do mkdir -p $OUT/$d; cp /tmp/$d/results.json /tmp/$d/results.md /tmp/$d/bench.log $OUT/$d/ 2>/dev/null; done
