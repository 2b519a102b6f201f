"""Both TRL preference formats from every supported source, the length report, exact-length synthetic pairs."""

import json

import datasets
import pytest

from longdpo.data.lengths import length_report
from longdpo.data.loading import load_preferences
from longdpo.data.synthetic import synthetic_pairs
from longdpo.levers.shared_prompt import cut_to_max_length

STANDARD = [{"prompt": f"q{i}", "chosen": f" good {i}", "rejected": f" bad {i}"} for i in range(6)]
CONVERSATIONAL = [
    {
        "prompt": [{"role": "user", "content": f"q{i}"}],
        "chosen": [{"role": "assistant", "content": "good"}],
        "rejected": [{"role": "assistant", "content": "bad"}],
    }
    for i in range(6)
]


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
    tokenized = {
        "prompt_ids": [[1] * 3, [1] * 5, [1] * 2],
        "chosen_ids": [[1] * 4, [1] * 1, [1] * 9],
        "rejected_ids": [[1] * 2, [1] * 6, [1] * 1],
    }
    report = length_report(tokenized, n_raw=5, max_length=8)
    # lengths: 3+4=7, 5+6=11, 2+9=11 -> sorted [7, 11, 11]
    assert report == {
        "pairs": 3,
        "tokens_p50": 11,
        "tokens_p90": 11,
        "tokens_max": 11,
        "truncated": 2,
        "tokens_lost_share": round(6 / 29, 4),
        "dropped": 2,
        "max_length": 8,
        # cut to 8: (3, 4, 2), (5, 1, 3), (2, 6, 1); two rows 2 x (7 + 8 + 8) = 46, shared 10 + 10 + 10 = 30
        "shared_prompt_saves": round(1 - 30 / 46, 4),
    }


def test_a_pair_is_cut_as_trl_cuts_it_and_dropped_where_its_prompt_fills_max_length():
    assert cut_to_max_length(5, 6, 1, 8) == (5, 3, 1)
    assert cut_to_max_length(8, 1, 1, 8) is None and cut_to_max_length(9, 1, 1, 8) is None
    assert cut_to_max_length(9, 1, 1, None) == (9, 1, 1)
    # a prompt that fills max_length adds nothing to what sharing saves: its pair does not reach the model
    kept = {"prompt_ids": [[1] * 3], "chosen_ids": [[1] * 4], "rejected_ids": [[1] * 2]}
    both = {k: v + [[1] * (8 if k == "prompt_ids" else 1)] for k, v in kept.items()}
    assert length_report(both, 2, 8)["shared_prompt_saves"] == length_report(kept, 1, 8)["shared_prompt_saves"]


def test_synthetic_pairs_have_exact_token_lengths():
    """Through TRL's own tokenization (which appends EOS to each completion), prompt + completion == seq_tokens."""
    from trl import DPOConfig, DPOTrainer

    from longdpo.config import ModelArgs
    from longdpo.data.synthetic import WORKLOADS, workload
    from longdpo.model.build import build_byte_tokenizer, build_model

    model_args = ModelArgs(architecture="recipes/architectures/tiny_mistral.json", tokenizer="byte", dtype="float32")
    # (prompt, chosen completion, rejected completion) in tokens, EOS included, for a 300-token sequence
    expected = {
        "equal": (75, 225, 225),
        "unequal": (75, 225, 202),
        "half-prompt": (150, 150, 135),
        "long-prompt": (270, 30, 27),
    }
    assert set(expected) == set(WORKLOADS) - {"mixed"}  # the mix: the test below
    for name, (prompt, chosen, rejected) in expected.items():
        rows = synthetic_pairs(**workload(name, 300, pairs=3))
        trainer = DPOTrainer(
            model=build_model(model_args),
            ref_model=build_model(model_args),
            args=DPOConfig(
                output_dir="/tmp/unused",
                report_to="none",
                bf16=False,
                max_length=300,
                activation_checkpointing=False,
                dataloader_pin_memory=False,
            ),
            train_dataset=datasets.Dataset.from_list(rows),
            processing_class=build_byte_tokenizer(),
        )
        for ex in trainer.train_dataset:
            got = (len(ex["prompt_ids"]), len(ex["chosen_ids"]), len(ex["rejected_ids"]))
            assert got == (prompt, chosen, rejected), name
    assert workload("unequal", 32768, 8)["prompt_tokens"] == 1024  # the short prompt stops at 1024 tokens


# ---- Hub-style datasets, column mapping, mixtures (local stand-ins; the same load_dataset call as a Hub id) --------


