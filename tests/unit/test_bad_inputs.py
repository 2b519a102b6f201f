"""Every bad input gives one clear error naming the fix, before any model is loaded, and loses nothing written."""

import json
import os

import pytest
from conftest import ROOT, TINY, run_train

from longdpo.checks import check_recipe
from longdpo.config import RecipeError, load_recipe, parse_overrides


def check(*argv: str, recipe: str = TINY, world_size: int = 1, cuda: bool = False):
    r = load_recipe(recipe, parse_overrides(list(argv)))
    check_recipe(r, world_size=world_size, cuda_available=cuda)
    return r


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--learning_rat", "1e-5"], "Unknown key `learning_rat`.*Did you mean `learning_rate`"),
        (["--memory.checkpointng", "layer"], "Unknown key `memory.checkpointng`.*Did you mean `checkpointing`"),
        (["--model.dtpye", "float32"], "Unknown key `model.dtpye`.*Did you mean `dtype`"),
        (["--max_steps", "ten"], "`max_steps` must be a number"),
        (["--gradient_checkpointing", "true"], "memory.checkpointing"),
        (["--memory.checkpointing", "norm_atn"], "Did you mean `norm_attn`"),
        (["--memory.empty_cache_steps", "1", "--torch_empty_cache_steps", "1"], "remove `torch_empty_cache_steps`"),
        (["--memory.empty_cache_steps", "-1"], "`memory.empty_cache_steps` must be >= 0"),
        (
            ["--memory.tiled_mlp", "2", "--memory.mlp_chunks", "2"],
            "Set one of `memory.tiled_mlp` and `memory.mlp_chunks`",
        ),
        (["--bf16", "true"], "set `bf16: false`"),
        (["--model.dtype", "bfloat16"], "set `model.dtype: float32`"),
        (["--model.dtype", "float64"], "`model.dtype` must be one of"),
        (["--activation_offloading", "true"], "set `activation_offloading: false`"),
        (["--memory.offload_pin_memory", "false"], "set `activation_offloading: true` too"),
        (["--memory.offload_keep_layers", "1"], "keeps part of TRL's activation offloading on the GPU; set"),
        (["--memory.offload_keep_layers", "-1"], "`memory.offload_keep_layers` must be a whole number >= 0"),
        (["--max_length", "1"], "`max_length` must be an integer >= 2"),
        (["--per_device_train_batch_size", "0"], "`per_device_train_batch_size` must be a positive integer"),
        (["--data.global_batch_size", "6"], r"`data.global_batch_size: 6` is not a multiple of .* = 4"),
        (["--data.global_batch_size", "0"], r"`data.global_batch_size` must be a positive integer .* or null, got 0"),
        (["--beta", "-0.1"], "`beta` must be a number > 0"),
        (["--beta", "0"], "`beta` must be a number > 0"),
        (["--learning_rate", "-1e-6"], "`learning_rate` must be a number >= 0"),
        (["--seed", "-1"], r"`seed` must be a whole number from 0 to 2\*\*32 - 1, got -1"),
        (["--label_smoothing", "0.7"], r"`label_smoothing` must be in \[0, 0.5\) .* got 0.7"),
        (["--weight_decay", "-0.1"], "`weight_decay` must be a number >= 0"),
        (["--loss_type", "dpo"], "`loss_type: dpo` is not one of TRL's DPO losses; choose from sigmoid, hinge, ipo"),
        (["--loss_type", "[sigmoid, sft2]"], "`loss_type: sft2` is not one of TRL's DPO losses"),
        (["--loss_type", "exo_pair"], "`loss_type: exo_pair` needs `label_smoothing` above 0"),
        (["--eval_strategy", "steps"], "`eval_strategy: steps` needs evaluation pairs: set `data.eval_files`"),
        (
            ["--max_steps", "-1", "--num_train_epochs", "0"],
            "`num_train_epochs: 0.0` with no `max_steps` trains nothing",
        ),
        (["--save_steps", "0"], r"`save_steps` must be a whole number of steps >= 1 .* `save_strategy: no`"),
        (["--logging_steps", "-1"], r"`logging_steps` must be a whole number of steps >= 1"),
        (["--eval_strategy", "steps", "--eval_steps", "2.5"], r"`eval_steps` must be a whole number"),
        (["--save_total_limit", "-1"], r"`save_total_limit` must be a whole number >= 1 .* or null"),
        (["--save_total_limit", "0"], r"`save_total_limit` must be a whole number >= 1"),
        (["--dataloader_num_workers", "-1"], r"`dataloader_num_workers` must be a whole number >= 0"),
        (["--report_to", "[tensorboard,tensorbored]"], r"`report_to: tensorbored` is not a logging integration"),
        (["--parallelism.sp_size", "0"], r"`parallelism.sp_size` must be a positive integer"),
        (["--max_steps", "1.5"], r"`max_steps` must be a whole number of optimizer steps"),
        (["--data.mixture", "5", "--data.train_files", "null"], r"`data.mixture` is a list of sources"),
        (["--truncation_mode", "middle"], "`truncation_mode` must be keep_start or keep_end, got 'middle'"),
        (["--loss_type", "aot", "--use_weighting", "true"], "`use_weighting: true` .* drop one of the two"),
        (["--data.train_files", "[missing.jsonl]"], "'missing.jsonl' does not exist"),
        (["--data.train_files", "[requirements.txt]"], "unsupported extension"),
        (["--data.train_files", "[]"], "No training data"),
        (["--data.synthetic", "{pairs: 2, seq_tokens: 10}"], "must be a mapping of whole numbers with the keys"),
        (["--data.synthetic", "{pairs: 2, seq_tokens: 10, prompt_tokens: 2.5}"], "must be a mapping of whole numbers"),
        (["--data.synthetic", "{pairs: 2, seq_tokens: 100, mix_seed: 0, prompt_tokens: 5}"], "or \\['mix_seed'"),
        (["--data.synthetic", "{pairs: 2, seq_tokens: 32, mix_seed: 0}"], "A mix in `data.synthetic` needs"),
        (["--model.name_or_path", "some/dir"], "Set exactly one of `model.name_or_path`"),
        (
            ["--model.architecture", "null", "--model.name_or_path", "tests"],
            "'tests' is a directory but not a saved model",
        ),
        (
            ["--model.architecture", "null", "--model.name_or_path", "org/model"],
            "'org/model' is not a local directory and could not be loaded",
        ),
        (
            ["--model.architecture", "null", "--model.name_or_path", "./no/such/dir"],
            "neither a local directory nor a Hugging Face Hub id",
        ),
        (["--model.architecture", "recipes/architectures/nope.json"], "does not exist"),
        (["--model.tokenizer", "null"], "set `model.tokenizer: byte`"),
        (["--deepspeed", "ds_configs/nope.json"], "does not exist; pass one of ds_configs"),
        (["--memory.sgd_in_backward", "true", "--deepspeed", "ds_configs/zero3.json"], "single process"),
        (["--memory.allocator_conf", "max_split_size_mb=64"], "malformed; write `key:value`"),
        (["--use_liger_kernel", "true"], "needs a CUDA GPU.*set `use_liger_kernel: false`"),
        (["--bf16", "true", "--fp16", "true"], "both set; keep one"),
        (["--run.on_nonfinite", "ignore"], "`run.on_nonfinite` must be stop or skip"),
        (["--run.on_nonfinite", "skip", "--memory.sgd_in_backward", "true"], "use `run.on_nonfinite: stop`"),
        (["--run.save_on_signals", "[SIGKILL]"], "not a signal a run can save on"),
        (["--memory.profile_step", "-1"], "`memory.profile_step` must be >= 0"),
        (["--model.lora_r", "8"], r"`model.lora_r` is set but LoRA is off: set `model.use_peft: true`"),
        (
            ["--model.use_peft", "true", "--model.lora_target_modules", "[q_prj, v_proj]"],
            r"\['q_prj'\] match\(es\) no module of this mistral model; its linear layers are .*'q_proj'",
        ),
        (["--model.use_peft", "true", "--model.lora_target_modules", ".*nothing.*"], "Fix `model.lora_target_modules`"),
        (["--model.use_peft", "true", "--model.lora_target_modules", "[q_proj, lm_head]"], "drop `lm_head` there"),
        (["--model.use_peft", "true", "--model.lora_r", "0"], "`model.lora_r` must be at least 1"),
        (["--model.use_peft", "true", "--model.lora_dropout", "1.5"], r"`model.lora_dropout` must be in \[0, 1\)"),
        (["--model.use_peft", "true", "--model.lora_save_merged", "true"], "random-init `model.architecture`"),
        (["--model.use_peft", "true", "--sync_ref_model", "true"], "set `sync_ref_model: false`"),
        (["--model.use_peft", "true", "--memory.sgd_in_backward", "true"], "set `memory.sgd_in_backward: false`"),
    ],
)
def test_bad_recipe_values(argv, message):
    with pytest.raises(RecipeError, match=message):
        check(*argv)


