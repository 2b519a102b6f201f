"""A lean RMSNorm (`memory.lean_norm`): the same numbers as Mistral/Llama/Qwen2's RMSNorm, a fraction of the memory.

The stock norm upcasts its input to fp32 and leaves autograd to differentiate five elementwise ops. At 64k tokens
per sequence a pair's hidden state is 2 x 65536 x 5120, so every fp32 copy is 2.7 GB: the snapshot of the best
nested configuration (results/gpu_2026-12-02_s2_32k_64k) found 5 such frameless fp32 blocks (13.4 GB) alive in one
norm's backward, plus the 2.7 GB fp32 cast and 1.3 GB normalised copy the recompute saves.

Here forward and backward run over token chunks, so fp32 exists one chunk (CHUNK_TOKENS rows) at a time, and only
the input (which the layer checkpoint keeps anyway) and one fp32 scale per token are saved. Forward runs the stock
module's ops and casts, per row; backward is the closed form
    dx = r * (g - x_hat * mean(g * x_hat)),  g = dy * w (upcast),  r = rsqrt(mean(x^2) + eps),
    dw = sum over tokens of dy * bf16(x_hat), accumulated in fp32.
"""

from __future__ import annotations

import torch

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
