"""Per-rank emulation on one GPU: SGD applied inside backward, each gradient freed at once.

One GPU cannot hold a 12B model's AdamW state. What one rank of an 8-GPU ZeRO-3 run carries on top of its
model-state shard is its activations plus transient gathered weights; full gradients never persist there
(reduce-scatter leaves each rank 1/8). Applying the update in each parameter's post-accumulate-grad hook and
dropping the gradient reproduces that: the peak above the weights is the activation footprint of a rank.
Single process only (no DeepSpeed), gradient_accumulation_steps 1, no clipping (no gradient survives to clip).
"""

from __future__ import annotations

import torch


def sgd_in_backward(model: torch.nn.Module, lr: float) -> int:
    """Register the hooks; returns how many parameters got one."""

    @torch.no_grad()
    def step_and_free(param: torch.Tensor) -> None:
        param.add_(param.grad, alpha=-lr)
        param.grad = None

    n = 0
    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(step_and_free)
            n += 1
    return n


def local_parameters(*models):
    """The parameter tensors this rank holds: its ZeRO-3 shard (`ds_tensor`) when partitioned, else the parameter."""
    for model in models:
        if model is not None:
            for p in model.parameters():
                yield getattr(p, "ds_tensor", p)


def parameter_bytes(*models) -> int:
    return sum(t.numel() * t.element_size() for t in local_parameters(*models))
