"""Every start-up check in one place, run before any model is loaded or GPU memory touched.

Each failure is one RecipeError sentence naming the key or flag that fixes it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re

from longdpo.config import Recipe, RecipeError, is_number, resolve_path, trainer_default
from longdpo.data import check_data_args, has_eval_data
from longdpo.model import allocator, liger, offloading, padding_mask, shared_prompt
from longdpo.model.build import check_model_args, load_architecture
from longdpo.model.checkpointing import check_mlp_split, check_policy
from longdpo.model.lora import check_lora_args
from longdpo.model.sequence_parallel import check_sequence_parallel, check_sp_size

logger = logging.getLogger(__name__)


def check_deepspeed_config(path: str) -> dict:
    if not os.path.isfile(resolve_path(path)):
        raise RecipeError(f"DeepSpeed config {path!r} does not exist; pass one of ds_configs/*.json.")
    try:
        with open(resolve_path(path)) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise RecipeError(f"DeepSpeed config {path!r} is not valid JSON: {e}") from None
    stage = cfg.get("zero_optimization", {}).get("stage")
    if stage not in (None, 0, 1, 2, 3):
        raise RecipeError(f"DeepSpeed config {path!r}: zero_optimization.stage must be 0-3, got {stage!r}.")
    return cfg


def check_family(recipe: Recipe) -> None:
    """Levers that patch decoder modules need a family whose modules they know; the plain `layer` policy (and TRL's
    own flags) run on any causal LM. Checked on the model's config, before loading."""
    from longdpo.model.checkpointing import SUPPORTED_MODELS

    mem = recipe.memory
    levers = [
        name
        for name, on in (
            (f"memory.checkpointing: {mem.checkpointing}", mem.checkpointing not in ("none", "layer")),
            ("memory.lean_norm", mem.lean_norm),
            ("memory.mlp_chunks", mem.mlp_chunks),
            ("memory.tiled_mlp", mem.tiled_mlp),
        )
        if on
    ]
    if not levers:
        return
    model_type = getattr(load_architecture(recipe.model), "model_type", None)
    if model_type not in SUPPORTED_MODELS:
        raise RecipeError(
            f"`{levers[0]}` patches the decoder layers of {', '.join(SUPPORTED_MODELS)} models "
            f"(Mistral, Llama-3, Qwen2.5, Qwen3); this model is {model_type!r}: turn it off "
            "(`memory.checkpointing: layer`, TRL's activation_offloading and the lean LM head still apply)."
        )


class Problems:
    """Collects the start-up problems so that one run reports them all (each check raises at its first)."""

    def __init__(self):
        self.found: list[str] = []

    @contextlib.contextmanager
    def check(self):
        try:
            yield
        except RecipeError as e:
            self.found += [line for line in str(e).splitlines() if line not in self.found]

    def raise_if_any(self) -> None:
        if self.found:
            raise RecipeError("\n".join(self.found))


