"""Recipe schema: a flat YAML of TRL `DPOConfig` fields plus sections of our own.

    # Model arguments      -> model:  (ModelArgs)
    # Data arguments       -> data:   (DataArgs)
    # Memory levers        -> memory: (the levers' keys, and MemoryArgs: telemetry, profiling, emulation)
    # Sequence parallelism -> parallelism: (the sequence-parallel lever's key)
    # Long runs            -> run:    (RunArgs: save on preemption, disk check)
    # DPOTrainer arguments -> top level, exactly the fields of trl.DPOConfig

The levers' keys are declared by the levers themselves (longdpo/levers/): a recipe's settings of them are one
`LeverSet`, `recipe.levers`. Command-line `--key value` overrides the YAML; section keys are dotted
(`--memory.checkpointing attn_mlp`). `read_raw` is plain Python (the allocator setting is applied from it before
torch is imported); `load_recipe` reads the levers' declarations, which import torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from longdpo.recipe_values import RecipeError, dpo_fields, is_number, trainer_default  # noqa: F401  (re-exported: the schema is where callers look for them)

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIPPED = Path(__file__).resolve().parent / "recipes"  # the recipes folder, where the package is installed


@dataclass
class ModelArgs:
    """Which model to train.

    name_or_path (str, defaults to None): a local Hugging Face model directory (config + weights + tokenizer) or a
        Hub id (`mistralai/Mistral-Nemo-Instruct-2407`), loaded by `from_pretrained` through the Hugging Face cache.
    architecture (str, defaults to None): an architecture JSON (e.g. recipes/architectures/mistral_nemo_12b.json);
        the model is randomly initialised from it, for benchmarks. Exactly one of name_or_path / architecture.
    num_hidden_layers (int, defaults to None): override the layer count (reduced-layer runs of a big architecture).
    tokenizer (str, defaults to None): a tokenizer directory or Hub id, or a byte-level tokenizer built in code (one
        token per UTF-8 byte): `byte` (a minimal chat template), `byte-llama3` (Llama-3 header tokens and template),
        `byte-chatml` (Qwen's ChatML), `byte-mistral` (Mistral's [INST] template). Defaults to name_or_path.
    chat_template (str, defaults to None): a chat template that sets or replaces the tokenizer's: a Jinja file
        (.jinja / .j2 / .txt) or the template itself. Needed for conversational data when the tokenizer has none.
    dtype (str, defaults to "bfloat16"): parameter dtype: bfloat16, float16 or float32.
    attn_implementation (str, defaults to "sdpa"): sdpa, eager or flash_attention_2.
    init_seed (int, defaults to 0): seed of the random initialisation; the reference model of a random-init run is
        built with the same seed, so it is an identical copy of the policy (step-0 loss = ln 2).

    LoRA (longdpo/model/lora.py; the names of TRL's `ModelConfig`, passed to TRL's `get_peft_config`):
    use_peft (bool, defaults to False): train LoRA adapters instead of all weights. The reference is the base model
        with the adapters switched off: no second copy of the weights, no gradients or optimizer state for them.
    lora_r (int, defaults to 16): adapter rank.
    lora_alpha (int, defaults to 32): adapter scale numerator (scale = lora_alpha / lora_r, or / sqrt(r) with rsLoRA).
    lora_dropout (float, defaults to 0.05): dropout on the adapters' input.
    lora_target_modules (list[str] | str, defaults to None): module names to adapt (`[q_proj, k_proj, v_proj,
        o_proj, gate_proj, up_proj, down_proj]`), `all-linear`, or a regex; None: PEFT's default for the family
        (q_proj and v_proj for Mistral, Llama, Qwen2 and Qwen3).
    lora_target_parameters (list[str], defaults to None): parameters to adapt directly (PEFT's target_parameters).
    lora_modules_to_save (list[str], defaults to None): modules trained in full and saved beside the adapter
        (e.g. `[lm_head, embed_tokens]` after adding tokens).
    lora_task_type (str, defaults to "CAUSAL_LM"): PEFT task type.
    use_rslora (bool, defaults to False): rank-stabilised LoRA scaling (lora_alpha / sqrt(r)).
    use_dora (bool, defaults to False): weight-decomposed LoRA (DoRA).
    lora_save_merged (bool, defaults to False): also write the adapter merged into the base weights to
        `<output_dir>/merged` (a plain model; needs `name_or_path`). The adapter itself is always saved.
    """

    name_or_path: str | None = None
    architecture: str | None = None
    num_hidden_layers: int | None = None
    tokenizer: str | None = None
    dtype: str = "bfloat16"
    attn_implementation: str = "sdpa"
    init_seed: int = 0
    use_peft: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: list[str] | str | None = None
    lora_target_parameters: list[str] | None = None
    lora_modules_to_save: list[str] | None = None
    lora_task_type: str = "CAUSAL_LM"
    use_rslora: bool = False
    use_dora: bool = False
    lora_save_merged: bool = False
    chat_template: str | None = None


@dataclass
class DataArgs:
    """Which preference pairs to train on.

    train_files (list[str], required): JSONL / JSON / Parquet files, or one `datasets.save_to_disk` directory.
        Rows are TRL preference pairs: `prompt`/`chosen`/`rejected` strings or message lists, or implicit-prompt
        `chosen`/`rejected` conversations.
    eval_files (list[str], defaults to []): the same, for evaluation.
    max_train_samples (int, defaults to None): keep only the first N training pairs.
    global_batch_size (int, defaults to None): if set, checked at start-up against
        per_device_train_batch_size x gradient_accumulation_steps x data-parallel ranks.
    synthetic (dict, defaults to None): instead of files, `{pairs: N, seq_tokens: L, prompt_tokens: P}` builds N
        standard pairs of exactly L tokens (prompt + completion + EOS) for the byte tokenizer (benchmarks).
    dataset_name (str, defaults to None): instead of files, a Hub dataset id (through your Hugging Face cache) or a
        local dataset folder, loaded with `datasets.load_dataset(dataset_name, dataset_config, split=dataset_split)`.
    dataset_config (str, defaults to None): its configuration (subset) name.
    dataset_split (str, defaults to "train"): the split to train on.
    eval_split (str, defaults to None): a split of `dataset_name` to evaluate on (e.g. `test`).
    columns (dict, defaults to None): your column names for TRL's, e.g. `{prompt: question, chosen: response_chosen,
        rejected: response_rejected}`; other columns are dropped.
    mixture (list[dict], defaults to None): several sources mixed as alignment-handbook's `dataset_mixer`: each
        `{name: org/dataset, config, split, fraction, columns, test_split}` or `{files: [...], fraction, columns}`;
        the first `fraction` (in (0, 1]) of each source's rows, concatenated and shuffled (seed 42); the
        `test_split`s, whole, are the evaluation set.
    """

    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)
    max_train_samples: int | None = None
    global_batch_size: int | None = None
    synthetic: dict | None = None
    dataset_name: str | None = None
    dataset_config: str | None = None
    dataset_split: str = "train"
    eval_split: str | None = None
    columns: dict | None = None
    mixture: list[dict] | None = None


@dataclass
class MemoryArgs:
    """Measuring memory, and the per-rank emulation (the memory levers' own keys: longdpo/levers/).

    snapshot_steps (int, defaults to 0): record CUDA memory history for the first N steps and dump a snapshot
        (open it at https://pytorch.org/memory_viz).
    profile_step (int, defaults to 0): profile optimizer step N with torch.profiler and write where its time went, by
        module kind and phase (forward, recompute, backward, offload copies), to profile_step<N>.md, and the whole trace
        to profile_step<N>.trace.json.gz (open it in https://ui.perfetto.dev; longdpo/training/profiling.py).
    telemetry (bool, defaults to True): per-step memory/time telemetry to the logs and memory.jsonl.
    sgd_in_backward (bool, defaults to False): the per-rank emulation, one process: apply SGD to each parameter in
        backward and free its gradient at once (what a ZeRO-3 rank keeps); see longdpo/model/emulation.py.
    memory_cap_gb (float, defaults to None): cap this process's GPU memory (torch.cuda.set_per_process_memory_fraction),
        e.g. 80 to emulate an 80 GB H100 on a larger GPU.
    """

    snapshot_steps: int = 0
    profile_step: int = 0
    telemetry: bool = True
    sgd_in_backward: bool = False
    memory_cap_gb: float | None = None


@dataclass
class RunArgs:
    """How a long run survives the cluster (longdpo/cluster/: checkpoints, signals).

    save_on_signals (list[str], defaults to [SIGUSR1, SIGTERM]): signals that save a checkpoint at the next step
        boundary (every rank at the same step) and exit with status 75; `[]` leaves the signals' default actions.
    check_disk (bool, defaults to True): at start-up, compare the checkpoints' size with the output dir's free space
        (an error if not even one fits, a warning if not all kept ones do).
    on_nonfinite (str, defaults to "stop"): a non-finite loss or gradient norm on any rank either stops the run at
        that step (`stop`, exit status 4) or leaves that step's update out and goes on (`skip`, logged per step).
    """

    save_on_signals: list[str] = field(default_factory=lambda: ["SIGUSR1", "SIGTERM"])
    check_disk: bool = True
    on_nonfinite: str = "stop"


# Our sections and the dataclass of each one's own keys (None: its keys are all levers')
SECTIONS = {"model": ModelArgs, "data": DataArgs, "memory": MemoryArgs, "parallelism": None, "run": RunArgs}


@dataclass
class Recipe:
    model: ModelArgs
    data: DataArgs
    memory: MemoryArgs
    run: RunArgs
    trainer: dict  # DPOConfig keyword arguments (validated names, coerced types)
    levers: object  # longdpo.levers.LeverSet: every lever's settings
    path: str | None = None


def _suggest(key: str, valid) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    return f" Did you mean `{close[0]}`?" if close else ""


def _coerce(value, annotation, key: str):
    """YAML gives `1e-6` as a string and the command line gives everything as strings: convert by field type."""
    if isinstance(annotation, str):  # postponed annotations
        annotation = {"int": int, "float": float, "bool": bool, "str": str}.get(annotation.split(" |")[0], None)
    args = typing.get_args(annotation)
    if isinstance(value, bool) and annotation is not bool and bool not in args:
        # YAML 1.1 reads `save_strategy: no` as False; a field without a bool type meant the word.
        return "no" if value is False else "yes"
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        if value is None and type(None) in args:
            return None
        for a in args:  # first scalar type that accepts the value
            if a in (bool, int, float):
                try:
                    return _coerce(value, a, key)
                except RecipeError:
                    continue
        return value
    if annotation is bool and isinstance(value, str):
        if value.lower() in ("true", "1", "yes"):
            return True
        if value.lower() in ("false", "0", "no"):
            return False
        raise RecipeError(f"`{key}` must be true or false, got {value!r}.")
    if annotation in (int, float) and isinstance(value, str):
        try:
            return annotation(float(value)) if annotation is int and float(value).is_integer() else annotation(value)
        except ValueError:
            raise RecipeError(f"`{key}` must be a number ({annotation.__name__}), got {value!r}.") from None
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _parse_value(text: str):
    """Command-line values are parsed as YAML scalars/lists: `true`, `3`, `[a, b]`, `null`."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_overrides(argv: list[str]) -> dict:
    """`--key value` / `--key=value` pairs -> nested dict (dotted keys go into sections)."""
    out: dict = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise RecipeError(f"Unexpected argument {arg!r}: overrides are `--key value` (e.g. `--max_steps 10`).")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise RecipeError(f"`--{key}` needs a value: `--{key} <value>`.")
            value = argv[i + 1]
            i += 1
        i += 1
        section, dot, sub = key.partition(".")
        if dot:
            out.setdefault(section, {})[sub] = _parse_value(value)
        else:
            out[key] = _parse_value(value)
    return out


def _merge(base: dict, overrides: dict) -> dict:
    merged = dict(base)
    for key, value in overrides.items():
        if key in SECTIONS and isinstance(value, dict):
            merged[key] = {**(merged.get(key) or {}), **value}
        else:
            merged[key] = value
    return merged


def _build_section(name: str, values) -> tuple[object, dict]:
    """(the section's own dataclass, or None; the values of the levers' keys in it), every key checked."""
    from longdpo.levers import section_keys  # waits: the levers' modules import this one

    cls = SECTIONS[name]
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise RecipeError(f"`{name}:` must be a mapping of keys, got {type(values).__name__}.")
    fields = {f.name: f.type for f in dataclasses.fields(cls)} if cls else {}
    levers = {key: k.type for key, k in section_keys(name).items()}
    kwargs, lever_values = {}, {}
    for key, value in values.items():
        if key in fields:
            kwargs[key] = _coerce(value, fields[key], f"{name}.{key}")
        elif key in levers:
            lever_values[key] = _coerce(value, levers[key], f"{name}.{key}")
        else:
            valid = [*fields, *levers]
            raise RecipeError(f"Unknown key `{name}.{key}`.{_suggest(key, valid)} Valid keys: {', '.join(valid)}.")
    return (cls(**kwargs) if cls else None), lever_values


def read_raw(path: str | os.PathLike | None, overrides: dict | None = None) -> dict:
    """The recipe YAML with overrides merged, as plain data. Pure Python: the entrypoint reads the memory section
    through this before torch is imported (the allocator must be set before CUDA starts)."""
    raw: dict = {}
    if path is not None:
        path = Path(resolve_path(str(path)))
        if not path.is_file():
            raise RecipeError(f"Recipe file {str(path)!r} does not exist; pass an existing YAML with `--recipe`.")
        text = path.read_text()
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            tabs = [n for n, line in enumerate(text.splitlines(), 1) if "\t" in line[: len(line) - len(line.lstrip())]]
            if tabs:
                raise RecipeError(
                    f"Recipe {str(path)!r} indents line {tabs[0]} with a tab: indent YAML with spaces."
                ) from None
            raise RecipeError(f"Recipe {str(path)!r} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise RecipeError(f"Recipe {str(path)!r} must be a YAML mapping of keys.")
    return _merge(raw, overrides or {})


def load_recipe(path: str | os.PathLike | None, overrides: dict | None = None) -> Recipe:
    """Read a recipe YAML, apply overrides, check every key. Raises RecipeError naming the fix."""
    from longdpo.levers import LeverSet, keys  # waits: the levers' modules import this one

    raw = read_raw(path, overrides)

    fields = dpo_fields()
    built = {name: _build_section(name, raw.get(name)) for name in SECTIONS}
    trainer = {}
    for key, value in raw.items():
        if key in SECTIONS:
            continue
        if key not in fields:
            home = next(
                (name for name, cls in SECTIONS.items() if cls and key in {f.name for f in dataclasses.fields(cls)}),
                keys()[key][1].section if key in keys() else None,
            )
            if home:  # e.g. TRL's `--use_peft` / `--lora_r`, which live under `model:` here
                raise RecipeError(
                    f"`{key}` is a `{home}:` key: write `{home}.{key}` in the recipe "
                    f"(`--{home}.{key}` on the command line)."
                )
            valid = list(fields) + list(SECTIONS)
            raise RecipeError(
                f"Unknown key `{key}`: not a DPOConfig field nor a section (model/data/memory/parallelism/run)."
                f"{_suggest(key, valid)}"
            )
        trainer[key] = _coerce(value, fields[key].type, key)
    lever_values = {name: values for name, (_, values) in built.items()}
    return Recipe(
        model=built["model"][0],
        data=built["data"][0],
        memory=built["memory"][0],
        run=built["run"][0],
        trainer=trainer,
        levers=LeverSet.from_recipe({**lever_values, "trainer": trainer}),
        path=str(path) if path is not None else None,
    )


def resolve_path(p: str) -> str:
    """Paths in recipes are relative to the working directory, else to the repository (a checkout), else
    `recipes/...` names a shipped recipe, architecture or data file (an installed package holds them)."""
    if os.path.exists(p) or os.path.isabs(p):
        return p
    for candidate in (REPO_ROOT / p, SHIPPED / Path(p).relative_to("recipes") if p.startswith("recipes/") else None):
        if candidate is not None and candidate.exists():
            return str(candidate)
    return p


def describe_keys() -> str:
    """Every key of our sections with its documentation (`--help`): the dataclasses' docstrings, and the levers'
    declarations (longdpo/levers/), with the top-level TRL keys the levers act on."""
    from longdpo.levers import default, section_keys  # waits: the levers' modules import this one

    def lever_line(section: str, key) -> str:
        kind = key.type if isinstance(key.type, str) else key.type.__name__
        where = "" if section == "trainer" else f"{section}."
        return f"  {where}{key.name} ({kind}, defaults to {default(key)!r}): {key.doc}"

    lines = []
    for section, cls in SECTIONS.items():
        title = cls.__doc__.strip().splitlines()[0] if cls else "the memory levers' keys"
        lines.append(f"\n{section}:  ({title})")
        fields = {f.name for f in dataclasses.fields(cls)} if cls else set()
        for line in (cls.__doc__ if cls else "").splitlines():
            name = line.strip().split(" (")[0]
            if line.startswith("    ") and not line.startswith("        ") and name in fields:
                lines.append(f"  {section}.{line.strip()}")
            elif line.startswith("        ") and lines[-1].startswith(f"  {section}."):
                lines[-1] += " " + line.strip()
        lines += [lever_line(section, key) for key in section_keys(section).values()]
    lines.append("\ntop level:  (TRL's DPOConfig fields that are levers here)")
    lines += [lever_line("trainer", key) for key in section_keys("trainer").values()]
    return "\n".join(lines)


class HelpRequested(Exception):
    """`--help`: print the usage and exit 0."""


def parse_cli(argv: list[str]) -> dict:
    """Split launcher arguments from recipe overrides: --recipe, --local_rank (from `deepspeed`), a positional
    DeepSpeed JSON, --deepspeed, --resume_from_checkpoint, --no_final_save, --skip-preflight, --overwrite_output_dir;
    everything else is `--key value`."""
    cli = {
        "recipe": None,
        "deepspeed": None,
        "resume": None,
        "save": True,
        "preflight": True,
        "overwrite": False,
        "overrides": {},
    }
    own = ("--recipe", "--local_rank", "--local-rank", "--resume_from_checkpoint", "--deepspeed")
    rest = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg in ("--help", "-h"):
            raise HelpRequested()
        if not arg.startswith("--"):
            if not arg.endswith(".json"):
                raise RecipeError(f"Unexpected argument {arg!r}: overrides are `--key value` (e.g. `--max_steps 10`).")
            cli["deepspeed"] = arg  # `deepspeed launch/train_dpo.py ds_configs/zero3.json ...`
            continue
        key, eq, value = arg.partition("=")
        if key == "--no_final_save":  # benchmarks: a random-init 12B model is not worth 24 GB of disk
            cli["save"] = False
            continue
        if key == "--skip-preflight":
            cli["preflight"] = False
            continue
        if key == "--overwrite_output_dir":  # replace an earlier run's checkpoints and records in output_dir
            cli["overwrite"] = True
            continue
        if not eq:  # the value is the next argument, whatever it looks like
            if i >= len(argv) or argv[i].startswith("--"):
                raise RecipeError(f"`{key}` needs a value: `{key} <value>`.")
            value = argv[i]
            i += 1
        if key not in own:
            rest += [key, value]
        elif key == "--recipe":
            cli["recipe"] = value
        elif key in ("--local_rank", "--local-rank"):
            os.environ.setdefault("LOCAL_RANK", value)
        elif key == "--resume_from_checkpoint":
            cli["resume"] = {"true": True, "auto": "auto"}.get(value.lower(), value)
        else:
            cli["deepspeed"] = value
    cli["overrides"] = parse_overrides(rest)
    if cli["deepspeed"]:
        cli["overrides"]["deepspeed"] = cli["deepspeed"]
    return cli
