"""Preference data through `datasets`: local files or a save_to_disk directory, checked and length-reported.

Both TRL formats pass through untouched (TRL's DPOTrainer applies chat templates and extracts implicit prompts):
  standard:        {"prompt": str, "chosen": str, "rejected": str}
  conversational:  {"prompt": [messages], "chosen": [messages], "rejected": [messages]}
  implicit prompt: {"chosen": [messages], "rejected": [messages]}   (shared leading turns become the prompt)
"""

from __future__ import annotations

import json
import logging
import os
import random
import string

from longdpo.config import DataArgs, RecipeError, is_number, resolve_path, trainer_default

LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
PAIR_COLUMNS = ("prompt", "chosen", "rejected")
SOURCE_KEYS = ("name", "files", "config", "split", "test_split", "fraction", "columns")


def check_data_args(args: DataArgs) -> None:
    """Start-up checks of the data section (nothing is read yet)."""
    if isinstance(args.train_files, str):
        args.train_files = [args.train_files]
    if isinstance(args.eval_files, str):
        args.eval_files = [args.eval_files]
    if args.synthetic is not None:
        keys, optional = {"pairs", "seq_tokens", "prompt_tokens"}, {"rejected_tokens"}
        if (
            not isinstance(args.synthetic, dict)
            or not keys <= set(args.synthetic) <= keys | optional
            or not all(type(v) is int for v in args.synthetic.values())
        ):
            raise RecipeError(
                f"`data.synthetic` must be a mapping of whole numbers with the keys {sorted(keys)} (and optionally "
                "rejected_tokens), e.g. '{pairs: 4, seq_tokens: 65536, prompt_tokens: 4096}'."
            )
        s = args.synthetic
        if s["pairs"] < 1 or not 0 < s["prompt_tokens"] < s["seq_tokens"] - 1:
            raise RecipeError("`data.synthetic` needs pairs >= 1 and 0 < prompt_tokens < seq_tokens - 1.")
        if not 2 <= s.get("rejected_tokens", 2) <= s["seq_tokens"] - s["prompt_tokens"]:
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


def _read_files(files: list[str], key: str):
    """JSONL / JSON / Parquet files, or one `save_to_disk` directory, as one `datasets.Dataset`."""
    import datasets

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
    import datasets
    from huggingface_hub import constants

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
    import datasets

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
    if args.synthetic:
        import datasets

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
    from jinja2 import TemplateError

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


def _tokenized(tokenizer, row: dict, with_prompt: bool = True):
    """The prompt's ids (None unless `with_prompt`) and those of prompt + chosen and prompt + rejected, as TRL 1.16's
    DPOTrainer tokenizes them (EOS appended to string completions, chat template applied to conversations). TRL's own
    tokenization helpers, so that the counts are TRL's."""
    from trl.data_utils import _tokenize, extract_prompt, is_conversational

    row = row if "prompt" in row else extract_prompt(row)
    if is_conversational(row):
        prompt = _tokenize(tokenizer, row["prompt"], add_generation_prompt=True)["input_ids"] if with_prompt else None
        return prompt, [_tokenize(tokenizer, row["prompt"] + row[k])["input_ids"] for k in ("chosen", "rejected")]
    eos = tokenizer.eos_token or ""
    prompt = _tokenize(tokenizer, row["prompt"])["input_ids"] if with_prompt else None
    full = [
        _tokenize(tokenizer, row["prompt"] + (row[k] if row[k].endswith(eos) else row[k] + eos))["input_ids"]
        for k in ("chosen", "rejected")
    ]
    return prompt, full


def _prompt_length(prompt: list[int], full: list[list[int]]) -> int:
    """The prompt's length in tokens as TRL counts it when it drops pairs: the tokens the prompt shares with
    prompt + chosen and prompt + rejected."""
    from trl.data_utils import common_prefix_length

    return min(common_prefix_length(prompt, ids) for ids in full)


def prompt_tokens(tokenizer, row: dict) -> int:
    """One pair's prompt length in tokens, as TRL counts it."""
    return _prompt_length(*_tokenized(tokenizer, row))


def longest_pair(tokenizer, dataset) -> int:
    """Tokens of the longest sequence (prompt + the longer completion) as TRL tokenizes it: what `max_length: null`
    trains on, and so what the planner plans for. One pass over the data (TRL makes the same one after the models
    load)."""
    return max((len(ids) for row in dataset for ids in _tokenized(tokenizer, row, with_prompt=False)[1]), default=0)


