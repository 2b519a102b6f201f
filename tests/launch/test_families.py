"""Llama-3, Qwen2.5, Qwen3 and Mistral through the real entrypoint: each tiny model built in code, with a byte-level
tokenizer carrying its family's real chat template, on conversational data, with every lever; start-up errors for
tokenizers and chat templates. (Every policy's numerics per family: tests/unit/test_checkpointing.py.)"""

import json
import math

import pytest
from conftest import TINY, run_train, summary

LEVERS = [
    "--memory.checkpointing",
    "layer+norm_attn",
    "--memory.lean_norm",
    "true",
    "--memory.lean_lm_head",
    "true",
    "--memory.mlp_chunks",
    "2",
    "--memory.reuse_attention_plans",
    "true",
]
RUN = ["--max_steps", "3", "--save_strategy", "no", "--report_to", "none", "--per_device_train_batch_size", "2"]
FAMILIES = {"llama3": "byte-llama3", "qwen2_5": "byte-chatml", "qwen3": "byte-chatml", "mistral": "byte-mistral"}
# what the family's template puts around a user turn (the real tokens, one token each)
MARKS = {
    "byte-llama3": "<|start_header_id|>user<|end_header_id|>",
    "byte-chatml": "<|im_start|>user",
    "byte-mistral": "[INST]",
}


def conversations(path, n=12, system=False):
    with open(path, "w") as f:
        for i in range(n):
            turns = [{"role": "system", "content": "Answer briefly."}] if system else []
            turns.append({"role": "user", "content": f"What is {i} + {i}?"})
            f.write(
                json.dumps(
                    {
                        "prompt": turns,
                        "chosen": [{"role": "assistant", "content": f"{2 * i}."}],
                        "rejected": [{"role": "assistant", "content": f"{2 * i + 1}, I think."}],
                    }
                )
                + "\n"
            )
    return str(path)


def family_args(name, data):
    return [
        "--model.architecture",
        f"recipes/architectures/tiny_{name}.json",
        "--model.tokenizer",
        FAMILIES[name],
        "--data.train_files",
        f"[{data}]",
    ]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_trains_with_every_lever_on_its_chat_template(tmp_path, name):
    data = conversations(tmp_path / "chat.jsonl")
    run_train(tmp_path / "out", *RUN, *family_args(name, data), *LEVERS)
    s = summary(tmp_path / "out")
    assert abs(s["losses"][0] - math.log(2)) < 1e-4 and s["losses"][-1] < s["losses"][0]
    assert s["wrapped"]["lean_norm"] == (4 if name == "qwen3" else 2) * 2 + 1  # Qwen3's q_norm / k_norm too
    assert s["wrapped"]["chunked_mlp"] == 2 and s["wrapped"]["attn"] == 2
    assert s["attention_plans_per_length_class"] is True  # set in the run's process before its first attention call
    template = (
        json.load(open(tmp_path / "out" / "tokenizer_config.json")).get("chat_template")
        or open(tmp_path / "out" / "chat_template.jinja").read()
    )
    assert MARKS[FAMILIES[name]].split("user")[0] in template


def test_tied_embeddings_under_two_process_zero3_equal_one_process(tmp_path):
    """Qwen2.5's tied head (the lean LM head writes the embedding's gradient), partitioned by ZeRO-3 over 2 processes
    with every lever: the curve of one ZeRO-3 process without levers. (One process without DeepSpeed runs torch's
    AdamW and departs from step 2 on, for every family.)"""
    data = conversations(tmp_path / "chat.jsonl", n=16)
    for name in ("qwen2_5",):
        run_train(
            tmp_path / f"{name}_1",
            *RUN,
            "--per_device_train_batch_size",
            "4",
            *family_args(name, data),
            launcher="deepspeed",
            procs=1,
        )
        run_train(tmp_path / f"{name}_2", *RUN, *family_args(name, data), *LEVERS, launcher="deepspeed", procs=2)
        one, two = summary(tmp_path / f"{name}_1"), summary(tmp_path / f"{name}_2")
        assert two["world_size"] == 2 and two["built_partitioned"]
        assert two["losses"] == pytest.approx(one["losses"], abs=1e-5), name


