"""GPU check: what does a new sequence length cost causal attention, and does torch's cuDNN ragged mode remove it?

On Hopper torch runs `scaled_dot_product_attention(..., is_causal=True)` on cuDNN, whose plans are built for one exact
shape: the first call at a new length builds a forward plan, the first backward a backward plan. A dataset of mixed
lengths meets a new length at nearly every step. With TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 torch keys plans on the
lengths rounded up to a power of two and passes the real lengths at run time, when q, k, v and the output are laid
out (batch, sequence, heads, dim) in memory and there is no mask tensor.

For each setting (a fresh process each: torch reads the variable once), this times forward + backward of one
attention call of the 12B Mistral-NeMo shape (32 query heads, 8 key/value heads, head dim 128, bf16, causal, GQA by
`enable_gqa`) at LENGTHS new lengths in a row, then the same lengths again (plans cached), in two memory layouts:
`bshd` (as a model's projections produce it) and `bhsd` (contiguous per head, as a concatenation along the sequence of
(batch, heads, sequence, dim) tensors makes it). Also checks the outputs and gradients of both settings agree.

    python tools/sdpa_shape_probe.py [--lengths 12] [--min 3000] [--max 30000] > sdpa_probe.json
"""

import argparse
import json
import os
import subprocess
import sys

from longdpo.levers.attention_plans import ENV_VAR

CHILD = """
import json, sys, time, torch
import torch.nn.functional as F
lengths = json.loads(sys.argv[1])
H, KV, D = 32, 8, 128
def make(n, layout):
    g = torch.Generator(device="cuda").manual_seed(n)
    def t(h):
        x = torch.randn(1, n, h, D, device="cuda", dtype=torch.bfloat16, generator=g)
        x = x.transpose(1, 2) if layout == "bshd" else x.transpose(1, 2).contiguous()
        return x.requires_grad_()
    return t(H), t(KV), t(KV)
def call(n, layout):
    q, k, v = make(n, layout)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    o.backward(torch.ones_like(o))
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    sums = [o.float().sum().item(), q.grad.float().abs().sum().item(), k.grad.float().abs().sum().item()]
    return elapsed, sums
out = {}
for layout in ("bshd", "bhsd"):
    call(1024, layout)  # libraries loaded, first plan built
    first = [call(n, layout) for n in lengths]
    again = [call(n, layout) for n in lengths]
    out[layout] = {"new_length_s": [round(t, 4) for t, _ in first], "cached_s": [round(t, 4) for t, _ in again],
                   "sums": [s for _, s in again]}
print(json.dumps(out))
"""


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, default=12)
    p.add_argument("--min", type=int, default=3000)
    p.add_argument("--max", type=int, default=30000)
    args = p.parse_args()
    step = (args.max - args.min) // max(args.lengths - 1, 1)
    lengths = [args.min + i * step + (i * 37) % 61 for i in range(args.lengths)]  # odd lengths, as data makes them
    out = {"lengths": lengths}
    for name, value in {"default": "0", "avoid_recompile": "1"}.items():  # torch reads "0" as off
        env = {**os.environ, ENV_VAR: value}
        r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(lengths)], capture_output=True, text=True, env=env)
        res = json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr[-1500:]}
        if r.returncode == 0:
            res["warnings"] = [line for line in r.stderr.splitlines() if ENV_VAR in line][:4]
            for d in (res["bshd"], res["bhsd"]):
                d["new_length_total_s"] = round(sum(d["new_length_s"]), 3)
                d["cached_total_s"] = round(sum(d["cached_s"]), 3)
        out[name] = res
    for layout in ("bshd", "bhsd"):
        a, b = out["default"].get(layout), out["avoid_recompile"].get(layout)
        if a and b:
            out[f"{layout}_max_relative_difference"] = max(
                abs(x - y) / max(abs(x), 1e-9) for sa, sb in zip(a["sums"], b["sums"]) for x, y in zip(sa, sb)
            )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
