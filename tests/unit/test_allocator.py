"""memory.allocator_conf reaches the allocator: set before torch touches CUDA, recipe over environment, checked keys."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT, run_train

from longdpo.config import RecipeError
from longdpo.levers import LeverSet, allocator


@pytest.mark.parametrize(
    "conf,parsed",
    [
        ("max_split_size_mb:64", {"max_split_size_mb": "64"}),
        ("max_split_size_mb:64, expandable_segments:True", {"max_split_size_mb": "64", "expandable_segments": "True"}),
        (
            "garbage_collection_threshold:0.8,roundup_power2_divisions:[256:1,512:2,>:4]",
            {"garbage_collection_threshold": "0.8", "roundup_power2_divisions": "[256:1,512:2,>:4]"},
        ),
    ],
)
def test_parse_valid(conf, parsed):
    assert allocator.parse(conf) == parsed


@pytest.mark.parametrize(
    "conf,message",
    [
        ("max_split_size_mb=64", "malformed; write `key:value`"),
        ("max_split_sz_mb:64", "Did you mean `max_split_size_mb`"),
        ("max_split_size_mb:10", "must be an integer > 20"),
        ("garbage_collection_threshold:1.5", "strictly between 0 and 1"),
        ("expandable_segments:yes", "True or False"),
        ("roundup_power2_divisions:3", "power of two"),
    ],
)
def test_malformed_or_unknown_is_an_error(conf, message):
    # torch itself accepts unknown keys silently: that is why we check
    with pytest.raises(RecipeError, match=message):
        allocator.parse(conf)


def test_precedence_recipe_over_environment():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert allocator.resolve(None, env) == ("expandable_segments:True", "environment")
    assert allocator.resolve("max_split_size_mb:64", env) == ("max_split_size_mb:64", "recipe")
    assert allocator.resolve(None, {}) == (None, "default")
    assert allocator.resolve(None, {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128"})[1] == "environment"
    with pytest.raises(RecipeError):  # a typo in the user's own environment is caught too
        allocator.resolve(None, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_sz_mb:64"})


def test_apply_sets_both_variables_and_overrides_the_user():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    record = allocator.apply("max_split_size_mb:64", env)
    handed = "max_split_size_mb:64,pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == env["PYTORCH_ALLOC_CONF"] == handed
    assert record["source"] == "recipe" and record["path"] == "environment"
    assert record["allocator_conf"] == "max_split_size_mb:64"  # what the run is named and planned by


def test_host_memory_is_pinned_by_threads_unless_the_setting_names_its_own_pinning_or_asks_for_torchs(monkeypatch):
    for var in allocator.ENV_VARS:  # a setting in the shell that runs the tests would be the user's own
        monkeypatch.delenv(var, raising=False)
    env = {}
    record = allocator.apply(None, env)
    assert env["PYTORCH_ALLOC_CONF"] == allocator.host_pinning(8) == record["host_pinning"]
    assert record["allocator_conf"] is None and record["source"] == "default" and record["path"] == "environment"
    assert allocator.parse(record["host_pinning"]) == {
        "pinned_use_cuda_host_register": "True",
        "pinned_num_register_threads": "8",
    }
    own = "expandable_segments:True,pinned_use_cuda_host_register:False"
    env = {"PYTORCH_CUDA_ALLOC_CONF": own}
    record = allocator.apply(None, env)
    assert env["PYTORCH_ALLOC_CONF"] == env["PYTORCH_CUDA_ALLOC_CONF"] == own and record["host_pinning"] is None
    env = {}
    record = allocator.apply(None, env, pinning_threads=0)  # `memory.host_pinning_threads: 0`
    assert env == {} and record["path"] is None and record["host_pinning"] is None
    record = allocator.apply_from_recipe({"memory": {"host_pinning_threads": 16}})
    assert record["host_pinning"] == allocator.host_pinning(16)


@pytest.mark.parametrize("threads", [3, 256, -8, True])
def test_pinning_threads_torch_would_refuse_are_one_line(threads):
    s = LeverSet(host_pinning_threads=threads)
    with pytest.raises(RecipeError, match="host_pinning_threads` must be 0 .* or a power of two up to 128"):
        allocator.LEVER.check(s, None)


def test_the_library_only_setup_pins_as_torch_does():
    assert LeverSet.read("stock+liger+offload").host_pinning_threads == 0
    assert LeverSet.read("layer+liger+offload").host_pinning_threads == 8
    assert LeverSet.read("layer+liger+offload+hostalloc").name == "layer+liger+offload+hostalloc"


def test_entrypoint_applies_it_before_torch_is_imported():
    """In a fresh process, the entrypoint's first step (longdpo/train.py) runs with torch not yet imported and CUDA not
    initialised: the allocator's lever module imports no other lever."""
    code = (
        "import os;"
        "from longdpo.levers import allocator;"
        "from longdpo.config import parse_cli, read_raw;"
        "cli = parse_cli(['--recipe', 'recipes/tiny_mistral/dpo_quickstart.yaml',"
        "                           '--memory.allocator_conf', 'max_split_size_mb:64']);"
        "rec = allocator.apply_from_recipe(read_raw(cli['recipe'], cli['overrides']));"
        "import json; print(json.dumps({**rec, 'env': os.environ.get('PYTORCH_CUDA_ALLOC_CONF'),"
        "                               'env2': os.environ.get('PYTORCH_ALLOC_CONF')}))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    assert rec["torch_imported_before"] is False and rec["cuda_initialized_before"] is False
    assert rec["path"] == "environment"
    assert rec["env"] == rec["env2"] == f"max_split_size_mb:64,{allocator.host_pinning(8)}"


def test_runtime_path_when_cuda_is_already_initialised():
    """CUDA cannot initialise on this CPU machine, so its state is stood in for in a subprocess: the runtime call is
    made, and a read-back that disagrees (what an H200 showed: results/gpu_2026-12-02_first) is a loud error."""
    code = """
import json, torch, sys
from longdpo.levers import allocator
from longdpo.config import RecipeError
calls = []
torch.cuda.is_initialized = lambda: True
torch.cuda.is_available = lambda: True
torch._C._accelerator_setAllocatorSettings = calls.append
torch.cuda.memory_stats = lambda: {"max_split_size": 64 * 1024 * 1024}
env = {}
ok = allocator.apply("max_split_size_mb:64", env)
torch.cuda.memory_stats = lambda: {"max_split_size": -1}
try:
    allocator.apply("max_split_size_mb:64", {})
    err = None
except RecipeError as e:
    err = str(e)
print(json.dumps({"ok": ok, "calls": calls, "err": err, "env": env}))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["ok"]["path"] == "runtime" and res["ok"]["cuda_initialized_before"] is True
    assert res["calls"] == ["max_split_size_mb:64", "max_split_size_mb:64"]
    assert res["env"]["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"
    assert "did not take effect (max_split_size reads -1)" in res["err"]


@pytest.mark.launcher
def test_effective_setting_recorded_in_telemetry(tmp_path):
    run_train(
        tmp_path,
        "--max_steps",
        "1",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--memory.allocator_conf",
        "max_split_size_mb:64",
        env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    )
    record = json.loads(open(tmp_path / "memory.jsonl").readline())
    assert record["allocator_conf"] == "max_split_size_mb:64"
    summary = json.load(open(tmp_path / "train_summary.json"))
    assert summary["allocator"]["source"] == "recipe"
    assert summary["allocator"]["torch_imported_before"] is False


def test_empty_cache_steps_runs_on_boundaries(tmp_path):
    """gc + empty_cache every N steps and micro-batches: counted through the callback's own hook points."""
    from longdpo.levers import Build, LeverSet, empty_cache

    build = Build()
    empty_cache.LEVER.configure(LeverSet(empty_cache_steps=2, empty_cache_microbatches=3), build)
    (cb,) = build.callbacks
    emptied = []
    original = empty_cache.empty_cache
    empty_cache.empty_cache = lambda: emptied.append("x")
    try:
        from transformers import TrainerControl, TrainerState, TrainingArguments

        args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
        state, control = TrainerState(), TrainerControl()
        for step in range(1, 5):  # 4 steps x 2 micro-batches = 8 micro-batches
            state.global_step = step
            cb.on_substep_end(args, state, control)
            cb.on_step_end(args, state, control)
    finally:
        empty_cache.empty_cache = original
    # micro-batches 3 and 6 -> 2; steps 2 and 4 -> 2
    assert len(emptied) == 4
