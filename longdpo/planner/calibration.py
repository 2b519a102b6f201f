"""The planner's calibration: every committed measurement (the benchmark's results.json files under results/ and the
GPU acceptance suite's runs) rebuilt into the Setup it ran with, and the coefficients fitted on them
(`python launch/plan_memory.py --calibrate` writes longdpo/planner/calibration.json).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex

from longdpo.config import REPO_ROOT, load_recipe, parse_cli
from longdpo.planner.levers import CONFIGS, add_setup_arguments
from longdpo.planner.plan import (
    SUB_GROUP,
    Setup,
    allocator_key,
    config_name,
    count_params,
    offloads_layer_inputs,
    pinned_bytes,
    predict,
    shared_tokens,
)

ROOT = str(REPO_ROOT)

ACCEPTANCE_RUNS = os.path.join(ROOT, "results", "gpu_acceptance", "runs.json")
ACCEPTANCE_LATEST = os.path.join(ROOT, "results", "gpu_acceptance", "latest_runs.json")


def setup_from_argv(argv: list[str]) -> Setup:
    """The Setup of a launch/train_dpo.py command line (launcher first, paths relative to the repo root)."""
    from longdpo.checks import check_deepspeed_config
    from longdpo.planner.plan import setup_from_recipe

    args = argv[[os.path.basename(a) for a in argv].index("train_dpo.py") + 1 :]
    cli = parse_cli([os.path.join(ROOT, a) if a.endswith((".yaml", ".json")) else a for a in args])
    recipe = load_recipe(cli["recipe"], cli["overrides"])
    ds = cli["deepspeed"] or ("ds_configs/zero3.json" if os.path.basename(argv[0]) == "accelerate" else None)
    return setup_from_recipe(recipe, 1, 1, check_deepspeed_config(os.path.join(ROOT, ds)) if ds else None)


def _bench_options(command: str) -> argparse.Namespace:
    """The recipe, layer count and GPU count of a recorded tools/bench_memory.py command line (its defaults)."""
    p = argparse.ArgumentParser(add_help=False)
    add_setup_arguments(p)
    return p.parse_known_args(shlex.split(command)[2:])[0]


def setup_from_result(environment: dict, row: dict) -> Setup:
    """The Setup a committed benchmark row (or acceptance run) ran with, rebuilt from its recorded command."""
    if "argv" in row:
        return setup_from_argv(row["argv"])
    from longdpo.config import ModelArgs
    from longdpo.model.build import load_architecture

    bench = _bench_options(environment["command"])
    recipe = load_recipe(os.path.join(ROOT, bench.recipe))
    lv = CONFIGS[row["config"]]
    arch = load_architecture(ModelArgs(**{**recipe.model.__dict__, "num_hidden_layers": bench.layers}))
    total, layer, embed = count_params(arch)
    return Setup(
        params=total,
        layer_params=layer,
        embed_params=embed,
        layers=arch.num_hidden_layers,
        hidden=arch.hidden_size,
        seq=row["seq_tokens"],
        ranks=bench.gpus,
        ranks_per_node=bench.gpus,
        zero3=environment["mode"] == "zero3",
        emulate=environment["mode"] == "emulate",
        config=config_name(
            lv.checkpointing,
            lv.tiled_mlp,
            lv.activation_offloading,
            lv.mlp_chunks,
            lv.lean_norm,
            lv.lean_lm_head,
            lv.use_liger_kernel,
        ),
        allocator_conf=lv.allocator_conf,
        offload_pinned=lv.offload_pin_memory,
        pair_tokens=shared_tokens(
            synthetic_spec(row["command"]), row["seq_tokens"], recipe.data.shared_prompt_min_saving
        )
        if lv.shared_prompt
        else None,
        padding_mask=lv.padding_mask == "keep" and row.get("workload", "equal") != "equal",
    )


def synthetic_spec(command: str) -> dict:
    """The pairs (`data.synthetic`) of a recorded training command."""
    argv = shlex.split(command)
    return json.loads(argv[argv.index("--data.synthetic") + 1])


def shared_prompt_rows(pattern: str = os.path.join(ROOT, "results", "**", "results.json")):
    """(environment, row, source) for every committed benchmark row that ran `data.shared_prompt` (any workload):
    not fitted on, held to the plan of its shared rows (tests/unit/test_planner.py)."""
    for env, row, src in _benchmark_rows(pattern):
        if row.get("peak_reserved_gb") is not None and getattr(CONFIGS.get(row["config"]), "shared_prompt", False):
            yield env, row, src


def _benchmark_rows(pattern: str):
    """(environment, row, source) of every committed benchmark results file, copies made by
    `bench_memory.py --merge` left out (their rows are read where they were measured)."""
    for path in sorted(glob.glob(pattern, recursive=True)):
        with open(path) as f:
            data = json.load(f)
        if "merged_from" in data["environment"]:
            continue
        for row in data["results"]:
            yield data["environment"], row, os.path.relpath(path, ROOT)


def measured_rows(pattern: str = os.path.join(ROOT, "results", "**", "results.json")):
    """(environment, row, source) for every committed measurement that produced memory figures: the benchmark's
    rows and the GPU acceptance suite's runs (real entrypoint, 1-2 layers; peaks over every step)."""
    for env, row, src in _benchmark_rows(pattern):
        # the planner plans two sequences of max_length: it is fitted on pairs of that shape only, run as two rows
        shared = row["config"] in CONFIGS and CONFIGS[row["config"]].shared_prompt
        if row.get("peak_allocated_gb") is not None and row.get("workload", "equal") == "equal" and not shared:
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
            "config": s.config,
            "seq_tokens": s.seq,
            "argv": argv,
            "run": name,
            **peak,
            "peak_reserved_gb": run["summary"]["measured_reserved_gb"],
        }
        env = {**data["environment"], "mode": "zero3" if s.zero3 else "one process"}
        yield env, row, os.path.relpath(path, ROOT), s


