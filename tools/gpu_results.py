"""The committed GPU results under results/, read back: every benchmark row and GPU acceptance run, with the planner
Setup it ran with, rebuilt from its recorded command. The planner's calibration (tools/calibrate_planner.py) fits on
them, and the tests hold the planner to them (tests/unit/test_planner.py). The package itself never reads results/.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex

from longdpo.checks import check_deepspeed_config
from longdpo.config import ModelArgs, load_recipe, parse_cli
from longdpo.data.synthetic import spec_pairs
from longdpo.levers import LeverSet, setup_facts
from longdpo.levers.shared_prompt import cut_to_max_length
from longdpo.model.build import load_architecture
from longdpo.planner.cli import positive_int
from longdpo.planner.plan import Setup, model_shape, setup_from_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "results", "**", "results.json")
ACCEPTANCE_RUNS = os.path.join(ROOT, "results", "gpu_acceptance", "runs.json")
ACCEPTANCE_LATEST = os.path.join(ROOT, "results", "gpu_acceptance", "latest_runs.json")
BENCH_RECIPE = "recipes/nemotron12b/dpo_12k.yaml"  # the benchmark's default recipe (model, data, trainer settings)


def add_setup_arguments(parser) -> None:
    """The benchmark's options that fix a row's setup: its recipe, layer count and GPU count. tools/bench_memory.py
    parses them to run; a recorded command line is read back with the same defaults."""
    parser.add_argument("--recipe", default=BENCH_RECIPE)
    parser.add_argument(
        "--layers",
        type=positive_int,
        default=None,
        help="cut the model to this many layers (the real path on one GPU: --mode zero3 --layers 8)",
    )
    parser.add_argument("--gpus", type=positive_int, default=1)


def bench_options(command: str) -> argparse.Namespace:
    """The recipe, layer count and GPU count of a recorded tools/bench_memory.py command line (its defaults)."""
    p = argparse.ArgumentParser(add_help=False)
    add_setup_arguments(p)
    return p.parse_known_args(shlex.split(command)[2:])[0]


def synthetic_spec(command: str) -> dict:
    """The pairs (`data.synthetic`) of a recorded training command."""
    argv = shlex.split(command)
    return json.loads(argv[argv.index("--data.synthetic") + 1])


def setup_from_argv(argv: list[str]) -> Setup:
    """The Setup of a launch/train_dpo.py command line (launcher first, paths relative to the repo root)."""
    args = argv[[os.path.basename(a) for a in argv].index("train_dpo.py") + 1 :]
    cli = parse_cli([os.path.join(ROOT, a) if a.endswith((".yaml", ".json")) else a for a in args])
    recipe = load_recipe(cli["recipe"], cli["overrides"])
    ds = cli["deepspeed"] or ("ds_configs/zero3.json" if os.path.basename(argv[0]) == "accelerate" else None)
    return setup_from_recipe(recipe, 1, 1, check_deepspeed_config(os.path.join(ROOT, ds)) if ds else None)


def setup_from_result(environment: dict, row: dict) -> Setup:
    """The Setup a committed benchmark row (or acceptance run) ran with: its lever set read from its name, the
    benchmark's recipe, layers, GPUs and mode from the recorded command."""
    if "argv" in row:
        return setup_from_argv(row["argv"])
    bench = bench_options(environment["command"])
    recipe = load_recipe(os.path.join(ROOT, bench.recipe))
    lever_set = LeverSet.read(row["config"])
    arch = load_architecture(ModelArgs(**{**recipe.model.__dict__, "num_hidden_layers": bench.layers}))
    seq = row["seq_tokens"]
    facts = setup_facts(lever_set, recipe, seq, met_pairs(synthetic_spec(row["command"]), seq, row), synthetic=True)
    return Setup(
        **model_shape(arch),
        seq=seq,
        ranks=bench.gpus,
        ranks_per_node=bench.gpus,
        zero3=environment["mode"] == "zero3",
        emulate=environment["mode"] == "emulate",
        levers=lever_set,
        pads=row.get("workload", "equal") != "equal",
        lengths_vary=row.get("workload") == "mixed",
        **facts,
    )


