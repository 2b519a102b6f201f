"""Both TRL preference formats from every supported source, the length report, exact-length synthetic pairs."""

import json

import datasets
import pytest

from recipes.data import length_report, load_preferences, synthetic_pairs

STANDARD = [{"prompt": f"q{i}", "chosen": f" good {i}", "rejected": f" bad {i}"} for i in range(6)]
CONVERSATIONAL = [{"prompt": [{"role": "user", "content": f"q{i}"}],
                   "chosen": [{"role": "assistant", "content": "good"}],
                   "rejected": [{"role": "assistant", "content": "bad"}]} for i in range(6)]


@pytest.mark.parametrize("rows", [STANDARD, CONVERSATIONAL], ids=["standard", "conversational"])
@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "save_to_disk"])
def test_sources_and_formats(tmp_path, rows, kind):
    ds = datasets.Dataset.from_list(rows)
    if kind == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "json":
        path = tmp_path / "d.json"
        path.write_text(json.dumps(rows))
    elif kind == "parquet":
        path = tmp_path / "d.parquet"
        ds.to_parquet(str(path))
    else:
        path = tmp_path / "saved"
        datasets.DatasetDict({"train": ds}).save_to_disk(str(path))
    loaded = load_preferences([str(path)], max_samples=4)
    assert len(loaded) == 4
    assert loaded[0]["chosen"] == rows[0]["chosen"]


def test_length_report_counts_truncated_and_dropped():
    tokenized = {"prompt_ids": [[1] * 3, [1] * 5, [1] * 2], "chosen_ids": [[1] * 4, [1] * 1, [1] * 9],
                 "rejected_ids": [[1] * 2, [1] * 6, [1] * 1]}
    report = length_report(tokenized, n_raw=5, max_length=8)
    # lengths: 3+4=7, 5+6=11, 2+9=11 -> sorted [7, 11, 11]
    assert report == {"pairs": 3, "tokens_p50": 11, "tokens_p90": 11, "tokens_max": 11, "truncated": 2,
                      "dropped": 2, "max_length": 8}


def test_synthetic_pairs_have_exact_token_lengths():
    """Through TRL's own tokenization (which appends EOS to each completion), prompt + completion == seq_tokens."""
    from trl import DPOConfig, DPOTrainer

    from recipes.config import ModelArgs
    from recipes.modeling import build_byte_tokenizer, build_model

    rows = synthetic_pairs(pairs=3, seq_tokens=300, prompt_tokens=40)
    model_args = ModelArgs(architecture="recipes/architectures/tiny_mistral.json", tokenizer="byte", dtype="float32")
    trainer = DPOTrainer(model=build_model(model_args), ref_model=build_model(model_args),
                         args=DPOConfig(output_dir="/tmp/unused", report_to="none", bf16=False, max_length=300),
                         train_dataset=datasets.Dataset.from_list(rows), processing_class=build_byte_tokenizer())
    for ex in trainer.train_dataset:
        assert len(ex["prompt_ids"]) == 40
        assert len(ex["prompt_ids"]) + len(ex["chosen_ids"]) == 300
        assert len(ex["prompt_ids"]) + len(ex["rejected_ids"]) == 300