def costliest_pair_tokens(tokenizer, dataset, max_length: int | None, min_saving: float) -> int:
    """With `data.shared_prompt` and one pair per batch: the most tokens one pair puts through the model, as its shared
    row (prompt + chosen + rejected + 1) where that saves `min_saving`, else as TRL's two rows; cut by `max_length` as
    TRL's collator cuts it. What the planner plans for, instead of two rows of `max_length`."""
    costliest = 0
    for row in dataset:
        prompt, full = _tokenized(tokenizer, row)
        p = _prompt_length(prompt, full)
        if max_length is not None and p >= max_length:
            continue  # TRL drops the pair
        c, r = (len(ids) - p for ids in full)
        if max_length is not None:
            c, r = min(c, max_length - p), min(r, max_length - p)
        costliest = max(costliest, tokens_through_model(p, c, r, min_saving))
    return costliest


def tokens_through_model(prompt: int, chosen: int, rejected: int, min_saving: float) -> int:
    """With `data.shared_prompt`, the tokens one pair puts through the model: its shared row (prompt + chosen +
    rejected + 1) where that saves `min_saving` of TRL's two rows (2 x (prompt + the longer completion)), else those
    two rows (longdpo/model/shared_prompt.py makes the same choice per batch)."""
    rows, shared = 2 * (prompt + max(chosen, rejected)), prompt + chosen + rejected + 1
    return shared if 1 - shared / rows >= min_saving else rows


def _plans_shared_rows(recipe) -> bool:
    """`data.shared_prompt` with one pair per batch: each batch's tokens are one pair's (with more pairs, the batch's
    decision and padding depend on which pairs meet, and the plan keeps TRL's two rows, an upper bound)."""
    batch = recipe.trainer.get("per_device_train_batch_size", trainer_default("per_device_train_batch_size"))
    return recipe.data.shared_prompt and batch == 1


def plan_on_data(recipe) -> bool:
    """Whether the planner needs the pairs themselves (files or a Hub dataset): with `max_length: null`, for their
    longest pair; with `data.shared_prompt`, for their costliest shared row."""
    no_max_length = recipe.trainer.get("max_length", trainer_default("max_length")) is None
    return not recipe.data.synthetic and (no_max_length or _plans_shared_rows(recipe))


def measured_for_plan(recipe, tokenizer, dataset) -> tuple[int | None, int | None]:
    """(seq, pair_tokens) for the planner, measured on the pairs (call it where `plan_on_data` says so): the longest
    pair where `max_length` is null, the costliest pair's tokens with `data.shared_prompt`; None where the recipe
    says it."""
    max_length = recipe.trainer.get("max_length", trainer_default("max_length"))
    seq = longest_pair(tokenizer, dataset) if max_length is None else None
    pair_tokens = None
    if _plans_shared_rows(recipe):
        pair_tokens = costliest_pair_tokens(tokenizer, dataset, max_length, recipe.data.shared_prompt_min_saving)
    return seq, pair_tokens


def check_some_pair_fits(tokenizer, dataset, max_length: int | None, truncation_mode: str) -> None:
    """Before any model is loaded: TRL drops every pair whose prompt alone fills `max_length` (keep_start
    truncation); a run where that is every pair is an error. Stops at the first pair that is kept (usually the
    first), so the full pass happens only when the answer is the error."""
    if max_length is None or truncation_mode != "keep_start":
        return
    shortest = None
    for row in dataset:
        n = prompt_tokens(tokenizer, row)
        if n < max_length:
            return
        shortest = n if shortest is None else min(shortest, n)
    raise RecipeError(
        f"All {len(dataset)} pairs would be dropped: every prompt is at least `max_length` "
        f"({max_length}) tokens (the shortest has {shortest}). Raise `max_length`."
    )


def _percentile(sorted_values: list[int], q: float) -> int:
    return sorted_values[min(len(sorted_values) - 1, int(round(q * (len(sorted_values) - 1))))]


