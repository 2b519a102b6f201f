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
#   mixed        a seeded mix of pairs as a dataset has them (`mixed_lengths`): long documents with short answers,
#                conversations, short prompts with long answers; answers of different lengths, every length up to L
WORKLOADS = ("equal", "unequal", "half-prompt", "long-prompt", "mixed")
PROMPT_SHARE = {"half-prompt": 0.5, "long-prompt": 0.9}
# The kinds of pair in the mix: (share of the pairs, the prompt's share of the pair's length, low and high)
MIX = {"document": (0.4, 0.80, 0.95), "conversation": (0.3, 0.35, 0.65), "answer": (0.3, 0.02, 0.10)}


def workload(name: str, seq_tokens: int, pairs: int, prompt_tokens: int = 1024) -> dict:
    """`data.synthetic` for a named workload (`prompt_tokens`: the short prompt of equal / unequal)."""
    if name not in WORKLOADS:
        raise RecipeError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}.")
    if name == "mixed":
        return {"pairs": pairs, "seq_tokens": seq_tokens, "mix_seed": 0}
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


def mixed_lengths(pairs: int, seq_tokens: int, mix_seed: int = 0) -> list[tuple[str, int, int, int]]:
    """(kind, prompt, chosen, rejected) tokens of each pair of a mix (completions with their EOS): the kinds of `MIX`
    in their shares, each pair's length (prompt + the longer completion) log-uniform from seq_tokens / 16 to
    seq_tokens (the first pair exactly seq_tokens, so that the longest is what max_length allows), the shorter
    completion 30-95% of the longer, chosen or rejected the longer at random."""
    rng = random.Random(mix_seed)
    kinds, shares = list(MIX), [share for share, _, _ in MIX.values()]
    out = []
    for i in range(pairs):
        kind = rng.choices(kinds, shares)[0]
        _, low, high = MIX[kind]
        length = seq_tokens if i == 0 else round(seq_tokens / 16 * 16 ** rng.random())
        prompt = min(max(1, round(length * rng.uniform(low, high))), length - 2)
        longer = length - prompt
        shorter = max(2, round(longer * rng.uniform(0.3, 0.95)))
        chosen, rejected = (longer, shorter) if rng.random() < 0.5 else (shorter, longer)
        out.append((kind, prompt, chosen, rejected))
    return out


def mixed_pairs(pairs: int, seq_tokens: int, mix_seed: int = 0) -> list[dict]:
    """The pairs of `mixed_lengths` as standard-format text for the byte tokenizer: a document, a conversation of
    user and assistant turns, or a question, each of its exact length in tokens."""
    rng = random.Random(mix_seed + 1)
    letters = string.ascii_lowercase + " "

    def text(k: int) -> str:
        return "".join(rng.choice(letters) for _ in range(k))

    def conversation(k: int) -> str:
        turns, left = [], k
        while left > 0:
            turn = f"{'User' if len(turns) % 2 == 0 else 'Assistant'}: "
            size = min(left, len(turn) + rng.randint(20, 400))
            turns.append((turn + text(size))[:size])
            left -= size
        return "".join(turns)

    return [
        {
            "prompt": conversation(p) if kind == "conversation" else text(p),
            "chosen": text(c - 1),  # TRL appends EOS: one token more
            "rejected": text(r - 1),
        }
        for kind, p, c, r in mixed_lengths(pairs, seq_tokens, mix_seed)
    ]


def spec_pairs(spec: dict, seq: int) -> list[tuple[int, int, int]]:
    """(prompt, chosen, rejected) tokens of the pairs of `data.synthetic` planned at `seq` tokens: the one shape of
    a fixed spec, or every pair of a mix."""
    if "mix_seed" in spec:
        return [(p, c, r) for _, p, c, r in mixed_lengths(spec["pairs"], spec["seq_tokens"], spec["mix_seed"])]
    return [synthetic_pair(spec, seq)]


def write_jsonl(rows: list[dict], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
