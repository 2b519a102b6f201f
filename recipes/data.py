"""Preference data through `datasets`: local files or a save_to_disk directory, checked and length-reported.

Both TRL formats pass through untouched (TRL's DPOTrainer applies chat templates and extracts implicit prompts):
  standard:        {"prompt": str, "chosen": str, "rejected": str}
  conversational:  {"prompt": [messages], "chosen": [messages], "rejected": [messages]}
  implicit prompt: {"chosen": [messages], "rejected": [messages]}   (shared leading turns become the prompt)
"""

from __future__ import annotations

import json
import os
import random
import string

from .config import DataArgs, RecipeError, resolve_path

LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def check_data_args(args: DataArgs) -> None:
    """Start-up checks of the data section (nothing is read yet)."""
    if isinstance(args.train_files, str):
        args.train_files = [args.train_files]
    if isinstance(args.eval_files, str):
        args.eval_files = [args.eval_files]
    if args.synthetic is not None:
        keys = {"pairs", "seq_tokens", "prompt_tokens"}
        if not isinstance(args.synthetic, dict) or set(args.synthetic) != keys:
            raise RecipeError(f"`data.synthetic` must be a mapping with exactly the keys {sorted(keys)}.")
        if args.train_files:
            raise RecipeError("Set either `data.train_files` or `data.synthetic`, not both.")
        s = args.synthetic
        if s["pairs"] < 1 or not 0 < s["prompt_tokens"] < s["seq_tokens"] - 1:
            raise RecipeError("`data.synthetic` needs pairs >= 1 and 0 < prompt_tokens < seq_tokens - 1.")
    elif not args.train_files:
        raise RecipeError("No training data: set `data.train_files` to JSONL/JSON/Parquet files or a dataset directory.")
    for key in ("train_files", "eval_files"):
        for f in getattr(args, key):
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


def load_preferences(files: list[str], key: str = "train_files", max_samples: int | None = None):
    """Load the files into one `datasets.Dataset` and check it holds preference pairs."""
    import datasets

    paths = [resolve_path(f) for f in files]
    if len(paths) == 1 and os.path.isdir(paths[0]):
        ds = datasets.load_from_disk(paths[0])
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise RecipeError(f"`data.{key}`: the DatasetDict at {files[0]!r} has no `train` split.")
            ds = ds["train"]
    else:
        exts = {os.path.splitext(p)[1] for p in paths}
        builders = {LOADERS.get(e) for e in exts}
        if len(builders) != 1 or None in builders:
            raise RecipeError(f"`data.{key}` mixes file types {sorted(exts)}; use one of .jsonl/.json/.parquet.")
        empty = [f for f, p in zip(files, paths) if os.path.getsize(p) == 0]
        if empty:
            raise RecipeError(f"`data.{key}` file(s) {empty} are empty; fill them or remove them from the recipe.")
        try:
            ds = datasets.load_dataset(builders.pop(), data_files=paths, split="train")
        except datasets.exceptions.DatasetGenerationError as e:
            cause = e.__cause__ or e
            raise RecipeError(f"`data.{key}` could not be read ({type(cause).__name__}: {str(cause)[:200]}); "
                              "fix the file (one JSON object per line for .jsonl).") from None
    missing = {"chosen", "rejected"} - set(ds.column_names)
    if missing:
        raise RecipeError(
            f"`data.{key}` rows lack column(s) {sorted(missing)} (found {ds.column_names}); preference pairs need "
            "`chosen` and `rejected` (and `prompt`, unless chosen/rejected are conversations sharing their prompt)."
        )
    if len(ds) == 0:
        raise RecipeError(f"`data.{key}` holds no rows.")
    if max_samples is not None:
        ds = ds.select(range(min(max_samples, len(ds))))
    return ds


def load_train_data(args: DataArgs):
    if args.synthetic:
        import datasets

        return datasets.Dataset.from_list(synthetic_pairs(**args.synthetic))
    return load_preferences(args.train_files, "train_files", args.max_train_samples)


def check_chat_template(tokenizer, dataset, key: str = "train_files", rows: int = 200) -> str | None:
    """Conversational pairs need a chat template that renders them. Before any model is loaded: no template is an
    error naming `model.chat_template`; a template that refuses a row (Mistral's refuses a system turn) is an error
    quoting it; messages a template silently leaves out come back as a warning line with a count (None if none)."""
    first = dataset[0]
    if not isinstance(first["chosen"], list):
        return None  # standard (string) pairs: no template involved
    if not getattr(tokenizer, "chat_template", None):
        raise RecipeError(f"`data.{key}` holds conversations but the tokenizer has no chat template: set "
                          "`model.chat_template` (a .jinja file or the template itself), or use a tokenizer that has one.")
    from jinja2 import TemplateError

    dropped, roles, checked = 0, set(), min(rows, len(dataset))
    for i in range(checked):
        row = dataset[i]
        messages = (row.get("prompt") or []) + row["chosen"]
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False)
        except TemplateError as e:
            raise RecipeError(f"`data.{key}` row {i}: the chat template refuses it ({e}); fix the data or set "
                              "`model.chat_template` to a template that accepts these roles.") from None
        lost = {m["role"] for m in messages if str(m.get("content") or "").strip() not in text}
        if lost:
            dropped += 1
            roles |= lost
    if dropped:
        return (f"chat template: {dropped} of the first {checked} pairs have messages the template leaves out (roles: "
                f"{', '.join(sorted(roles))}); they train without them. Set `model.chat_template` to keep them.")
    return None


def _percentile(sorted_values: list[int], q: float) -> int:
    return sorted_values[min(len(sorted_values) - 1, int(round(q * (len(sorted_values) - 1))))]


def length_report(tokenized, n_raw: int, max_length: int | None) -> dict:
    """Tokens per sequence (prompt + longer completion) after TRL's tokenization, and what max_length cuts."""
    lengths = sorted(
        len(p) + max(len(c), len(r))
        for p, c, r in zip(tokenized["prompt_ids"], tokenized["chosen_ids"], tokenized["rejected_ids"])
    )
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
        "dropped": n_raw - len(lengths),
        "max_length": max_length,
    }


def synthetic_pairs(pairs: int, seq_tokens: int, prompt_tokens: int, seed: int = 0) -> list[dict]:
    """Standard-format pairs whose prompt + completion is exactly `seq_tokens` with the byte tokenizer.

    One ASCII letter is one token; TRL appends EOS to each completion, so a completion text has one letter less."""
    if not 0 < prompt_tokens < seq_tokens - 1:
        raise RecipeError(f"prompt tokens ({prompt_tokens}) must be between 1 and sequence tokens - 2 ({seq_tokens}).")
    rng = random.Random(seed)
    letters = string.ascii_lowercase
    completion = seq_tokens - prompt_tokens - 1

    def text(k: int) -> str:
        return "".join(rng.choice(letters) for _ in range(k))

    return [{"prompt": text(prompt_tokens), "chosen": text(completion), "rejected": text(completion)}
            for _ in range(pairs)]


def write_jsonl(rows: list[dict], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
