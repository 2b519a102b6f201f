"""Every shipped recipe, DeepSpeed JSON and accelerate config is valid; the benchmark's own logic is right."""

import glob
import gzip
import importlib.util
import json
import math
import os
import pickle
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT

from longdpo.checks import check_deepspeed_config, check_recipe
from longdpo.config import load_recipe

RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*", "*.yaml")))
DS_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "ds_configs", "*.json")))
ACCELERATE = sorted(glob.glob(os.path.join(ROOT, "launch", "accelerate", "*.yaml")))


def test_something_is_shipped():
    assert len(RECIPES) >= 2 and len(DS_CONFIGS) >= 2 and len(ACCELERATE) >= 2


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_is_valid(path, gpu_packages):
    recipe = load_recipe(path)
    gpu = recipe.model.dtype != "float32"
    ranks = (recipe.data.global_batch_size or 1) // recipe.trainer.get("per_device_train_batch_size", 8) or 1
    check_recipe(recipe, world_size=ranks, cuda_available=gpu)
    header = open(path).read().split("\n\n")[0]
    for word in ("Hardware:", "Global batch:", "Tokens per step:", "Launch:"):
        assert word in header, f"{path} header lacks {word}"


def test_12k_recipe_is_the_seeds_setting():
    r = load_recipe(os.path.join(ROOT, "recipes", "nemotron12b", "dpo_12k.yaml"))
    t = r.trainer
    assert (t["max_length"], t["beta"], t["loss_type"], t["learning_rate"], t["lr_scheduler_type"]) == (
        12288,
        0.1,
        ["sigmoid"],
        1e-6,
        "constant",
    )
    assert r.data.global_batch_size == 8 and r.data.synthetic["seq_tokens"] == 12288
    arch = json.load(open(os.path.join(ROOT, r.model.architecture)))
    assert (
        arch["hidden_size"],
        arch["num_hidden_layers"],
        arch["num_attention_heads"],
        arch["num_key_value_heads"],
        arch["head_dim"],
        arch["intermediate_size"],
        arch["vocab_size"],
        arch["rope_theta"],
    ) == (5120, 40, 32, 8, 128, 14336, 131072, 1e6)


@pytest.mark.parametrize("path", DS_CONFIGS, ids=os.path.basename)
def test_deepspeed_json(path):
    cfg = check_deepspeed_config(path)
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3 and zero["stage3_gather_16bit_weights_on_model_save"] is True
    # the recipe is the single source of batch size, lr and clipping
    for key in (
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
    ):
        assert cfg[key] == "auto", key
    assert cfg["bf16"]["enabled"] == "auto"
    assert "optimizer" not in cfg and "scheduler" not in cfg  # they come from the recipe via the Trainer


@pytest.mark.parametrize("path", ACCELERATE, ids=os.path.basename)
def test_accelerate_config_points_at_a_shipped_deepspeed_json(path):
    cfg = yaml.safe_load(open(path))
    assert cfg["distributed_type"] == "DEEPSPEED"
    assert os.path.isfile(os.path.join(ROOT, cfg["deepspeed_config"]["deepspeed_config_file"]))