def dataset_folder(root, name, rows_train, rows_test=0, cols=("question", "good", "bad")):
    """A dataset laid out as on the Hub: data/train.jsonl and data/test.jsonl, with the user's own column names."""
    folder = root / name / "data"
    folder.mkdir(parents=True)
    for split, n in (("train", rows_train), ("test", rows_test)):
        if n:
            with open(folder / f"{split}.jsonl", "w") as f:
                for i in range(n):
                    f.write(json.dumps(dict(zip(cols, (f"{name} q{i}", f" {name} good {i}", f" bad {i}")))) + "\n")
    return str(root / name)


def data_args(**kw):
    from longdpo.checks import check_data_args
    from longdpo.config import DataArgs

    args = DataArgs(**kw)
    check_data_args(args)
    return args


def test_a_dataset_by_name_with_split_and_column_mapping(tmp_path):
    from longdpo.data.loading import load_eval_data, load_train_data

    name = dataset_folder(tmp_path, "prefs", 10, 3)
    args = data_args(
        dataset_name=name, eval_split="test", columns={"prompt": "question", "chosen": "good", "rejected": "bad"}
    )
    train, test = load_train_data(args), load_eval_data(args)
    assert (len(train), len(test)) == (10, 3)
    assert train.column_names == ["prompt", "chosen", "rejected"] and train[0]["prompt"] == "prefs q0"


def test_a_mixture_takes_each_sources_fraction_and_its_test_split(tmp_path):
    """alignment-handbook's dataset_mixer: the first fraction of each source's train rows, concatenated and shuffled;
    the test splits whole."""
    from longdpo.data.loading import load_eval_data, load_train_data

    mapping = {"prompt": "question", "chosen": "good", "rejected": "bad"}
    a = dataset_folder(tmp_path, "a", 10, 4)
    b = dataset_folder(tmp_path, "b", 6, 2, cols=("prompt", "chosen", "rejected"))
    files = tmp_path / "c.jsonl"
    files.write_text("".join(json.dumps(r) + "\n" for r in STANDARD))
    args = data_args(
        mixture=[
            {"name": a, "fraction": 0.5, "columns": mapping, "test_split": "test"},
            {"name": b, "test_split": "test"},
            {"files": [str(files)], "fraction": 0.5},
        ]
    )
    train, test = load_train_data(args), load_eval_data(args)
    assert len(train) == 5 + 6 + 3 and len(test) == 4 + 2
    prompts = train["prompt"]
    assert sum(p.startswith("a q") for p in prompts) == 5 and {f"a q{i}" for i in range(5)} <= set(prompts)
    assert prompts != sorted(prompts, key=lambda p: (not p.startswith("a"), not p.startswith("b")))  # shuffled


@pytest.mark.parametrize(
    "kw,message",
    [
        (
            {"dataset_name": "x", "train_files": ["recipes/data/arithmetic_preferences.jsonl"]},
            "Set one source of training data; `data.train_files` and `data.dataset_name`",
        ),
        (
            {"train_files": ["recipes/data/arithmetic_preferences.jsonl"], "columns": {"question": "prompt"}},
            r"`data.columns` maps TRL's column names to yours",
        ),
        ({"mixture": [{"name": "a", "fraction": 1.5}]}, r"`data.mixture\[0\].fraction` is the share .* in \(0, 1\]"),
        ({"mixture": [{"name": "a", "weight": 1}]}, r"`data.mixture\[0\]` has unknown key\(s\) \['weight'\]"),
        ({"mixture": [{"name": "a", "files": ["b.jsonl"]}]}, "needs exactly one of `name`"),
        ({"mixture": [{"files": ["nope.jsonl"]}]}, r"`data.mixture\[0\].files` entry 'nope.jsonl' does not exist"),
        ({"train_files": ["recipes/data/arithmetic_preferences.jsonl"], "eval_split": "test"}, "for files use"),
    ],
)
def test_bad_data_sections_are_one_line_before_anything_is_read(kw, message):
    from longdpo.config import RecipeError

    with pytest.raises(RecipeError, match=message):
        data_args(**kw)


def test_a_mapped_column_that_is_not_there_names_the_columns_found(tmp_path):
    from longdpo.config import RecipeError
    from longdpo.data.loading import load_train_data

    args = data_args(dataset_name=dataset_folder(tmp_path, "p", 3), columns={"prompt": "query"})
    with pytest.raises(RecipeError, match=r"maps from column\(s\) \['query'\] .*found \['question', 'good', 'bad'\]"):
        load_train_data(args)


