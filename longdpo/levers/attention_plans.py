"""Attention plans built once per length class instead of once per length (`memory.reuse_attention_plans`).

On Hopper and newer GPUs PyTorch runs causal `scaled_dot_product_attention` on cuDNN, whose execution plans are
built for one exact shape: the first forward at a new sequence length builds a plan, its first backward another, and
the plans cost tens to hundreds of milliseconds each on the host while the GPU waits. A dataset of many lengths meets
a new length at nearly every step, and a step of the shared prompt runs three attention shapes. With this lever on,
torch keys the plans on the lengths rounded up to a power of two and passes the real lengths when the kernel runs
(its `TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`, read once per process at the first attention call; this lever sets it before
the models run). It applies to attention calls without a mask tensor whose queries, keys, values and output are laid
out (batch, sequence, heads, dim) in memory, as a model's projections make them: the calls of the shared prompt and of
TRL's batch without its padding mask; a call with TRL's mask keeps a plan per length. The kernels are cuDNN's either
way; outputs and gradients agree to bf16 rounding (tools/sdpa_shape_probe.py).

The planner prices it as nothing: it changes no activation the step holds. cuDNN sizes a plan's scratch memory for the
class's length, up to twice the call's own; not yet measured in a training step.
"""

from __future__ import annotations

import logging
import os

from longdpo.levers import Key, Lever

logger = logging.getLogger(__name__)
ENV_VAR = "TORCH_CUDNN_SDPA_AVOID_RECOMPILE"


def reused(environ=os.environ) -> bool:
    """Whether this process's attention plans are kept per length class: torch reads "1" as on, "0" or nothing as off
    (and warns of any other value)."""
    return environ.get(ENV_VAR) == "1"


class AttentionPlans(Lever):
    name = "attention_plans"
    order = 95
    tokens = ("plans",)
    flag = ("reuse_attention_plans", True, "plans")
    keys = (
        Key(
            "reuse_attention_plans",
            bool,
            False,
            "cuDNN attention plans built once per power-of-two length class, not once per sequence length (PyTorch's "
            f"{ENV_VAR}=1): on data of many lengths, saves the plan builds a new length costs at nearly every step.",
        ),
    )

    def configure(self, s, build):
        if s.reuse_attention_plans:
            os.environ[ENV_VAR] = "1"
        elif reused() and build.is_main:
            logger.info("%s is set in the environment: attention plans are kept per length class", ENV_VAR)

    def summary(self, s, build):
        return {"attention_plans_per_length_class": reused()}

    def price(self, s, setup, terms, cal):
        pass  # module docstring


LEVER = AttentionPlans()