def test_bench_command_layers_configuration_over_neutral_base():
    from tools.bench_memory import build_command, parse_args

    args = parse_args(
        [
            "--out",
            "/tmp/x",
            "--configs",
            "layer+norm_attn_mlp+offload",
            "--layers",
            "4",
            "--memory-cap-gb",
            "80",
            "--mode",
            "emulate",
        ]
    )
    cmd = build_command(args, "layer+norm_attn_mlp+offload", 4096, "/tmp/x/run")
    flags = dict(zip(cmd[2:-1:2], cmd[3:-1:2]))  # [python, train_dpo.py, --key, value, ..., --no_final_save]
    assert cmd[1].endswith("train_dpo.py") and cmd[-1] == "--no_final_save"
    assert flags["--memory.checkpointing"] == "layer+norm_attn_mlp"
    assert flags["--activation_offloading"] == "true" and flags["--memory.allocator_conf"] == "null"
    assert flags["--max_length"] == "4096" and flags["--model.num_hidden_layers"] == "4"
    assert flags["--memory.sgd_in_backward"] == "true" and flags["--memory.memory_cap_gb"] == "80.0"
    assert json.loads(flags["--data.synthetic"]) == {"pairs": 32, "seq_tokens": 4096, "prompt_tokens": 1024}
    assert flags["--memory.padding_mask"] == "auto"
    long = dict(zip(*[iter(build_command(args, "stock+offload", 4096, "/tmp/x/run", "long-prompt")[2:-1])] * 2))
    assert json.loads(long["--data.synthetic"]) == {
        "pairs": 32,
        "seq_tokens": 4096,
        "prompt_tokens": 3686,
        "rejected_tokens": 369,
    }
    assert long["--memory.padding_mask"] == "keep"  # the library-only setups pass TRL's mask
    mixed = dict(zip(*[iter(build_command(args, "stock", 4096, "/tmp/x/run", "mixed")[2:-1])] * 2))
    assert json.loads(mixed["--data.synthetic"]) == {"pairs": 32, "seq_tokens": 4096, "mix_seed": 0}
    z3 = parse_args(["--out", "/tmp/x", "--gpus", "8"])
    cmd = build_command(z3, "stock", 12288, "/tmp/x/run")
    assert os.path.basename(cmd[0]) == "deepspeed" and cmd[1:3] == ["--num_gpus", "8"]
    forced = parse_args(["--out", "/tmp/x", "--skip-preflight"])
    assert (
        "--skip-preflight" not in cmd and build_command(forced, "stock", 12288, "/tmp/x/run")[-1] == "--skip-preflight"
    )
    assert "ds_configs/zero3.json" in cmd and dict(zip(cmd, cmd[1:]))["--per_device_train_batch_size"] == "1"
    assert parse_args(["--out", "/tmp/x", "--seq-tokens", "4096,65536"]).seq_tokens == [4096, 65536]
    for bad in (["--seq-tokens", "32k"], ["--seq-tokens", "0"], ["--gpus", "0"], ["--layers", "-1"]):
        with pytest.raises(SystemExit):  # argparse's one line naming the flag, exit 2
            parse_args(["--out", "/tmp/x", *bad])


def test_bench_summary_and_table():
    from tools.bench_memory import render_table, summarise

    records = [
        {
            "peak_allocated_gb": 90.0,
            "peak_reserved_gb": 95.0,
            "frag_gap_gb": 5.0,
            "step_time_s": 9.0,
            "tokens_per_s": 1.0,
            "host_rss_gb": 2.0,
            "host_pinned_gb": 0.0,
            "alloc_retries": 0,
            "weights_gb": 49.0,
        },
        {
            "peak_allocated_gb": 60.0,
            "peak_reserved_gb": 70.0,
            "frag_gap_gb": 10.0,
            "step_time_s": 6.0,
            "tokens_per_s": 4000.0,
            "host_rss_gb": 2.0,
            "host_pinned_gb": 1.0,
            "alloc_retries": 0,
            "weights_gb": 49.0,
        },
        {
            "peak_allocated_gb": 62.0,
            "peak_reserved_gb": 69.0,
            "frag_gap_gb": 7.0,
            "step_time_s": 7.0,
            "tokens_per_s": 3500.0,
            "host_rss_gb": 3.0,
            "host_pinned_gb": 1.5,
            "alloc_retries": 1,
            "weights_gb": 49.0,
        },
    ]
    s = summarise(records)  # the first (warm-up) step is left out
    assert s["peak_allocated_gb"] == 62.0 and s["above_weights_gb"] == 13.0 and s["peak_reserved_gb"] == 70.0
    assert s["step_time_s"] == 7.0 and s["steps_measured"] == 2
    profiled = summarise([{**r, "step": i + 1} for i, r in enumerate(records)], profiled_step=3)
    assert profiled["step_time_s"] == 6.0 and profiled["steps_measured"] == 1  # the profiled step is not timed
    table = render_table(
        [
            {"config": "ours", "seq_tokens": 12288, "workload": "unequal", "rc": 0, "oom": False, **s},
            {"config": "stock", "seq_tokens": 65536, "rc": 1, "oom": True},
            {"config": "lib", "seq_tokens": 32768, "rc": 2, "oom": False, "refused": "Predicted 85.0 GB | of 80.0"},
        ]
    )
    assert "| 12288 | unequal | ours | 62.00 | 13.00 | 70.00 |" in table
    cells = [line.replace("\\|", "").count("|") for line in table.splitlines()]  # an escaped pipe is text
    assert cells == [cells[0]] * len(cells)
    assert "| 65536 | equal | stock | OOM |" in table  # rows from before workloads were named ran equal pairs
    assert "| 32768 | equal | lib | refused: Predicted 85.0 GB \\| of 80.0 |" in table  # the planner's reason