def length_report(tokenized, n_raw: int, max_length: int | None) -> dict:
    """Tokens per sequence (prompt + longer completion) after TRL's tokenization, what max_length cuts, and the share
    of the tokens TRL's two rows per pair (2 x (prompt + longer completion)) that one shared row per pair
    (prompt + chosen + rejected + 1; `data.shared_prompt`) does without."""
    lengths, two_rows, shared = [], 0, 0
    for p, c, r in zip(tokenized["prompt_ids"], tokenized["chosen_ids"], tokenized["rejected_ids"]):
        lengths.append(len(p) + max(len(c), len(r)))
        p = min(len(p), max_length or len(p))  # as TRL's collator cuts the row
        c, r = (min(len(x), max_length - p) if max_length else len(x) for x in (c, r))
        two_rows, shared = two_rows + 2 * (p + max(c, r)), shared + p + c + r + 1
    lengths.sort()
    if not lengths:
        raise RecipeError(
            f"All {n_raw} pairs were dropped: every prompt is at least `max_length` ({max_length}) tokens. "
            "Raise `max_length`."
        )
    return {
        "pairs": len(lengths),
        "tokens_p50": _percentile(lengths, 0.5),
        "tokens_p90": _percentile(lengths, 0.9),
        "tokens_max": lengths[-1],
        "truncated": sum(n > max_length for n in lengths) if max_length else 0,
        "tokens_lost_share": round(sum(max(0, n - max_length) for n in lengths) / sum(lengths), 4)
        if max_length
        else 0.0,
        "dropped": n_raw - len(lengths),
        "max_length": max_length,
        "shared_prompt_saves": round(1 - shared / two_rows, 4),
    }


def truncation_warning(report: dict) -> str | None:
    """A loud line when `max_length` cuts pairs: how many, and the share of their tokens lost."""
    if not report["truncated"]:
        return None
    return (
        f"max_length {report['max_length']} truncates {report['truncated']} of {report['pairs']} pairs "
        f"({report['tokens_lost_share']:.0%} of all tokens lost; longest pair {report['tokens_max']} tokens): raise "
        "`max_length` unless this is intended."
    )


def synthetic_pairs(
    pairs: int, seq_tokens: int, prompt_tokens: int, rejected_tokens: int | None = None, seed: int = 0
) -> list[dict]:
    """Standard-format pairs for the byte tokenizer: prompt + chosen is exactly `seq_tokens` (what max_length
    measures), the rejected completion `rejected_tokens` (EOS included; default: as long as the chosen one).

    One ASCII letter is one token; TRL appends EOS to each completion, so a completion text has one letter less."""
    if not 0 < prompt_tokens < seq_tokens - 1:
        raise RecipeError(f"prompt tokens ({prompt_tokens}) must be between 1 and sequence tokens - 2 ({seq_tokens}).")
    rng = random.Random(seed)
    letters = string.ascii_lowercase
    chosen = seq_tokens - prompt_tokens
    rejected = chosen if rejected_tokens is None else rejected_tokens

    def text(k: int) -> str:
        return "".join(rng.choice(letters) for _ in range(k))

    return [
        {"prompt": text(prompt_tokens), "chosen": text(chosen - 1), "rejected": text(rejected - 1)}
        for _ in range(pairs)
    ]


# The shapes of preference data the benchmarks run, for a sequence (prompt + the longer completion) of L tokens:
#   equal        prompt min(1024, L/4), both completions the rest (the shape of every figure before these existed)
#   unequal      the same prompt, the rejected completion 10% shorter than the chosen (real pairs differ in length)
#   half-prompt  prompt 50% of L, completions as unequal's (between the two; where sharing the prompt starts to pay)
#   long-prompt  prompt 90% of L (a long document or conversation), the chosen completion the other 10%, the
#                rejected one 10% shorter than that
WORKLOADS = ("equal", "unequal", "half-prompt", "long-prompt")
PROMPT_SHARE = {"half-prompt": 0.5, "long-prompt": 0.9}


def workload(name: str, seq_tokens: int, pairs: int, prompt_tokens: int = 1024) -> dict:
    """`data.synthetic` for a named workload (`prompt_tokens`: the short prompt of equal / unequal)."""
    if name not in WORKLOADS:
        raise RecipeError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}.")
    if name in PROMPT_SHARE:
        prompt = round(PROMPT_SHARE[name] * seq_tokens)
    else:
        prompt = max(1, min(prompt_tokens, seq_tokens // 4))
    chosen = seq_tokens - prompt
    spec = {"pairs": pairs, "seq_tokens": seq_tokens, "prompt_tokens": prompt}
    if name != "equal":
        spec["rejected_tokens"] = max(2, round(0.9 * chosen))
    return spec


def write_jsonl(rows: list[dict], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
