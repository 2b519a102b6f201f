"""Preference data through `datasets`: local files or a save_to_disk directory, a Hub dataset, or a mixture.

Both TRL formats pass through untouched (TRL's DPOTrainer applies chat templates and extracts implicit prompts):
  standard:        {"prompt": str, "chosen": str, "rejected": str}
  conversational:  {"prompt": [messages], "chosen": [messages], "rejected": [messages]}
  implicit prompt: {"chosen": [messages], "rejected": [messages]}   (shared leading turns become the prompt)
The data section's values are checked before anything is read (longdpo/checks.py); what only reading can tell
(an empty file, a line that is not JSON, missing columns, a chat template that refuses a row) is checked here.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile

import datasets
from huggingface_hub import constants
from jinja2 import TemplateError

from longdpo.config import DataArgs, RecipeError, resolve_path
from longdpo.data.synthetic import mixed_pairs, synthetic_pairs, write_jsonl

LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
PAIR_COLUMNS = ("prompt", "chosen", "rejected")
SOURCE_KEYS = ("name", "files", "config", "split", "test_split", "fraction", "columns")


def _read_files(files: list[str], key: str):
    """JSONL / JSON / Parquet files, or one `save_to_disk` directory, as one `datasets.Dataset`."""
    paths = [resolve_path(f) for f in files]
    if len(paths) == 1 and os.path.isdir(paths[0]):
        ds = datasets.load_from_disk(paths[0])
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise RecipeError(f"`data.{key}`: the DatasetDict at {files[0]!r} has no `train` split.")
            ds = ds["train"]
        return ds
    exts = {os.path.splitext(p)[1] for p in paths}
    builders = {LOADERS.get(e) for e in exts}
    if len(builders) != 1 or None in builders:
        raise RecipeError(f"`data.{key}` mixes file types {sorted(exts)}; use one of .jsonl/.json/.parquet.")
    empty = [f for f, p in zip(files, paths) if os.path.getsize(p) == 0]
    if empty:
        raise RecipeError(f"`data.{key}` file(s) {empty} are empty; fill them or remove them from the recipe.")
    for f, p in zip(files, paths):
        if p.endswith(".jsonl"):
            _check_first_json_line(f, p, key)
    # datasets logs a failed parse at ERROR before raising: our one line says it, with the fix
    ds_logger = datasets.utils.logging.get_logger("datasets")
    level = ds_logger.level
    ds_logger.setLevel(logging.CRITICAL)
    try:
        return datasets.load_dataset(builders.pop(), data_files=paths, split="train")
    except datasets.exceptions.DatasetGenerationError as e:
        cause = e.__cause__ or e
        raise RecipeError(
            f"`data.{key}` could not be read ({type(cause).__name__}: {str(cause)[:200]}); "
            "fix the file (one JSON object per line for .jsonl)."
        ) from None
    finally:
        ds_logger.setLevel(level)


def _check_first_json_line(name: str, path: str, key: str) -> None:
    """A file that is not JSON Lines at all is told before `datasets` reads it (and logs its own lines)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise RecipeError(
                        f"`data.{key}` {name!r} line {number} is not JSON ({e}); a .jsonl file holds "
                        "one JSON object per line."
                    ) from None
                if not isinstance(row, dict):
                    raise RecipeError(
                        f"`data.{key}` {name!r} line {number} is a JSON {type(row).__name__}, not an "
                        "object; a .jsonl file holds one JSON object per line."
                    )
                return


def _read_hub(name: str, config: str | None, split: str, key: str):
    """A dataset by Hub id (from the `datasets` cache, or the Hub) or a local dataset folder, via load_dataset."""
    local = resolve_path(name)
    try:
        return datasets.load_dataset(local if os.path.isdir(local) else name, config, split=split)
    except (FileNotFoundError, ConnectionError, ValueError, datasets.exceptions.DatasetNotFoundError) as e:
        offline = (
            (
                " (HF_HUB_OFFLINE=1 is set: only datasets loaded before are read; unset it, or load the dataset "
                "once with network)"
            )
            if constants.HF_HUB_OFFLINE
            else ""
        )
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise RecipeError(
            f"`{key}` {name!r} (config {config!r}, split {split!r}) could not be loaded{offline}: {reason}"
        ) from None


def _check_pairs(ds, key: str):
    missing = {"chosen", "rejected"} - set(ds.column_names)
    if missing:
        raise RecipeError(
            f"`data.{key}` rows lack column(s) {sorted(missing)} (found {ds.column_names}); preference pairs need "
            "`chosen` and `rejected` (and `prompt`, unless chosen/rejected are conversations sharing their prompt); "
            "map other names with `data.columns: {prompt: ..., chosen: ..., rejected: ...}`."
        )
    if len(ds) == 0:
        raise RecipeError(f"`data.{key}` holds no rows.")
    return ds


def load_preferences(files: list[str], key: str = "train_files", max_samples: int | None = None):
    """Load the files into one `datasets.Dataset` and check it holds preference pairs."""
    ds = _check_pairs(_read_files(files, key), key)
    if max_samples is not None:
        ds = ds.select(range(min(max_samples, len(ds))))
    return ds


def _renamed(ds, columns: dict | None, key: str):
    """`columns: {prompt: question, ...}`: the dataset's columns renamed to TRL's; the others dropped."""
    if columns:
        absent = [src for src in columns.values() if src not in ds.column_names]
        if absent:
            raise RecipeError(
                f"`{key}` maps from column(s) {absent} that the data does not have (found {ds.column_names})."
            )
        ds = ds.rename_columns({src: dst for dst, src in columns.items() if src != dst})
    keep = [c for c in PAIR_COLUMNS if c in ds.column_names]
    return ds.select_columns(keep) if keep else ds