def calibrate() -> dict:
    """Fit per-configuration coefficients on the emulate-mode rows (pure activations); allocator factors on rows
    that set an allocator; the host memory of offloading on rows that offloaded."""
    zero = {"configs": {}, "allocator_factors": {}, "pinned_factor": 1.0}  # fits one config at a time
    # each row's Setup rebuilt once (a recipe and an architecture read per row), then shared by every fit below
    rows = [(env, row, src, setup_from_result(env, row)) for env, row, src in measured_rows()]
    by_config: dict[str, list] = {}
    for env, row, src, s in rows:
        if env["mode"] == "emulate":
            by_config.setdefault(s.config, []).append((s, row, src))
    cal = {
        "_comment": "fitted by `python launch/plan_memory.py --calibrate` from the files in `sources`",
        "configs": {},
        "allocator_factors": {},
        "pinned_factor": 1.0,
    }
    for config, items in by_config.items():
        base = {**zero, "configs": {config: {"per_token_bytes": 0.0, "reserved_factor": 1.0}}}
        # least squares through the origin: residual = per_token_bytes x tokens
        num = den = 0.0
        for s, row, _ in items:
            residual = row["peak_allocated_gb"] * 1e9 - predict(s, base).peak_allocated_gb * 1e9
            num, den = num + residual * s.tokens, den + s.tokens**2
        factors = []
        for s, row, _ in items:
            fixed = resident(s, base)
            factors.append((row["peak_reserved_gb"] - fixed) / (row["peak_allocated_gb"] - fixed))
        cal["hidden"] = items[0][0].hidden  # the width the per-token coefficients were measured at
        cal["configs"][config] = {
            "per_token_bytes": round(num / den, 1),
            "reserved_factor": round(sum(factors) / len(factors), 4),
            "sources": sorted({src for *_, src in items}),
        }
    fit_zero3_reserved(rows, cal)
    cal["lora"] = fit_lora(cal)
    cal.update(fit_host(rows))
    cal["mask_bytes_per_element"] = fit_mask()
    cal["zero3"] = fit_zero3(rows, cal)
    ratios: dict[str, list] = {}
    for _env, row, _src, s in rows:
        if s.allocator_conf and s.config in cal["configs"]:
            unfactored = predict(Setup(**{**s.__dict__, "allocator_conf": None}), cal).peak_reserved_gb
            fixed = resident(s, cal)
            ratios.setdefault(allocator_key(s), []).append((row["peak_reserved_gb"] - fixed) / (unfactored - fixed))
    cal["allocator_factors"] = {k: round(sum(v) / len(v), 4) for k, v in sorted(ratios.items())}
    return cal


