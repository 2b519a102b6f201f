"""Every start-up check, run before any model is loaded or GPU memory touched: the recipe's sections (model, data,
trainer, run), each lever's own check (declared with the lever, longdpo/levers/, and run from here), and the machine
(processes per GPU, disk, optimizer packages).

Both commands run `check_recipe` the same way: training on the machine it runs on, the planner for the GPUs it plans
(whose packages and CUDA it cannot see). Each failure is one RecipeError sentence naming the key or flag that fixes
it; `check_recipe` reports every problem of a recipe at once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field

from transformers import Trainer
from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK  # what the Trainer accepts
from trl import DPOConfig

from longdpo.config import DataArgs, Recipe, RecipeError, is_number, resolve_path, trainer_default
from longdpo.data.loading import LOADERS, PAIR_COLUMNS, SOURCE_KEYS, has_eval_data
from longdpo.levers import as_yaml, default, levers, replica_ranks
from longdpo.model import families
from longdpo.model.build import check_model_args, load_architecture
from longdpo.model.lora import adapter_params, check_lora_args
from longdpo.planner.plan import checkpoint_bytes, checkpoints_kept, count_params

logger = logging.getLogger(__name__)


def deepspeed_config_path(recipe: Recipe) -> str | None:
    """The DeepSpeed config this launch runs with: the recipe's (`deepspeed`, or the launcher's positional JSON), else
    the one `accelerate launch` was given, else None (one process without DeepSpeed)."""
    return recipe.trainer.get("deepspeed") or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")


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


def check_family(recipe: Recipe, ctx: CheckContext) -> None:
    """Levers that patch decoder modules need a family whose modules they know; the plain `layer` policy (and TRL's
    own flags) run on any causal LM. Checked on the model's config, before loading."""
    patching = [lever for lever in levers() if lever.patches_decoder(recipe.levers)]
    if not patching:
        return
    model_type = getattr(ctx.architecture(), "model_type", None)
    if model_type not in families.FAMILIES:
        key = next(k for k in patching[0].keys if getattr(recipe.levers, k.name) != default(k))
        raise RecipeError(
            f"`{key.dotted}: {as_yaml(getattr(recipe.levers, key.name))}` patches the decoder layers of "
            f"{families.supported()} models; this model is {model_type!r}: set `{key.dotted}: "
            f"{as_yaml(default(key))}` (the levers that patch no decoder module still apply)."
        )


@dataclass
class CheckContext:
    """What a lever's start-up check may ask besides its settings: the recipe, the ranks, the machine, the model's
    config (read once, only when asked)."""

    recipe: Recipe
    world_size: int
    cuda_available: bool
    evaluating: bool = False
    on_this_machine: bool = True  # the run happens here (its packages count), not only planned here
    model_ok: bool = True  # the model section passed its checks (else its config cannot be read)
    _architecture: object = field(default=None, repr=False)

    def architecture(self):
        """The model's config; a check that needs it is skipped when the model section has problems of its own."""
        if not self.model_ok:
            raise SkipCheck()
        if self._architecture is None:
            self._architecture = load_architecture(self.recipe.model)
        return self._architecture


class SkipCheck(Exception):
    """A check that cannot be made while another problem stands (that problem is reported)."""


