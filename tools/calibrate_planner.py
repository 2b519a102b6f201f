"""Fit the planner's coefficients on the committed GPU results and write them into the package's calibration file
(longdpo/planner/calibration.json), the only file the planner reads:

    python tools/calibrate_planner.py            # refit and write
    python tools/calibrate_planner.py --check    # exit 1 when the shipped file is not what the results give

Every committed measurement (the benchmark's results.json rows and the GPU acceptance suite's runs, read back by
tools/gpu_results.py) is rebuilt into the planner Setup it ran with; per-lever-set coefficients are fitted on the
per-rank emulation rows, the rest on the rows that measured them (each fit's docstring says which).
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/gpu_results.py beside this script

from gpu_results import (  # noqa: E402
    benchmark_rows,
    lora_rows,
    measured_rows,
    setup_from_result,
)

from longdpo.levers import levers  # noqa: E402
from longdpo.planner.plan import (  # noqa: E402
    CALIBRATION,
    SUB_GROUP,
    Setup,
    load_calibration,
    predict,
    terms_of,
    tokens,
)


def calibrate() -> dict:
    """Fit per-lever-set coefficients on the emulate-mode rows (pure activations); allocator factors on rows that
    set an allocator; the host memory of offloading on rows that offloaded."""
    zero = {"configs": {}, "allocator_factors": {}, "pinned_factor": 1.0}  # fits one lever set at a time
    # each row's Setup rebuilt once (a recipe and an architecture read per row), then shared by every fit below
    rows = [(env, row, src, setup_from_result(env, row)) for env, row, src in measured_rows()]
    by_config: dict[str, list] = {}
    for env, row, src, s in rows:
        if env["mode"] == "emulate":
            by_config.setdefault(s.levers.priced_name, []).append((s, row, src))
    cal = {
        "_comment": "fitted by `python tools/calibrate_planner.py` from the files in `sources`",
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
            num, den = num + residual * tokens(s), den + tokens(s) ** 2
        factors = []
        # rows run with an allocator setting measure that setting (its own factor, the allocator lever's fit): the
        # lever set's reserved factor comes from the default allocator's rows where it has any
        for s, row, _ in [item for item in items if not terms_of(item[0], base).allocator_key] or items:
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
    cal["zero3"] = fit_zero3(rows, cal)
    # the levers' own terms (longdpo/levers/: each lever's `fit`), in lever order: the allocator's factors, last,
    # read every other fit
    every = [
        (env, row, src, setup_from_result(env, row))
        for env, row, src in benchmark_rows()
        if row.get("peak_allocated_gb") is not None
    ]
    planner = SimpleNamespace(predict=predict, terms_of=terms_of, tokens=tokens, resident=resident)
    for lever in levers():
        cal.update(lever.fit(rows, every, cal, planner))
    return cal


def fit_lora(cal: dict) -> dict:
    """Per configuration, LoRA's activation bytes per token and reserved factor, from the acceptance suite's LoRA runs:
    frozen weights and a reference pass that stores nothing keep other activations than full fine-tuning (the
    full fine-tuning coefficients under-predicted LoRA's allocation by 7-10% and over-predicted its reserved memory
    by up to 42%)."""
    by_config: dict[str, list] = {}
    for _env, row, src, s in lora_rows():
        by_config.setdefault(s.levers.priced_name, []).append((s, row, src))
    fitted = {}
    for config, items in sorted(by_config.items()):
        base = {**cal, "lora": {config: {"per_token_bytes": 0.0, "reserved_factor": 1.0}}}
        num = den = 0.0
        for s, row, _ in items:
            residual = (row["peak_allocated_gb"] - predict(s, base).peak_allocated_gb) * 1e9
            num, den = num + residual * tokens(s), den + tokens(s) ** 2
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
        if terms_of(s, cal).allocator_key or s.offload_optimizer:  # an allocator setting: its own factor
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
        name = s.levers.priced_name
        if terms_of(s, cal).allocator_key or name not in cal["configs"] or act - fixed < 2 * (opt - fixed):
            continue
        factors.setdefault(name, []).append(((row["peak_reserved_gb"] - fixed) / (act - fixed), src))
    for config, items in factors.items():
        cal["configs"][config]["reserved_factor_zero3"] = round(sum(f for f, _ in items) / len(items), 4)
        cal["configs"][config]["sources"] = sorted({*cal["configs"][config]["sources"], *(src for _, src in items)})


def resident(s: Setup, cal: dict) -> float:
    """GB that stay put through a step (model states + reference): the part of the allocation the reserved factor
    does not scale."""
    breakdown = predict(s, cal).breakdown
    return breakdown["model_states"] + breakdown["reference_model"]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cal = calibrate()
    if "--check" in argv:
        same = cal == load_calibration()
        print("calibration.json is what the results give" if same else "calibration.json differs from a refit")
        return 0 if same else 1
    with open(CALIBRATION, "w") as f:
        json.dump(cal, f, indent=1)
        f.write("\n")
    print(f"wrote {os.path.relpath(CALIBRATION)}: {len(cal['configs'])} lever sets, {len(cal['lora'])} with LoRA")
    return 0


if __name__ == "__main__":
    sys.exit(main())