def test_keeping_every_layer_on_the_gpu_is_no_offloading(gpu_packages):
    with pytest.raises(RecipeError, match="keeps every one of the model's 2 layers on the GPU; set `activation_off"):
        check("--activation_offloading", "true", "--memory.offload_keep_layers", "2", cuda=True)
    check("--activation_offloading", "true", "--memory.offload_keep_layers", "1", cuda=True)


def test_16_bit_formats_are_not_mixed(gpu_packages):
    with pytest.raises(RecipeError, match="`model.dtype: float16` with `bf16: true` mixes two 16-bit formats"):
        check("--model.dtype", "float16", "--bf16", "true", cuda=True, recipe="recipes/nemotron12b/dpo_12k.yaml")
    check(
        "--model.dtype",
        "bfloat16",
        "--bf16",
        "true",
        cuda=True,
        world_size=8,
        recipe="recipes/nemotron12b/dpo_12k.yaml",
    )


def test_global_batch_sets_the_accumulation_for_the_gpus_there_are(gpu_packages):
    """The shipped 12B recipes say 8 pairs per step: on 8, 4, 2 or 1 GPUs the accumulation follows."""
    for gpus, accumulation in ((8, 1), (4, 2), (2, 4), (1, 8)):
        r = check(world_size=gpus, cuda=True, recipe="recipes/nemotron12b/dpo_12k.yaml")
        assert r.trainer["gradient_accumulation_steps"] == accumulation, gpus
    with pytest.raises(RecipeError, match="not a multiple of per_device_train_batch_size \\(1\\) x 3 data-parallel"):
        check(world_size=3, cuda=True, recipe="recipes/nemotron12b/dpo_12k.yaml")
    r = check(
        "--data.global_batch_size",
        "8",
        "--per_device_train_batch_size",
        "2",
        world_size=2,
        cuda=True,
        recipe="recipes/nemotron12b/dpo_12k.yaml",
    )
    assert r.trainer["gradient_accumulation_steps"] == 2