def check_recipe(recipe: Recipe, world_size: int, cuda_available: bool) -> None:
    """Every check that needs no model; all problems are reported together, one line each."""
    t, mem, problems = recipe.trainer, recipe.memory, Problems()
    check_sp_size(recipe.parallelism.sp_size)  # every count of ranks below divides by it: first, alone
    with problems.check():
        check_model_args(recipe.model)
    model_ok = not problems.found  # the checks below that read the model's config need it to be there
    if model_ok:
        with problems.check():
            check_lora_args(recipe.model)
        with problems.check():
            check_family(recipe)
    with problems.check():
        check_data_args(recipe.data)
    if recipe.model.use_peft and t.get("sync_ref_model"):
        problems.found.append(
            "`sync_ref_model` needs a reference copy, and LoRA has none (its reference is the base "
            "model with the adapters off): set `sync_ref_model: false`."
        )
    if recipe.model.use_peft and mem.sgd_in_backward:
        problems.found.append(
            "`memory.sgd_in_backward` emulates full fine-tuning of one ZeRO-3 rank; a LoRA run needs "
            "no emulation (its optimizer state is the adapters'): set `memory.sgd_in_backward: false`."
        )
    with problems.check():
        check_policy(mem.checkpointing)
    if recipe.parallelism.sp_size != 1 and model_ok:
        with problems.check():
            check_sequence_parallel(
                recipe.parallelism.sp_size,
                world_size,
                load_architecture(recipe.model),
                t,
                recipe.model.attn_implementation,
                evaluating=has_eval_data(recipe.data),
            )
    if model_ok:
        with problems.check():
            offloading.check(
                mem.offload_keep_layers,
                bool(t.get("activation_offloading")),
                lambda: load_architecture(recipe.model).num_hidden_layers,
            )
    if mem.allocator_conf:
        with problems.check():
            allocator.parse(mem.allocator_conf)
    with problems.check():
        liger.check(t, cuda_available)
    with problems.check():
        _check_run(recipe)
    with problems.check():
        check_mlp_split(mem.tiled_mlp, mem.mlp_chunks)
    with problems.check():
        padding_mask.check(mem.padding_mask)
    with problems.check():
        shared_prompt.check(
            recipe.data.shared_prompt,
            recipe.data.shared_prompt_min_saving,
            bool(t.get("padding_free")),
            mem.padding_mask,
        )
    for key in (
        "tiled_mlp",
        "mlp_chunks",
        "empty_cache_steps",
        "empty_cache_microbatches",
        "snapshot_steps",
        "profile_step",
    ):
        if getattr(mem, key) < 0:
            problems.found.append(f"`memory.{key}` must be >= 0, got {getattr(mem, key)}.")
    with problems.check():
        _check_trainer(recipe, world_size)
    with problems.check():
        _check_trl_values(t, has_eval_data(recipe.data))
    with problems.check():
        _check_hardware(recipe, cuda_available)
    problems.raise_if_any()


def _check_run(recipe: Recipe) -> None:
    run = recipe.run
    if run.on_nonfinite not in ("stop", "skip"):
        raise RecipeError(f"`run.on_nonfinite` must be stop or skip, got {run.on_nonfinite!r}.")
    if run.on_nonfinite == "skip" and recipe.memory.sgd_in_backward:
        raise RecipeError(
            "`run.on_nonfinite: skip` cannot skip updates that `memory.sgd_in_backward` applies inside "
            "backward; use `run.on_nonfinite: stop`."
        )
    for name in run.save_on_signals:
        if name not in ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT", "SIGHUP"):
            raise RecipeError(
                f"`run.save_on_signals`: {name!r} is not a signal a run can save on; use SIGUSR1, "
                "SIGUSR2, SIGTERM, SIGINT or SIGHUP."
            )


def _check_trainer(recipe: Recipe, world_size: int) -> None:
    t, mem = recipe.trainer, recipe.memory
    for key in ("gradient_checkpointing", "activation_checkpointing"):
        if key in t:
            raise RecipeError(
                "Set activation checkpointing with `memory.checkpointing` (layer = transformers' own per-layer "
                f"checkpointing), not `{key}`: remove that key."
            )
    if mem.empty_cache_steps and t.get("torch_empty_cache_steps"):
        raise RecipeError(
            "Both `memory.empty_cache_steps` and TRL's `torch_empty_cache_steps` are set, which would empty the cache "
            "twice; keep `memory.empty_cache_steps` (it also runs gc) and remove `torch_empty_cache_steps`."
        )
    derive_accumulation(recipe, world_size)
    if t.get("deepspeed"):
        check_deepspeed_config(t["deepspeed"])
    if mem.sgd_in_backward:
        if t.get("deepspeed") or world_size > 1:
            raise RecipeError(
                "`memory.sgd_in_backward` emulates one rank in a single process; drop the DeepSpeed "
                "config / launcher, or set `memory.sgd_in_backward: false`."
            )
        if t.get("gradient_accumulation_steps", trainer_default("gradient_accumulation_steps")) != 1:
            raise RecipeError(
                "`memory.sgd_in_backward` updates inside backward, so it needs `gradient_accumulation_steps: 1`."
            )
    check_max_length(t)


