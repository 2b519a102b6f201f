"""Write long synthetic preference pairs of exact token length (byte tokenizer) to a JSONL file.

    python tools/make_synthetic_data.py --pairs 64 --seq-tokens 65536 --prompt-tokens 1024 --out data/synth_64k.jsonl

Recipes can also build them in memory: `data: {synthetic: {pairs: 64, seq_tokens: 65536, prompt_tokens: 1024}}`.
"""

import argparse

from longdpo.data.synthetic import synthetic_pairs, write_jsonl

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=64)
    p.add_argument("--seq-tokens", type=int, required=True, help="prompt + completion + EOS tokens per sequence")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    write_jsonl(synthetic_pairs(a.pairs, a.seq_tokens, a.prompt_tokens, a.seed), a.out)
    print(f"wrote {a.pairs} pairs of {a.seq_tokens} tokens to {a.out}")
