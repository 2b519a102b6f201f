"""Selective activation checkpointing and sequence-tiled MLPs, applied by wrapping module *forwards*.

Parameter names, state dicts and saved checkpoints are untouched (only `module.forward` is replaced on the
instance), so a model trained with any policy reloads with plain `from_pretrained`. Applied to the policy only:
the reference model runs under no_grad and keeps nothing for backward.

Policies (`memory.checkpointing`):
  none            nothing checkpointed
  layer           transformers' own per-decoder-layer checkpointing (TRL's default; what a stock user gets)
  attn_mlp        attention and MLP each in a non-reentrant checkpoint, norms not (the seed's starting point)
  norm_attn       every RMSNorm (the final norm too) and attention (what the user named)
  norm_attn_mlp   every RMSNorm, attention and MLP (the seed's fix: its fp32 norms were 1/3 of activations)
  layer+<inner>   nested, done right: the decoder layer is checkpointed AND, while it is recomputed in backward,
                  each <inner> module is checkpointed again, so a layer's backward holds one module's
                  intermediates instead of the whole layer's.

Why "done right": a probe on one H200 (12B architecture, one pair, TRL 1.16) found that wrapping inner modules in
checkpoints *inside* transformers' layer checkpointing made memory worse (12k: 17.1 -> 25.7 GB; 64k + offload:
OOM instead of 38.8 GB). A non-reentrant checkpoint keeps its inputs referenced (in its recompute closure) from the
first forward until backward, so inner checkpoints created during the outer's first forward pin every norm /
attention / MLP input of every layer: exactly what the outer checkpoint was meant to drop. Here the inner modules
run plainly during the outer's first forward (the outer discards what they save anyway) and are checkpointed only
while the outer recomputes.

Tiling (`memory.tiled_mlp: N`): DeepSpeed's TiledMLP runs each MLP over N sequence tiles and recomputes it in
backward, so only the MLP input is kept and the 14336-wide intermediates exist one tile at a time. A tiled MLP is
not checkpointed a second time.
"""

from __future__ import annotations

import contextvars
import functools

import torch
from torch.utils.checkpoint import checkpoint

from .config import RecipeError

INNER = {"attn_mlp": ("attn", "mlp"), "norm_attn": ("norm", "attn"), "norm_attn_mlp": ("norm", "attn", "mlp")}
POLICIES = ["none", "layer", *INNER, *(f"layer+{p}" for p in INNER)]
SUPPORTED_MODELS = ("mistral", "llama", "qwen2")

# None outside any outer (layer) checkpoint; "forward" during its first forward; "recompute" during its replay.
_OUTER_PHASE: contextvars.ContextVar[str | None] = contextvars.ContextVar("recipes_outer_phase", default=None)


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        import difflib

        close = difflib.get_close_matches(policy, POLICIES, n=1)
        hint = f" Did you mean `{close[0]}`?" if close else ""
        raise RecipeError(f"`memory.checkpointing: {policy}` is not a policy.{hint} Choose one of: {', '.join(POLICIES)}.")


def uses_transformers_layer_checkpointing(policy: str) -> bool:
    """`layer` alone is transformers' gradient checkpointing (DPOConfig.gradient_checkpointing=True)."""
    return policy == "layer"


def _counted(module: torch.nn.Module, forward):
    """Count executions of the real forward: a checkpointed module runs twice per training step."""
    module.recipes_forward_calls = 0

    @functools.wraps(forward)
    def run(*args, **kwargs):
        module.recipes_forward_calls += 1
        return forward(*args, **kwargs)

    return run


def _wrap_inner(module: torch.nn.Module) -> None:
    forward = _counted(module, module.forward)

    def checkpointed_forward(*args, **kwargs):
        if not (module.training and torch.is_grad_enabled()) or _OUTER_PHASE.get() == "forward":
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed_forward


def _wrap_outer(layer: torch.nn.Module) -> None:
    forward = _counted(layer, layer.forward)

    def checkpointed_forward(*args, **kwargs):
        if not (layer.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        calls = 0

        def run(*a, **k):
            nonlocal calls
            calls += 1
            token = _OUTER_PHASE.set("forward" if calls == 1 else "recompute")
            try:
                return forward(*a, **k)
            finally:
                _OUTER_PHASE.reset(token)

        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    layer.forward = checkpointed_forward


def _wrap_tiled_mlp(mlp: torch.nn.Module, shards: int) -> None:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    forward = _counted(mlp, mlp.forward)
    params = list(mlp.parameters())

    def tiled_forward(x):
        if not (mlp.training and torch.is_grad_enabled()):
            return forward(x)
        return TiledMLP.apply(lambda _self, x_shard: forward(x_shard), mlp, x, shards, params)

    mlp.forward = tiled_forward


def decoder_modules(model: torch.nn.Module):
    """(decoder layers, final norm) of a Mistral/Llama/Qwen2-shaped CausalLM, or a clear error."""
    model_type = getattr(model.config, "model_type", None)
    backbone = getattr(model, "model", None)
    layers = getattr(backbone, "layers", None)
    needed = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    if model_type not in SUPPORTED_MODELS or layers is None or not all(hasattr(layers[0], n) for n in needed):
        raise RecipeError(
            f"Checkpointing policies other than `layer`/`none` support {', '.join(SUPPORTED_MODELS)} models; this is "
            f"{model_type!r}. Set `memory.checkpointing: layer`."
        )
    return layers, backbone.norm


def apply_memory_patches(model: torch.nn.Module, policy: str, tiled_mlp: int = 0) -> dict[str, int]:
    """Wrap the policy model's module forwards for `policy` (and tile its MLPs). Returns what was wrapped."""
    check_policy(policy)
    wrapped = {"norm": 0, "attn": 0, "mlp": 0, "layer": 0, "tiled_mlp": 0}
    if policy in ("none", "layer") and not tiled_mlp:
        return wrapped
    layers, final_norm = decoder_modules(model)
    outer, _, inner_name = policy.rpartition("+") if "+" in policy else ("", "", policy)
    inner = INNER.get(inner_name, ())
    for layer in layers:
        if tiled_mlp:
            _wrap_tiled_mlp(layer.mlp, tiled_mlp)
            wrapped["tiled_mlp"] += 1
        targets = {
            "norm": [layer.input_layernorm, layer.post_attention_layernorm],
            "attn": [layer.self_attn],
            "mlp": [] if tiled_mlp else [layer.mlp],
        }
        for kind in inner:
            for module in targets[kind]:
                _wrap_inner(module)
                wrapped[kind] += 1
        if outer == "layer":
            _wrap_outer(layer)
            wrapped["layer"] += 1
    if "norm" in inner:
        _wrap_inner(final_norm)
        wrapped["norm"] += 1
    return wrapped
