"""Sequence-parallel DPO (parallelism.sp_size) on CPU over gloo, fp32: sp_size=2 on 2 processes gives the same loss,
parameter gradients and logged metrics as sp_size=1, directly (a tiny model of every supported family) and through
ZeRO-3 training (tiny Mistral)."""

import os
import subprocess
from types import SimpleNamespace

import pytest
import torch
from conftest import BIN, ROOT, RUN_TIMEOUT_S, free_port, run_job, run_train, summary

from longdpo.config import RecipeError
from longdpo.levers.sequence_parallel import check_sequence_parallel


@pytest.fixture(scope="module", params=["mistral", "llama3", "qwen2_5", "qwen3"])  # every supported family
def worker(tmp_path_factory, request):
    out = tmp_path_factory.mktemp("sp")
    cmd = [
        os.path.join(BIN, "torchrun"),
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        os.path.join(ROOT, "tests", "launch", "sp_worker.py"),
    ]
    env = {
        **os.environ,
        "SP_OUT": str(out),
        "OMP_NUM_THREADS": "1",
        "PATH": BIN + os.pathsep + os.environ["PATH"],
        "SP_FAMILY": request.param,
    }
    proc = run_job(cmd, RUN_TIMEOUT_S, cwd=ROOT, env=env, stderr=subprocess.STDOUT)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def test_two_ranks_share_one_pair_set_and_split_the_sequence(worker):
    assert [w["dp"] for w in worker] == [(0, 1), (0, 1)]  # one data-parallel rank: both see the same pairs
    assert [w["sp_rank"] for w in worker] == [0, 1]
    assert worker[0]["seq_len"] % 2 == 1  # odd: the wrapper padded it to split it in two


@pytest.mark.parametrize("rank", [0, 1])
def test_loss_gradients_and_metrics_equal_the_unsharded_run(worker, rank):
    (loss, metrics, grads), (sp_loss, sp_metrics, sp_grads) = worker[rank]["plain"], worker[rank]["sp"]
    assert abs(loss.item() - 0.6931) > 1e-3  # policy != reference: a real gradient signal
    assert torch.allclose(sp_loss, loss, atol=1e-6)
    assert set(sp_grads) == set(grads)
    for name, g in grads.items():
        assert g.abs().max() > 0, name
        assert torch.allclose(sp_grads[name], g, atol=1e-5, rtol=1e-4), name
    assert set(sp_metrics) == set(metrics)
    for key, value in metrics.items():  # rewards/*, logps/*, logits/*, entropy, accuracy, token count
        assert sp_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


STEPS = [
    "--max_steps",
    "3",
    "--report_to",
    "none",
    "--save_strategy",
    "no",
    "--per_device_train_batch_size",
    "2",
    "--optim",
    "sgd",
    "--learning_rate",
    "0.5",
    "--max_grad_norm",
    "0",  # SGD: a gradient scale error would show
    "--data.eval_files",
    "[recipes/data/arithmetic_preferences.jsonl]",
    "--data.max_train_samples",
    "16",
    "--eval_strategy",
    "steps",
    "--eval_steps",
    "3",
    "--per_device_eval_batch_size",
    "2",
]


@pytest.fixture(scope="module")
def zero3_runs(tmp_path_factory):
    one, two = tmp_path_factory.mktemp("sp1"), tmp_path_factory.mktemp("sp2")
    run_train(one, *STEPS, launcher="deepspeed", procs=1)
    # sp2 also runs the lean LM-head backward (longdpo/levers/lean_lm_head.py): on ZeRO-3's gathered head it must leave
    # the same gradients, so the sp1 run without it is the reference for both
    run_train(two, *STEPS, "--parallelism.sp_size", "2", "--memory.lean_lm_head", "true", launcher="deepspeed", procs=2)
    return one, two


