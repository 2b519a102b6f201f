"""Shared helpers: run the real entrypoint under the real launchers on CPU (gloo), tiny Mistral built in code."""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The tests never reach the Hub: a Hub id resolves from a cache a test lays out, or fails at once.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from longdpo.cluster.distributed import run_job  # a timed-out launch leaves no rank behind  # noqa: E402
from longdpo.config import ModelArgs  # noqa: E402

BIN = os.path.dirname(sys.executable)
TINY = os.path.join(ROOT, "recipes", "tiny_mistral", "dpo_quickstart.yaml")
TRAIN = os.path.join(ROOT, "launch", "train_dpo.py")
FAULTS = os.path.join(ROOT, "tests", "launch", "fault_worker.py")  # train_dpo.py with a fault injected (its docstring)
ZERO3 = os.path.join(ROOT, "ds_configs", "zero3.json")
# one tiny run takes under a minute on a 2-core box; a hung one is killed whole at this, not at CI's limit
RUN_TIMEOUT_S = 300
ZERO3_STEPS = ["--max_steps", "4", "--save_steps", "2", "--report_to", "none"]  # the ds2 fixture's run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def environment_put_back():
    """Each test starts from the same environment: a test that runs the entrypoint in this process sets what a run
    sets (the allocator's variables among them), which would change what the tests after it see."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def pytest_collection_modifyitems(items):
    """Tests under tests/launch/ start the entrypoint under a launcher (tens of seconds each): marked `launcher`, so
    that `pytest -m "not launcher"` runs the rest in a few minutes."""
    for item in items:
        if f"{os.sep}launch{os.sep}" in str(item.fspath):
            item.add_marker(pytest.mark.launcher)


def launch_command(
    out_dir, *overrides: str, launcher: str = "python", procs: int = 1, recipe: str = TINY, script: str = TRAIN
) -> list[str]:
    """The command users type to run launch/train_dpo.py (or a script that wraps it) under `launcher`."""
    args = ["--recipe", recipe, "--output_dir", str(out_dir), *overrides]
    if launcher == "python":
        return [sys.executable, script, *args]
    if launcher == "deepspeed":
        return [
            os.path.join(BIN, "deepspeed"),
            "--num_gpus",
            str(procs),
            "--master_port",
            str(free_port()),
            script,
            ZERO3,
            *args,
        ]
    if launcher == "accelerate":
        return [
            os.path.join(BIN, "accelerate"),
            "launch",
            "--config_file",
            os.path.join(ROOT, "launch", "accelerate", "zero3.yaml"),
            "--num_processes",
            str(procs),
            "--main_process_port",
            str(free_port()),
            script,
            *args,
        ]
    raise ValueError(launcher)


def job_env(env: dict | None = None) -> dict:
    return {
        **os.environ,
        "PATH": BIN + os.pathsep + os.environ.get("PATH", ""),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **(env or {}),
    }


def run_train(
    out_dir,
    *overrides: str,
    launcher: str = "python",
    procs: int = 1,
    recipe: str = TINY,
    env: dict | None = None,
    check: bool = True,
    script: str = TRAIN,
) -> subprocess.CompletedProcess:
    """Launch launch/train_dpo.py (or a script that wraps it) the way users do; returns the finished process
    (stdout+stderr in .stdout)."""
    cmd = launch_command(out_dir, *overrides, launcher=launcher, procs=procs, recipe=recipe, script=script)
    proc = run_job(cmd, RUN_TIMEOUT_S, cwd=ROOT, env=job_env(env), stderr=subprocess.STDOUT)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}\nexited {proc.returncode}:\n{proc.stdout[-6000:]}")
    return proc


def summary(out_dir) -> dict:
    with open(os.path.join(out_dir, "train_summary.json")) as f:
        return json.load(f)


def shm_segments() -> set[str]:
    return set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"))


@pytest.fixture(scope="session")
def ds2(tmp_path_factory):
    """The tiny recipe on 2 processes under the deepspeed launcher, ZeRO-3 over gloo: 4 steps of 2 pairs per rank,
    checkpoints at steps 2 and 4; the curve that resumed, patched and interrupted 2-rank runs must reproduce."""
    out = tmp_path_factory.mktemp("ds2")
    before = shm_segments()
    proc = run_train(out, *ZERO3_STEPS, "--per_device_train_batch_size", "2", launcher="deepspeed", procs=2)
    (out / "launch.log").write_text(proc.stdout)
    (out / "shm_left.json").write_text(json.dumps(sorted(shm_segments() - before)))
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Mistral + byte tokenizer saved as a local Hugging Face directory (the `name_or_path` form)."""
    from longdpo.config import ModelArgs
    from longdpo.model.build import build_byte_tokenizer, build_model

    path = tmp_path_factory.mktemp("tiny_mistral_hf")
    model = build_model(
        ModelArgs(
            architecture="recipes/architectures/tiny_mistral.json", tokenizer="byte", dtype="float32", init_seed=3
        )
    )
    model.save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    return str(path)