def check_data_args(args: DataArgs) -> None:
    """Start-up checks of the data section (nothing is read yet)."""
    if isinstance(args.train_files, str):
        args.train_files = [args.train_files]
    if isinstance(args.eval_files, str):
        args.eval_files = [args.eval_files]
    if args.synthetic is not None:
        fixed, mix = {"pairs", "seq_tokens", "prompt_tokens"}, {"pairs", "seq_tokens", "mix_seed"}
        named = set(args.synthetic) if isinstance(args.synthetic, dict) else set()
        if not (fixed <= named <= fixed | {"rejected_tokens"} or named == mix) or not all(
            type(v) is int for v in args.synthetic.values()
        ):
            raise RecipeError(
                f"`data.synthetic` must be a mapping of whole numbers with the keys {sorted(fixed)} (and optionally "
                "rejected_tokens), e.g. '{pairs: 4, seq_tokens: 65536, prompt_tokens: 4096}', or "
                f"{sorted(mix)} for a mix of pair shapes."
            )
        s = args.synthetic
        if "mix_seed" in s:
            if s["pairs"] < 1 or s["seq_tokens"] < 64:
                raise RecipeError("A mix in `data.synthetic` needs pairs >= 1 and seq_tokens >= 64.")
        elif s["pairs"] < 1 or not 0 < s["prompt_tokens"] < s["seq_tokens"] - 1:
            raise RecipeError("`data.synthetic` needs pairs >= 1 and 0 < prompt_tokens < seq_tokens - 1.")
        elif not 2 <= s.get("rejected_tokens", 2) <= s["seq_tokens"] - s["prompt_tokens"]:
            raise RecipeError(
                "`data.synthetic.rejected_tokens` (the rejected completion, EOS included) must be "
                "between 2 and seq_tokens - prompt_tokens (the chosen completion's length)."
            )
    given = [
        k
        for k, on in (
            ("train_files", args.train_files),
            ("dataset_name", args.dataset_name),
            ("mixture", args.mixture),
            ("synthetic", args.synthetic is not None),
        )
        if on
    ]
    if len(given) > 1:
        raise RecipeError(f"Set one source of training data; {' and '.join(f'`data.{k}`' for k in given)} are all set.")
    if not given:
        raise RecipeError(
            "No training data: set `data.train_files` (JSONL/JSON/Parquet files or a dataset directory), "
            "`data.dataset_name` (a Hub dataset) or `data.mixture`."
        )
    if args.columns is not None:
        _check_columns(args.columns, "data.columns")
    if args.mixture is not None:
        _check_mixture(args)
    if args.eval_split and not args.dataset_name:
        raise RecipeError(
            "`data.eval_split` names a split of `data.dataset_name`; for files use `data.eval_files`, "
            "in a mixture `test_split` per source."
        )
    files = (
        [("train_files", f) for f in args.train_files]
        + [("eval_files", f) for f in args.eval_files]
        + [(f"mixture[{i}].files", f) for i, src in enumerate(args.mixture or []) for f in src.get("files", [])]
    )
    for key, f in files:
        path = resolve_path(f)
        if not os.path.exists(path):
            raise RecipeError(f"`data.{key}` entry {f!r} does not exist; fix the path in the recipe.")
        if os.path.isfile(path) and os.path.splitext(path)[1] not in LOADERS:
            raise RecipeError(
                f"`data.{key}` entry {f!r} has an unsupported extension; use .jsonl, .json, .parquet "
                "or a `datasets.save_to_disk` directory."
            )
    if args.max_train_samples is not None and args.max_train_samples < 1:
        raise RecipeError(f"`data.max_train_samples` must be at least 1, got {args.max_train_samples}.")


def _check_columns(columns, key: str) -> None:
    if (
        not isinstance(columns, dict)
        or not columns
        or not set(columns) <= set(PAIR_COLUMNS)
        or not all(isinstance(v, str) for v in columns.values())
    ):
        raise RecipeError(
            f"`{key}` maps TRL's column names to yours: `{{prompt: question, chosen: good, rejected: "
            f"bad}}` (keys among {', '.join(PAIR_COLUMNS)}), got {columns!r}."
        )


def _check_mixture(args: DataArgs) -> None:
    if not isinstance(args.mixture, list) or not args.mixture:
        raise RecipeError("`data.mixture` is a list of sources: `[{name: org/a, fraction: 0.5}, {files: [b.jsonl]}]`.")
    for i, src in enumerate(args.mixture):
        key = f"data.mixture[{i}]"
        if not isinstance(src, dict):
            raise RecipeError(f"`{key}` must be a mapping like `{{name: org/dataset, fraction: 0.5}}`, got {src!r}.")
        unknown = set(src) - set(SOURCE_KEYS)
        if unknown:
            raise RecipeError(f"`{key}` has unknown key(s) {sorted(unknown)}; a source takes {', '.join(SOURCE_KEYS)}.")
        if ("name" in src) == ("files" in src):
            raise RecipeError(f"`{key}` needs exactly one of `name` (a Hub dataset or dataset folder) and `files`.")
        if isinstance(src.get("files"), str):
            src["files"] = [src["files"]]
        fraction = src.get("fraction", 1.0)
        if not is_number(fraction) or not 0 < fraction <= 1:
            raise RecipeError(
                f"`{key}.fraction` is the share of the source's rows to train on, in (0, 1]; got {fraction!r}."
            )
        if "columns" in src:
            _check_columns(src["columns"], f"{key}.columns")
        if "files" in src and "test_split" in src:
            raise RecipeError(
                f"`{key}`: `test_split` names a split of a `name` source; for files use `data.eval_files`."
            )


class Problems:
    """Collects the start-up problems so that one run reports them all (each check raises at its first)."""

    def __init__(self):
        self.found: list[str] = []

    @contextlib.contextmanager
    def check(self):
        try:
            yield
        except SkipCheck:
            pass
        except RecipeError as e:
            self.found += [line for line in str(e).splitlines() if line not in self.found]

    def raise_if_any(self) -> None:
        if self.found:
            raise RecipeError("\n".join(self.found))


