"""Emptying the CUDA cache at step boundaries (`memory.empty_cache_steps`, `memory.empty_cache_microbatches`):
gc.collect() and torch.cuda.empty_cache() every N optimizer steps or micro-batches, as NeMo-RL PR #926 did.

It returns cached blocks to the driver, which lowers reserved memory between steps, not the peak within one; measured
on the real path at 64k it raised the peak reserved (docs/BENCHMARKS.md), so the recipes leave it off. The planner
prices it as nothing: its prediction is the peak without it.
"""

from __future__ import annotations

import gc

import torch
from transformers import TrainerCallback

from longdpo.levers import Key, Lever
from longdpo.recipe_values import RecipeError, is_number


def empty_cache() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class EmptyCacheCallback(TrainerCallback):
    def __init__(self, steps: int, microbatches: int):
        self.steps, self.microbatches, self._seen = steps, microbatches, 0

    def _microbatch_done(self):
        self._seen += 1
        if self.microbatches and self._seen % self.microbatches == 0:
            empty_cache()

    def on_substep_end(self, args, state, control, **kwargs):
        self._microbatch_done()

    def on_step_end(self, args, state, control, **kwargs):
        self._microbatch_done()  # the last micro-batch of a step ends here, not in on_substep_end
        if self.steps and state.global_step % self.steps == 0:
            empty_cache()


class EmptyCache(Lever):
    name = "empty_cache"
    order = 110
    tokens = ("empty_cache<N>", "empty_cache_mb<N>")
    keys = (
        Key(
            "empty_cache_steps",
            int,
            0,
            "gc.collect() + torch.cuda.empty_cache() every N optimizer steps. Setting TRL's `torch_empty_cache_steps` "
            "as well is an error (the cache would be emptied twice); use this one.",
        ),
        Key("empty_cache_microbatches", int, 0, "the same every N micro-batches (costs speed; off by default)."),
    )

    def check(self, s, ctx):
        for key in ("empty_cache_steps", "empty_cache_microbatches"):
            value = getattr(s, key)
            if not is_number(value, whole=True) or value < 0:
                raise RecipeError(f"`memory.{key}` must be >= 0, got {value!r}.")
        if s.empty_cache_steps and ctx.recipe.trainer.get("torch_empty_cache_steps"):
            raise RecipeError(
                "Both `memory.empty_cache_steps` and TRL's `torch_empty_cache_steps` are set, which would empty the "
                "cache twice; keep `memory.empty_cache_steps` (it also runs gc) and remove `torch_empty_cache_steps`."
            )

    def configure(self, s, build):
        if s.empty_cache_steps or s.empty_cache_microbatches:
            build.callbacks.append(EmptyCacheCallback(s.empty_cache_steps, s.empty_cache_microbatches))

    def price(self, s, setup, terms, cal):
        pass  # the planned peak is the peak without it (module docstring)

    def spell(self, s, priced=False):
        if priced:
            return None
        tokens = []
        if s.empty_cache_steps:
            tokens.append("empty_cache" + ("" if s.empty_cache_steps == 1 else str(s.empty_cache_steps)))
        if s.empty_cache_microbatches:
            tokens.append(f"empty_cache_mb{s.empty_cache_microbatches}")
        return "+".join(tokens) or None

    def read(self, token):
        if token.startswith("empty_cache_mb") and token[14:].isdigit():
            return {"empty_cache_microbatches": int(token[14:])}
        if token.startswith("empty_cache") and (token[11:] == "" or token[11:].isdigit()):
            return {"empty_cache_steps": int(token[11:] or 1)}
        return None


LEVER = EmptyCache()