def test_zero3_training_with_sp2_equals_sp1(zero3_runs):
    one, two = (summary(d) for d in zero3_runs)
    assert two["world_size"] == 2 and len(one["train_logs"]) == len(two["train_logs"]) == 3
    assert two["sequence_parallel"] == {"sp_size": 2, "dp_size": 1} and two["wrapped"]["lean_lm_head"] == 1
    for a, b in zip(one["train_logs"], two["train_logs"]):
        for key in (
            "loss",
            "grad_norm",
            "rewards/chosen",
            "rewards/rejected",
            "rewards/margins",
            "logps/chosen",
            "logps/rejected",
            "logits/chosen",
            "entropy",
            "num_tokens",
            "num_input_tokens_seen",
        ):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    assert one["losses"][-1] < one["losses"][0]
    (ev1,), (ev2,) = one["eval_logs"], two["eval_logs"]  # evaluation sequence-parallel too, over the same pairs
    for key in ("eval_loss", "eval_rewards/chosen", "eval_rewards/margins", "eval_logps/rejected"):
        assert ev2[key] == pytest.approx(ev1[key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("min_saving, shared", [("0", True), ("0.99", False)])
def test_zero3_shared_prompt_with_sp2_equals_sp1(zero3_runs, tmp_path, min_saving, shared):
    """Each pair's prompt computed once under sequence parallelism: Ulysses' all-to-all hands the shared-prompt
    attention whole rows; TRL's two rows on sp1 give the same curve, metrics and evaluation. With a minimum saving no
    batch reaches, every batch runs as TRL's rows, in two calls of Ulysses' micro-batch (one shared row per pair)."""
    run_train(
        tmp_path,
        *STEPS,
        *("--parallelism.sp_size", "2", "--data.shared_prompt", "true", "--data.shared_prompt_min_saving", min_saving),
        launcher="deepspeed",
        procs=2,
    )
    one, run = summary(zero3_runs[0]), summary(tmp_path)
    assert run["sequence_parallel"] == {"sp_size": 2, "dp_size": 1}
    forwards = run["shared_prompt_forwards"]
    assert (forwards["shared"] > 0, forwards["two_rows"] > 0) == (shared, not shared), forwards
    for a, b in zip(one["train_logs"], run["train_logs"], strict=True):
        for key in ("loss", "grad_norm", "rewards/margins", "logps/rejected", "entropy", "num_tokens"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    (ev1,), (ev2,) = one["eval_logs"], run["eval_logs"]
    assert ev2["eval_loss"] == pytest.approx(ev1["eval_loss"], rel=1e-5, abs=1e-6)


def test_zero3_sp2_saves_the_same_parameters(zero3_runs):
    """Three SGD steps with equal gradients leave equal weights (gathered from the ZeRO-3 shards at save)."""
    from transformers import AutoModelForCausalLM

    a, b = (AutoModelForCausalLM.from_pretrained(d).state_dict() for d in zero3_runs)
    for name, tensor in a.items():
        assert torch.allclose(b[name], tensor, atol=1e-5), name


ARCH = SimpleNamespace(num_attention_heads=32, num_key_value_heads=8, sliding_window=None)


@pytest.mark.parametrize(
    "k,world,arch,trainer,attn,match",
    [
        (0, 8, ARCH, {}, "sdpa", "must be a positive integer"),
        (3, 8, ARCH, {}, "sdpa", r"must divide the number of processes \(8\).*one of \[1, 2, 4, 8\]"),
        (12, 48, ARCH, {}, "sdpa", "must divide the model's 32 attention heads"),
        (
            4,
            4,
            SimpleNamespace(num_attention_heads=12, num_key_value_heads=6, sliding_window=None),
            {},
            "sdpa",
            "6 key/value heads must divide one another",
        ),
        (2, 2, ARCH, {}, "eager", "needs `model.attn_implementation` sdpa or flash_attention_2"),
        (
            2,
            2,
            SimpleNamespace(num_attention_heads=32, num_key_value_heads=8, sliding_window=4096),
            {"max_length": 8192},
            "sdpa",
            "sliding-window attention",
        ),
        (2, 2, ARCH, {"padding_free": True}, "sdpa", "padding_free"),
        (2, 2, ARCH, {"precompute_ref_log_probs": True}, "sdpa", "precompute_ref_log_probs"),
        (2, 2, ARCH, {"prediction_loss_only": False}, "sdpa", "prediction_loss_only"),
    ],
)
def test_bad_sequence_parallel_settings_are_clear_errors(k, world, arch, trainer, attn, match):
    with pytest.raises(RecipeError, match=match):
        check_sequence_parallel(k, world, arch, trainer, attn)


def test_eval_batch_larger_than_train_batch_is_refused_only_with_eval_data():
    trainer = {"per_device_train_batch_size": 1, "per_device_eval_batch_size": 8}
    check_sequence_parallel(2, 2, ARCH, trainer, "sdpa", evaluating=False)
    with pytest.raises(RecipeError, match="per_device_eval_batch_size"):
        check_sequence_parallel(2, 2, ARCH, trainer, "sdpa", evaluating=True)


def test_entrypoint_refuses_sp_size_that_does_not_divide_the_processes(tmp_path):
    proc = run_train(tmp_path / "run", "--parallelism.sp_size", "2", check=False)
    assert proc.returncode == 2
    assert "error: `parallelism.sp_size: 2` must divide the number of processes (1)" in proc.stdout
    assert not (tmp_path / "run").exists()  # refused before anything was written