def check_max_length(t: dict) -> None:
    max_length = t.get("max_length", trainer_default("max_length"))
    if max_length is not None and (not is_number(max_length, whole=True) or max_length < 2):
        raise RecipeError(
            f"`max_length` must be an integer >= 2 (prompt + at least one completion token), got {max_length!r}."
        )


def trl_loss_types() -> list[str]:
    """The DPO losses TRL implements. TRL lists them only in DPOConfig's help text and in the error its loss raises
    at the first training step, once the model is loaded: read from the help, so that another TRL's list is used."""
    from trl import DPOConfig

    field = DPOConfig.__dataclass_fields__["loss_type"]
    return re.findall(r"`'(\w+)'`", field.metadata["help"].split("If multiple")[0])


def _check_trl_values(t: dict, evaluating: bool) -> None:
    """Values that TRL or torch refuse only once the models are loaded, or take silently (a negative beta, no
    epochs and no step limit: a run of no steps)."""
    problems = Problems()
    if t.get("eval_strategy", trainer_default("eval_strategy")) not in (None, "no") and not evaluating:
        problems.found.append(
            f"`eval_strategy: {t['eval_strategy']}` needs evaluation pairs: set `data.eval_files` (or "
            "`data.eval_split`), or `eval_strategy: no`."
        )
    max_steps = t.get("max_steps", trainer_default("max_steps"))
    if not is_number(max_steps, whole=True):  # the Trainer's progress loop fails on a fraction at its start
        problems.found.append(
            f"`max_steps` must be a whole number of optimizer steps (-1: by epochs), got {max_steps!r}."
        )
    epochs = t.get("num_train_epochs", trainer_default("num_train_epochs"))
    if isinstance(max_steps, int) and max_steps <= 0 and isinstance(epochs, (int, float)) and epochs <= 0:
        problems.found.append(
            f"`num_train_epochs: {epochs}` with no `max_steps` trains nothing: set `num_train_epochs` above 0 or "
            "`max_steps` to the steps to run."
        )
    mode = t.get("truncation_mode", trainer_default("truncation_mode"))
    if mode not in ("keep_start", "keep_end"):  # TRL's two (DPOConfig's help); its trainer refuses others
        problems.found.append(f"`truncation_mode` must be keep_start or keep_end, got {mode!r}.")
    beta = t.get("beta", trainer_default("beta"))
    if not is_number(beta) or beta <= 0:
        problems.found.append(
            f"`beta` must be a number > 0 (how strongly the policy is held to the reference, e.g. 0.1), got {beta!r}."
        )
    lr = t.get("learning_rate", trainer_default("learning_rate"))
    if not is_number(lr) or lr < 0:
        problems.found.append(f"`learning_rate` must be a number >= 0 (e.g. 5e-7), got {lr!r}.")
    smoothing = t.get("label_smoothing", trainer_default("label_smoothing"))  # TRL's DPOConfig help: in [0, 0.5)
    if not is_number(smoothing) or not 0 <= smoothing < 0.5:
        problems.found.append(
            f"`label_smoothing` must be in [0, 0.5) (the chance a preference label is flipped, e.g. 0.1), got "
            f"{smoothing!r}."
        )
    decay = t.get("weight_decay", trainer_default("weight_decay"))
    if not is_number(decay) or decay < 0:
        problems.found.append(f"`weight_decay` must be a number >= 0 (e.g. 0.0 or 0.01), got {decay!r}.")
    for kind in ("save", "logging", "eval"):  # transformers takes <= 0 silently (no saves) or refuses it late
        strategy, steps = t.get(f"{kind}_strategy", trainer_default(f"{kind}_strategy")), t.get(f"{kind}_steps")
        if str(strategy).lower().endswith("steps") and steps is not None:
            if not is_number(steps) or steps <= 0 or (steps > 1 and steps != int(steps)):
                problems.found.append(
                    f"`{kind}_steps` must be a whole number of steps >= 1 (or a fraction of the run below 1), got "
                    f"{steps!r}; to turn it off, set `{kind}_strategy: no`."
                )
    limit = t.get("save_total_limit")  # our rotation keeps the newest `limit`: 0 or below would delete every one
    if limit is not None and (not is_number(limit, whole=True) or limit < 1):
        problems.found.append(
            f"`save_total_limit` must be a whole number >= 1 (the checkpoints kept) or null (keep every one), got "
            f"{limit!r}."
        )
    workers = t.get("dataloader_num_workers", trainer_default("dataloader_num_workers"))
    if not is_number(workers, whole=True) or workers < 0:  # torch's DataLoader refuses it at the first step
        problems.found.append(
            f"`dataloader_num_workers` must be a whole number >= 0 (0 loads in the training process), got {workers!r}."
        )
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK  # what the Trainer accepts

    report_to = t.get("report_to") or []
    for name in [report_to] if isinstance(report_to, str) else report_to:
        if name not in INTEGRATION_TO_CALLBACK and name not in ("none", "all"):
            problems.found.append(
                f"`report_to: {name}` is not a logging integration; choose from tensorboard, "
                f"{', '.join(sorted(set(INTEGRATION_TO_CALLBACK) - {'tensorboard'}))}, or none."
            )
    seed = t.get("seed", trainer_default("seed"))  # numpy's range: the trainer's set_seed refuses others, late
    if not is_number(seed, whole=True) or not 0 <= seed < 2**32:
        problems.found.append(f"`seed` must be a whole number from 0 to 2**32 - 1, got {seed!r}.")
    loss_type = t.get("loss_type", trainer_default("loss_type"))
    names = [loss_type] if isinstance(loss_type, str) else list(loss_type or [])
    known = trl_loss_types()
    for name in names:
        if known and name not in known:
            problems.found.append(
                f"`loss_type: {name}` is not one of TRL's DPO losses; choose from {', '.join(known)}."
            )
    # Two of DPOTrainer's own refusals, which it makes only once the models are loaded (TRL 1.16, its __init__).
    if "exo_pair" in names and not smoothing:
        problems.found.append("`loss_type: exo_pair` needs `label_smoothing` above 0 (its paper uses 1e-3).")
    if t.get("use_weighting") and {"aot", "aot_unpaired"} & set(names):
        problems.found.append(
            "`use_weighting: true` (WPO) does not work with the `aot` losses, which sort the pairs: drop one "
            "of the two."
        )
    problems.raise_if_any()