def met_pairs(spec: dict, seq: int, row: dict) -> list[tuple[int, int, int]]:
    """The pairs of a row's `data.synthetic` that its run trained on. A run of a few steps on a mix meets some of the
    dataset's pairs, perhaps not its costliest, and is held to the plan of those it met: read from its steps' token
    counts (one pair a step: the prompt twice, chosen and rejected, cut to `seq` as TRL cuts them). Every pair of
    the spec where a step matches none of them (a fixed shape, more pairs a step, no steps recorded)."""
    pairs = spec_pairs(spec, seq)
    steps = {step["tokens"] for step in row.get("steps", [])}
    if "mix_seed" not in spec or not steps:
        return pairs
    real = {pair: 2 * cut[0] + cut[1] + cut[2] for pair in pairs if (cut := cut_to_max_length(*pair, seq))}
    met = [pair for pair, tokens in real.items() if tokens in steps]
    return met if steps <= set(real.values()) else pairs


def gpu_memory_gb(environment: dict, row: dict) -> float | None:
    """The memory of the GPU a row ran on: what its telemetry read, or, in rows from before it was kept, the GB in the
    card's name (a lower bound: an "80GB" H100 holds 85.0 GB)."""
    if row.get("gpu_limit_gb"):
        return row["gpu_limit_gb"]
    named = re.search(r"(\d+)GB", environment.get("gpu") or "")
    return float(named.group(1)) if named else None


def benchmark_rows(pattern: str = RESULTS):
    """(environment, row, source) of every committed benchmark results file, copies made by
    `bench_memory.py --merge` left out (their rows are read where they were measured)."""
    for path in sorted(glob.glob(pattern, recursive=True)):
        with open(path) as f:
            data = json.load(f)
        if "merged_from" in data["environment"]:
            continue
        for row in data["results"]:
            yield data["environment"], row, os.path.relpath(path, ROOT)


def reshaped_rows(pattern: str = RESULTS):
    """(environment, row, source) for every committed benchmark row whose levers ran pairs as other rows than TRL's
    two (the shared prompt; any workload): not fitted on, held to the plan of their rows (tests/unit/test_planner)."""
    for env, row, src in benchmark_rows(pattern):
        if row.get("peak_reserved_gb") is not None and LeverSet.read(row["config"]).reshapes_pairs:
            yield env, row, src


def measured_rows(pattern: str = RESULTS):
    """(environment, row, source) for every committed measurement that produced memory figures: the benchmark's
    rows and the GPU acceptance suite's runs (real entrypoint, 1-2 layers; peaks over every step)."""
    for env, row, src in benchmark_rows(pattern):
        # the planner plans two sequences of max_length: it is fitted on pairs of that shape only, run as two rows
        reshaped = LeverSet.read(row["config"]).reshapes_pairs
        if row.get("peak_allocated_gb") is not None and row.get("workload", "equal") == "equal" and not reshaped:
            yield env, row, src
    for env, row, src, s in acceptance_rows(ACCEPTANCE_RUNS):
        if not s.lora_params:
            yield env, row, src


def lora_rows():
    """(environment, row, source, Setup) for the LoRA runs of the newest GPU acceptance suite (1-2 layers, equal
    pairs), the rows LoRA's coefficients are fitted on."""
    for env, row, src, s in acceptance_rows(ACCEPTANCE_LATEST):
        if s.lora_params:
            yield env, row, src, s


def acceptance_rows(path: str):
    """(environment, row, source, Setup) for every run of an acceptance suite's runs file that exited 0 on equal pairs
    (unequal pairs are shorter than the planner's two sequences of max_length), with its Setup rebuilt from its
    command line against the recipes as that run read them."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        data = json.load(f)
    # the shipped recipes as that run read them (they change later): kept beside the runs, per commit
    kept = os.path.join(os.path.dirname(path), f"recipes_{data['environment']['commit']}")
    for name, run in data["runs"].items():
        if run["rc"] != 0 or not run["records"] or any("rejected_tokens" in a for a in run["argv"]):
            continue
        argv = [
            os.path.relpath(os.path.join(kept, os.path.basename(a)), ROOT)
            if a.startswith("recipes/nemotron12b/") and os.path.isdir(kept)
            else a
            for a in run["argv"]
        ]
        s = setup_from_argv(argv)
        peak = {
            k: max(r[k] for r in run["records"])
            for k in ("peak_allocated_gb", "activation_peak_allocated_gb", "optimizer_peak_allocated_gb")
        }
        row = {
            "config": s.levers.name,
            "seq_tokens": s.seq,
            "argv": argv,
            "run": name,
            **peak,
            "peak_reserved_gb": run["summary"]["measured_reserved_gb"],
        }
        env = {**data["environment"], "mode": "zero3" if s.zero3 else "one process"}
        yield env, row, os.path.relpath(path, ROOT), s
