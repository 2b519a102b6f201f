"""The model families whose decoder modules the levers patch by name, and where those modules are.

A family is a transformers `model_type` whose decoder layers have `self_attn`, `mlp`, `input_layernorm` and
`post_attention_layernorm` and whose backbone ends in `norm`. Levers that patch modules by name (checkpointing of
norms, attention or MLP, MLP chunks and tiles, the lean norm, profiling labels) need one; TRL's own flags and the
plain `layer` policy run on any causal LM. To add a family: docs/EXTENDING.md.
"""

from __future__ import annotations

from longdpo.config import RecipeError

# model_type -> the family as users know it (Llama-3.x are `llama`, Qwen2.5 `qwen2`)
FAMILIES = {"mistral": "Mistral", "llama": "Llama-3", "qwen2": "Qwen2.5", "qwen3": "Qwen3"}


def supported() -> str:
    """`mistral (Mistral), llama (Llama-3), ...`: for messages."""
    return ", ".join(f"{t} ({name})" for t, name in FAMILIES.items())


def decoder_modules(model):
    """(decoder layers, final norm) of a supported CausalLM, or a clear error."""
    model_type = getattr(model.config, "model_type", None)
    backbone = getattr(model, "model", None)
    layers = getattr(backbone, "layers", None)
    needed = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    if model_type not in FAMILIES or layers is None or not all(hasattr(layers[0], n) for n in needed):
        raise RecipeError(
            f"This model is {model_type!r}; the levers that patch decoder modules support {supported()}: turn them "
            "off in the recipe (the start-up checks name each one)."
        )
    return layers, backbone.norm


def rms_norms(layer) -> list:
    """Every RMSNorm of a decoder layer: the two around attention and MLP, and Qwen3's per-head q_norm / k_norm
    inside attention (checkpointed with attention, which holds them)."""
    inside = [getattr(layer.self_attn, name, None) for name in ("q_norm", "k_norm")]
    return [layer.input_layernorm, layer.post_attention_layernorm, *(n for n in inside if n is not None)]