def test_an_uncached_hub_dataset_offline_is_one_line(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from longdpo.config import RecipeError
    from longdpo.data.loading import load_train_data

    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        RecipeError, match=r"`data.dataset_name` 'someone/prefs' .* could not be loaded \(HF_HUB_OFFLINE"
    ):
        load_train_data(data_args(dataset_name="someone/prefs"))


@pytest.mark.launcher
def test_the_entrypoint_trains_on_a_mixture_and_evaluates_on_its_test_splits(tmp_path):
    import math

    from conftest import run_train, summary

    a = dataset_folder(tmp_path, "a", 16, 4)
    b = dataset_folder(tmp_path, "b", 8, 4, cols=("prompt", "chosen", "rejected"))
    mixture = (
        f"[{{name: {a}, fraction: 0.5, test_split: test, columns: {{prompt: question, chosen: good, "
        f"rejected: bad}}}}, {{name: {b}, test_split: test}}]"
    )
    proc = run_train(
        tmp_path / "out",
        "--data.train_files",
        "[]",
        "--data.mixture",
        mixture,
        "--max_steps",
        "2",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "2",
        "--per_device_eval_batch_size",
        "4",
    )
    s = summary(tmp_path / "out")
    assert s["length_report"]["pairs"] == 8 + 8 and abs(s["losses"][0] - math.log(2)) < 1e-4
    assert "'eval_loss'" in proc.stdout  # the 4 + 4 test rows were evaluated at step 2


def test_truncation_is_a_warning_with_the_count_and_the_share_of_tokens_lost():
    from longdpo.data.lengths import truncation_warning

    tokenized = {"prompt_ids": [[1] * 3, [1] * 5], "chosen_ids": [[1] * 4, [1] * 1], "rejected_ids": [[1] * 2, [1] * 6]}
    report = length_report(tokenized, n_raw=2, max_length=8)  # 7 and 11 tokens: one pair loses 3 of 18 tokens
    assert report["truncated"] == 1 and report["tokens_lost_share"] == round(3 / 18, 4)
    assert truncation_warning(report).startswith("max_length 8 truncates 1 of 2 pairs (17% of all tokens lost")
    assert truncation_warning(length_report(tokenized, n_raw=2, max_length=20)) is None


def test_a_mix_of_pair_shapes_as_a_dataset_has_them():
    """`mixed`: documents with short answers, conversations, short prompts with long answers, in their shares; every
    length up to seq_tokens (the first exactly it); answers of different lengths; each pair exactly its planned
    tokens through TRL's own tokenization; the same seed, the same pairs; read from a JSONL file as user data is."""
    from longdpo.config import DataArgs
    from longdpo.data.lengths import pair_lengths
    from longdpo.data.loading import load_train_data
    from longdpo.data.synthetic import MIX, mixed_lengths, mixed_pairs, workload
    from longdpo.model.build import build_byte_tokenizer

    planned = mixed_lengths(600, 4096, mix_seed=3)
    assert planned == mixed_lengths(600, 4096, mix_seed=3) != mixed_lengths(600, 4096, mix_seed=4)
    lengths = [p + max(c, r) for _, p, c, r in planned]
    assert lengths[0] == 4096 and max(lengths) == 4096 and min(lengths) >= 4096 // 16
    assert sum(n < 1024 for n in lengths) > 100 and sum(n > 2048 for n in lengths) > 100  # spread over the range
    for kind, (share, low, high) in MIX.items():
        of_kind = [(p, c, r) for k, p, c, r in planned if k == kind]
        assert abs(len(of_kind) / len(planned) - share) < 0.07, kind
        assert all(low - 0.01 <= p / (p + max(c, r)) <= high + 0.01 for p, c, r in of_kind), kind
    assert all(c != r and min(c, r) >= 2 for _, _, c, r in planned)  # unequal answers, each at least its EOS
    rows = mixed_pairs(40, 512, mix_seed=1)
    assert "User: " in "".join(row["prompt"] for row in rows)  # the conversations have turns
    as_tokenized = pair_lengths(build_byte_tokenizer(), datasets.Dataset.from_list(rows))
    assert as_tokenized == [(p, c, r) for _, p, c, r in mixed_lengths(40, 512, mix_seed=1)]
    spec = workload("mixed", 512, pairs=40)
    assert spec == {"pairs": 40, "seq_tokens": 512, "mix_seed": 0}
    loaded = load_train_data(DataArgs(synthetic={**spec, "mix_seed": 1}))
    assert [dict(row) for row in loaded] == rows  # written as a file, read back as a user's file is