def _check_hardware(recipe: Recipe, cuda_available: bool) -> None:
    """Precision, offloading and dtype against the machine; every one of them at once."""
    t, mem, problems = recipe.trainer, recipe.memory, Problems()
    if t.get("bf16") and t.get("fp16"):
        problems.found.append("`bf16: true` and `fp16: true` are both set; keep one (bf16 on H100/H200).")
    mixed = "bf16" if t.get("bf16") else "fp16" if t.get("fp16") else None
    if mixed and recipe.model.dtype in ("bfloat16", "float16") and recipe.model.dtype[0] != mixed[0]:
        problems.found.append(
            f"`model.dtype: {recipe.model.dtype}` with `{mixed}: true` mixes two 16-bit formats; set "
            f"`model.dtype: {'bfloat16' if mixed == 'bf16' else 'float16'}` or the other precision flag."
        )
    # Precision: DPOConfig defaults to bf16, which a CPU-only machine refuses.
    if not cuda_available and (t.get("bf16") or t.get("fp16")):
        problems.found.append("bf16/fp16 mixed precision needs a GPU; on CPU set `bf16: false` (or `--bf16 false`).")
    if not mem.offload_pin_memory and not t.get("activation_offloading"):
        problems.found.append(
            "`memory.offload_pin_memory: false` only changes TRL's activation offloading; set "
            "`activation_offloading: true` too, or drop it."
        )
    if not cuda_available and t.get("activation_offloading"):
        problems.found.append(
            "TRL's activation offloading moves activations to pinned host memory from a GPU; on a "
            "CPU-only machine set `activation_offloading: false`."
        )
    if not cuda_available and recipe.model.dtype != "float32":
        problems.found.append(f"`model.dtype: {recipe.model.dtype}` on a CPU-only machine: set `model.dtype: float32`.")
    problems.raise_if_any()


