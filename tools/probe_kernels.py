"""GPU probe of the two kernels that hold the peak once activations are lean, at the 12B model's sizes.

1. TRL's fused LM-head backward vs the lean one (longdpo/levers/lean_lm_head.py): peak memory the backward adds on
   top of its inputs, its time, and how far the lean gradients are from TRL's.
2. Causal SDPA forward + backward with grouped-query attention (32 query / 8 key-value heads, head_dim 128), as
   transformers calls it (enable_gqa, no mask), per SDPA backend: peak above the inputs and time.
3. One MLP (Liger's SwiGLU when liger-kernel is installed, else transformers' Mistral MLP) on a chosen/rejected pair:
   the forward alone, then in chunks each in its own checkpoint, split along the sequence or along the flattened
   tokens (as `memory.mlp_chunks` runs it), and those chunks' recompute + backward.
4. Shared-prompt attention (longdpo/levers/shared_prompt.py) on a long-prompt pair (prompt 90%, rejected 10% shorter
   than chosen): TRL's two rows with `is_causal` against the one shared row's two calls, forward + backward time,
   and how far the completions' outputs are from the two rows' (bf16).
5. The rejected part's call of shared-prompt attention, several ways (`rejected_call`): as one lower-right causal call
   (with and without repeated key/value heads; on a materialised mask), and as the lever's two blocks merged by
   log-sum-exp (with and without repeated heads): forward + backward time and the largest difference of the output
   and gradients from the one lower-right call. (At commit 104a853 it also ran the two blocks on flash: 38.97 ms.)
    python tools/probe_kernels.py --tokens 24576 --attn-seq 65536 --mlp-seq 12288 --out probe.json
    python tools/probe_kernels.py --tokens 4096 --shared-seq 65536 --rejected-seq 65536 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


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
    return {
        "backward_s": round(time.perf_counter() - t0, 3),
        "backward_peak_above_inputs_gb": round((torch.cuda.max_memory_allocated() - base) / 1e9, 3),
        "grads": (h.grad, w.grad),
    }


def attention(seq: int, batch: int = 2, heads: int = 32, kv_heads: int = 8, dim: int = 128) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    q = torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.randn(batch, kv_heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2)
    )
    rows = {}
    for name in ("default", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        backends = (
            [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
            if name == "default"
            else [getattr(SDPBackend, name)]
        )
        try:
            for _ in range(2):  # the second is measured
                q.grad = k.grad = v.grad = None
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                with sdpa_kernel(backends):
                    out = sdpa(q, k, v, is_causal=True, enable_gqa=True)
                out.backward(torch.ones_like(out))
                torch.cuda.synchronize()
                rows[name] = {
                    "fwd_bwd_s": round(time.perf_counter() - t0, 3),
                    "peak_above_inputs_gb": round((torch.cuda.max_memory_allocated() - base) / 1e9, 3),
                }
                del out
        except (RuntimeError, NotImplementedError) as e:  # this backend cannot run these shapes
            rows[name] = {"error": str(e).splitlines()[0][:200]}
    return {"seq": seq, "batch": batch, "heads": heads, "kv_heads": kv_heads, "head_dim": dim, **rows}


def shared_attention(seq: int, heads: int = 32, kv_heads: int = 8, dim: int = 128) -> dict:
    from types import SimpleNamespace

    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from longdpo.levers.shared_prompt import shared_attention

    p = round(0.9 * seq)
    c = seq - p
    r = round(0.9 * c)
    x = 1
    torch.manual_seed(0)

    def qkv(n, h):
        return torch.randn(1, h, n, dim, device="cuda", dtype=torch.bfloat16)

    prompt = [qkv(p, heads), qkv(p, kv_heads), qkv(p, kv_heads)]
    chosen = [qkv(c, heads), qkv(c, kv_heads), qkv(c, kv_heads)]
    rejected = [qkv(r, heads), qkv(r, kv_heads), qkv(r, kv_heads)]
    # the two rows: [P, C] and [P, R] padded to P + C
    rows = [
        torch.cat([torch.cat([a, b], 2), torch.cat([a, d, torch.zeros_like(b[:, :, : c - r])], 2)]).requires_grad_()
        for a, b, d in zip(prompt, chosen, rejected)
    ]
    # the shared row: [P, C, x, R], x = the prompt's last token
    shared = [torch.cat([a, b, a[:, :, -1:], d], 2).requires_grad_() for a, b, d in zip(prompt, chosen, rejected)]
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=True)

    def two_rows():
        out = sdpa(*rows, is_causal=True, enable_gqa=True)
        out.backward(torch.ones_like(out))
        return out

    def one_row():
        out, _ = shared_attention(module, *shared, None, row_layout=[(p, c, r, x)])
        out.backward(torch.ones_like(out))
        return out

    result = {"seq": seq, "prompt": p, "chosen": c, "rejected": r}
    result["two_rows_fwd_bwd_ms"] = _cuda_ms(two_rows)
    result["shared_fwd_bwd_ms"] = _cuda_ms(one_row)
    with torch.no_grad():
        a = sdpa(*rows, is_causal=True, enable_gqa=True).transpose(1, 2)
        b, _ = shared_attention(module, *shared, None, row_layout=[(p, c, r, x)])
    result["max_abs_diff_chosen"] = (a[0, : p + c] - b[0, : p + c]).float().abs().max().item()
    result["max_abs_diff_rejected"] = (a[1, p - 1 : p + r] - b[0, p + c : p + c + x + r]).float().abs().max().item()
    result["finite"] = bool(torch.isfinite(b).all())
    return result


def rejected_call(variant: str, q, k, v, p: int, groups: int, scale: float):
    """The rejected part's attention: queries q = [x, R], keys/values k, v = the whole row [P, C, x, R] (the chosen
    part's keys are skipped); p: the prompt's length. Returns (B, H, len(q), D)."""
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    from transformers.integrations.sdpa_attention import repeat_kv

    from longdpo.levers.shared_prompt import PromptAndTail, lower_right_call

    n = q.shape[2]
    k_p, v_p, k_t, v_t = k[:, :, : p - 1], v[:, :, : p - 1], k[:, :, -n:], v[:, :, -n:]
    if variant == "split_cudnn_gqa":  # the lever's two blocks, key/value heads handed over as they are
        return PromptAndTail.apply(q, k_t, v_t, k_p, v_p, scale)
    if variant == "split_cudnn":  # the same with key/value heads repeated per group first
        return PromptAndTail.apply(q, *(repeat_kv(t, groups) for t in (k_t, v_t, k_p, v_p)), scale)
    if variant == "lower_right":  # the one call (the lever runs it where the two blocks' kernels are missing)
        return lower_right_call(q, k_t, v_t, k_p, v_p, groups, scale)
    keys, values = torch.cat([k_p, k_t], 2), torch.cat([v_p, v_t], 2)
    if variant == "lower_right_gqa":
        return sdpa(q, keys, values, attn_mask=causal_lower_right(n, keys.shape[2]), scale=scale, enable_gqa=True)
    if variant == "dense_mask_cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        mask = causal_lower_right(n, keys.shape[2])._materialize(q.device)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return sdpa(q, repeat_kv(keys, groups), repeat_kv(values, groups), attn_mask=mask, scale=scale)
    raise ValueError(variant)


REJECTED_VARIANTS = ("lower_right", "lower_right_gqa", "dense_mask_cudnn", "split_cudnn", "split_cudnn_gqa")


def rejected_kernels(seq: int, heads: int = 32, kv_heads: int = 8, dim: int = 128) -> dict:
    """Step 5: the rejected part's call of shared-prompt attention (prompt 90%, chosen and rejected 5% each), each
    variant's forward + backward time and its output and gradients' largest difference from "lower_right" (the one
    call), and the chosen part's causal call per backend for scale."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    p = round(0.9 * seq)
    c = r = (seq - p) // 2
    n = 1 + r
    torch.manual_seed(0)
    k, v = (torch.randn(1, kv_heads, p + c + n, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(1, heads, n, dim, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(1, heads, n, dim, device="cuda", dtype=torch.bfloat16)
    scale = dim**-0.5
    result = {"seq": seq, "prompt": p, "chosen": c, "rejected": r, "queries": n, "keys": p - 1 + n}

    def run(variant):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = rejected_call(variant, *leaves, p, heads // kv_heads, scale)
        out.backward(dout)
        return out, [t.grad for t in leaves]

    reference = run("lower_right")
    for variant in REJECTED_VARIANTS:
        try:
            out, grads = run(variant)
            row = {"fwd_bwd_ms": _cuda_ms(lambda variant=variant: run(variant))}
            for name, a, b in zip(("out", "dq", "dk", "dv"), [reference[0], *reference[1]], [out, *grads]):
                row[f"max_abs_diff_{name}"] = (a.float() - b.float()).abs().max().item()
                row[f"max_abs_{name}"] = a.float().abs().max().item()
        except (RuntimeError, NotImplementedError, TypeError) as e:
            row = {"error": str(e).splitlines()[0][:300]}
        result[variant] = row
        torch.cuda.empty_cache()
    qc = torch.randn(1, heads, p + c, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kc, vc = (t[:, :, : p + c].clone().requires_grad_() for t in (k, v))
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):

        def chosen(name=name):
            with sdpa_kernel([getattr(SDPBackend, name)]):
                sdpa(qc, kc, vc, is_causal=True, enable_gqa=True).sum().backward()

        try:
            result[f"chosen_call_{name}_fwd_bwd_ms"] = _cuda_ms(chosen)
        except RuntimeError as e:
            result[f"chosen_call_{name}"] = str(e).splitlines()[0][:300]
    return result


def _cuda_ms(fn, repeat: int = 3) -> float:
    """Median wall time of fn() on the GPU, in ms, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return round(sorted(times)[len(times) // 2], 2)


def mlp(seq: int, chunks: int = 3, batch: int = 2, hidden: int = 5120, ffn: int = 14336) -> dict:
    from torch.utils.checkpoint import checkpoint
    from transformers import MistralConfig

    config = MistralConfig(hidden_size=hidden, intermediate_size=ffn)
    try:
        from liger_kernel.transformers import LigerSwiGLUMLP as MLP
    except ImportError:
        from transformers.models.mistral.modeling_mistral import MistralMLP as MLP
    module = MLP(config).to("cuda", torch.bfloat16)
    x = torch.randn(batch, seq, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def split(how):
        if how == "sequence":
            return list(x.chunk(chunks, dim=-2)), lambda parts: torch.cat(parts, dim=-2)
        flat = x.reshape(-1, hidden)
        return list(flat.chunk(chunks)), lambda parts: torch.cat(parts).view(batch, seq, -1)

    def chunked(how):
        parts, join = split(how)
        return join([checkpoint(module, p, use_reentrant=False) for p in parts])

    def backward(how):
        x.grad = None
        module.zero_grad(set_to_none=True)
        chunked(how).sum().backward()

    rows = {"mlp": MLP.__module__ + "." + MLP.__name__, "seq": seq, "batch": batch, "chunks": chunks}
    with torch.no_grad():
        rows["forward_no_grad_ms"] = _cuda_ms(lambda: module(x))
    rows["forward_ms"] = _cuda_ms(lambda: module(x))
    for how in ("sequence", "flat"):
        rows[f"chunked_forward_{how}_ms"] = _cuda_ms(lambda how=how: chunked(how))
        rows[f"chunked_forward_backward_{how}_ms"] = _cuda_ms(lambda how=how: backward(how))
    rows["forward_backward_ms"] = _cuda_ms(lambda: module(x).sum().backward())
    return rows


def main(argv=None):
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    from longdpo.levers.lean_lm_head import LeanLMHeadLogProb

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=24576)
    p.add_argument("--vocab", type=int, default=131072)
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--attn-seq", type=int, default=None, help="also probe attention at this sequence length")
    p.add_argument("--mlp-seq", type=int, default=None, help="also probe one MLP at this sequence length (a pair)")
    p.add_argument("--mlp-chunks", dest="chunks", type=int, default=3)
    p.add_argument("--shared-seq", type=int, default=None, help="probe shared-prompt attention at these tokens")
    p.add_argument("--rejected-seq", type=int, default=None, help="probe the rejected part's attention call's kernels")
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
    out = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "tokens": args.tokens,
        "vocab": args.vocab,
        "hidden": args.hidden,
        **rows,
        "max_abs_diff_grad_hidden": (h1.float() - h0.float()).abs().max().item(),
        "max_abs_grad_hidden": h0.float().abs().max().item(),
        "max_abs_diff_grad_weight": (w1.float() - w0.float()).abs().max().item(),
        "max_abs_grad_weight": w0.float().abs().max().item(),
    }
    del hidden, weight, h0, w0, h1, w1
    torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    if args.attn_seq:
        out["attention"] = attention(args.attn_seq)
    if args.mlp_seq:
        torch.cuda.empty_cache()
        out["mlp"] = mlp(args.mlp_seq, args.chunks)
    if args.shared_seq:
        torch.cuda.empty_cache()
        out["shared_attention"] = shared_attention(args.shared_seq)
    if args.rejected_seq:
        torch.cuda.empty_cache()
        out["rejected_kernels"] = rejected_kernels(args.rejected_seq)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
