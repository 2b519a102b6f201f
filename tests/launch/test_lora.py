"""LoRA DPO (`model.use_peft: true`) through the real entrypoint: TRL's `peft_config`, no reference copy, every
lever, ZeRO-3 in 2 processes, the saved adapter and the merged model."""

import json
import math
import os
import shutil

import pytest
import torch
from conftest import run_train, summary

# all linear layers adapted, no dropout (so that curves can be compared across launches), 4 pairs per step
LORA = [
    "--model.use_peft",
    "true",
    "--model.lora_target_modules",
    "all-linear",
    "--model.lora_dropout",
    "0",
    "--model.architecture",
    "null",
    "--model.tokenizer",
    "null",
    "--report_to",
    "none",
    "--max_steps",
    "4",
    "--save_steps",
    "2",
]
# Launches that split the batch differently (1 x 4 pairs vs 2 x 2) sum every gradient in another float32 order.
# AdamW divides each update by the gradient's own running magnitude, so an element whose gradient cancels to rounding
# level moves by an amount set by that rounding (seen: 1 of 20,480 adapter elements 2.8e-5 apart on one CPU, all
# others within 1e-5): no element-wise tolerance below the learning rate holds under AdamW. Under plain SGD the
# weights differ by lr x (the gradients' rounding difference) per step; see the bound in the test below.
SGD = ["--optim", "sgd", "--learning_rate", "0.5", "--max_grad_norm", "0"]
LEVERS = [
    "--memory.checkpointing",
    "layer+norm_attn",
    "--memory.lean_norm",
    "true",
    "--memory.lean_lm_head",
    "true",
    "--memory.mlp_chunks",
    "2",
]


@pytest.fixture(scope="module")
def plain(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_plain")
    proc = run_train(out, *LORA, "--model.name_or_path", tiny_model_dir, "--model.lora_save_merged", "true")
    (out / "launch.log").write_text(proc.stdout)
    return out


@pytest.fixture(scope="module")
def zero3_one(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_ds1")
    run_train(
        out,
        *LORA,
        *SGD,
        "--model.name_or_path",
        tiny_model_dir,
        "--per_device_train_batch_size",
        "4",
        launcher="deepspeed",
        procs=1,
    )
    return out


def adapter(folder) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "adapter_model.safetensors"))


def test_starts_at_ln2_learns_and_builds_no_reference_copy(plain):
    s = summary(plain)
    assert abs(s["losses"][0] - math.log(2)) < 1e-4  # the reference is the base model: adapters start at zero
    assert s["losses"][-1] < s["losses"][0]
    log = (plain / "launch.log").read_text()
    assert "LoRA: 32,768 trainable of" in log


