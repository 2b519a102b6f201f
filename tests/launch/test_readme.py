"""Every command README.md shows in a ```bash block runs, and says what README says of it (`# -> text`: the text is in
its output). Commands that need GPUs are checked as far as a CPU can: their recipe and overrides through the
planner, on the GPUs they name. The walkthrough ("Your model and your data") runs end to end in a copy of the
repository: the planner on the real 12B configuration of its Hub id, training and the reload on a tiny Mistral laid
out in a Hugging Face cache under the same id, on 2 CPU ranks.

A command this file does not know how to run fails the test: add it to `classify`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, RUN_TIMEOUT_S, free_port, hub_cache, job_env, run_job

README = os.path.join(ROOT, "README.md")
WALKTHROUGH = "Your model and your data on N GPUs"
HUB_ID = "mistralai/Mistral-Nemo-Instruct-2407"
# What a CPU cannot do, said for the walkthrough's training command: bf16, Liger's Triton kernels, pinned host
# memory; and a short run (the shipped pairs are short, and 4 steps show training and saving).
CPU_OVERRIDES = (
    "--bf16 false --model.dtype float32 --use_liger_kernel false --activation_offloading false"
    " --max_length 128 --max_steps 4"
)


def sections() -> dict[str, str]:
    with open(README) as f:
        parts = re.split(r"^## ", f.read(), flags=re.M)
    return {part.split("\n", 1)[0].strip(): part for part in parts[1:]}


def commands(text: str) -> list[tuple[str, str | None]]:
    """(command, expected output or None) for every line of every ```bash block."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command, _, expect = line.partition("# -> ")
            command = command.split("  #")[0].strip() if "# -> " not in line else command.strip()
            if command and not command.startswith("#"):
                found.append((command, expect.strip() or None))
    return found


def yaml_file(text: str, name: str) -> str:
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", text, flags=re.S) if b.startswith(f"# {name}\n")]
    return block


def classify(command: str) -> str:
    """How a README command is checked on a CPU."""
    if command == "make test":
        return "the suite itself"
    if command == "make quickstart":
        return "make"
    if command.startswith(("deepspeed --num_gpus", "accelerate launch")) and "nemotron12b/" in command:
        return "gpu"
    if command.startswith(("python ", "deepspeed --num_gpus", "head ")):
        return "run"
    raise AssertionError(f"README shows a command this test does not check: {command!r}; add it to classify()")


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A copy of the repository to run README's commands in (they write my_dpo.yaml, outputs/, ...)."""
    copy = tmp_path_factory.mktemp("readme") / "repo"
    skip = shutil.ignore_patterns(".git", ".venv", "outputs", "results", ".whl", ".gpu", "__pycache__", "*.egg-info")
    shutil.copytree(ROOT, copy, ignore=skip)
    return copy


def run(command: str, cwd, env: dict | None = None) -> subprocess.CompletedProcess:
    """A README line as a user's shell runs it (a timeout kills the whole job, launcher ranks too)."""
    env = job_env({"HF_HUB_OFFLINE": "1", **(env or {})})
    return run_job(["bash", "-c", command], RUN_TIMEOUT_S, cwd=cwd, env=env, stderr=subprocess.STDOUT)


def check(proc: subprocess.CompletedProcess, command: str, expect: str | None, statuses=(0,)) -> None:
    assert proc.returncode in statuses, f"{command}\nexited {proc.returncode}:\n{proc.stdout[-5000:]}"
    if expect:
        assert expect in proc.stdout, f"{command}\nREADME says `{expect}`; the output:\n{proc.stdout[-5000:]}"


def as_planner(command: str) -> str:
    """A GPU launch line as the planner's: the same recipe and overrides, on the GPUs the line names."""
    gpus = re.search(r"--num_gpus (\d+)", command)
    args = command.split("launch/train_dpo.py", 1)[1].replace("ds_configs/zero3.json", "")
    return f"python launch/plan_memory.py {args} --gpus {gpus.group(1) if gpus else 8} --gpu-memory 80GB"


def test_every_command_outside_the_walkthrough(repo):
    for title, text in sections().items():
        if title == WALKTHROUGH:
            continue
        for command, expect in commands(text):
            how = classify(command)
            if how == "the suite itself":
                continue
            if how == "make":
                # the environment make set up for this suite (STAMP empty: nothing reinstalled from the copy)
                proc = run(f"make quickstart VENV={sys.prefix} STAMP=", repo)
                check(proc, command, expect)
                with open(repo / "outputs" / "tiny_mistral_quickstart" / "train_summary.json") as f:
                    losses = json.load(f)["losses"]
                assert "0.6931" in sections()["Quickstart"] and abs(losses[0] - 0.6931) < 1e-4, losses
                assert losses[-1] < losses[0], losses  # "then it falls"
                for name in ("memory.jsonl", "memory_summary.md", "memory.png"):
                    assert name in sections()["Quickstart"]
                    assert (repo / "outputs" / "tiny_mistral_quickstart" / name).exists(), name
            elif how == "gpu":
                plan = as_planner(command)
                check(run(plan, repo), plan, "verdict: FITS")
            else:
                planner = "plan_memory.py" in command
                check(run(command, repo), command, expect, statuses=(0, 1) if planner else (0,))


@pytest.fixture(scope="module")
def caches(tmp_path_factory, tiny_model_dir):
    """Two Hugging Face caches holding HUB_ID: the 12B configuration (the planner reads only the configuration and
    the tokenizer), and a tiny Mistral to train."""
    from longdpo.model.build import build_byte_tokenizer

    root = tmp_path_factory.mktemp("hub")
    config_only = root / "nemo_12b"
    config_only.mkdir()
    shutil.copy(os.path.join(ROOT, "recipes", "architectures", "mistral_nemo_12b.json"), config_only / "config.json")
    build_byte_tokenizer("byte-mistral").save_pretrained(config_only)
    return {
        "plan": hub_cache(root / "hf_12b", HUB_ID, str(config_only)),
        "train": hub_cache(root / "hf_tiny", HUB_ID, tiny_model_dir),
    }


def test_the_walkthrough_end_to_end(repo, caches):
    text = sections()[WALKTHROUGH]
    recipe = yaml_file(text, "my_dpo.yaml")
    assert f"name_or_path: {HUB_ID}" in recipe and "train_files: [my_prefs.jsonl]" in recipe
    (repo / "my_dpo.yaml").write_text(recipe)
    shutil.copy(repo / "recipes" / "data" / "arithmetic_preferences.jsonl", repo / "my_prefs.jsonl")  # your pairs
    steps = commands(text)
    assert [classify(c) for c, _ in steps] == ["run"] * len(steps)
    for command, expect in steps:
        if command.startswith("deepspeed"):
            # 2 CPU ranks instead of the GPUs the line names, with what a CPU cannot do switched off
            command = re.sub(r"--num_gpus \d+", f"--num_gpus 2 --master_port {free_port()}", command)
            proc = run(f"{command} {CPU_OVERRIDES}", repo, {"HF_HOME": caches["train"]})
            check(proc, command, expect)
            assert "saved the model to outputs/my_dpo" in proc.stdout
        else:
            cache = caches["plan"] if "plan_memory.py" in command else caches["train"]
            check(run(command, repo, {"HF_HOME": cache}), command, expect)