def fit_mask(pattern: str = os.path.join(ROOT, "results", "**", "results.json")) -> float:
    """Bytes per element of the explicit mask TRL's padding becomes (2 rows x seq x seq a pair), from benchmark rows
    of unequal pairs with the mask kept beside a row of equal pairs of the same setup (configuration, length, mode,
    layers; allocation does not depend on the card): their difference in peak allocated."""
    rows = [
        (env, row)
        for env, row, _ in _benchmark_rows(pattern)
        if row.get("peak_allocated_gb") is not None and row["config"] in CONFIGS
    ]

    def key(env, row):
        return row["config"], row["seq_tokens"], env["mode"], _bench_options(env["command"]).layers

    equal = {key(env, row): row for env, row in rows if row.get("workload", "equal") == "equal"}
    per_element = [
        (row["peak_allocated_gb"] - equal[key(env, row)]["peak_allocated_gb"]) * 1e9 / (2 * row["seq_tokens"] ** 2)
        for env, row in rows
        if row.get("workload") == "unequal" and CONFIGS[row["config"]].padding_mask == "keep" and key(env, row) in equal
    ]
    return round(sum(per_element) / len(per_element), 3) if per_element else 0.0


def fit_host(rows) -> dict:
    """Host memory of activation offloading, from rows that offloaded the layer inputs (TRL's offloader, one pair
    per step): the blocks of tokens x hidden x 2 bytes copied beyond the layer inputs (`offloaded_gb` counts the
    bytes exactly: the final norm's and the LM head's inputs, saved after the last layer, make about 2 more), pinned
    memory over those blocks rounded up to powers of two, and the process's own resident memory beside its pinned
    blocks (Python, torch, CUDA, DeepSpeed)."""
    extra, pinned, process = [], [], []
    for _env, row, _src, s in rows:
        if not (s.config.endswith("+offload") and offloads_layer_inputs(s.config) and row.get("offloaded_gb")):
            continue
        block = s.tokens * s.hidden * 2
        extra.append(row["offloaded_gb"] * 1e9 / block - (s.layers - s.offload_keep_layers))
        if s.offload_pinned and row.get("host_pinned_gb") and row.get("host_rss_gb"):
            blocks = s.layers - s.offload_keep_layers + extra[-1]
            pinned.append(row["host_pinned_gb"] * 1e9 / (blocks * pinned_bytes(block)))
            process.append(row["host_rss_gb"] - row["host_pinned_gb"])
    mean = lambda v, default: round(sum(v) / len(v), 4) if v else default  # noqa: E731
    return {
        "offload_extra_blocks": mean(extra, 0.0),
        "pinned_factor": mean(pinned, 1.0),
        "host_process_gb": mean(process, 0.0),
    }


