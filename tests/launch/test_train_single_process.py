"""End-to-end DPO through launch/train_dpo.py, one process (the quickstart path)."""

import glob
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, run_train, summary

STEPS = 6


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    out = tmp_path_factory.mktemp("quickstart")
    proc = run_train(out, "--max_steps", str(STEPS), "--save_steps", "3")
    return out, proc.stdout


def test_step0_loss_is_ln2_and_loss_goes_down(quickstart):
    out, _ = quickstart
    losses = summary(out)["losses"]
    assert len(losses) == STEPS
    assert abs(losses[0] - math.log(2)) < 1e-4  # policy == reference at step 0
    assert summary(out)["built_partitioned"] is False  # no DeepSpeed here
    assert losses[-1] < losses[0] - 0.2


def test_tensorboard_events_and_memory_telemetry_written(quickstart):
    out, _ = quickstart
    assert glob.glob(os.path.join(out, "runs", "*", "events.out.tfevents.*"))
    records = [json.loads(line) for line in open(os.path.join(out, "memory.jsonl"))]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert r["step_time_s"] > 0 and r["tokens"] > 0 and r["host_rss_gb"] > 0
        # the step's peak is at least what is resident at its end (0.01 GB: the kernel's per-thread RSS counters
        # are folded in lazily, 64 pages a thread)
        assert r["host_peak_gb"] is None or r["host_peak_gb"] >= r["host_rss_gb"] - 0.01
        assert r["peak_allocated_gb"] is None  # no GPU here: GPU fields are null, not zero
    assert summary(out)["measured_reserved_gb"] is None
    table = open(os.path.join(out, "memory_summary.md")).read()  # on CPU: says so, and shows what is measured
    assert (
        "GPU memory is not measured" in table
        and "| Host RSS (GB) | Host peak (GB) | Step Time (s) | Tokens/s |" in table
    )
    assert "n/a" not in table or records[0]["host_peak_gb"] is None  # no peak to read outside Linux
    png = open(os.path.join(out, "memory.png"), "rb").read()
    assert len(png) > 1000 and png[16:24] == (1100).to_bytes(4, "big") + (700).to_bytes(4, "big")  # 2 x 2 panels


def test_memory_plot_gives_each_quantity_its_own_axis(tmp_path):
    """A long run: the reward margin (~14) does not flatten the loss and the accuracy; the accuracy reads 0 to 1;
    no markers past 30 steps; with a GPU the table has the GPU columns."""
    from longdpo.training.callbacks import write_summary

    records = [
        {
            "step": i,
            "peak_allocated_gb": 60.0,
            "peak_reserved_gb": 70.0,
            "frag_gap_gb": 10.0,
            "step_time_s": 1.0,
            "tokens_per_s": 100.0,
            "host_rss_gb": 5.0,
        }
        for i in range(1, 573)
    ]
    logs = [
        {"step": i, "loss": 0.69 / i, "rewards/margins": 14 * i / 572, "rewards/accuracies": min(1, i / 100)}
        for i in range(1, 573)
    ]
    import matplotlib.pyplot as plt

    made = []
    real_savefig = plt.Figure.savefig

    def keep(fig, *a, **k):
        made.append(fig)
        return real_savefig(fig, *a, **k)

    plt.Figure.savefig = keep
    try:
        write_summary(records, str(tmp_path), logs)
    finally:
        plt.Figure.savefig = real_savefig
    (loss, margin, accuracy, memory) = made[0].axes
    assert loss.get_ylim()[1] < 1 and margin.get_ylim()[1] > 13 and accuracy.get_ylim() == (-0.02, 1.02)
    assert memory.get_ylim()[0] == 0 and memory.get_ylim()[1] >= 70
    assert all(line.get_marker() in ("None", None, "") for ax in made[0].axes for line in ax.get_lines())
    assert "| Peak Allocated (GB) | Peak Reserved (GB) |" in (tmp_path / "memory_summary.md").read_text()


