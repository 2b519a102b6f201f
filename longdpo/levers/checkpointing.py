"""Activation checkpointing policies (`memory.checkpointing`), applied by wrapping module *forwards*.

Parameter names, state dicts and saved checkpoints are untouched (only `module.forward` is replaced on the instance),
so a model trained with any policy reloads with plain `from_pretrained`. Applied to the policy only: the reference
runs under no_grad and keeps nothing for backward.

  none            nothing checkpointed
  layer           transformers' own per-decoder-layer checkpointing (TRL's default; what a stock user gets)
  attn_mlp        attention and MLP each in a non-reentrant checkpoint, norms not (NeMo-RL PR #926's starting point)
  norm_attn       every RMSNorm (the final norm too) and attention
  norm_attn_mlp   every RMSNorm, attention and MLP (NeMo-RL PR #926's fix: its fp32 norms were 1/3 of activations)
  layer+<inner>   nested, done right: transformers' layer checkpoint AND each <inner> module in its own, so a layer's
                  backward holds the inner modules' inputs plus one module's intermediates instead of the whole
                  layer's intermediates.

Why "done right": a non-reentrant checkpoint saves its *positional* tensor inputs through the saved-tensor hooks (so
an enclosing checkpoint drops them) but keeps its *keyword* inputs alive in the recompute closure until backward;
attention is called with `hidden_states=`, so naive nesting pinned every layer's attention input and raised memory
(12k: 17.1 -> 25.7 GB). Every wrapped module here passes its keyword tensors positionally. An MLP that another lever
already recomputes (MLP chunks, tiles) is not checkpointed a second time. Measurements: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import difflib

import torch
from torch.utils.checkpoint import checkpoint

from longdpo.levers import Key, Lever
from longdpo.model.families import decoder_modules
from longdpo.model.forwards import counted
from longdpo.recipe_values import RecipeError

INNER = {"attn_mlp": ("attn", "mlp"), "norm_attn": ("norm", "attn"), "norm_attn_mlp": ("norm", "attn", "mlp")}
POLICIES = ["none", "layer", *INNER, *(f"layer+{p}" for p in INNER)]
# bf16 bytes per token, per layer, per hidden unit that each policy's checkpoints keep (the planner's stored term)
STORED_BYTES = {"layer": 2.0, "attn_mlp": 16.0, "norm_attn": 14.0, "norm_attn_mlp": 8.0}
# The earliest benchmark rows named the nested attention-only policy (its MLP chunked) `layer+attn`
LEGACY = {"layer+attn": "layer+attn_mlp"}


def uses_layer_checkpoint(policy: str) -> bool:
    """`layer` and `layer+...` use transformers' own per-layer checkpointing (TRL's activation_checkpointing)."""
    return policy == "layer" or policy.startswith("layer+")


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        close = difflib.get_close_matches(str(policy), POLICIES, n=1)
        hint = f" Did you mean `{close[0]}`?" if close else ""
        raise RecipeError(
            f"`memory.checkpointing: {policy}` is not a policy.{hint} Choose one of: {', '.join(POLICIES)}."
        )


def checkpoint_module(module: torch.nn.Module) -> None:
    """Run `module` in a non-reentrant checkpoint when training, its keyword tensors passed positionally."""
    forward = counted(module, module.forward)

    def checkpointed_forward(*args, **kwargs):
        if not (module.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        n_args, names = len(args), list(kwargs)

        def run(*flat):
            return forward(*flat[:n_args], **dict(zip(names, flat[n_args:])))

        return checkpoint(run, *args, *kwargs.values(), use_reentrant=False)

    module.forward = checkpointed_forward


def wrap_policy(model: torch.nn.Module, policy: str, mlp_recomputes_itself: bool = False) -> dict[str, int]:
    """Checkpoint the policy's inner modules; returns how many of each kind were wrapped."""
    check_policy(policy)
    wrapped = {"norm": 0, "attn": 0, "mlp": 0}
    inner = INNER.get(policy.removeprefix("layer+"), ())
    if not inner:
        return wrapped
    layers, final_norm = decoder_modules(model)
    for layer in layers:
        targets = {
            "norm": [layer.input_layernorm, layer.post_attention_layernorm],
            "attn": [layer.self_attn],
            "mlp": [] if mlp_recomputes_itself else [layer.mlp],
        }
        for kind in inner:
            for module in targets[kind]:
                checkpoint_module(module)
                wrapped[kind] += 1
    if "norm" in inner:
        checkpoint_module(final_norm)
        wrapped["norm"] += 1
    return wrapped


class Checkpointing(Lever):
    name = "checkpointing"
    order = 10
    base = True
    tokens = tuple(POLICIES)
    keys = (
        Key(
            "checkpointing",
            str,
            "layer",
            f"activation-checkpointing policy, one of {', '.join(POLICIES)} (none: nothing; layer: transformers' "
            "per-layer checkpoint, TRL's default; attn_mlp / norm_attn / norm_attn_mlp: those modules each in their "
            "own checkpoint; layer+<inner>: both, nested).",
            priced=True,
        ),
    )

    def check(self, s, ctx):
        for key in ("gradient_checkpointing", "activation_checkpointing"):
            if key in ctx.recipe.trainer:
                raise RecipeError(
                    "Set activation checkpointing with `memory.checkpointing` (layer = transformers' own per-layer "
                    f"checkpointing), not `{key}`: remove that key."
                )
        check_policy(s.checkpointing)

    def patches_decoder(self, s):
        return s.checkpointing not in ("none", "layer")

    def configure(self, s, build):
        build.trainer_kwargs["activation_checkpointing"] = uses_layer_checkpoint(s.checkpointing)

    def wrap_recompute(self, s, model, build):
        build.wrapped.update(wrap_policy(model, s.checkpointing, build.mlp_recomputes_itself))

    def price(self, s, setup, terms, cal):
        policy = s.checkpointing
        terms.saves_layer_inputs = uses_layer_checkpoint(policy)
        terms.stored_bytes = STORED_BYTES["layer"] if terms.saves_layer_inputs else STORED_BYTES.get(policy, 16.0)

    def spell(self, s, priced=False):
        return s.checkpointing

    def read_base(self, name):
        for policy in sorted([*POLICIES, *LEGACY], key=len, reverse=True):
            if name == policy or name.startswith(policy + "+"):
                return {"checkpointing": LEGACY.get(policy, policy)}, name[len(policy) :]
        return {}, name


LEVER = Checkpointing()
