"""Liger's Triton kernels (`use_liger_kernel: true`) composed with our levers, not instead of them.

transformers applies Liger when training starts (`Trainer.train` -> `apply_liger_kernel`), after our patches, and
Liger rebinds each RMSNorm's and MLP's `forward` on the instance (liger-kernel 0.8.5 `_bind_method_to_module`). So a
recipe with `use_liger_kernel: true` silently lost the lean norms and the MLP chunks (seen reading transformers
5.24's trainer.py and Liger's monkey_patch.py). Here Liger is applied by the entrypoint, to the policy and the
reference, before our patches, so that our chunk checkpoints wrap Liger's SwiGLU, and the Trainer is told not to
apply it again. Per kernel:

  RoPE         Liger's (a module-level function of the model family: every model of the process)
  RMSNorm      Liger's, unless `memory.lean_norm` (ours then: chunked fp32, nothing but the input saved)
  SwiGLU MLP   Liger's; `memory.mlp_chunks` / `memory.tiled_mlp` still split it over the sequence
  LM head      TRL's fused head (ours with `memory.lean_lm_head`); Liger's fused linear cross-entropy stays off, as
               TRL's DPOTrainer requires

Liger's kernels are Triton: GPU only (requirements-gpu.txt). Our pure-PyTorch levers are the path without Triton.
"""

from __future__ import annotations

import importlib.util

from longdpo.config import RecipeError

PIN = "liger-kernel==0.8.5"


def check(trainer: dict, cuda_available: bool) -> None:
    """Start-up checks for `use_liger_kernel` (no model loaded yet)."""
    if not trainer.get("use_liger_kernel"):
        return
    if not cuda_available:
        raise RecipeError(
            "`use_liger_kernel: true` needs a CUDA GPU (Liger's kernels are Triton); on a CPU-only "
            "machine set `use_liger_kernel: false`."
        )
    if importlib.util.find_spec("liger_kernel") is None:
        raise RecipeError(
            f"`use_liger_kernel: true` needs the liger-kernel package: `pip install -r requirements-gpu.txt` ({PIN})."
        )
    if (trainer.get("liger_kernel_config") or {}).get("fused_linear_cross_entropy"):
        raise RecipeError(
            "`liger_kernel_config: {fused_linear_cross_entropy: true}` would replace the fused LM head "
            "that DPO computes its log-probabilities with; remove it (`memory.lean_lm_head` is the "
            "lean head)."
        )


def take(trainer: dict) -> dict | None:
    """Remove Liger from the Trainer's arguments (it is applied here instead); returns its kernel config, or None."""
    if not trainer.pop("use_liger_kernel", False):
        trainer.pop("liger_kernel_config", None)
        return None
    config = dict(trainer.pop("liger_kernel_config", None) or {})
    return {**config, "fused_linear_cross_entropy": False, "cross_entropy": False}


def apply(models, config: dict, lean_norm: bool) -> dict:
    """Apply Liger's kernels to each model (before `apply_memory_patches`); returns the kernel config used."""
    from transformers.integrations.liger import apply_liger_kernel

    config = {**config, **({"rms_norm": False} if lean_norm else {})}
    for model in models:
        if model is not None:
            apply_liger_kernel(model, config)
    return config
