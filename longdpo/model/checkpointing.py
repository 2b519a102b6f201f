"""Selective activation checkpointing and sequence-tiled MLPs, applied by wrapping module *forwards*.

Parameter names, state dicts and saved checkpoints are untouched (only `module.forward` is replaced on the
instance), so a model trained with any policy reloads with plain `from_pretrained`. Applied to the policy only:
the reference model runs under no_grad and keeps nothing for backward.

Policies (`memory.checkpointing`):
  none            nothing checkpointed
  layer           transformers' own per-decoder-layer checkpointing (TRL's default; what a stock user gets)
  attn_mlp        attention and MLP each in a non-reentrant checkpoint, norms not (NeMo-RL PR #926's starting point)
  norm_attn       every RMSNorm (the final norm too) and attention (what the user named)
  norm_attn_mlp   every RMSNorm, attention and MLP (NeMo-RL PR #926's fix: its fp32 norms were 1/3 of activations)
  layer+<inner>   nested, done right: transformers' layer checkpoint AND each <inner> module in its own, so a
                  layer's backward holds the inner modules' inputs plus one module's intermediates instead of
                  the whole layer's intermediates.

Why "done right": a non-reentrant checkpoint saves its *positional* tensor inputs through the saved-tensor hooks (so
an enclosing checkpoint drops them) but keeps its *keyword* inputs alive in the recompute closure until backward;
attention is called with `hidden_states=`, so naive nesting pinned every layer's attention input and raised memory
(12k: 17.1 -> 25.7 GB). Every wrapped module here passes its keyword tensors positionally. The measurements behind
each policy and lever: docs/DESIGN.md and docs/BENCHMARKS.md.

Chunking (`memory.mlp_chunks: N`): each of N contiguous chunks of every MLP's tokens in its own checkpoint; nested in
the layer checkpoint the chunks cost no extra MLP forward (see `_wrap_chunked_mlp`).

Tiling (`memory.tiled_mlp: N`): DeepSpeed's TiledMLP runs each MLP over N sequence tiles and recomputes it in
backward, so only the MLP input is kept and the 14336-wide intermediates exist one tile at a time. A tiled MLP is
not checkpointed a second time.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from longdpo.config import RecipeError
from longdpo.model.lean_norm import make_lean

INNER = {"attn_mlp": ("attn", "mlp"), "norm_attn": ("norm", "attn"), "norm_attn_mlp": ("norm", "attn", "mlp")}
POLICIES = ["none", "layer", *INNER, *(f"layer+{p}" for p in INNER)]
SUPPORTED_MODELS = ("mistral", "llama", "qwen2", "qwen3")  # Llama-3.x are `llama`, Qwen2.5 `qwen2`


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        import difflib

        close = difflib.get_close_matches(policy, POLICIES, n=1)
        hint = f" Did you mean `{close[0]}`?" if close else ""
        raise RecipeError(
            f"`memory.checkpointing: {policy}` is not a policy.{hint} Choose one of: {', '.join(POLICIES)}."
        )


def check_mlp_split(tiled_mlp: int, mlp_chunks: int) -> None:
    if tiled_mlp and mlp_chunks:
        raise RecipeError("Set one of `memory.tiled_mlp` and `memory.mlp_chunks`: both split the MLP's sequence.")


def uses_transformers_layer_checkpointing(policy: str) -> bool:
    """`layer` and `layer+...` use transformers' own per-layer checkpointing (DPOConfig.gradient_checkpointing)."""
    return policy == "layer" or policy.startswith("layer+")


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
        if not (module.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        # Keyword tensors would be pinned by checkpoint's recompute closure: pass everything positionally.
        n_args, keys = len(args), list(kwargs)

        def run(*flat):
            return forward(*flat[:n_args], **dict(zip(keys, flat[n_args:])))

        return checkpoint(run, *args, *kwargs.values(), use_reentrant=False)

    module.forward = checkpointed_forward


def _wrap_tiled_mlp(mlp: torch.nn.Module, shards: int) -> None:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    forward = _counted(mlp, mlp.forward)
    params = list(mlp.parameters())

    def tiled_forward(x):
        if not (mlp.training and torch.is_grad_enabled()):
            return forward(x)
        return TiledMLP.apply(lambda _self, x_shard: forward(x_shard), mlp, x, shards, params)

    mlp.forward = tiled_forward


def _in_backward() -> bool:
    """torch's own test in its checkpoint unpack hook (torch/utils/checkpoint.py)."""
    return torch._C._current_graph_task_id() != -1


def _under_non_reentrant_layer_checkpoint(layer: torch.nn.Module | None) -> bool:
    """Asked in the forward: does transformers' per-layer checkpoint of `layer` run non-reentrant now? (A reentrant
    one runs its forward under no_grad, so the chunked path is not taken there at all.)"""
    func = getattr(layer, "_gradient_checkpointing_func", None)
    return bool(
        getattr(layer, "gradient_checkpointing", False) and getattr(func, "keywords", {}).get("use_reentrant") is False
    )


def _wrap_chunked_mlp(mlp: torch.nn.Module, chunks: int, layer: torch.nn.Module | None = None) -> None:
    """Each chunk of the MLP's tokens in its own checkpoint: backward holds one chunk's 14336-wide intermediates.

    Compute, counted by the tests: each chunk runs in the forward and in its own recompute, 2 MLP forwards per step
    as for an unchunked nested MLP. In a non-reentrant layer checkpoint's replay (in backward) the chunks'
    checkpoints are entered again - they save their inputs, which is all the layer's backward needs of the MLP - but
    their forwards do not run: that replay's outputs are thrown away (torch stops it at the last chunk's input).
    Measured before this: the replay ran all but the last chunk, 0.5 s a step at 12k on the 12B architecture. A
    reentrant layer checkpoint uses its replay's outputs, so there the chunks run; which kind ran is recorded in the
    forward, since TRL re-enables checkpointing (with other arguments) around reference forwards between a forward
    and its backward. DeepSpeed's TiledMLP (an autograd.Function) is replayed in full: 3 forwards."""
    forward = _counted(mlp, mlp.forward)
    replay_free = False

    def chunked_forward(x):
        nonlocal replay_free
        in_replay = _in_backward()
        # Every training forward through the layer checkpoint records its kind, the reentrant one too (it runs
        # under no_grad). Seen when only grad-enabled forwards recorded it: with LoRA under ZeRO-3, step 1 ran
        # non-reentrant and later steps reentrant (TRL re-enables checkpointing with forced reentrant arguments),
        # so the later replays skipped the chunks whose outputs a reentrant backward uses: wrong gradients.
        if (
            mlp.training
            and not in_replay
            and (torch.is_grad_enabled() or getattr(layer, "gradient_checkpointing", False))
        ):
            replay_free = _under_non_reentrant_layer_checkpoint(layer)
        if not (mlp.training and torch.is_grad_enabled()):
            return forward(x)
        run = torch.empty_like if in_replay and replay_free else forward
        # Chunks of the flattened tokens, not of the sequence dimension: DPO runs chosen and rejected as a batch of
        # 2, where a sequence slice is strided and each projection pays for it (MLP forward +7.4% at 12k with 3
        # chunks, +11.7% at 64k with 8, against +3.4% / +2.9% for contiguous token chunks; tools/probe_kernels.py).
        # A whole 12B step at 12k: +1.9% -> +0.9% over TRL + offloading + Liger (results/gpu_2026-12-04_token_chunks).
        flat = x.reshape(-1, x.shape[-1])
        parts = [checkpoint(run, part, use_reentrant=False) for part in flat.chunk(chunks)]
        return torch.cat(parts).view(*x.shape[:-1], -1)

    mlp.forward = chunked_forward


def decoder_modules(model: torch.nn.Module):
    """(decoder layers, final norm) of a Mistral / Llama / Qwen2 / Qwen3 CausalLM, or a clear error."""
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


def rms_norms(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """Every RMSNorm of a decoder layer: the two around attention and MLP, and Qwen3's per-head q_norm / k_norm
    inside attention (checkpointed with attention, which holds them)."""
    inside = [getattr(layer.self_attn, name, None) for name in ("q_norm", "k_norm")]
    return [layer.input_layernorm, layer.post_attention_layernorm, *(n for n in inside if n is not None)]


def apply_memory_patches(
    model: torch.nn.Module, policy: str, tiled_mlp: int = 0, mlp_chunks: int = 0, lean_norm: bool = False, label=None
) -> dict[str, int]:
    """Wrap the policy model's module forwards for `policy` (tile or chunk its MLPs, make its norms lean).
    `label(model)`, if given, runs after the norms are made lean and before any wrapper (longdpo/training/profiling.py).
    Returns what was wrapped."""
    check_policy(policy)
    check_mlp_split(tiled_mlp, mlp_chunks)
    wrapped = {"norm": 0, "attn": 0, "mlp": 0, "tiled_mlp": 0, "chunked_mlp": 0, "lean_norm": 0}
    if policy in ("none", "layer") and not (tiled_mlp or mlp_chunks or lean_norm):
        if label:
            label(model)
        return wrapped
    layers, final_norm = decoder_modules(model)
    if lean_norm:  # first, so that a checkpoint wraps the lean forward
        for norm in [final_norm, *(n for layer in layers for n in rms_norms(layer))]:
            make_lean(norm)
            wrapped["lean_norm"] += 1
    if label:
        label(model)
    inner = INNER.get(policy.removeprefix("layer+"), ())
    for layer in layers:
        if tiled_mlp:
            _wrap_tiled_mlp(layer.mlp, tiled_mlp)
            wrapped["tiled_mlp"] += 1
        if mlp_chunks:
            _wrap_chunked_mlp(layer.mlp, mlp_chunks, layer)
            wrapped["chunked_mlp"] += 1
        targets = {
            "norm": [layer.input_layernorm, layer.post_attention_layernorm],
            "attn": [layer.self_attn],
            "mlp": [] if (tiled_mlp or mlp_chunks) else [layer.mlp],  # already split and recomputed
        }
        for kind in inner:
            for module in targets[kind]:
                _wrap_inner(module)
                wrapped[kind] += 1
    if "norm" in inner:
        _wrap_inner(final_norm)
        wrapped["norm"] += 1
    return wrapped