def test_a_mix_is_timed_by_pair_size_against_the_library_only_row(tmp_path):
    """The same pairs in the same order in every row: steps in thirds by their pair's tokens (step 1 and a profiled
    last step untimed), each row's mean step per third, its MFU there (FLOP-weighted: model FLOPs over time) and its
    speed against the first `stock` row."""
    from tools.bench_memory import by_pair_size, summarise, write_outputs

    def row(config, times, mfus=None, **extra):
        tokens = [100, 10, 20, 30, 40, 50, 60, 70]
        records = [
            {"step": i + 1, "tokens": tokens[i], "step_time_s": t, **({"mfu": mfus[i]} if mfus else {})}
            for i, t in enumerate(times)
        ]
        return {"config": config, "seq_tokens": 32768, "workload": "mixed", "rc": 0, **summarise(records), **extra}

    lib = row("stock+liger+offload", [9, 2, 4, 6, 8, 10, 12], mfus=[0.1, 0.2, 0.4, 0.3, 0.3, 0.5, 0.2])
    ours = row("layer+offload", [9, 1, 2, 2, 2, 2, 3, 99], profile={"step": 8})  # step 8 profiled: not timed
    refused = {"config": "stock", "seq_tokens": 32768, "workload": "mixed", "rc": 2, "refused": "too large"}
    table = by_pair_size([ours, refused, lib, {**lib, "workload": "equal", "seq_tokens": 4096}])
    assert table.splitlines() == [
        "| 32768 mixed: mean step by pair size | 10-20 tokens (2 steps) | 30-40 tokens (2 steps) "
        "| 50-60 tokens (2 steps) |",
        "|---|---|---|---|",
        "| layer+offload | 1.50 s (2.00x) | 2.00 s (3.50x) | 2.50 s (4.40x) |",
        # (0.2 * 2 + 0.4 * 4) / 6, (0.3 * 6 + 0.3 * 8) / 14, (0.5 * 10 + 0.2 * 12) / 22
        "| stock+liger+offload | 3.00 s, MFU 33.3% | 7.00 s, MFU 30.0% | 11.00 s, MFU 33.6% |",
    ]
    assert by_pair_size([ours]).count("x)") == 0  # no library-only row: no ratio
    write_outputs(str(tmp_path), {}, [lib, ours])
    assert "| layer+offload | 1.50 s (2.00x) |" in (tmp_path / "results.md").read_text()
    write_outputs(str(tmp_path), {"merged_from": ["a", "b"]}, [lib, ours])  # rows of many invocations: no ratio
    assert "by pair size" not in (tmp_path / "results.md").read_text()