def fit_lora(cal: dict) -> dict:
    """Per configuration, LoRA's activation bytes per token and reserved factor, from the acceptance suite's LoRA runs:
    frozen weights and a reference pass that stores nothing keep other activations than full fine-tuning (the
    full fine-tuning coefficients under-predicted LoRA's allocation by 7-10% and over-predicted its reserved memory
    by up to 42%)."""
    by_config: dict[str, list] = {}
    for _env, row, src, s in lora_rows():
        by_config.setdefault(s.config, []).append((s, row, src))
    fitted = {}
    for config, items in sorted(by_config.items()):
        base = {**cal, "lora": {config: {"per_token_bytes": 0.0, "reserved_factor": 1.0}}}
        num = den = 0.0
        for s, row, _ in items:
            residual = (row["peak_allocated_gb"] - predict(s, base).peak_allocated_gb) * 1e9
            num, den = num + residual * s.tokens, den + s.tokens**2
        coef = {"per_token_bytes": round(num / den, 1), "reserved_factor": 1.0}
        fixed = [resident(s, base) for s, _, _ in items]
        factors = [(r["peak_reserved_gb"] - f) / (r["peak_allocated_gb"] - f) for (_, r, _), f in zip(items, fixed)]
        coef["reserved_factor"] = round(sum(factors) / len(factors), 4)
        fitted[config] = {**coef, "rows": len(items), "sources": sorted({src for *_, src in items})}
    return fitted


def fit_zero3(rows, cal: dict) -> dict:
    """The optimizer step's transient per parameter of a sub-group, and the gap it leaves between reserved and
    allocated, from real-path rows that measured the two peaks apart (no allocator setting). `rows`: calibrate()'s
    (environment, row, source, Setup) tuples."""
    steps, gaps, sources = [], [], set()
    for env, row, src, s in rows:
        opt = row.get("optimizer_peak_allocated_gb")
        if env["mode"] != "zero3" or opt is None:
            continue
        if s.allocator_conf or s.offload_optimizer:
            continue
        steps.append((opt - resident(s, cal)) * 1e9 / min(s.params / s.ranks, SUB_GROUP))
        if opt >= (row.get("activation_peak_allocated_gb") or 0):  # the optimizer phase set the peak
            gaps.append(row["peak_reserved_gb"] - opt)
        sources.add(src)
    if not steps:
        return {}
    return {
        "step_bytes_per_param": round(sum(steps) / len(steps), 3),
        "gap_gb": round(sum(gaps) / len(gaps), 3) if gaps else 0.0,
        "rows": len(steps),
        "sources": sorted(sources),
    }


def fit_zero3_reserved(rows, cal: dict) -> None:
    """A configuration's reserved factor on the real path, where it was measured there with the forward/backward
    transient at least twice the optimizer step's: the per-rank emulation runs 40 layers of churn and fragments more
    (at 64k with Liger's kernels and TRL's offloading: 1.93x the activations in emulation, 1.27x on ZeRO-3 with 8
    layers)."""
    factors: dict[str, list] = {}
    for env, row, src, s in rows:
        act, opt = row.get("activation_peak_allocated_gb"), row.get("optimizer_peak_allocated_gb")
        if env["mode"] != "zero3" or act is None or opt is None:
            continue
        fixed = resident(s, cal)
        # only where the forward/backward clearly set the peak: near the optimizer step's the reserved figure is
        # the step's own gap, and the quotient below blows up (12k, 8 layers, stock: 1.89)
        if s.allocator_conf or s.config not in cal["configs"] or act - fixed < 2 * (opt - fixed):
            continue
        factors.setdefault(s.config, []).append(((row["peak_reserved_gb"] - fixed) / (act - fixed), src))
    for config, items in factors.items():
        cal["configs"][config]["reserved_factor_zero3"] = round(sum(f for f, _ in items) / len(items), 4)
        cal["configs"][config]["sources"] = sorted({*cal["configs"][config]["sources"], *(src for _, src in items)})


def resident(s: Setup, cal: dict) -> float:
    """GB that stay put through a step (model states + reference): the part of the allocation the reserved factor
    does not scale."""
    breakdown = predict(s, cal).breakdown
    return breakdown["model_states"] + breakdown["reference_model"]