def test_saves_an_adapter_that_peft_reloads_and_only_adapters_changed(plain, tiny_model_dir):
    """The adapter is LoRA weights only; merged into the base it gives the merged model the run wrote; every weight
    outside the adapted linear layers is the base's, bit for bit."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    saved = adapter(plain)
    assert saved and all("lora_A" in k or "lora_B" in k for k in saved)
    assert any(t.abs().max() > 0 for k, t in saved.items() if "lora_B" in k)  # B starts at zero: it trained
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    reloaded = PeftModel.from_pretrained(base, plain)
    merged = AutoModelForCausalLM.from_pretrained(plain / "merged")
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, merged(ids).logits, atol=1e-5)
    changed = {k for k, v in merged.state_dict().items() if not torch.equal(v, base_state[k])}
    adapted = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert changed and all(k.split(".")[-2] in adapted for k in changed)
    assert all(any(f".{name}." in k for k in changed) for name in adapted)


def test_every_lever_gives_the_same_curve(plain, tiny_model_dir, tmp_path):
    """Nested checkpoints, lean norms, the lean LM head and MLP chunks wrap modules whose linear layers PEFT has
    replaced: the adapters run inside them and the curve does not move."""
    run_train(tmp_path, *LORA, *LEVERS, "--model.name_or_path", tiny_model_dir, "--save_strategy", "no")
    s = summary(tmp_path)
    assert sum(s["wrapped"].values()) > 0
    assert s["losses"] == pytest.approx(summary(plain)["losses"], abs=1e-5)


def test_shared_prompt_gives_the_same_curve(plain, tiny_model_dir, tmp_path):
    """Each pair's prompt computed once, the reference being the base with the adapters off through the same forward;
    with the levers, and evaluated: the same curve, and the same evaluation loss as without sharing."""
    evaluate = ["--data.eval_files", "recipes/data/arithmetic_preferences.jsonl", "--eval_strategy", "steps"]
    evaluate += ["--eval_steps", "2", "--save_strategy", "no"]
    base = [*LORA, *LEVERS, *evaluate, "--model.name_or_path", tiny_model_dir]
    run_train(tmp_path / "shared", *base, "--data.shared_prompt", "true", "--data.shared_prompt_min_saving", "0")
    run_train(tmp_path / "rows", *base)
    shared, rows = summary(tmp_path / "shared"), summary(tmp_path / "rows")
    assert shared["shared_prompt_forwards"]["shared"] > 0 and shared["shared_prompt_forwards"]["two_rows"] == 0
    # each step's telemetry says how many of its pairs ran with the prompt once: all of them here
    steps = [json.loads(line) for line in open(tmp_path / "shared" / "memory.jsonl")]
    assert steps and all(r["shared_pairs"] == r["pairs"] > 0 for r in steps)
    assert "shared_pairs" not in json.loads(open(tmp_path / "rows" / "memory.jsonl").readline())
    assert shared["shared_prompt"] and shared["losses"] == pytest.approx(summary(plain)["losses"], abs=1e-5)
    evals = [[h["eval_loss"] for h in s["eval_logs"]] for s in (shared, rows)]
    assert evals[0] and evals[0] == pytest.approx(evals[1], abs=1e-5)


def test_resume_continues_the_same_curve(plain, tiny_model_dir, tmp_path):
    shutil.copytree(plain / "checkpoint-2", tmp_path / "checkpoint-2")
    run_train(tmp_path, *LORA, "--model.name_or_path", tiny_model_dir, "--resume_from_checkpoint", "true")
    assert summary(tmp_path)["losses"] == pytest.approx(summary(plain)["losses"], abs=1e-6)
    assert adapter(tmp_path).keys() == adapter(plain).keys()
    for k, t in adapter(tmp_path).items():
        assert torch.allclose(t, adapter(plain)[k], atol=1e-6), k


def test_two_process_zero3_with_levers_equals_one_process(zero3_one, tiny_model_dir, tmp_path):
    """Under ZeRO-3 TRL forces transformers' layer checkpoint to be reentrant for PEFT; our checkpoints nest in it.
    Two ranks (2 pairs each) with every lever == one rank (4 pairs), in the curve and in the saved adapter.

    Bound on the adapter: every gradient element is at most the step's gradient norm (< 0.7 here); reordering a
    float32 sum moves it by a few ulps of the largest partial sum, under 1e-6 relative. Over 4 SGD steps of lr 0.5
    that is at most 4 x 0.5 x 0.7 x 1e-6 = 1.4e-6 per weight, inside 1e-5 (measured: 6e-8)."""
    run_train(
        tmp_path,
        *LORA,
        *LEVERS,
        *SGD,
        "--model.name_or_path",
        tiny_model_dir,
        "--per_device_train_batch_size",
        "2",
        launcher="deepspeed",
        procs=2,
    )
    one, two = summary(zero3_one), summary(tmp_path)
    assert two["world_size"] == 2 and two["built_partitioned"]
    assert abs(one["losses"][0] - math.log(2)) < 1e-4 and one["losses"][-1] < one["losses"][0]
    assert two["losses"] == pytest.approx(one["losses"], abs=1e-5)
    norms = [[h["grad_norm"] for h in s["train_logs"]] for s in (one, two)]
    assert max(norms[0]) < 0.7 and norms[1] == pytest.approx(norms[0], rel=1e-5)
    a1, a2 = adapter(zero3_one), adapter(tmp_path)
    assert a1.keys() == a2.keys()
    for k in a1:
        assert torch.allclose(a1[k], a2[k], atol=1e-5), k