def sources(args: DataArgs) -> list[dict]:
    """The data section as a list of sources: a mixture, one Hub dataset, or files."""
    if args.mixture:
        return args.mixture
    if args.dataset_name:
        return [
            {
                "name": args.dataset_name,
                "config": args.dataset_config,
                "split": args.dataset_split,
                "columns": args.columns,
                "test_split": args.eval_split,
            }
        ]
    return [{"files": args.train_files, "columns": args.columns}]


def _load_source(src: dict, i: int | None, split_key: str = "split"):
    where = "data" if i is None else f"data.mixture[{i}]"
    if "files" in src:
        ds = _read_files(src["files"], "train_files" if i is None else f"mixture[{i}].files")
    else:
        ds = _read_hub(
            src["name"],
            src.get("config"),
            src.get(split_key) or "train",
            "data.dataset_name" if i is None else f"{where}.name",
        )
    return _renamed(ds, src.get("columns"), f"{where}.columns")


def _concatenate(parts: list, key: str):
    if len(parts) == 1:
        return parts[0]
    try:
        return datasets.concatenate_datasets(parts).shuffle(seed=42)  # alignment-handbook's dataset_mixer order
    except ValueError as e:
        raise RecipeError(
            f"`{key}`: the sources cannot be mixed, their columns differ ({str(e).splitlines()[0][:160]}"
            "); give them one format (all strings or all conversations) and map names with "
            "`columns`."
        ) from None


def load_train_data(args: DataArgs):
    """The training pairs: synthetic, files, a Hub dataset, or a mixture (each source's first `fraction` of its rows,
    concatenated and shuffled with seed 42: alignment-handbook's `dataset_mixer`)."""
    if args.synthetic and "mix_seed" in args.synthetic:  # a mix is read as a dataset's file is
        return _check_pairs(_read_files([_written_mix(args.synthetic)], "synthetic"), "synthetic")
    if args.synthetic:
        return datasets.Dataset.from_list(synthetic_pairs(**args.synthetic))
    mixed = args.mixture is not None
    parts = []
    for i, src in enumerate(sources(args)):
        ds = _load_source(src, i if mixed else None)
        fraction = src.get("fraction", 1.0)
        parts.append(ds.select(range(max(1, int(fraction * len(ds))))) if fraction < 1 else ds)
    ds = _check_pairs(_concatenate(parts, "data.mixture"), "mixture" if mixed else "train_files")
    if args.max_train_samples is not None:
        ds = ds.select(range(min(args.max_train_samples, len(ds))))
    return ds


def _written_mix(spec: dict) -> str:
    """The mix of `data.synthetic` as a JSONL file (one per mix, in the temporary folder; every rank writes the same
    file whole, renamed into place)."""
    path = os.path.join(tempfile.gettempdir(), "longdpo-mix-{pairs}x{seq_tokens}-seed{mix_seed}.jsonl".format(**spec))
    if not os.path.exists(path):
        partial = f"{path}.{os.getpid()}"
        write_jsonl(mixed_pairs(**spec), partial)
        os.replace(partial, path)
    return path


def has_eval_data(args: DataArgs) -> bool:
    """Whether `load_eval_data` finds evaluation pairs, read from the recipe alone (nothing is loaded)."""
    srcs = sources(args)  # a malformed mixture (not a list) has its own start-up error: no evaluation here
    return bool(args.eval_files) or (
        not args.synthetic
        and isinstance(srcs, list)
        and any(isinstance(src, dict) and src.get("test_split") for src in srcs)
    )


def load_eval_data(args: DataArgs):
    """`data.eval_files`, else each source's `test_split` (the whole split, as alignment-handbook takes it)."""
    if args.eval_files:
        return load_preferences(args.eval_files, "eval_files")
    if not has_eval_data(args):
        return None
    mixed = args.mixture is not None
    parts = [
        _load_source(src, i if mixed else None, "test_split")
        for i, src in enumerate(sources(args))
        if src.get("test_split")
    ]
    return _check_pairs(_concatenate(parts, "data.mixture"), "eval_split") if parts else None


def check_chat_template(tokenizer, dataset, key: str = "train_files", rows: int = 200) -> str | None:
    """Conversational pairs need a chat template that renders them. Before any model is loaded: no template is an
    error naming `model.chat_template`; a template that refuses a row (Mistral's refuses a system turn) is an error
    quoting it; messages a template silently leaves out come back as a warning line with a count (None if none)."""
    first = dataset[0]
    if not isinstance(first["chosen"], list):
        return None  # standard (string) pairs: no template involved
    if not getattr(tokenizer, "chat_template", None):
        raise RecipeError(
            f"`data.{key}` holds conversations but the tokenizer has no chat template: set "
            "`model.chat_template` (a .jinja file or the template itself), or use a tokenizer that has one."
        )

    dropped, roles, checked = 0, set(), min(rows, len(dataset))
    for i in range(checked):
        row = dataset[i]
        messages = (row.get("prompt") or []) + row["chosen"]
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False)
        except TemplateError as e:
            raise RecipeError(
                f"`data.{key}` row {i}: the chat template refuses it ({e}); fix the data or set "
                "`model.chat_template` to a template that accepts these roles."
            ) from None
        lost = {m["role"] for m in messages if str(m.get("content") or "").strip() not in text}
        if lost:
            dropped += 1
            roles |= lost
    if dropped:
        return (
            f"chat template: {dropped} of the first {checked} pairs have messages the template leaves out (roles: "
            f"{', '.join(sorted(roles))}); they train without them. Set `model.chat_template` to keep them."
        )
    return None