def check_recipe(recipe: Recipe, world_size: int, cuda_available: bool, on_this_machine: bool = True) -> None:
    """Every check that needs no model; all problems are reported together, one line each. `on_this_machine`
    False: planned for GPUs elsewhere (`cuda_available` True then), so this machine's packages do not count."""
    t, mem, problems = recipe.trainer, recipe.memory, Problems()
    ctx = CheckContext(recipe, world_size, cuda_available, has_eval_data(recipe.data), on_this_machine)
    with problems.check():
        check_model_args(recipe.model)
    model_ok = not problems.found  # the checks below that read the model's config need it to be there
    if model_ok:
        with problems.check():
            check_lora_args(recipe.model)
        with problems.check():
            check_family(recipe, ctx)
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
    ctx.model_ok, levers_ok = model_ok, True
    for lever in levers():
        found = len(problems.found)
        with problems.check():
            lever.check(recipe.levers, ctx)
        levers_ok &= len(problems.found) == found
    with problems.check():
        _check_run(recipe)
    for key in ("snapshot_steps", "profile_step"):
        if getattr(mem, key) < 0:
            problems.found.append(f"`memory.{key}` must be >= 0, got {getattr(mem, key)}.")
    with problems.check():
        _check_trainer(recipe, world_size, levers_ok)
    with problems.check():
        _check_trl_values(t, ctx.evaluating)
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


def _check_trainer(recipe: Recipe, world_size: int, levers_ok: bool = True) -> None:
    t, mem = recipe.trainer, recipe.memory
    if levers_ok:  # the ranks of a replica (sequence parallelism) divide the world: a bad value is its lever's line
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
    help_text = DPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    return re.findall(r"`'(\w+)'`", help_text.split("If multiple")[0])


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
    t, problems = recipe.trainer, Problems()
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
    dp = world_size // replica_ranks(recipe.levers)  # the ranks of a sequence-parallel group share their pairs
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


# ---- the machine: disk, optimizer packages -------------------------------------------------------------------------


def free_bytes(output_dir: str) -> int:
    path = os.path.abspath(output_dir)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def disk_space(output_dir: str, one_checkpoint: float, kept: int, final_weights: float) -> str | None:
    """A RecipeError when not even one checkpoint (or the final model) fits; a warning line when all of them do
    not; None when they do."""
    free = free_bytes(output_dir)
    first = one_checkpoint if kept else final_weights
    total = kept * one_checkpoint + final_weights
    if first > free:
        what = "one checkpoint" if kept else "the final model"
        raise RecipeError(
            f"{what} needs {first / 1e9:.1f} GB but {output_dir} has {free / 1e9:.1f} GB free; free "
            "space there or set `output_dir` to a larger disk."
        )
    if total > free:
        return (
            f"disk: {kept} checkpoint(s) of {one_checkpoint / 1e9:.1f} GB plus the final model "
            f"({final_weights / 1e9:.1f} GB) need {total / 1e9:.1f} GB, {output_dir} has {free / 1e9:.1f} GB "
            "free: lower `save_total_limit` or free space before the later saves"
        )
    return None


def check_disk_space(recipe, output_dir: str, final_save: bool) -> str | None:
    """A recipe's checkpoints and final model against the output dir's free space, before any model is loaded: an
    error when not even one fits, a warning line (returned) when not all kept ones do."""
    try:
        params = count_params(load_architecture(recipe.model))[0]
    except (AttributeError, KeyError, TypeError):  # an architecture the planner cannot size
        return None
    t = recipe.trainer
    dtype_bytes = 4 if recipe.model.dtype == "float32" else 2
    ds_path = deepspeed_config_path(recipe)
    zero3 = bool(ds_path) and check_deepspeed_config(ds_path).get("zero_optimization", {}).get("stage") == 3
    final, lora = params * dtype_bytes, 0
    if recipe.model.use_peft:  # the adapters (fp32), and the merged model when asked
        lora = adapter_params(recipe.model)
        final = lora * 4 + (final if recipe.model.lora_save_merged else 0)
    one = checkpoint_bytes(params, dtype_bytes, zero3, not t.get("save_only_model"), lora)
    return disk_space(output_dir, one, checkpoints_kept(t), final if final_save else 0)


def check_optimizer(args) -> None:
    """An `optim` whose package is missing (bitsandbytes for the 8-bit ones, torchao, ...) fails only when the
    trainer makes the optimizer, after the models loaded, with an ImportError traceback: asked of transformers'
    Trainer here instead, once TRL's arguments exist."""
    try:
        Trainer.get_optimizer_cls_and_kwargs(args)
    except ImportError as e:
        name = getattr(args.optim, "value", args.optim)
        raise RecipeError(f"`optim: {name}` needs a package that is not installed: {e}") from None
    except ValueError:  # optimizers built around the model (GaLore, APOLLO): the trainer checks those itself
        pass
