"""The planner at a run's start and at its out-of-memory end: the verdict before any model is loaded (on the GPU, or
on this machine's memory without one) and the report that says what would have fitted."""

from __future__ import annotations

import json
import logging
import os

import psutil
import torch

from longdpo.checks import check_deepspeed_config, deepspeed_config_path
from longdpo.config import RecipeError
from longdpo.planner import plan as planner

logger = logging.getLogger("train_dpo")


def gpu_memory_gb(recipe) -> float | None:
    """The per-GPU budget: the recipe's cap (also on CPU, for planning), else this rank's GPU."""
    if recipe.memory.memory_cap_gb:
        return recipe.memory.memory_cap_gb
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)  # this rank's own GPU, before anything lands on GPU 0 by default
        return torch.cuda.get_device_properties(local_rank).total_memory / 1e9
    return None


def planned(recipe, world_size: int, gpu_memory: float | None = None, pairs=None):
    """The plan of this launch: the launcher's ranks per node, the DeepSpeed config it was given. `pairs`: the data's
    (prompt, chosen, rejected) token counts where the plan depends on them (longdpo.planner.plan.needs_pairs)."""
    ds_path = deepspeed_config_path(recipe)
    ds = check_deepspeed_config(ds_path) if ds_path else None
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    budget = gpu_memory if gpu_memory is not None else gpu_memory_gb(recipe)
    return planner.plan(recipe, per_node, budget, max(1, world_size // per_node), ds, pairs=pairs)


def preflight(recipe, world_size: int, enforce: bool, pairs=None, problems_found: bool = False):
    """The planner's verdict; refuses a run predicted not to fit (--skip-preflight runs it anyway). `pairs`: the
    data's token counts where the plan depends on them. `problems_found`: the recipe has problems already reported,
    so a value the planner cannot read is one of them, not worth a line of its own."""
    try:
        result = planned(recipe, world_size, pairs=pairs)
    except (AttributeError, KeyError, TypeError, OSError) as e:  # an architecture the planner cannot model
        if not problems_found:
            logger.warning("planner: cannot model this run (%s); no preflight", e)
        return None
    if int(os.environ.get("RANK", 0)) == 0 and result.gpu_memory_gb:  # no GPU and no cap: nothing to plan for
        logger.warning(
            "planner: predicted peak reserved %.2f GB per rank of %.1f GB",
            result.peak_reserved_gb,
            result.gpu_memory_gb,
        )
    if enforce and result.fits is False:
        raise RecipeError(
            f"Predicted peak reserved {result.peak_reserved_gb:.1f} GB per rank exceeds the GPU's "
            f"{result.gpu_memory_gb:.1f} GB, so this run would run out of memory:\n{planner.render(result)}\n"
            "Apply one of the changes above, or pass --skip-preflight to run anyway."
        )
    if enforce and not torch.cuda.is_available():
        need = planner.cpu_memory_gb(result, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
        free = psutil.virtual_memory().available / 1e9
        if need > free:
            raise RecipeError(
                f"This machine has no GPU, so the model, its reference, gradients and optimizer state live in its "
                f"memory: the planner puts this run at no less than {need:.0f} GB and {free:.0f} GB are free. Run it "
                "on GPUs (the recipe's header names them) or try the pipeline here on a small model "
                "(recipes/tiny_mistral/dpo_quickstart.yaml); --skip-preflight runs it anyway."
            )
    return result


def oom_report(error, recipe, world_size: int, records: list[dict], last_checkpoint, pairs=None) -> str:
    """What a CUDA out-of-memory error leaves the user: the last steps' telemetry, the allocator's gap, the
    planner's changes for this recipe, the last intact checkpoint."""
    lines = [f"CUDA out of memory during training: {str(error).splitlines()[0]}", "last steps' telemetry:"]
    lines += [f"  {json.dumps(r)}" for r in records[-3:]] or ["  (no step completed)"]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats = torch.cuda.memory_stats()
        gap = (stats.get("reserved_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0)) / 1e9
        lines.append(f"allocator now: fragmentation gap {gap:.2f} GB")
    try:
        predicted = planned(recipe, world_size, pairs=pairs)
        # It did not fit, whatever was predicted: ask for changes predicted below both the budget and the prediction.
        budget = min(predicted.gpu_memory_gb or predicted.peak_reserved_gb, predicted.peak_reserved_gb * 0.999)
        lines.append("planner for this recipe:\n" + planner.render(planned(recipe, world_size, budget, pairs)))
    except (AttributeError, KeyError, TypeError):
        lines.append("planner: cannot model this run")
    lines.append(
        f"last saved checkpoint (intact): {last_checkpoint}" if last_checkpoint else "no checkpoint had been saved yet"
    )
    return "\n".join(lines)
