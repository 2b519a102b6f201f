"""Pairs of exact token lengths for the byte tokenizer (one ASCII letter is one token), and the named workloads the
benchmarks and the GPU acceptance suite run (`data.synthetic`, tools/bench_memory.py `--workloads`).
"""

from __future__ import annotations

import json
import os
import random
import string

from longdpo.config import RecipeError


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


def synthetic_pair(spec: dict, seq: int) -> tuple[int, int, int]:
    """(prompt, chosen, rejected) tokens of a synthetic pair (`data.synthetic`) planned at `seq` tokens."""
    prompt = spec["prompt_tokens"]
    chosen = seq - prompt
    return prompt, chosen, min(spec.get("rejected_tokens", chosen), chosen)


def write_jsonl(rows: list[dict], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
