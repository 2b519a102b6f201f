"""DeepSpeed ZeRO-3 on CPU over gloo, launched as users launch it: the `deepspeed` launcher and `accelerate launch`."""

import json
import math
import os
import shutil

import pytest
import torch
from conftest import ROOT, ZERO3_STEPS, run_train, summary

# 4 pairs per optimizer step in every run: 1 process x 4, or 2 processes x 2
STEPS = ZERO3_STEPS


@pytest.fixture(scope="module")
def ds1(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds1")
    run_train(out, *STEPS, "--per_device_train_batch_size", "4", launcher="deepspeed", procs=1)
    return out


def test_two_process_curve_matches_one_process(ds1, ds2):
    one, two = summary(ds1)["losses"], summary(ds2)["losses"]
    assert abs(one[0] - math.log(2)) < 1e-4 and abs(two[0] - math.log(2)) < 1e-4
    assert two == pytest.approx(one, abs=1e-5)
    assert one[-1] < one[0]


def test_no_shared_memory_allreduce_built_or_left_in_dev_shm(ds2):
    """DeepSpeed's CPU shm allreduce (unused by training) took a build lock that hung CI once a rank died holding
    it, and leaked 66 MB of /dev/shm per rank per run (longdpo/patches.py)."""
    assert "deepspeed_shm_comm_op built successfully" not in (ds2 / "launch.log").read_text()
    assert json.loads((ds2 / "shm_left.json").read_text()) == []


def test_parameters_really_partitioned(ds1, ds2):
    s1, s2 = summary(ds1), summary(ds2)
    assert s2["world_size"] == 2
    assert s1["built_partitioned"] and s2["built_partitioned"]  # constructed under zero.Init, not partitioned later
    total = s2["total_numel"]
    per_rank = s2["partition_numel_per_rank"]
    assert len(per_rank) == 2
    # each rank holds about half (ZeRO-3 pads each parameter's partition to the world size)
    assert all(0.45 * total <= n <= 0.6 * total for n in per_rank), (per_rank, total)
    assert sum(per_rank) >= total
    assert s1["partition_numel_per_rank"][0] >= total  # one rank holds everything


def test_zero3_save_gathers_a_model_that_reloads(ds2):
    """The 16-bit model gathered at save == the fp32 weights reconstructed from the ZeRO-3 shards."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(ds2)
    shards = get_fp32_state_dict_from_zero_checkpoint(os.path.join(ds2, "checkpoint-4"))
    state = reloaded.state_dict()
    assert set(shards) <= set(state)
    for name, tensor in shards.items():
        assert torch.allclose(state[name].float(), tensor, atol=1e-6), name


def test_resume_under_zero3_continues_the_same_curve(ds2, tmp_path):
    shutil.copytree(os.path.join(ds2, "checkpoint-2"), tmp_path / "checkpoint-2")
    run_train(
        tmp_path,
        *STEPS,
        "--per_device_train_batch_size",
        "2",
        "--resume_from_checkpoint",
        str(tmp_path / "checkpoint-2"),
        launcher="deepspeed",
        procs=2,
    )
    assert summary(tmp_path)["losses"] == pytest.approx(summary(ds2)["losses"], abs=1e-5)
    ran = [json.loads(line)["step"] for line in open(tmp_path / "memory.jsonl")]
    assert ran == [3, 4]  # resumed from step 2, not restarted


@pytest.mark.parametrize("lean_head,tiles,chunks", [("false", 4, 0), ("true", 0, 2)])
def test_saved_tensor_hooks_and_mlp_pieces_under_zero3_leave_the_curve_unchanged(
    ds2, tmp_path, lean_head, tiles, chunks
):
    """Activation offloading's hooks around each step (identity hooks here, tests/launch/hooks_worker.py): the fused LM
    head (TRL's, and the lean one) still gathers its partitioned weight in backward. Under the same hooks, the MLP in
    tiles or in checkpointed chunks must re-gather its partitioned weights in recompute. Tiles and chunks sum each MLP
    weight's gradient over sequence pieces, a different fp32 summation order than one matmul: after three updates the
    loss moved by 1.2e-6 on a 2-core CPU, so they compare at 1e-5 (a missed re-gather or a wrong gradient moves it by
    orders of magnitude more)."""
    run_train(
        tmp_path,
        *STEPS,
        "--per_device_train_batch_size",
        "2",
        "--save_strategy",
        "no",
        "--memory.lean_lm_head",
        lean_head,
        "--memory.checkpointing",
        "layer+norm_attn",
        "--memory.tiled_mlp",
        str(tiles),
        "--memory.mlp_chunks",
        str(chunks),
        launcher="deepspeed",
        procs=2,
        script=os.path.join(ROOT, "tests", "launch", "hooks_worker.py"),
    )
    s = summary(tmp_path)
    assert sum(s["wrapped"].values()) > 0
    assert s["losses"] == pytest.approx(summary(ds2)["losses"], abs=1e-5)


def test_accelerate_launch_matches(ds1, tmp_path):
    run_train(tmp_path, *STEPS, "--per_device_train_batch_size", "2", launcher="accelerate", procs=2)
    s = summary(tmp_path)
    assert s["world_size"] == 2
    assert s["losses"] == pytest.approx(summary(ds1)["losses"], abs=1e-5)


@pytest.mark.parametrize("policy", ["norm_attn_mlp", "layer+norm_attn_mlp"])
def test_patched_policies_equal_stock_under_zero3(ds2, tmp_path, policy):
    """Recompute under ZeRO-3 must re-gather partitioned weights: any miss changes the gradients, so the curve (the MLP
    in tiles and chunks: the test above)."""
    run_train(
        tmp_path,
        *STEPS,
        "--per_device_train_batch_size",
        "2",
        "--save_strategy",
        "no",
        "--memory.checkpointing",
        policy,
        launcher="deepspeed",
        procs=2,
    )
    s = summary(tmp_path)
    assert sum(s["wrapped"].values()) > 0
    assert s["losses"] == pytest.approx(summary(ds2)["losses"], abs=1e-6)


@pytest.mark.parametrize("launcher,procs,per_device", [("python", 1, 4), ("deepspeed", 2, 2)])
def test_precompute_ref_log_probs(tmp_path, launcher, procs, per_device):
    """Reference log-probs computed once before training (no reference model kept): the same ln 2 start."""
    run_train(
        tmp_path,
        "--max_steps",
        "2",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--precompute_ref_log_probs",
        "true",
        "--per_device_train_batch_size",
        str(per_device),
        launcher=launcher,
        procs=procs,
    )
    losses = summary(tmp_path)["losses"]
    assert abs(losses[0] - math.log(2)) < 1e-4 and losses[1] < losses[0]


def test_shared_prompt_on_two_ranks_equals_two_rows_on_one(ds1, ds2, tmp_path):
    """Each pair's prompt computed once (data.shared_prompt), ZeRO-3 on 2 ranks with the levers, against TRL's two
    rows on 1 rank; then resumed from the unshared run's checkpoint, it continues that curve. The float32 sums differ
    only in order (other matmul shapes, the ranks' reduction): a few ulps of the loss, inside 1e-5."""
    levers = ["--memory.checkpointing", "layer+norm_attn", "--memory.mlp_chunks", "2", "--memory.lean_lm_head", "true"]
    shared = ["--data.shared_prompt", "true", "--data.shared_prompt_min_saving", "0"]
    shared += ["--per_device_train_batch_size", "2"]
    run_train(tmp_path / "run", *STEPS, *shared, *levers, launcher="deepspeed", procs=2)
    s = summary(tmp_path / "run")
    assert s["shared_prompt"] and s["world_size"] == 2
    assert s["shared_prompt_forwards"]["shared"] > 0 and s["shared_prompt_forwards"]["two_rows"] == 0
    assert s["losses"] == pytest.approx(summary(ds1)["losses"], abs=1e-5)
    norms = [[h["grad_norm"] for h in x["train_logs"]] for x in (s, summary(ds1))]
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)
    resumed = tmp_path / "resumed"
    shutil.copytree(os.path.join(ds2, "checkpoint-2"), resumed / "checkpoint-2")
    run_train(resumed, *STEPS, *shared, "--resume_from_checkpoint", "true", launcher="deepspeed", procs=2)
    assert summary(resumed)["losses"] == pytest.approx(summary(ds2)["losses"], abs=1e-5)


# ---- resume on another number of ranks ---------------------------------------------------------------------------


def moments(checkpoint) -> dict:
    """Every parameter's Adam second moment in a ZeRO-3 checkpoint, whole (its universal form, converted once)."""
    from longdpo.cluster.checkpoints import universal

    folder = os.path.join(checkpoint, universal(str(checkpoint)), "zero")  # a folder per parameter
    names = [name for name in os.listdir(folder) if os.path.isdir(os.path.join(folder, name))]
    return {name: torch.load(os.path.join(folder, name, "exp_avg_sq.pt")) for name in names}


def resumed_from(run, out, procs: int, per_device: int, resume: str = "true"):
    """`run`'s checkpoint-2 copied into `out` and resumed there by `procs` ranks under the deepspeed launcher."""
    shutil.copytree(os.path.join(run, "checkpoint-2"), out / "checkpoint-2")
    return run_train(
        out,
        *STEPS,
        "--per_device_train_batch_size",
        str(per_device),
        "--resume_from_checkpoint",
        resume,
        launcher="deepspeed",
        procs=procs,
    )


def test_a_checkpoint_of_two_ranks_resumes_on_one(ds2, tmp_path):
    """Saved by 2 ranks x 2 pairs, resumed by 1 rank: the optimizer state is re-partitioned from DeepSpeed's universal
    checkpoint, converted once beside the checkpoint; the global batch (4 pairs) is the checkpoint's, so 1 rank
    accumulates 2 micro-batches; the curve and the optimizer state at step 4 are the uninterrupted run's (the float32
    sums differ only in order: measured 2e-8 in the loss)."""
    proc = resumed_from(ds2, tmp_path, procs=1, per_device=2, resume="auto")
    assert "written by 2 ranks, this launch has 1" in proc.stdout
    assert summary(tmp_path)["losses"] == pytest.approx(summary(ds2)["losses"], abs=1e-5)
    assert [json.loads(line)["step"] for line in open(tmp_path / "memory.jsonl")] == [3, 4]  # resumed, not restarted
    # the optimizer state was carried, not started afresh: Adam's moments at step 4 are the uninterrupted run's
    resumed, straight = moments(tmp_path / "checkpoint-4"), moments(os.path.join(ds2, "checkpoint-4"))
    assert resumed.keys() == straight.keys()
    for name, tensor in straight.items():
        assert torch.allclose(resumed[name], tensor, rtol=1e-4, atol=1e-12), name
    converted = tmp_path / "checkpoint-2" / "latest_universal"
    before = converted.stat().st_mtime_ns
    moments(tmp_path / "checkpoint-2")  # a second requeue finds it converted
    assert converted.stat().st_mtime_ns == before


@pytest.fixture(scope="module")
def ds2_six(tmp_path_factory):
    """2 ranks x 1 pair x 3 micro-batches: 6 pairs a step, which 1, 2, 3 or 6 ranks can share."""
    out = tmp_path_factory.mktemp("ds2_six")
    run_train(
        out,
        *STEPS,
        "--per_device_train_batch_size",
        "1",
        "--data.global_batch_size",
        "6",
        launcher="deepspeed",
        procs=2,
    )
    return out


def test_a_checkpoint_of_two_ranks_resumes_on_three(ds2_six, tmp_path):
    """The recipe sets no global batch: the checkpoint's 6 pairs are kept (3 ranks x 1 pair x 2 micro-batches)."""
    proc = resumed_from(ds2_six, tmp_path, procs=3, per_device=1)
    assert "data.global_batch_size 6, as the checkpoint was trained" in proc.stdout
    assert summary(tmp_path)["world_size"] == 3
    assert summary(tmp_path)["losses"] == pytest.approx(summary(ds2_six)["losses"], abs=1e-5)


def test_a_checkpoint_of_one_rank_resumes_on_two(ds1, tmp_path):
    resumed_from(ds1, tmp_path, procs=2, per_device=2)
    assert summary(tmp_path)["losses"] == pytest.approx(summary(ds1)["losses"], abs=1e-5)


def test_what_cannot_resume_is_one_line_before_any_model(ds1, ds2_six, tmp_path):
    """A DeepSpeed checkpoint in one process, a one-process checkpoint under DeepSpeed, a global batch the ranks at
    hand cannot share: each one line naming what to run, exit status 2, before any model is built."""
    zero3 = os.path.join(ROOT, "ds_configs", "zero3.json")
    shutil.copytree(os.path.join(ds1, "checkpoint-2"), tmp_path / "a" / "checkpoint-2")
    alone = run_train(tmp_path / "a", *STEPS, "--resume_from_checkpoint", "true", check=False)
    assert alone.returncode == 2 and "holds DeepSpeed's optimizer state (1 partitions)" in alone.stdout
    assert "Traceback" not in alone.stdout
    run_train(tmp_path / "b", "--max_steps", "1", "--save_steps", "1", "--report_to", "none")  # one process
    under = run_train(
        tmp_path / "b", "--max_steps", "2", "--resume_from_checkpoint", "true", "--deepspeed", zero3, check=False
    )
    assert under.returncode == 2 and "was written by one process without DeepSpeed" in under.stdout
    shutil.copytree(os.path.join(ds2_six, "checkpoint-2"), tmp_path / "c" / "checkpoint-2")
    four = run_train(
        tmp_path / "c",
        *STEPS,
        "--per_device_train_batch_size",
        "1",
        "--resume_from_checkpoint",
        "true",
        "--deepspeed",
        zero3,
        env={"WORLD_SIZE": "4"},
        check=False,
    )
    assert four.returncode == 2 and "`data.global_batch_size: 6` is not a multiple of" in four.stdout