# ---- numerics: one real TRL DPO batch per supported family, and a policy's loss and gradients on it ----------------

TINY_ARGS = ModelArgs(architecture="recipes/architectures/tiny_mistral.json", tokenizer="byte", dtype="float32")
# the supported families, each built in code with its tokenizer (Qwen2.5's tiny model ties its embeddings)
FAMILIES = {
    name: ModelArgs(architecture=f"recipes/architectures/tiny_{name}.json", tokenizer=tok, dtype="float32")
    for name, tok in (
        ("mistral", "byte-mistral"),
        ("llama3", "byte-llama3"),
        ("qwen2_5", "byte-chatml"),
        ("qwen3", "byte-chatml"),
    )
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return FAMILIES[request.param]


@pytest.fixture(scope="module")
def dpo_batch(family):
    """One real TRL DPO batch (chosen + rejected, padded, with completion mask) from the shipped data."""
    from longdpo.data.loading import load_preferences

    return make_dpo_batch(family, load_preferences(["recipes/data/arithmetic_preferences.jsonl"]), 4, 128)


def make_dpo_batch(family, dataset, batch_size: int, max_length: int):
    """(trainer, its first prepared batch, family) for TRL's DPOTrainer on `dataset`, float32, no checkpointing."""
    from trl import DPOConfig, DPOTrainer

    from longdpo.model.build import build_byte_tokenizer, build_model

    args = DPOConfig(
        output_dir="/tmp/unused",
        report_to="none",
        bf16=False,
        per_device_train_batch_size=batch_size,
        max_length=max_length,
        activation_checkpointing=False,
        dataloader_pin_memory=False,
    )
    trainer = DPOTrainer(
        model=build_model(family),
        ref_model=build_model(family),
        args=args,
        train_dataset=dataset,
        processing_class=build_byte_tokenizer(family.tokenizer),
    )
    return trainer, trainer._prepare_inputs(next(iter(trainer.get_train_dataloader()))), family


def loss_and_grads(
    dpo_batch,
    policy: str,
    tiles: int = 0,
    chunks: int = 0,
    lean: bool = False,
    reentrant: bool = False,
    drop_mask: bool = False,
    shared: bool = False,
    min_saving: float = 0.0,
):
    """DPO loss and every parameter gradient of a fresh policy (seed 0) against a different reference (seed 1).
    `drop_mask`: right padding's attention mask dropped (longdpo/levers/padding_mask.py) on both; `shared`: each
    pair's prompt computed once (longdpo/levers/shared_prompt.py) on both, for batches saving `min_saving`."""
    from trl.trainer.utils import add_fused_lm_head

    from longdpo.levers import LeverSet, padding_mask, patch_policy, shared_prompt
    from longdpo.levers.checkpointing import uses_layer_checkpoint
    from longdpo.model.build import build_model

    trainer, inputs, args = dpo_batch
    model = build_model(args)
    if uses_layer_checkpoint(policy):
        model.activation_checkpointing_enable({"use_reentrant": reentrant})
    levers = LeverSet(checkpointing=policy, tiled_mlp=tiles, mlp_chunks=chunks, lean_norm=lean)
    wrapped = patch_policy(model, levers)
    weighting = ("log_sum_sq_probs",) if trainer.use_weighting else ()  # as TRL asks for WPO's weights
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1", *weighting))
    trainer.ref_model = build_model(ModelArgs(**{**args.__dict__, "init_seed": 1}))
    add_fused_lm_head(trainer.ref_model)
    if drop_mask:
        padding_mask.install(model)
        padding_mask.install(trainer.ref_model)
    if shared:
        for m in (model, trainer.ref_model):
            m.set_attn_implementation(shared_prompt.NAME)
            shared_prompt.wrap(m, min_saving)
    model.train()
    trainer.model = model
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    return model, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, wrapped


@pytest.fixture
def gpu_packages(monkeypatch):
    """Start-up checks as on a GPU machine with requirements-gpu.txt installed: liger-kernel (it needs Triton, so
    it is not installed here) is reported present."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "liger_kernel" else real(n, *a))


def hub_cache(home, repo_id: str, source_dir: str) -> str:
    """Lay `source_dir` out in a Hugging Face cache under `home` (HF_HOME) as the snapshot of `repo_id`'s main."""
    import shutil

    revision = "0" * 40
    repo = os.path.join(home, "hub", "models--" + repo_id.replace("/", "--"))
    shutil.copytree(source_dir, os.path.join(repo, "snapshots", revision))
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(revision)
    return str(home)
