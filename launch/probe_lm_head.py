"""GPU probe: TRL's fused LM-head backward vs the lean one (recipes/lean_lm_head.py) at a real size.

Peak memory the backward adds on top of its inputs, its time, and how far the lean gradients are from TRL's.
    python launch/probe_lm_head.py --tokens 24576 --out probe_lm_head.json   # one 12k pair (chosen + rejected)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure(fn, hidden, weight, targets) -> dict:
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logprobs, entropy, *_ = fn.apply(h, w, None, targets, 1.0, 32768, None, 1.0, ("entropy",))
    loss = logprobs.sum() + 0.1 * entropy.sum()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    loss.backward()
    torch.cuda.synchronize()
    return {"backward_s": round(time.perf_counter() - t0, 3),
            "backward_peak_above_inputs_gb": round((torch.cuda.max_memory_allocated() - base) / 1e9, 3),
            "grads": (h.grad, w.grad)}


def main(argv=None):
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    from recipes.lean_lm_head import LeanLMHeadLogProb

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=24576)
    p.add_argument("--vocab", type=int, default=131072)
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(args.vocab, args.hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    targets = torch.randint(0, args.vocab, (args.tokens,), device="cuda")
    rows = {}
    for fn in (ChunkedLogProbFunction, LeanLMHeadLogProb, ChunkedLogProbFunction, LeanLMHeadLogProb):  # 2nd = warm
        rows[fn.__name__] = measure(fn, hidden, weight, targets)
    (h0, w0), (h1, w1) = rows["ChunkedLogProbFunction"].pop("grads"), rows["LeanLMHeadLogProb"].pop("grads")
    out = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "command": " ".join(sys.argv),
           "tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden, **rows,
           "max_abs_diff_grad_hidden": (h1.float() - h0.float()).abs().max().item(),
           "max_abs_grad_hidden": h0.float().abs().max().item(),
           "max_abs_diff_grad_weight": (w1.float() - w0.float()).abs().max().item(),
           "max_abs_grad_weight": w0.float().abs().max().item()}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
