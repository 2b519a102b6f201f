"""Liger's Triton kernels (`use_liger_kernel: true`) composed with our levers, not instead of them.

transformers applies Liger when training starts (`Trainer.train` -> `apply_liger_kernel`), after our patches, and
Liger rebinds each RMSNorm's and MLP's `forward` on the instance (liger-kernel 0.8.5 `_bind_method_to_module`). So a
recipe with `use_liger_kernel: true` silently lost the lean norms and the MLP chunks (seen reading transformers
5.24's trainer.py and Liger's monkey_patch.py). Here Liger is applied to the policy and the reference before any other
lever, so that our chunk checkpoints wrap Liger's SwiGLU and the lean norm replaces Liger's RMSNorm, and the Trainer
is told not to apply it again. Per kernel:

  RoPE         Liger's (a module-level function of the model family: every model of the process)
  RMSNorm      Liger's, unless `memory.lean_norm` (then the lean norm, applied after this)
  SwiGLU MLP   Liger's; `memory.mlp_chunks` / `memory.tiled_mlp` still split it over the tokens
  LM head      TRL's fused head (ours with `memory.lean_lm_head`); Liger's fused linear cross-entropy stays off, as
               TRL's DPOTrainer requires

Liger's kernels are Triton: GPU only (requirements-gpu.txt). Our pure-PyTorch levers are the path without Triton.
"""

from __future__ import annotations

import importlib.util

from longdpo.levers import Key, Lever
from longdpo.recipe_values import RecipeError

PIN = "liger-kernel==0.8.5"


class Liger(Lever):
    name = "liger"
    order = 20
    tokens = ("liger",)
    flag = ("use_liger_kernel", True, "liger")
    keys = (
        Key(
            "use_liger_kernel",
            bool,
            None,
            "TRL's switch for Liger's Triton RMSNorm / SwiGLU / RoPE kernels (GPU only: requirements-gpu.txt); "
            "applied before our levers so that they compose.",
            section="trainer",
            priced=True,
        ),
    )

    def check(self, s, ctx):
        if not s.use_liger_kernel:
            return
        if not ctx.cuda_available:
            raise RecipeError(
                "`use_liger_kernel: true` needs a CUDA GPU (Liger's kernels are Triton); on a CPU-only "
                "machine set `use_liger_kernel: false`."
            )
        if ctx.on_this_machine and importlib.util.find_spec("liger_kernel") is None:
            raise RecipeError(
                f"`use_liger_kernel: true` needs the liger-kernel package: `pip install -r requirements-gpu.txt` "
                f"({PIN})."
            )
        if (ctx.recipe.trainer.get("liger_kernel_config") or {}).get("fused_linear_cross_entropy"):
            raise RecipeError(
                "`liger_kernel_config: {fused_linear_cross_entropy: true}` would replace the fused LM head "
                "that DPO computes its log-probabilities with; remove it (TRL's fused head, or our lean one, "
                "stays)."
            )

    def configure(self, s, build):
        """Liger leaves the Trainer's arguments (it is applied to the models here instead)."""
        kwargs = build.trainer_kwargs
        kwargs.pop("use_liger_kernel", None)
        config = dict(kwargs.pop("liger_kernel_config", None) or {})
        build.state["liger"] = {**config, "fused_linear_cross_entropy": False, "cross_entropy": False}

    def replace_kernels(self, s, models, build):
        build.wrapped["liger"] = int(bool(s.use_liger_kernel))
        if not s.use_liger_kernel:
            return
        from transformers.integrations.liger import apply_liger_kernel  # imports Triton: only where Liger is on

        for model in models:
            if model is not None:
                apply_liger_kernel(model, build.state["liger"])

    def price(self, s, setup, terms, cal):
        # in the coefficients fitted per lever set; where a set with Liger was not measured, the same set without it
        # stands in: an upper bound, Liger's kernels keep less
        terms.upper_bound_without.append(("use_liger_kernel", "Liger's kernels (an upper bound: Liger keeps less)"))


LEVER = Liger()
