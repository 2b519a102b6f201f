#!/usr/bin/env bash
# The GPU acceptance suite (tests/gpu) in one command, on a machine with one GPU of 140+ GB (an H200) and no network
# access needed: the pinned packages come from a local wheelhouse in ./.whl when they are not installed
# (tools/offline_env.sh). Writes the full output, GPU name and commit first, to the log (default
# results/gpu_acceptance/latest.log; commit it). About 7 minutes on an H200. On an 80 GB H100 the 1-layer 12B runs
# (about 46 GB each) go one at a time, about 40 s each (35 s of it start-up), so run the suite there in three parts,
# one command each: GPU_ACCEPTANCE_PART=1/3, 2/3, 3/3 (13 runs each with stock, 8-9 minutes each on an H100; each run
# and the runs it is compared with in one part), or a named subset with GPU_ACCEPTANCE_ONLY=word,word (the runs whose
# names contain one of the words, and stock).
#   bash tools/gpu_acceptance.sh [LOG]
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-results/gpu_acceptance/latest.log}
mkdir -p "$(dirname "$LOG")"
python3 -c "import trl, deepspeed, longdpo" 2>/dev/null || source tools/offline_env.sh
# the shipped recipes run Liger's kernels: without the package half the runs would refuse to start, minutes in
if ! python3 -c "import liger_kernel" 2>/dev/null; then
    echo "error: liger-kernel is not installed: pip install -r requirements-gpu.txt (offline: put its wheel in .whl)" >&2
    exit 1
fi
{
    echo "GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
    echo "commit: ${GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    python3 -c "import torch, transformers, trl, deepspeed, accelerate, peft, datasets as d; print('torch', torch.__version__,
'transformers', transformers.__version__, 'trl', trl.__version__, 'deepspeed', deepspeed.__version__,
'accelerate', accelerate.__version__, 'peft', peft.__version__, 'datasets', d.__version__)" 2>&1 | grep -v Warning
    echo "command: bash tools/gpu_acceptance.sh $*"
    [ -n "${GPU_ACCEPTANCE_ONLY:-}" ] && echo "SUBSET of the suite: GPU_ACCEPTANCE_ONLY=$GPU_ACCEPTANCE_ONLY (runs whose names contain these, and stock)"
    [ -n "${GPU_ACCEPTANCE_PART:-}" ] && echo "PART of the suite: GPU_ACCEPTANCE_PART=$GPU_ACCEPTANCE_PART"
} > "$LOG"
export GPU_ACCEPTANCE_OUT=${GPU_ACCEPTANCE_OUT:-/tmp/gpu_acceptance}
python3 -m pytest tests/gpu -m gpu -vv -s -rfE 2>&1 | tee -a "$LOG"