def test_reserved_memory_that_follows_a_larger_pair_is_not_creep():
    """On a mix, the largest pair may come late: reserved memory that rises with the allocation is the pair's; what
    the allocator holds beyond the largest allocation so far is what creeps."""
    from tools.bench_memory import summarise

    def run(reserved_at_12, allocated_at_12):
        return [
            {
                "step": i,
                "tokens": 1000 * i,
                "peak_allocated_gb": 50.0 if i < 12 else allocated_at_12,
                "peak_reserved_gb": 55.0 if i < 12 else reserved_at_12,
                "step_time_s": 1.0,
            }
            for i in range(1, 16)
        ]

    larger_pair = summarise(run(reserved_at_12=58.0, allocated_at_12=53.0))
    assert larger_pair["reserved_spread_after_10_gb"] == 3.0 and larger_pair["reserved_creep_after_10_gb"] == 0.0
    creeping = summarise(run(reserved_at_12=58.0, allocated_at_12=50.0))
    assert creeping["reserved_creep_after_10_gb"] == 3.0
    # a smaller pair after a larger one leaves the allocator's cache as it was: not creep either
    smaller_after = summarise(run(reserved_at_12=58.0, allocated_at_12=53.0)[:12] + run(58.0, 40.0)[12:])
    assert smaller_after["reserved_creep_after_10_gb"] == 0.0
    assert [s["tokens"] for s in larger_pair["steps"]] == [1000 * i for i in range(1, 16)]
    assert larger_pair["steps"][11] == {
        "step": 12,
        "tokens": 12000,
        "peak_allocated_gb": 53.0,
        "peak_reserved_gb": 58.0,
        "step_time_s": 1.0,
        "model_tflops": None,
        "mfu": None,
        "host_pinned_gb": None,
        "shared_pairs": None,
    }


def test_a_run_that_dies_after_its_first_step_is_not_a_measurement():
    """An OOM in step 2 of 2 leaves step 1's telemetry (the warm-up step, which the benchmark never times): the row
    shows the failure and what the run reached, and gives the table, chart and planner no figures."""
    from tools.bench_memory import measurement, render_table

    step1 = {"peak_allocated_gb": 69.2861, "peak_reserved_gb": 80.0063, "step_time_s": 12.5683, "weights_gb": 14.09}
    died = measurement([step1], rc=3, steps=2)
    assert "peak_allocated_gb" not in died and died["reached"]["steps"] == 1
    row = {"config": "stock+offload+liger", "seq_tokens": 32768, "workload": "unequal", "rc": 3, "oom": True, **died}
    assert (
        "| 32768 | unequal | stock+offload+liger | OOM in step 2 (step 1: 69.29 GB allocated, 80.01 GB reserved, "
        "12.57 s) |" in render_table([row])
    )
    # a run that failed after its last step (at teardown, say) measured every step: its figures stand
    done = measurement([step1, {**step1, "step_time_s": 5.0}], rc=1, steps=2)
    assert done["peak_allocated_gb"] == 69.2861 and done["step_time_s"] == 5.0


def test_snapshot_replay_finds_what_holds_the_peak(tmp_path):
    from tools.analyze_snapshot import peak_holders

    mlp = [
        {
            "filename": "/venv/lib/site-packages/transformers/models/mistral/modeling_mistral.py",
            "line": 47,
            "name": "forward",
        }
    ]
    norm = [
        {
            "filename": "/venv/lib/site-packages/transformers/models/mistral/modeling_mistral.py",
            "line": 194,
            "name": "forward",
        }
    ]
    mb = 10**6
    trace = [
        {"action": "alloc", "addr": 1, "size": 300 * mb, "frames": mlp},
        {"action": "alloc", "addr": 2, "size": 200 * mb, "frames": norm},
        {"action": "free_completed", "addr": 1, "size": 300 * mb},
        {"action": "alloc", "addr": 3, "size": 250 * mb, "frames": mlp},  # total 450 < earlier 500
        {"action": "alloc", "addr": 4, "size": 100 * mb, "frames": []},
    ]  # total 550: the peak
    path = tmp_path / "snap.pickle"
    pickle.dump({"segments": [], "device_traces": [trace]}, open(path, "wb"))
    out = peak_holders(str(path))
    assert out["peak_during_training_gb"] == 0.55
    sites = {h["site"]: h["gb"] for h in out["top_holders"]}
    assert sites == {
        "transformers/models/mistral/modeling_mistral.py:47 forward": 0.25,
        "transformers/models/mistral/modeling_mistral.py:194 forward": 0.2,
        "other (no model/TRL frame)": 0.1,
    }
    assert [b["bytes"] for b in out["largest_blocks"]] == [250 * mb, 200 * mb, 100 * mb]