def test_length_report_logged(quickstart):
    out, log = quickstart
    report = summary(out)["length_report"]
    assert report["pairs"] == 64 and report["dropped"] == 0 and report["truncated"] == 0
    assert report["tokens_p50"] <= report["tokens_p90"] <= report["tokens_max"] <= 128
    assert "length report" in log and "pairs per optimizer step" in log


def test_the_quickstart_prints_no_warnings_a_user_cannot_act_on(quickstart):
    """Our own keys are not deprecated ones, TRL's deprecated calls are not echoed, no pinned-memory warning on a CPU,
    no DeepSpeed accelerator guess, no planner line without a GPU to plan for; the model card names no `None` base
    model."""
    out, log = quickstart
    assert "FutureWarning" not in log and "UserWarning" not in log, [
        line for line in log.splitlines() if "Warning" in line
    ]
    assert "WARNING" not in log and "planner:" not in log, [line for line in log.splitlines() if "WARNING" in line]
    assert "[None]" not in open(os.path.join(out, "README.md")).read()


def test_saved_model_reloads_with_trained_weights(quickstart):
    from transformers import AutoModelForCausalLM

    from longdpo.config import ModelArgs
    from longdpo.model.build import build_model

    out, _ = quickstart
    final = AutoModelForCausalLM.from_pretrained(out)
    last_ckpt = AutoModelForCausalLM.from_pretrained(os.path.join(out, f"checkpoint-{STEPS}"))
    init = build_model(
        ModelArgs(architecture="recipes/architectures/tiny_mistral.json", tokenizer="byte", dtype="float32")
    )
    for (name, p), q in zip(final.named_parameters(), last_ckpt.parameters()):
        assert torch.equal(p, q), name
    assert any(not torch.equal(p, r) for p, r in zip(final.parameters(), init.parameters()))


def test_resume_continues_the_same_curve(quickstart, tmp_path):
    out, _ = quickstart
    import shutil

    shutil.copytree(os.path.join(out, "checkpoint-3"), tmp_path / "checkpoint-3")
    run_train(
        tmp_path,
        "--max_steps",
        str(STEPS),
        "--save_steps",
        "3",
        "--resume_from_checkpoint",
        str(tmp_path / "checkpoint-3"),
    )
    resumed = summary(tmp_path)["losses"]  # steps 1-3 restored from the checkpoint's state, 4-6 trained anew
    original = summary(out)["losses"]
    assert len(resumed) == STEPS
    assert resumed == pytest.approx(original, abs=1e-6)
    # and it really resumed (a restart from scratch would give the same curve): only steps 4-6 ran here
    ran = [json.loads(line)["step"] for line in open(tmp_path / "memory.jsonl")]
    assert ran == [4, 5, 6]


def test_report_to_none_writes_no_events(tmp_path):
    run_train(tmp_path, "--max_steps", "1", "--report_to", "none", "--save_strategy", "no")
    assert not os.path.exists(tmp_path / "runs")
    assert os.path.exists(tmp_path / "memory.jsonl")


