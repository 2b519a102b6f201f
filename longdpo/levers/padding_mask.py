"""No attention mask where causal attention already excludes the padding (`memory.padding_mask: auto`).

TRL's preference collator puts chosen and rejected in one batch and pads each row on the right, and passes the
padding mask to the model. transformers turns a mask with padding into an explicit boolean attention mask, and
PyTorch's attention with an explicit mask leaves its fast causal kernels: at 32k tokens, batch 2, forward + backward,
448 ms with the mask against 109 ms with `is_causal` (cuDNN on an H100, torch 2.11); the flash kernel refuses masks
outright, and the mask itself is GBs at long lengths. A whole 32k DPO step of the 12B model ran 2.2x slower on
pairs whose answers differ in length than on equal ones (docs/BENCHMARKS.md).

With the padding at the end of each row, causal attention already keeps every real token from seeing it: token t
attends to tokens 0..t, all real. Positions are 0..n-1 either way (transformers numbers them by index when no
position ids are given). So for every token the loss reads (TRL scores only labelled positions), the output is the
same without the mask; the padding positions' own outputs change and are never read. The mask is dropped per
forward, on the model's backbone (the policy, the reference, LoRA's reference pass with the adapters off), only
when the batch really is right-padded (each row: ones, then zeros); a left-padded or packed batch keeps it.

Planner: kept on pairs that pad, TRL's mask becomes an explicit seq x seq mask per row (bool, and the additive form
attention builds from it): a few large blocks, outside the fragmentation of the per-token churn, so its own term
(`mask_bytes_per_element`, fitted: at 32k, +7.25 GB allocated).
"""

from __future__ import annotations

import torch

from longdpo.levers import Key, Lever
from longdpo.recipe_values import RecipeError

SETTINGS = ("auto", "keep")


def decide(setting: str, config) -> tuple[bool, str]:
    """Whether to drop right padding's mask for this model, and the start-up line that says so."""
    if setting == "keep":
        return False, "attention: TRL's padding mask is kept (memory.padding_mask: keep)"
    if config.get_text_config() is not config or getattr(config, "is_encoder_decoder", False):
        return False, "attention: the padding mask is kept (not a text-only causal decoder)"
    return True, (
        "attention: no mask for right-padded pairs (causal attention already keeps each real token from the "
        "padding after it), so attention runs its causal kernel; memory.padding_mask: keep restores TRL's"
    )


def right_padded(mask: torch.Tensor) -> bool:
    """Every row is ones then zeros (at least one real token first)."""
    return mask.dim() == 2 and bool(mask[:, 0].all()) and bool((mask[:, 1:] <= mask[:, :-1]).all())


def _drop(module, args, kwargs):
    mask = kwargs.get("attention_mask")
    if mask is None or kwargs.get("position_ids") is not None or not right_padded(mask):
        return None
    return args, {**kwargs, "attention_mask": None}


def install(model: torch.nn.Module | None) -> bool:
    """Drop right padding's mask on the model's backbone (`base_model`, the module TRL's fused LM head calls)."""
    if model is None:
        return False
    model.base_model.register_forward_pre_hook(_drop, with_kwargs=True)
    return True


class PaddingMask(Lever):
    name = "padding_mask"
    order = 90
    tokens = ("mask",)
    flag = ("padding_mask", "keep", "mask")
    keys = (
        Key(
            "padding_mask",
            str,
            "auto",
            "`auto` runs right-padded batches without an attention mask, where causal attention already keeps every "
            "real token from the padding after it (the same loss and gradients, on the fast causal kernel); `keep` "
            "passes TRL's padding mask to the model.",
        ),
    )

    def check(self, s, ctx):
        if s.padding_mask not in SETTINGS:
            raise RecipeError(f"`memory.padding_mask` must be auto or keep, got {s.padding_mask!r}.")

    def route_attention(self, s, models, build):
        drop, line = decide(s.padding_mask, models[0].config)
        if drop:
            for model in models:
                install(model)
        build.messages.append(line)

    def price(self, s, setup, terms, cal):
        terms.masked = s.padding_mask == "keep" and setup.pads and not terms.shared_rows
        if terms.masked:
            terms.mask_bytes = cal.get("mask_bytes_per_element", 0.0) * 2 * setup.batch * setup.seq**2

    def fit(self, rows, every, cal, planner):
        """Bytes per element of the explicit mask (2 rows x seq x seq a pair), from benchmark rows of unequal pairs
        with the mask kept beside a row of equal pairs of the same setup (lever set, length, mode, layers; allocation
        does not depend on the card): their difference in peak allocated."""

        def key(env, row, s):
            return row["config"], row["seq_tokens"], env["mode"], s.layers

        equal = {key(*x[:2], x[3]): x[1] for x in every if x[1].get("workload", "equal") == "equal"}
        per_element = [
            (row["peak_allocated_gb"] - equal[key(env, row, s)]["peak_allocated_gb"])
            * 1e9
            / (2 * row["seq_tokens"] ** 2)
            for env, row, _src, s in every
            if row.get("workload") == "unequal" and s.levers.padding_mask == "keep" and key(env, row, s) in equal
        ]
        return {"mask_bytes_per_element": round(sum(per_element) / len(per_element), 3) if per_element else 0.0}

    def proposals(self, s, setup, plan_of):
        if plan_of(s).terms.masked:
            yield (
                0,
                "memory.padding_mask: auto (no mask for right-padded pairs: attention keeps its causal kernel)",
                s.replace(padding_mask="auto"),
            )


LEVER = PaddingMask()
