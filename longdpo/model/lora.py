"""LoRA DPO (`model.use_peft: true`): TRL's `peft_config`, checked before any weight is loaded, and the saved adapter.

TRL wraps the policy in PEFT itself and computes the reference log-probs with the adapters switched off, so no
reference copy of the weights exists and frozen weights get no gradient or optimizer state. The keys are TRL's
`ModelConfig` names and go through TRL's own `get_peft_config`. Our memory patches are applied to the base model
before TRL wraps it: they replace module forwards (attention, MLP, norms), and the LoRA layers PEFT puts inside those
modules run within them.

Start-up check: the model's skeleton is built on the meta device (no memory, a fraction of a second for 12B) and
PEFT matches the target modules on it, so a name that matches nothing is one line before loading anything.
"""

from __future__ import annotations

import logging
import os

import torch
from peft import PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import AutoModelForCausalLM
from trl import ModelConfig, get_peft_config

from longdpo.config import ModelArgs, RecipeError, resolve_path
from longdpo.model.build import DTYPES, load_architecture, model_source

logger = logging.getLogger(__name__)

LORA_KEYS = (
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "lora_target_parameters",
    "lora_modules_to_save",
    "lora_task_type",
    "use_rslora",
    "use_dora",
    "lora_save_merged",
)


def peft_config(args: ModelArgs):
    """TRL's LoraConfig for these model keys, or None without `use_peft`."""
    if not args.use_peft:
        return None
    return get_peft_config(
        ModelConfig(
            use_peft=True,
            lora_r=args.lora_r,
            lora_alpha=args.lora_alpha,
            lora_dropout=args.lora_dropout,
            lora_target_modules=args.lora_target_modules,
            lora_target_parameters=args.lora_target_parameters,
            lora_modules_to_save=args.lora_modules_to_save,
            lora_task_type=args.lora_task_type,
            use_rslora=args.use_rslora,
            use_dora=args.use_dora,
        )
    )


def check_lora_args(args: ModelArgs) -> None:
    """Start-up checks of the LoRA keys (no weights loaded): values, peft present, every target matches a module."""
    if not args.use_peft:
        given = [k for k in LORA_KEYS if getattr(args, k) != getattr(ModelArgs, k, None)]
        if given:
            raise RecipeError(f"`model.{given[0]}` is set but LoRA is off: set `model.use_peft: true` (or drop it).")
        return
    if args.lora_r < 1 or args.lora_alpha <= 0:
        raise RecipeError(
            f"`model.lora_r` must be at least 1 and `model.lora_alpha` positive (got {args.lora_r}, {args.lora_alpha})."
        )
    if not 0 <= args.lora_dropout < 1:
        raise RecipeError(f"`model.lora_dropout` must be in [0, 1), got {args.lora_dropout}.")
    if isinstance(args.lora_modules_to_save, str):
        args.lora_modules_to_save = [args.lora_modules_to_save]
    if args.lora_save_merged and not args.name_or_path:
        raise RecipeError(
            "`model.lora_save_merged` merges the adapter into the base weights read from "
            "`model.name_or_path`; a random-init `model.architecture` has none on disk: drop it."
        )
    _check_targets(args)


def _skeleton(args: ModelArgs):
    """The model's modules on the meta device: names and types, no memory."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(load_architecture(args))


def _check_targets(args: ModelArgs) -> None:
    model = _skeleton(args)
    names = [name for name, _ in model.named_modules()]

    def matches(target: str) -> bool:
        return any(name == target or name.endswith("." + target) for name in names)

    for key in ("lora_target_modules", "lora_modules_to_save"):
        value = getattr(args, key)
        if isinstance(value, list):
            missing = [t for t in value if not matches(t)]
            if missing:
                leaves = sorted(
                    {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
                )
                raise RecipeError(
                    f"`model.{key}` {missing} match(es) no module of this {model.config.model_type} "
                    f"model; its linear layers are {leaves} (or use `all-linear`)."
                )
    adapter_params(args, model)


_COUNTED: dict[str, int] = {}  # repr(ModelArgs) -> adapter parameters: start-up checks, disk check and planner ask


def adapter_params(args: ModelArgs, skeleton=None) -> int:
    """Parameters LoRA trains (adapters + modules_to_save), counted by PEFT itself on the meta-device skeleton (once
    per model section: a 12B skeleton with PEFT on it takes a second or two)."""
    key = repr(args)
    if key not in _COUNTED:
        _COUNTED[key] = _count_adapters(args, skeleton)
    return _COUNTED[key]


def _count_adapters(args: ModelArgs, skeleton) -> int:
    try:
        peft_model = get_peft_model(skeleton if skeleton is not None else _skeleton(args), peft_config(args))
    except ValueError as e:  # PEFT's own matching: a regex or default targets that find nothing, a bad task type
        raise RecipeError(
            f"LoRA settings do not apply to this model: {str(e).splitlines()[0]} Fix `model.lora_target_modules`."
        ) from None
    if isinstance(peft_model.get_output_embeddings(), BaseTunerLayer):  # TRL refuses it after loading the model
        raise RecipeError(
            "`model.lora_target_modules` adapts `lm_head`, but DPO's log-probs are computed from "
            "`lm_head.weight` directly, so its adapter would never train: drop `lm_head` there (list it "
            "in `model.lora_modules_to_save` to train the head in full)."
        )
    return peft_model.get_nb_trainable_parameters()[0]


def trainable_summary(model) -> str:
    trainable, total = model.get_nb_trainable_parameters()
    return f"LoRA: {trainable:,} trainable of {total:,} parameters ({100 * trainable / total:.3f}%)"


def save_merged(output_dir: str, args: ModelArgs, tokenizer) -> str:
    """The saved adapter merged into the base weights (read again from `model.name_or_path`, on the CPU), written to
    `<output_dir>/merged`: a plain model that loads with `from_pretrained` and needs no peft."""
    base = AutoModelForCausalLM.from_pretrained(model_source(resolve_path(args.name_or_path)), dtype=DTYPES[args.dtype])
    merged = PeftModel.from_pretrained(base, output_dir).merge_and_unload()
    target = os.path.join(output_dir, "merged")
    merged.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target