def test_recipe_file_problems(tmp_path):
    with pytest.raises(RecipeError, match="does not exist; pass an existing YAML"):
        load_recipe(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("beta: [unclosed\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(bad)
    bad.write_text("- a list\n")
    with pytest.raises(RecipeError, match="must be a YAML mapping"):
        load_recipe(bad)
    bad.write_text("model:\n  dtype: float32\nmemory:\n\tlean_norm: true\n")
    with pytest.raises(RecipeError, match="indents line 4 with a tab: indent YAML with spaces"):
        load_recipe(bad)


def test_help_prints_the_usage_and_exits_0():
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch", "train_dpo.py"), "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0 and proc.stderr == ""
    for text in (
        "deepspeed --num_gpus 8 launch/train_dpo.py",
        "accelerate launch",
        "--resume_from_checkpoint",
        "--overwrite_output_dir",
        "Exit status",
        "DPOConfig",
    ):
        assert text in proc.stdout, text
    import dataclasses

    from longdpo.config import SECTIONS
    from longdpo.levers import keys

    ours = [f"{section}.{f.name}" for section, cls in SECTIONS.items() if cls for f in dataclasses.fields(cls)]
    ours += [key.dotted for _, key in keys().values()]  # the levers' keys, declared with each lever
    assert len(ours) > 50
    for name in ours:  # every key of ours, with its one-line documentation
        line = next((x for x in proc.stdout.splitlines() if x.startswith(f"  {name} (")), "")
        assert "): " in line, name


def test_invalid_deepspeed_json(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text("{not json")
    with pytest.raises(RecipeError, match="not valid JSON"):
        check("--deepspeed", str(ds))


def test_command_line_shape_errors():
    with pytest.raises(RecipeError, match="needs a value"):
        parse_overrides(["--max_steps"])
    with pytest.raises(RecipeError, match="Unexpected argument 'oops'"):
        parse_overrides(["oops"])


def test_yaml_no_means_the_word_no():
    r = load_recipe(TINY, parse_overrides(["--save_strategy", "no"]))
    assert r.trainer["save_strategy"] == "no"


@pytest.mark.parametrize(
    "text,message",
    [
        (json.dumps({"prompt": "a", "chosen": "b"}) + "\n", r"lack column\(s\) \['rejected'\]"),
        ("", "are empty"),
        ('{"prompt": "a", "chosen": "b", "rejected": \n', "line 1 is not JSON"),
        ("not json at all\n", "line 1 is not JSON .*one JSON object per line"),
        ('["a", "list"]\n', "line 1 is a JSON list, not an object"),
        (json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n{broken\n", "could not be read"),  # datasets'
    ],
)
def test_bad_data_files(tmp_path, text, message):
    from longdpo.data.loading import load_preferences

    f = tmp_path / "d.jsonl"
    f.write_text(text)
    with pytest.raises(RecipeError, match=message):
        load_preferences([str(f)])


@pytest.mark.launcher
def test_entrypoint_error_exits_2_with_one_line_and_loses_nothing(tmp_path):
    """All pairs dropped by max_length: found from the prompts' token counts before any model is loaded (TRL's
    tokenization of the dataset comes after the models); the output dir a user pointed at keeps what it had and
    gains nothing."""
    (tmp_path / "precious.txt").write_text("keep me")
    proc = run_train(tmp_path, "--max_length", "5", check=False)
    assert proc.returncode == 2
    errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "All 64 pairs would be dropped" in errors[0] and "Raise `max_length`" in errors[0]
    assert "Tokenizing train dataset" not in proc.stdout
    assert "Traceback" not in proc.stdout
    assert sorted(os.listdir(tmp_path)) == ["precious.txt"]
    assert (tmp_path / "precious.txt").read_text() == "keep me"


@pytest.mark.launcher
@pytest.mark.parametrize(
    "argv,message",
    [
        (["--parallelism.sp_size", "0"], "`parallelism.sp_size` must be a positive integer"),
        (["--model.architecture", "null", "--model.name_or_path", "tests"], "is a directory but not a saved model"),
    ],
)
def test_a_recipe_the_planner_cannot_plan_is_still_one_line(tmp_path, argv, message):
    """The start-up plan runs beside the other checks to report everything at once; a recipe those checks refused
    (no ranks to divide by, a folder with no model) is not planned, instead of a traceback from the planner."""
    proc = run_train(tmp_path / "out", *argv, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout, proc.stdout[-3000:]
    errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
    assert errors and message in errors[0] and not os.path.exists(tmp_path / "out")


@pytest.mark.launcher
def test_a_value_trl_refuses_is_one_line_and_overwriting_deletes_nothing_before_it(tmp_path):
    """A setting transformers' own arguments refuse (an unknown `lr_scheduler_type`) is one line, exit 2; with
    --overwrite_output_dir the earlier run is deleted only once TRL has accepted the recipe, so here it stays."""
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "memory.jsonl").write_text("{}\n")
    proc = run_train(tmp_path, "--lr_scheduler_type", "bogus", "--overwrite_output_dir", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout, proc.stdout[-3000:]
    errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert errors[0].startswith("error: TRL's DPOConfig refuses this recipe: bogus is not a valid SchedulerType")
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "memory.jsonl"]


@pytest.mark.launcher
def test_a_setting_trls_trainer_refuses_is_one_line_and_overwriting_loses_nothing(tmp_path):
    """DPOTrainer checks some of its arguments only when it is built, after the models (here an f-divergence its
    loss has no form for): one line naming TRL's reason, exit 2, no traceback. With --overwrite_output_dir the
    earlier run was set aside by then; the refused run puts it back, every file as it was."""
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "model.safetensors").write_text("weights")
    (tmp_path / "memory.jsonl").write_text("{}\n")
    (tmp_path / "notes.txt").write_text("not a run's file")
    before = sorted((str(p.relative_to(tmp_path)), p.read_text() if p.is_file() else None) for p in tmp_path.rglob("*"))
    proc = run_train(
        tmp_path,
        "--f_divergence_type",
        "js_divergence",
        "--loss_type",
        "apo_zero",
        "--overwrite_output_dir",
        check=False,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stdout, proc.stdout[-3000:]
    errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: TRL's DPOTrainer refuses this recipe: `f_divergence_type")
    assert "set aside in" in proc.stdout and "the earlier run is back in" in proc.stdout  # it was moved, then back
    after = sorted((str(p.relative_to(tmp_path)), p.read_text() if p.is_file() else None) for p in tmp_path.rglob("*"))
    assert after == before


def test_every_loss_type_trl_offers_is_accepted():
    """The list is read from TRL's DPOConfig help; each name on it is a loss TRL computes (the shared-prompt tests
    run every one), and sigmoid, TRL's default, is first."""
    from longdpo.checks import trl_loss_types

    names = trl_loss_types()
    assert names[0] == "sigmoid" and {"ipo", "hinge", "sft", "apo_zero", "sigmoid_norm"} <= set(names)
    for name in names:
        check("--loss_type", name, "--label_smoothing", "0.001")


def test_entrypoint_without_recipe_names_the_flag(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch", "train_dpo.py")], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 2 and "pass `--recipe" in proc.stderr


def test_launcher_arguments_are_told_apart_from_overrides(monkeypatch):

    monkeypatch.setenv("LOCAL_RANK", "0")  # parse_cli exports --local_rank; monkeypatch removes it afterwards
    from longdpo.config import parse_cli

    # what the deepspeed launcher passes: --local_rank first, the DeepSpeed JSON positionally
    cli = parse_cli(
        [
            "--local_rank=0",
            "ds_configs/zero3.json",
            "--recipe",
            "r.yaml",
            "--model.architecture",
            "other.json",
            "--resume_from_checkpoint",
            "out/checkpoint-2",
            "--no_final_save",
            "--beta=0.2",
        ]
    )
    assert cli["recipe"] == "r.yaml" and cli["resume"] == "out/checkpoint-2" and cli["save"] is False
    assert cli["overrides"] == {
        "deepspeed": "ds_configs/zero3.json",
        "model": {"architecture": "other.json"},
        "beta": 0.2,
    }
    assert parse_cli(["--deepspeed", "ds.json", "--recipe", "r.yaml"])["overrides"]["deepspeed"] == "ds.json"
    with pytest.raises(RecipeError, match="Unexpected argument 'stray'"):
        parse_cli(["stray"])


@pytest.mark.launcher
def test_tokenizer_larger_than_vocab_is_caught_before_the_model_is_built(tmp_path):
    arch = json.load(open(os.path.join(ROOT, "recipes", "architectures", "tiny_mistral.json")))
    arch["vocab_size"] = 100
    (tmp_path / "small_vocab.json").write_text(json.dumps(arch))
    proc = run_train(tmp_path / "out", "--model.architecture", str(tmp_path / "small_vocab.json"), check=False)
    assert proc.returncode == 2 and "tokenizer has 263 tokens but the model's vocab_size is 100" in proc.stdout


def test_liger_needs_its_package_and_keeps_trls_fused_head(monkeypatch):
    """On a GPU machine: liger-kernel missing names requirements-gpu.txt; Liger's fused cross-entropy is refused;
    the Trainer is handed no Liger flag (the entrypoint applies it before our patches)."""
    import importlib.util

    from longdpo.checks import CheckContext
    from longdpo.levers import Build, liger

    def check(**trainer):
        recipe = load_recipe(TINY, {"use_liger_kernel": True, **trainer})
        liger.LEVER.check(recipe.levers, CheckContext(recipe, 1, cuda_available=True))

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "liger_kernel" else real(n, *a))
    with pytest.raises(RecipeError, match="requirements-gpu.txt"):
        check()
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "liger_kernel" else real(n, *a))
    with pytest.raises(RecipeError, match="fused_linear_cross_entropy"):
        check(liger_kernel_config={"fused_linear_cross_entropy": True})
    check(liger_kernel_config={"swiglu": False})
    build = Build(trainer_kwargs={"use_liger_kernel": True, "liger_kernel_config": {"swiglu": False}, "max_steps": 3})
    liger.LEVER.configure(load_recipe(TINY, {"use_liger_kernel": True}).levers, build)
    assert build.state["liger"] == {"swiglu": False, "fused_linear_cross_entropy": False, "cross_entropy": False}
    assert build.trainer_kwargs == {"max_steps": 3}  # the Trainer never applies Liger itself


def test_more_processes_than_gpus_names_the_launcher_flag():
    from longdpo.checks import check_processes_per_gpu

    check_processes_per_gpu(8, 8)
    with pytest.raises(RecipeError, match="8 processes on this node but 1 GPU.*--num_processes 1.*--num_gpus 1"):
        check_processes_per_gpu(8, 1)


def test_a_section_key_given_at_the_top_level_names_its_section():
    """TRL's scripts take `--use_peft` / `--lora_r` at the top level; here they are `model:` keys."""
    with pytest.raises(RecipeError, match=r"`use_peft` is a `model:` key: write `model.use_peft`"):
        check("--use_peft", "true")


def test_a_logging_integration_that_is_not_installed_is_one_line(monkeypatch):
    """`report_to: wandb` without wandb failed after both models were loaded; now at start-up."""
    import importlib.util

    from longdpo.checks import resolve_report_to

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(RecipeError, match=r"`report_to: wandb` needs the wandb package.*`pip install wandb`"):
        resolve_report_to({"report_to": ["tensorboard", "wandb"]})
    assert resolve_report_to({"report_to": "none"}) == ["none"]


@pytest.mark.launcher
def test_under_the_deepspeed_launcher_an_error_is_said_once(tmp_path):
    proc = run_train(tmp_path / "out", "--model.lora_r", "8", launcher="deepspeed", procs=2, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stdout
    assert proc.stdout.count("error: `model.lora_r` is set but LoRA is off") == 1


@pytest.mark.launcher
def test_a_12b_recipe_on_a_cpu_machine_says_every_problem_at_once(tmp_path):
    """Four settings a CPU cannot run and a model no 24 GB machine holds: one run, one line each, before any model
    is loaded (it was four runs of one error each, then 77 s of silence and the kernel's OOM kill)."""
    import psutil

    recipe = os.path.join(ROOT, "recipes", "nemotron12b", "dpo_12k.yaml")
    proc = run_train(tmp_path / "out", recipe=recipe, check=False)
    errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stdout
    for key in ("use_liger_kernel: false", "bf16: false", "activation_offloading: false", "model.dtype: float32"):
        assert sum(key in e for e in errors) == 1, (key, errors)
    # 12.2 B parameters: policy, reference, gradients and optimizer state are over 100 GB at 16 bits
    if psutil.virtual_memory().available < 100e9:
        assert sum("no GPU, so the model" in e for e in errors) == 1, errors
    assert len(errors) <= 5 and not os.path.exists(tmp_path / "out")


def test_no_gpu_memory_check_keeps_to_what_the_machine_has(tmp_path):
    """The host-memory verdict on a CPU machine, from the planner's plan: the tiny model fits anywhere; a need
    above what is free is one line naming the fix, whatever this machine's size."""
    import psutil

    from longdpo.planner import plan as planner

    tiny = planner.plan(load_recipe(TINY), 1, None)
    assert planner.cpu_memory_gb(tiny, 1) < 1
    assert planner.cpu_memory_gb(tiny, 2) == pytest.approx(2 * tiny.peak_allocated_gb + tiny.host_per_node_gb)
    free = psutil.virtual_memory().available / 1e9
    big = load_recipe(TINY, parse_overrides(["--max_length", str(int(free * 1e9 / 8))]))  # activations past `free`
    assert planner.cpu_memory_gb(planner.plan(big, 1, None), 1) > free


@pytest.mark.parametrize("conversational", [False, True])
def test_prompt_tokens_are_counted_as_trl_drops_pairs(conversational):
    """For every shipped pair, our count agrees with TRL's tokenization in a real DPOTrainer (its prompt_ids),
    so the early all-dropped check and TRL's filter cannot disagree."""
    import datasets
    from trl import DPOConfig, DPOTrainer

    from longdpo.config import ModelArgs
    from longdpo.data.lengths import prompt_tokens
    from longdpo.data.loading import load_preferences
    from longdpo.model.build import build_byte_tokenizer, build_model

    raw = load_preferences([os.path.join(ROOT, "recipes", "data", "arithmetic_preferences.jsonl")])
    if conversational:  # the same pairs as messages, through the tokenizer's chat template
        raw = raw.map(
            lambda r: {
                "prompt": [{"role": "user", "content": r["prompt"]}],
                "chosen": [{"role": "assistant", "content": r["chosen"]}],
                "rejected": [{"role": "assistant", "content": r["rejected"]}],
            }
        )
    tok = build_byte_tokenizer()
    model, ref = (
        build_model(
            ModelArgs(architecture="recipes/architectures/tiny_mistral.json", tokenizer="byte", dtype="float32")
        )
        for _ in range(2)
    )
    args = DPOConfig(
        output_dir="/tmp/unused",
        report_to="none",
        max_length=None,
        bf16=False,
        use_cpu=True,
        activation_checkpointing=False,
        dataloader_pin_memory=False,
    )
    trl = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=raw, processing_class=tok).train_dataset
    assert isinstance(trl, datasets.Dataset) and len(trl) == len(raw)
    assert [prompt_tokens(tok, row) for row in raw] == [len(ids) for ids in trl["prompt_ids"]]


def test_an_optimizer_whose_package_is_missing_is_one_line(tmp_path):
    """`optim: adamw_8bit` without bitsandbytes was an ImportError traceback when the trainer made the optimizer,
    after the models loaded; now one line at start-up, before any model."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes"):
        pytest.skip("bitsandbytes is installed here: adamw_8bit is then a valid choice")
    proc = run_train(tmp_path / "out", "--optim", "adamw_8bit", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout, proc.stdout[-3000:]
    errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: `optim: adamw_8bit` needs a package that is not installed")
    assert "bitsandbytes" in errors[0] and "length report" not in proc.stdout  # before the data and the models