def check_processes_per_gpu(processes_on_node: int, gpus: int) -> None:
    """One process per GPU: more processes than GPUs on a node end in `invalid device ordinal` on every rank."""
    if processes_on_node > gpus:
        raise RecipeError(
            f"{processes_on_node} processes on this node but {gpus} GPU(s): start one per GPU "
            f"(`accelerate launch --num_processes {gpus} ...` or `deepspeed --num_gpus {gpus} ...`)."
        )


def derive_accumulation(recipe: Recipe, world_size: int) -> None:
    """`data.global_batch_size` is the intent: gradient_accumulation_steps = global / (per device x data-parallel
    ranks), set in the recipe and logged; an error only when it does not divide."""
    t = recipe.trainer
    per_device = t.get("per_device_train_batch_size", trainer_default("per_device_train_batch_size"))
    accum = t.get("gradient_accumulation_steps", trainer_default("gradient_accumulation_steps"))
    for key, value in (("per_device_train_batch_size", per_device), ("gradient_accumulation_steps", accum)):
        if not isinstance(value, int) or value < 1:
            raise RecipeError(f"`{key}` must be a positive integer, got {value!r}.")
    want = recipe.data.global_batch_size
    if want is None:
        return
    if not is_number(want, whole=True) or want < 1:
        raise RecipeError(
            f"`data.global_batch_size` must be a positive integer (pairs per optimizer step) or null, got {want!r}."
        )
    dp = world_size // recipe.parallelism.sp_size  # the ranks of a sequence-parallel group share their pairs
    if want % (per_device * dp):
        raise RecipeError(
            f"`data.global_batch_size: {want}` is not a multiple of per_device_train_batch_size ({per_device}) x "
            f"{dp} data-parallel ranks = {per_device * dp}; change one of them (or the GPU count)."
        )
    derived = want // (per_device * dp)
    if derived != accum and int(os.environ.get("RANK", 0)) == 0:
        logger.info(
            "gradient_accumulation_steps = %d, from data.global_batch_size %d / (%d per device x %d "
            "data-parallel ranks)%s",
            derived,
            want,
            per_device,
            dp,
            f"; the recipe's {accum} is replaced" if "gradient_accumulation_steps" in t else "",
        )
    t["gradient_accumulation_steps"] = derived


def resolve_report_to(trainer: dict) -> list[str]:
    """TensorBoard by default; a run must not fail when tensorboard is not installed."""
    report_to = trainer.get("report_to", ["tensorboard"])
    report_to = [report_to] if isinstance(report_to, str) else list(report_to or ["none"])
    if (
        "tensorboard" in report_to
        and importlib.util.find_spec("tensorboard") is None
        and importlib.util.find_spec("tensorboardX") is None
    ):
        logger.warning(
            "tensorboard is not installed: logging to TensorBoard is off for this run (pip install tensorboard)"
        )
        report_to = [r for r in report_to if r != "tensorboard"] or ["none"]
    missing = [r for r in report_to if r in REPORT_PACKAGES and importlib.util.find_spec(REPORT_PACKAGES[r]) is None]
    if missing:
        raise RecipeError(
            f"`report_to: {missing[0]}` needs the {REPORT_PACKAGES[missing[0]]} package, which is not "
            f"installed: `pip install {REPORT_PACKAGES[missing[0]]}`, or drop it from "
            "`report_to`."
        )
    return report_to


# transformers' logging integrations (report_to names) and the package each needs
REPORT_PACKAGES = {
    "wandb": "wandb",
    "comet_ml": "comet_ml",
    "mlflow": "mlflow",
    "neptune": "neptune",
    "clearml": "clearml",
    "dvclive": "dvclive",
    "swanlab": "swanlab",
    "trackio": "trackio",
    "codecarbon": "codecarbon",
    "azure_ml": "azureml",
    "dagshub": "dagshub",
    "flyte": "flytekit",
}
