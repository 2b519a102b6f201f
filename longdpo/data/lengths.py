"""Token lengths of preference pairs as TRL 1.16's DPOTrainer tokenizes them (its own helpers): one pair's prompt,
every pair's (prompt, chosen, rejected) for the planner, the length report a run logs, and the check that some pair
survives `max_length`.
"""

from __future__ import annotations

from trl.data_utils import _tokenize, common_prefix_length, extract_prompt, is_conversational

from longdpo.config import RecipeError
from longdpo.levers.shared_prompt import cut_to_max_length, row_tokens


def _tokenized(tokenizer, row: dict, with_prompt: bool = True):
    """The prompt's ids (None unless `with_prompt`) and those of prompt + chosen and prompt + rejected, as TRL 1.16's
    DPOTrainer tokenizes them (EOS appended to string completions, chat template applied to conversations). TRL's own
    tokenization helpers, so that the counts are TRL's."""
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
    return min(common_prefix_length(prompt, ids) for ids in full)


def prompt_tokens(tokenizer, row: dict) -> int:
    """One pair's prompt length in tokens, as TRL counts it."""
    return _prompt_length(*_tokenized(tokenizer, row))


def pair_lengths(tokenizer, dataset) -> list[tuple[int, int, int]]:
    """(prompt, chosen, rejected) tokens of every pair, as TRL tokenizes them (completions with their EOS), uncut:
    what the planner measures where the plan depends on the pairs. One pass over the data (TRL makes the same one
    after the models load)."""
    out = []
    for row in dataset:
        prompt, full = _tokenized(tokenizer, row)
        p = _prompt_length(prompt, full)
        out.append((p, len(full[0]) - p, len(full[1]) - p))
    return out


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
        cut = cut_to_max_length(len(p), len(c), len(r), max_length)
        if cut:  # TRL has dropped the pairs this leaves out
            two_rows, shared = two_rows + 2 * (cut[0] + max(cut[1:])), shared + row_tokens(*cut)
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
        "shared_prompt_saves": round(1 - shared / two_rows, 4) if two_rows else 0.0,
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