def test_runs_when_tensorboard_is_not_installed(tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    # sys.modules[name] = None makes both `import` and importlib.util.find_spec treat the package as absent
    (hide / "sitecustomize.py").write_text(
        "import sys\nsys.modules['tensorboard'] = None\nsys.modules['tensorboardX'] = None\n"
    )
    out = tmp_path / "out"
    proc = run_train(
        out,
        "--max_steps",
        "1",
        "--save_strategy",
        "no",
        env={"PYTHONPATH": str(hide) + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )
    assert "tensorboard is not installed" in proc.stdout
    assert not os.path.exists(out / "runs")


def test_local_model_directory_and_conversational_data(tmp_path, tiny_model_dir):
    """`model.name_or_path` form (reference loaded by TRL from the same path) on implicit-prompt conversations."""
    data = tmp_path / "chat.jsonl"
    with open(data, "w") as f:
        for i in range(8):
            user = {"role": "user", "content": f"What is {i} + {i}?"}
            f.write(
                json.dumps(
                    {
                        "chosen": [user, {"role": "assistant", "content": f"{2 * i}."}],
                        "rejected": [user, {"role": "assistant", "content": f"{2 * i + 1}, maybe."}],
                    }
                )
                + "\n"
            )
    out = tmp_path / "out"
    run_train(
        out,
        "--max_steps",
        "2",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--model.architecture",
        "null",
        "--model.tokenizer",
        "null",
        "--model.name_or_path",
        tiny_model_dir,
        "--data.train_files",
        f"[{data}]",
        "--per_device_train_batch_size",
        "2",
    )
    s = summary(out)
    assert abs(s["losses"][0] - math.log(2)) < 1e-4
    assert s["length_report"]["pairs"] == 8


def test_a_hub_id_loads_from_the_hugging_face_cache(tmp_path, tiny_model_dir):
    """`model.name_or_path: owner/name` goes to `from_pretrained` as in every peer: here from a Hugging Face cache
    laid out in a temporary HF_HOME, offline. An id in neither the cache nor the Hub is one line before any load."""
    from conftest import hub_cache

    home = hub_cache(tmp_path / "hf", "someone/tiny-mistral", tiny_model_dir)
    env = {"HF_HOME": home, "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "out"
    run_train(
        out,
        "--max_steps",
        "1",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--model.architecture",
        "null",
        "--model.tokenizer",
        "null",
        "--model.name_or_path",
        "someone/tiny-mistral",
        env=env,
    )
    assert abs(summary(out)["losses"][0] - math.log(2)) < 1e-4
    proc = run_train(
        tmp_path / "out2",
        "--model.architecture",
        "null",
        "--model.tokenizer",
        "null",
        "--model.name_or_path",
        "someone/not-cached",
        env=env,
        check=False,
    )
    assert proc.returncode != 0
    lines = [line for line in proc.stdout.splitlines() if "someone/not-cached" in line]
    assert len(lines) == 1 and "HF_HUB_OFFLINE=1 is set" in lines[0], proc.stdout[-2000:]
    assert "Traceback" not in proc.stdout


def test_the_entrypoint_sends_no_usage_ping():
    """TRL's trainers ping huggingface.co from a thread unless huggingface_hub's telemetry switch is off; the
    entrypoint turns it off, and a user's own setting wins."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_DISABLE_TELEMETRY", "HF_HUB_OFFLINE")}
    probe = "import launch.train_dpo; from huggingface_hub import constants; print(constants.HF_HUB_DISABLE_TELEMETRY)"
    for setting, expected in ((None, "True"), ("0", "False")):
        run_env = env if setting is None else {**env, "HF_HUB_DISABLE_TELEMETRY": setting}
        out = subprocess.run(
            [sys.executable, "-c", probe], cwd=ROOT, env=run_env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == expected, setting


def test_shared_prompt_on_files_is_planned_on_the_measured_pairs(tmp_path):
    """With data.shared_prompt on files and one pair per batch, the start-up verdict waits for the data and plans the
    costliest pair's tokens (measured as TRL tokenizes it), not two rows of max_length."""
    from conftest import TINY

    from longdpo.config import load_recipe, parse_cli
    from longdpo.data.lengths import pair_lengths
    from longdpo.data.loading import load_train_data
    from longdpo.model.build import load_tokenizer
    from longdpo.planner.plan import plan

    args = ["--data.shared_prompt", "true", "--per_device_train_batch_size", "1", "--max_steps", "1"]
    run_train(tmp_path, *args, "--save_strategy", "no")
    cli = parse_cli(["--recipe", TINY, *args])
    recipe = load_recipe(cli["recipe"], cli["overrides"])
    pairs = pair_lengths(load_tokenizer(recipe.model), load_train_data(recipe.data))
    planned = plan(recipe, 1, None, pairs=pairs)
    assert planned.terms.shared_rows and planned.terms.pair_tokens < 2 * recipe.trainer["max_length"]
    expected = planned.peak_reserved_gb
    assert summary(tmp_path)["planner_predicted_reserved_gb"] == expected