@pytest.mark.launcher
def test_bench_end_to_end_on_cpu(tmp_path, capsys):
    """The real path: two configurations in fresh processes, results JSON + table + chart."""
    from tools.bench_memory import SUMMARY_LINE, main

    results = main(
        [
            "--recipe",
            "recipes/tiny_mistral/dpo_quickstart.yaml",
            "--mode",
            "emulate",
            "--seq-tokens",
            "48",
            "--steps",
            "2",
            "--prompt-tokens",
            "8",
            "--configs",
            "stock,layer+norm_attn_mlp",
            "--profile",
            "--out",
            str(tmp_path),
        ]
    )
    assert [r["rc"] for r in results] == [0, 0]
    assert results[0]["losses"] == pytest.approx(results[1]["losses"], abs=1e-6)  # levers change no numerics
    # one line a run on stdout: its figures from the log alone
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert lines == [{k: r.get(k) for k in SUMMARY_LINE} for r in results]
    assert all(line["mean_step_time_s"] > 0 and line["model_tflops_per_step"] > 0 for line in lines)
    # the profiled last step: each module kind's forward, its recompute by the checkpoints, and autograd's backward
    rows = results[1]["profile"]["kernel_ms"]
    for row in (
        "forward:attention",
        "forward:mlp",
        "forward:norm",
        "forward:lm_head",
        "recompute:attention",
        "recompute:mlp",
        "recompute:norm",
        "backward:matmul",
        "forward:reference",
    ):
        assert rows.get(row, 0) > 0, (row, rows)
    assert "| forward:attention |" in (tmp_path / "profiles" / "layer-norm_attn_mlp_48.md").read_text()
    with gzip.open(tmp_path / "profiles" / "layer-norm_attn_mlp_48.trace.json.gz", "rt") as f:  # the whole trace
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert {"longdpo:forward:attention", "longdpo:recompute:mlp"} <= names
    from tools import analyze_trace

    with pytest.raises(SystemExit, match="holds no GPU kernels"):  # a CPU run's trace: one clear line
        analyze_trace.main([str(tmp_path / "profiles" / "layer-norm_attn_mlp_48.trace.json.gz")])
    saved = json.load(open(tmp_path / "results.json"))
    assert saved["environment"]["mode"] == "emulate" and saved["environment"]["trl"] == "1.16.0"
    assert (tmp_path / "results.md").read_text().count("| 48 |") == 2
    assert os.path.getsize(tmp_path / "memory_vs_length.png") > 1000