def test_a_role_the_template_refuses_is_one_line_before_loading(tmp_path):
    """Mistral's template accepts user and assistant turns only: a system turn stops the run at start-up, quoted."""
    from longdpo.config import RecipeError
    from longdpo.data.loading import check_chat_template, load_preferences
    from longdpo.model.build import build_byte_tokenizer

    data = load_preferences([conversations(tmp_path / "chat.jsonl", system=True)])
    with pytest.raises(
        RecipeError,
        match=r"row 0: the chat template refuses it \(Conversation roles must alternate.*"
        r"`model.chat_template`",
    ):
        check_chat_template(build_byte_tokenizer("byte-mistral"), data)


def test_a_template_that_drops_a_role_is_a_warning_with_a_count(tmp_path):
    from longdpo.data.loading import check_chat_template, load_preferences
    from longdpo.model.build import build_byte_tokenizer

    data = load_preferences([conversations(tmp_path / "chat.jsonl", system=True)])
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'system' %}<|{{ m['role'] }}|>"
        "{{ m['content'] }}</s>{% endif %}{% endfor %}"
    )
    warning = check_chat_template(tokenizer, data)
    assert warning.startswith(
        "chat template: 12 of the first 12 pairs have messages the template leaves out (roles: system)"
    )
    assert check_chat_template(build_byte_tokenizer("byte-chatml"), data) is None  # ChatML keeps system turns


def test_conversations_without_a_chat_template_name_the_key(tmp_path, tiny_model_dir):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.load(open(model / "tokenizer_config.json"))
    config.pop("chat_template", None)
    json.dump(config, open(model / "tokenizer_config.json", "w"))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    from longdpo.config import ModelArgs, RecipeError
    from longdpo.data.loading import check_chat_template, load_preferences
    from longdpo.model.build import load_tokenizer

    data = conversations(tmp_path / "chat.jsonl")
    with pytest.raises(
        RecipeError, match="holds conversations but the tokenizer has no chat template: set `model.chat_template`"
    ):
        check_chat_template(load_tokenizer(ModelArgs(name_or_path=str(model))), load_preferences([data]))
    base = [
        *RUN,
        "--model.architecture",
        "null",
        "--model.tokenizer",
        "null",
        "--model.name_or_path",
        str(model),
        "--data.train_files",
        f"[{data}]",
    ]
    # an inline template fixes it
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    run_train(tmp_path / "out2", *base, "--model.chat_template", template)
    assert abs(summary(tmp_path / "out2")["losses"][0] - math.log(2)) < 1e-4


def test_a_model_folder_without_a_tokenizer_is_one_line(tmp_path, tiny_model_dir):
    import shutil

    from longdpo.config import ModelArgs, RecipeError
    from longdpo.model.build import check_model_args

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    for f in model.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "special_tokens_map.json":
            f.unlink()
    with pytest.raises(RecipeError, match=f"No tokenizer in '{model}'.*set `model.tokenizer`"):
        check_model_args(ModelArgs(name_or_path=str(model)))
    check_model_args(ModelArgs(name_or_path=str(model), tokenizer=tiny_model_dir))  # a tokenizer from elsewhere


def test_a_family_outside_the_supported_ones_runs_plain_and_names_the_lever(tmp_path):
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "n_layer": 2,
                "n_embd": 32,
                "n_head": 2,
                "vocab_size": 320,
                "n_positions": 256,
                "bos_token_id": 1,
                "eos_token_id": 2,
            }
        )
    )
    from longdpo.checks import check_recipe
    from longdpo.config import RecipeError, load_recipe, parse_overrides

    base = [*RUN, "--model.architecture", str(gpt2)]
    recipe = load_recipe(TINY, parse_overrides([*base, "--memory.lean_norm", "true"]))
    with pytest.raises(
        RecipeError,
        match=r"`memory.lean_norm: true` patches the decoder layers of mistral \(Mistral\), llama \(Llama-3\), "
        r"qwen2 \(Qwen2.5\), qwen3 \(Qwen3\) models; this model is 'gpt2': set `memory.lean_norm: false`",
    ):
        check_recipe(recipe, world_size=1, cuda_available=False)
    run_train(tmp_path / "ok", *base, "--memory.checkpointing", "layer")
    assert abs(summary(tmp_path / "ok")["losses"][0] - math.log(2)) < 1e-4
