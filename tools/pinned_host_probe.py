"""GPU check: how long does pinning host memory for activation offloading take, and what shortens it?

torch's pinned caching allocator makes a new block for every request it cannot serve from a cached block of the same
power-of-two class, so a step whose pair is the first of a larger size class pins all of its offloaded activations
afresh. This times that step's allocations (BLOCKS blocks of MB megabytes, as a 60k-token pair of a 5,120-wide model
offloads under layer checkpointing), then the same again from the cache, in a fresh process for each
PYTORCH_CUDA_ALLOC_CONF setting, and a device-to-host copy into each block.

    python tools/pinned_host_probe.py [--blocks 42] [--mb 620] > pinned_probe.json
"""

import argparse
import json
import os
import subprocess
import sys

from longdpo.levers.allocator import ENV_VARS, host_pinning

CONFS = {"default": "", "host_register_8_threads": host_pinning(8), "host_register_16_threads": host_pinning(16)}

CHILD = """
import json, sys, time, torch
blocks, nbytes = int(sys.argv[1]), int(sys.argv[2])
src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
def round_():
    t0 = time.perf_counter()
    held = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(blocks)]
    t1 = time.perf_counter()
    for h in held:
        h.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return held, t1 - t0, t2 - t1
held, alloc_s, copy_s = round_()
del held
_, cached_alloc_s, cached_copy_s = round_()
gb = blocks * nbytes / 1e9
print(json.dumps({
    "pinned_gb": round(gb, 2), "first_alloc_s": round(alloc_s, 3), "first_alloc_gb_per_s": round(gb / alloc_s, 2),
    "copy_s": round(copy_s, 3), "copy_gb_per_s": round(gb / copy_s, 2),
    "cached_alloc_s": round(cached_alloc_s, 4), "cached_copy_s": round(cached_copy_s, 3),
}))
"""


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=42)
    p.add_argument("--mb", type=int, default=620)
    args = p.parse_args()
    out = {"blocks": args.blocks, "mb": args.mb}
    for name, conf in CONFS.items():
        env = {**os.environ, **dict.fromkeys(ENV_VARS, conf)}
        cmd = [sys.executable, "-c", CHILD, str(args.blocks), str(args.mb * 10**6)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        out[name] = {"conf": conf, **(json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr[-500:]})}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
