"""A lean RMSNorm (`memory.lean_norm`): the same numbers as Mistral/Llama/Qwen2's RMSNorm, a fraction of the memory.

The stock norm upcasts its input to fp32 and leaves autograd to differentiate five elementwise ops. At 64k tokens
per sequence a pair's hidden state is 2 x 65536 x 5120, so every fp32 copy is 2.7 GB, and a memory snapshot of one
norm's backward held five of them besides the fp32 cast and the normalised copy the recompute saves
(docs/BENCHMARKS.md).

Here forward and backward run over token chunks, so fp32 exists one chunk (CHUNK_TOKENS rows) at a time, and only
the input (which the layer checkpoint keeps anyway) and one fp32 scale per token are saved. Forward runs the stock
module's ops and casts, per row; backward is the closed form
    dx = r * (g - x_hat * mean(g * x_hat)),  g = dy * w (upcast),  r = rsqrt(mean(x^2) + eps),
    dw = sum over tokens of dy * bf16(x_hat), accumulated in fp32.

It applies after Liger's kernels (longdpo/levers/liger.py) and replaces the forward of every norm, Liger's too, in
the policy and the reference alike: its forward gives the stock norm's numbers, so the reference stays an exact copy
of the policy (step-1 loss ln 2) whatever kernels Liger brought, and a recipe with both runs Liger's RoPE and SwiGLU
with these norms.
"""

from __future__ import annotations

import torch

from longdpo.levers import Key, Lever
from longdpo.model.families import decoder_modules, rms_norms

CHUNK_TOKENS = 4096


class LeanRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float):
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty_like(rows, dtype=torch.result_type(weight, rows))
        rstd = torch.empty(rows.shape[0], 1, device=x.device, dtype=torch.float32)
        for s in range(0, rows.shape[0], CHUNK_TOKENS):
            h = rows[s : s + CHUNK_TOKENS].to(torch.float32)
            r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
            rstd[s : s + CHUNK_TOKENS] = r
            out[s : s + CHUNK_TOKENS] = weight * (h * r).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        rows, grads = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, x.shape[-1])
        grad_x = torch.empty_like(rows) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
        for s in range(0, rows.shape[0], CHUNK_TOKENS):
            r = rstd[s : s + CHUNK_TOKENS]
            x_hat = rows[s : s + CHUNK_TOKENS].to(torch.float32) * r
            dy = grads[s : s + CHUNK_TOKENS]
            grad_w += (dy * x_hat.to(x.dtype)).sum(0, dtype=torch.float32)
            if grad_x is not None:
                g = (dy * weight).to(torch.float32)
                grad_x[s : s + CHUNK_TOKENS] = (r * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))).to(x.dtype)
        grad_x = grad_x.view_as(x) if grad_x is not None else None
        return grad_x, grad_w.to(weight.dtype) if ctx.needs_input_grad[1] else None, None


def make_lean(norm: torch.nn.Module) -> None:
    """Replace an RMSNorm module's forward (weight and variance_epsilon stay where they are: state dicts unchanged)."""
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None or not isinstance(getattr(norm, "weight", None), torch.nn.Parameter):
        raise TypeError(f"{type(norm).__name__} is not a Mistral/Llama/Qwen2-style RMSNorm")

    def lean_forward(hidden_states):
        return LeanRMSNormFunction.apply(hidden_states, norm.weight, eps)

    norm.forward = lean_forward


def make_model_lean(model: torch.nn.Module) -> int:
    """Every RMSNorm of the decoder (the final norm too) made lean; returns how many."""
    layers, final_norm = decoder_modules(model)
    norms = [final_norm, *(n for layer in layers for n in rms_norms(layer))]
    for norm in norms:
        make_lean(norm)
    return len(norms)


class LeanNorm(Lever):
    name = "lean_norm"
    order = 30
    tokens = ("lean",)
    flag = ("lean_norm", True, "lean")
    keys = (
        Key(
            "lean_norm",
            bool,
            False,
            "RMSNorms computed over token chunks with a closed-form backward, saving only their input and one fp32 "
            "scale per token: no fp32 copies of the hidden state (for machines without Liger's Triton kernels).",
            priced=True,
        ),
    )

    def patches_decoder(self, s):
        return s.lean_norm

    def replace_kernels(self, s, models, build):
        counts = [make_model_lean(model) for model in models if model is not None and s.lean_norm]
        build.wrapped["lean_norm"] = counts[0] if counts else 0

    def price(self, s, setup, terms, cal):
        pass  # in the coefficients fitted per lever set (its token in the priced name)


LEVER = LeanNorm()