def test_bench_run_past_its_timeout_is_a_row_not_a_crash(tmp_path):
    """A configuration that overruns --timeout is killed whole and recorded; the benchmark goes on to the next."""
    from tools.bench_memory import main

    results = main(
        [
            "--recipe",
            "recipes/tiny_mistral/dpo_quickstart.yaml",
            "--mode",
            "emulate",
            "--seq-tokens",
            "48",
            "--steps",
            "2",
            "--configs",
            "stock,stock+offload",
            "--timeout",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    assert [r["rc"] for r in results] == [124, 124]
    assert (tmp_path / "results.md").read_text().count("| timed out |") == 2


@pytest.mark.launcher
def test_bench_zero3_mode_on_cpu(tmp_path):
    """The real path as NeMo-RL PR #926's 8-GPU setting runs it (deepspeed launcher, ZeRO-3, one pair per rank per
    step), here with 2 CPU processes over gloo. (That every policy keeps stock's curve under ZeRO-3 is
    tests/launch/test_train_zero3.py's; one configuration here keeps the suite short.)"""
    from conftest import RUN_TIMEOUT_S, free_port

    from tools.bench_memory import main

    results = main(
        [
            "--recipe",
            "recipes/tiny_mistral/dpo_quickstart.yaml",
            "--mode",
            "zero3",
            "--gpus",
            "2",
            "--port",
            str(free_port()),
            "--timeout",
            str(RUN_TIMEOUT_S),
            "--seq-tokens",
            "48",
            "--steps",
            "2",
            "--prompt-tokens",
            "8",
            "--configs",
            "layer+norm_attn_mlp",
            "--out",
            str(tmp_path),
        ]
    )
    assert [r["rc"] for r in results] == [0], open(tmp_path / "bench.log").read()  # every run's log tail
    assert results[0]["losses"][0] == pytest.approx(math.log(2), abs=1e-4)  # policy == reference at step 1
    assert json.load(open(tmp_path / "results.json"))["environment"]["mode"] == "zero3"


def test_merge_of_committed_results(tmp_path):
    """One table + chart of every committed per-rank emulation row: the newest run of a (configuration, length)
    wins, real ZeRO-3 rows (other weights) stay out, a missing file is one clear error."""
    from tools.bench_memory import merge

    paths = glob.glob(os.path.join(ROOT, "results", "gpu_*", "**", "results.json"), recursive=True)
    rows = merge(paths, str(tmp_path))
    by_key = {(r["config"], r["seq_tokens"]): r for r in rows}
    # 64k stock+offload was measured twice (54.70 s, then 54.27 s the same day): the later run is the row
    assert by_key[("stock+offload", 65536)]["step_time_s"] == pytest.approx(54.27, abs=0.01)
    assert by_key[("stock+offload", 65536)]["source"].startswith("results/gpu_2026-12-02_s2_32k_64k")
    assert all(r.get("weights_gb") is None or r["weights_gb"] > 40 for r in rows)  # no 4-layer ZeRO-3 rows
    table = open(tmp_path / "results.md").read()
    assert "| 12288 | equal | attn_mlp | OOM |" in table and table.count("\n") == len(rows) + 2
    assert os.path.getsize(tmp_path / "memory_vs_length.png") > 1000
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tools", "bench_memory.py"),
            "--out",
            str(tmp_path),
            "--merge",
            "missing.json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 1 and "not found: ['missing.json']" in proc.stderr


def test_imports_go_one_way():
    """longdpo/ is the library: it imports neither the entrypoints (launch/) nor the measurement tools (tools/), and
    the tools and entrypoints import each other not at all, so the benchmark, the planner and training share their
    pieces through longdpo/ only."""
    import ast

    def imported(path):
        tree = ast.parse(open(path).read())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
        return {n.split(".")[0] for n in names}

    checked = 0
    for package, banned in (("longdpo", {"launch", "tools"}), ("launch", {"tools"}), ("tools", {"launch"})):
        for path in glob.glob(os.path.join(ROOT, package, "**", "*.py"), recursive=True):
            assert not imported(path) & banned, f"{os.path.relpath(path, ROOT)} imports {imported(path) & banned}"
            checked += 1
    assert checked > 40


def trace_event(cat, name, tid, ts, dur, **args):
    """One complete event of a torch.profiler (kineto) trace."""
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def test_trace_overlap_by_row_and_stream(tmp_path):
    """A trace in torch.profiler's (kineto's) layout: labels on the CPU thread, launches and kernels tied by their
    correlation id. Each kernel is charged to the innermost label around its launch; overlap counts only kernels of
    other streams."""
    from tools import analyze_trace

    events = [
        trace_event("user_annotation", "longdpo:forward:attention", 1, 0, 100),
        trace_event("user_annotation", "longdpo:forward:norm", 1, 10, 40),  # nested: the innermost label wins
        trace_event("user_annotation", "longdpo:forward:mlp", 1, 100, 100),
        trace_event("cuda_runtime", "cudaLaunchKernel", 1, 20, 1, correlation=1),
        trace_event("cuda_runtime", "cudaLaunchKernel", 1, 60, 1, correlation=2),
        trace_event("cuda_runtime", "cudaLaunchKernel", 1, 150, 1, correlation=3),
        trace_event("cuda_runtime", "cudaLaunchKernel", 2, 150, 1, correlation=4),  # a thread without labels
        trace_event("kernel", "k1", 7, 100, 100, stream=7, correlation=1),
        trace_event("kernel", "k2", 7, 200, 100, stream=7, correlation=2),
        trace_event("kernel", "k3", 20, 150, 100, stream=20, correlation=3),
        trace_event("kernel", "k4", 7, 300, 10, stream=7, correlation=4),
        # the backward thread: kernels charged to the autograd node around their launch, as the step's breakdown does
        # (the shared prompt's attention function counts as attention), a checkpoint's recompute label inside a node
        trace_event("cpu_op", "autograd::engine::evaluate_function: PromptAndTailBackward", 3, 400, 10),
        trace_event("cpu_op", "autograd::engine::evaluate_function: SliceBackward0", 3, 410, 10),
        trace_event("cpu_op", "autograd::engine::evaluate_function: CheckpointFunctionBackward", 3, 420, 30),
        trace_event("user_annotation", "longdpo:recompute:mlp", 3, 425, 10),
        trace_event("cuda_runtime", "cudaLaunchKernel", 3, 401, 1, correlation=5),
        trace_event("cuda_runtime", "cudaLaunchKernel", 3, 411, 1, correlation=6),
        trace_event("cuda_runtime", "cudaLaunchKernel", 3, 426, 1, correlation=7),
        trace_event("kernel", "cudnn_bprop", 7, 500, 20, stream=7, correlation=5),
        trace_event("kernel", "fill", 7, 520, 100, stream=7, correlation=6),
        trace_event("kernel", "gemm", 7, 620, 5, stream=7, correlation=7),
    ]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    rows = analyze_trace.main([str(path), "--out", str(tmp_path / "overlap.md")])
    assert rows["forward:norm"]["kernel_ms"] == pytest.approx(0.1)  # k1, overlapped by k3 over [150, 200]
    assert rows["forward:norm"]["overlapped_ms"] == pytest.approx(0.05)
    assert rows["forward:attention"]["overlapped_ms"] == pytest.approx(0.05)  # k2 by k3 over [200, 250]
    assert rows["forward:mlp"]["overlapped_ms"] == pytest.approx(0.1)  # k3 by k1 then k2: [150, 250]
    assert dict(rows["forward:mlp"]["with"]) == pytest.approx(
        {("forward:norm", 7): 0.05, ("forward:attention", 7): 0.05}
    )
    assert rows["unlabelled"]["kernel_ms"] == pytest.approx(0.01) and rows["unlabelled"]["overlapped_ms"] == 0
    assert "| forward:mlp | 0.1 | 0.1 |" in (tmp_path / "overlap.md").read_text()
    backward = {row: rows[row]["kernel_ms"] for row in ("backward:attention", "backward:other", "recompute:mlp")}
    assert backward == pytest.approx({"backward:attention": 0.02, "backward:other": 0.1, "recompute:mlp": 0.005})
    # --kernels: which kernels make up one row
    analyze_trace.main([str(path), "--kernels", "forward:attention", "--out", str(tmp_path / "kernels.md")])
    assert (tmp_path / "kernels.md").read_text().splitlines()[2:] == ["| `k2` | 0.1 | 1 |"]
    analyze_trace.main([str(path), "--kernels", "backward:other", "--out", str(tmp_path / "kernels.md")])
    assert (tmp_path / "kernels.md").read_text().splitlines()[2:] == ["| `SliceBackward0: fill` | 0.1 | 1 |"]
    with pytest.raises(SystemExit, match="no kernels under 'optimizer'; the rows of this trace: backward:attention"):
        analyze_trace.main([str(path), "--kernels", "optimizer"])


def test_step_breakdown_counts_each_kernel_once_where_it_was_launched():
    """The profiled step's rows come from its trace: every kernel and copy once, under the innermost label around its
    launch (a reference layer's label around an inner label, copies on their own row); the rows sum to the kernels'
    time. The profiler's in-process events had charged one kernel to two rows (more kernel time than the step's
    wall with nothing overlapping)."""
    from longdpo.training.profiling import trace_breakdown

    events = [
        trace_event("user_annotation", "longdpo:forward:reference", 1, 0, 100),
        trace_event("user_annotation", "longdpo:forward:mlp", 1, 50, 40),
        trace_event("cpu_op", "aten::mm", 1, 10, 5),
        trace_event("cuda_runtime", "cudaLaunchKernel", 1, 11, 1, correlation=1),
        trace_event("cuda_runtime", "cudaLaunchKernel", 1, 60, 1, correlation=2),
        trace_event("cuda_runtime", "cudaMemcpyAsync", 1, 95, 1, correlation=3),
        trace_event("cpu_op", "Optimizer.step#SGD.step", 1, 200, 50),
        trace_event("cuda_runtime", "cudaLaunchKernel", 1, 210, 1, correlation=4),
        trace_event("kernel", "gemm_ref", 7, 100, 300, stream=7, correlation=1),
        trace_event("kernel", "gemm_mlp", 7, 400, 200, stream=7, correlation=2),
        trace_event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 30, 400, 150, stream=30, correlation=3),
        trace_event("kernel", "sgd_update", 7, 600, 20, stream=7, correlation=4),
        trace_event("kernel", "ncclDevKernel_AllGather", 40, 600, 10, stream=40, correlation=99),
    ]
    rows = trace_breakdown(events)
    assert rows == pytest.approx(
        {
            "forward:reference": 0.3,
            "forward:mlp": 0.2,
            "offload copies": 0.15,
            "optimizer": 0.02,
            "communication": 0.01,
        }
    )
    assert sum(rows.values()) == pytest.approx(sum(e["dur"] for e in events if e["tid"] >= 7) / 1e3)


def test_gpu_suite_parts_cover_it_once_and_keep_compared_runs_together():
    """GPU_ACCEPTANCE_PART=k/n: every run in exactly one part (stock in each), a run and its reference together."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_acceptance", os.path.join(ROOT, "tests/gpu/test_acceptance.py"))
    suite = sys.modules["gpu_acceptance"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(suite)
    parts = [suite.part(suite.RUNS, k, 3) for k in (1, 2, 3)]
    assert all("stock" in p for p in parts)
    named = [name for p in parts for name in p if name != "stock"]
    assert sorted(named) == sorted(n for n in suite.RUNS if n != "stock")
    for a, b in [*suite.EXACT.items(), *suite.SAME_GRADIENTS.items()]:
        assert any(a in p and b in p for p in parts), (a, b)
    assert max(map(len, parts)) - min(map(len, parts)) <= 2


def test_an_allocator_setting_keeps_its_own_commas_in_a_list_of_configurations():
    from tools.bench_memory import parse_args, split_configs

    pinned = "layer+offload+alloc(expandable_segments:True,pinned_num_register_threads:16)"
    assert split_configs(f"stock+liger+offload,{pinned},layer") == ["stock+liger+offload", pinned, "layer"]
    args = parse_args(["--configs", f"{pinned},stock", "--out", "/tmp/unused"])  # each one a lever set it reads
    assert split_configs(args.configs)[0] == pinned


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is not None, reason="needs a Python without liger-kernel")
def test_gpu_suite_without_liger_is_one_line_before_any_run(tmp_path):
    """The shipped recipes run Liger's kernels: a machine without the package stops the suite at once, log unwritten."""
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    log = tmp_path / "acceptance.log"
    r = subprocess.run(
        ["bash", os.path.join(ROOT, "tools", "gpu_acceptance.sh"), str(log)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 1 and not log.exists()
    assert r.stderr.strip().splitlines() == [
        "error: liger-kernel is not installed: pip install -r requirements-gpu.txt (offline: put its wheel in .whl)"
    ]
