"""GPU check of NeMo-RL PR #926's finding and our fix: does PYTORCH_CUDA_ALLOC_CONF take effect when set (a) after
`import torch` but before CUDA initialises, (b) after CUDA initialises, (c) through the runtime call?
Each case runs in a fresh process; torch.cuda.memory_stats()['max_split_size'] is read back.

    python tools/gpu_allocator_probe.py > allocator_probe.json
"""

import json
import subprocess
import sys

SET_ENV = "os.environ['PYTORCH_CUDA_ALLOC_CONF'] = os.environ['PYTORCH_ALLOC_CONF'] = 'max_split_size_mb:64'"
INIT = "torch.zeros(1, device='cuda')"
CASES = {
    "env_after_import_before_init": f"import os, torch; {SET_ENV}; {INIT}",
    "env_after_cuda_init": f"import os, torch; {INIT}; {SET_ENV}; {INIT}",
    "runtime_call_after_init": f"import torch; {INIT}; "
    f"torch.cuda.memory._set_allocator_settings('max_split_size_mb:64'); {INIT}",
    "recipes_allocator_apply_after_init": f"import sys, torch; {INIT}; from longdpo.levers import allocator; "
    "r = allocator.apply('max_split_size_mb:64'); print(r['path'], file=sys.stderr)",
}
out = {}
for name, code in CASES.items():
    code += "; import torch; print(torch.cuda.memory_stats().get('max_split_size'))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    out[name] = {"max_split_size": p.stdout.strip(), "expected": 64 * 1024 * 1024, "stderr": p.stderr[-300:]}
print(json.dumps(out, indent=1))
