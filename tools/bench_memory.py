"""Memory/speed benchmark of the levers on the real training path (launch/train_dpo.py), one fresh process each.

A configuration is a lever set's name (`layer+liger+chunked8+head+offload`; `stock` is TRL as a user gets it:
transformers' layer checkpoint and TRL's padding mask; longdpo/levers/ declares every lever and its token). For each
sequence length and configuration it runs a few DPO steps of synthetic pairs of exactly that length
and records, from the run's own memory.jsonl (steps after the first): peak allocated, peak reserved,
fragmentation gap, median step time, tokens/s, host RSS, pinned host memory and the step's host peak. `stock` and
ours run in the same invocation on the same GPU, so ratios are honest.

    # the real path: ZeRO-3 + AdamW, fewer layers so model states fit one GPU
    python tools/bench_memory.py --gpus 1 --layers 4 --seq-tokens 12288 \
        --configs stock,stock+offload,attn_mlp,norm_attn_mlp,norm_attn_mlp+alloc64 --out results/levers_12k
    # CPU smoke (the tests run this): tiny model, python launcher
    python tools/bench_memory.py --recipe recipes/tiny_mistral/dpo_quickstart.yaml --mode emulate \
        --seq-tokens 64 --steps 2 --configs stock,norm_attn_mlp --out /tmp/bench
    # per-rank emulation: full 40-layer model, SGD in backward, gradients freed as produced
    python tools/bench_memory.py --mode emulate --seq-tokens 12288,32768,65536 --configs stock,stock+offload,...

    # one table + chart of every committed per-rank emulation row (the newest of each configuration and length)
    python tools/bench_memory.py --out results/summary --merge results/*/results.json results/*/*/results.json

Outputs in --out: results.json (GPU name, library versions, command lines, memory cap, mode), results.md (NeMo-RL
PR #926's table format) and memory_vs_length.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/gpu_results.py beside this script

from analyze_snapshot import peak_holders  # noqa: E402
from gpu_results import add_setup_arguments  # noqa: E402

from longdpo.cluster.distributed import run_job  # noqa: E402
from longdpo.data.synthetic import WORKLOADS, workload  # noqa: E402
from longdpo.levers import STOCK, LeverSet  # noqa: E402
from longdpo.planner.cli import positive_ints  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_command(args, name: str, seq: int, out_dir: str, shape: str = "equal") -> list[str]:
    overrides = {
        **LeverSet.read(name).overrides(),
        "data.synthetic": json.dumps(workload(shape, seq, 8 * args.steps, args.prompt_tokens)),
        "data.train_files": "[]",
        "data.global_batch_size": "null",
        "max_length": str(seq),
        "max_steps": str(args.steps),
        "per_device_train_batch_size": "1",
        "gradient_accumulation_steps": "1",
        "logging_steps": "1",
        "save_strategy": "no",
        "report_to": "none",
        "output_dir": out_dir,
    }
    if args.layers:
        overrides["model.num_hidden_layers"] = str(args.layers)
    if args.memory_cap_gb:
        overrides["memory.memory_cap_gb"] = str(args.memory_cap_gb)
    if args.mode == "emulate":
        overrides["memory.sgd_in_backward"] = "true"
    if args.snapshot:
        overrides["memory.snapshot_steps"] = "2"
    if args.profile:
        overrides["memory.profile_step"] = str(args.steps)
    flat = [x for k, v in overrides.items() for x in (f"--{k}", v)] + ["--no_final_save"]
    if args.skip_preflight:
        flat.append("--skip-preflight")
    script = os.path.join(ROOT, "launch", "train_dpo.py")
    if args.launcher == "python":
        return [sys.executable, script, "--recipe", args.recipe, *flat]
    # the launcher installed beside this Python (a virtualenv not on PATH), else the one on PATH
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    launcher = launcher if os.path.exists(launcher) else "deepspeed"
    return [
        launcher,
        "--num_gpus",
        str(args.gpus),
        "--master_port",
        str(args.port),
        script,
        args.ds_config,
        "--recipe",
        args.recipe,
        *flat,
    ]


# kept for every step of a run: a mix of pair shapes is read step by step (pinned host memory: torch's pinned cache
# rounds blocks up to a power of two, so a pair larger than any before may pin new blocks, a cost of that step; with
# the shared prompt, whether the step's pair ran as one row or as TRL's two)
STEP_FIELDS = (
    "step",
    "tokens",
    "peak_allocated_gb",
    "peak_reserved_gb",
    "step_time_s",
    "model_tflops",
    "mfu",
    "host_pinned_gb",
    "shared_pairs",
)


def summarise(records: list[dict], profiled_step: int | None = None) -> dict:
    # steps after the first; a profiled step is not timed (the profiler slows it)
    steady = [r for r in records[1:] if profiled_step is None or r.get("step") != profiled_step] or records

    def agg(key, fn):
        vals = [r[key] for r in steady if r.get(key) is not None]
        return fn(vals) if vals else None

    median = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    mean = lambda v: round(sum(v) / len(v), 4)  # noqa: E731
    peak = agg("peak_allocated_gb", max)
    weights = steady[-1].get("weights_gb")
    # memory that stays flat: how far the peak reserved moves over the steps after the tenth, and how far what the
    # allocator holds beyond the largest allocation so far moves (`reserved_creep_after_10_gb`): on a mix of pair
    # shapes the first, but not the second, also jumps when a pair larger than any before comes late (measured: the
    # largest of 30 pairs at step 22); every step is kept (`steps`)
    late = [r["peak_reserved_gb"] for r in records[10:] if r.get("peak_reserved_gb") is not None]
    held, largest = [], 0.0
    for r in records:
        if r.get("peak_reserved_gb") is not None and r.get("peak_allocated_gb") is not None:
            largest = max(largest, r["peak_allocated_gb"])
            held.append(r["peak_reserved_gb"] - largest)
        else:
            held.append(None)
    held_late = [h for h in held[10:] if h is not None]
    return {
        "peak_allocated_gb": peak,
        "above_weights_gb": round(peak - weights, 3) if peak is not None and weights else None,
        "weights_gb": weights,
        "peak_reserved_gb": agg("peak_reserved_gb", max),
        "frag_gap_gb": agg("frag_gap_gb", max),
        "step_time_s": agg("step_time_s", median),
        "mean_step_time_s": agg("step_time_s", mean),  # over the same pairs for every lever set of a benchmark
        "tokens_per_s": agg("tokens_per_s", median),
        "model_tflops_per_step": agg("model_tflops", mean),
        "mfu_of_peak": agg("mfu", mean),  # model FLOPs over time and the card's dense bf16 peak
        "host_rss_gb": agg("host_rss_gb", max),
        "host_pinned_gb": agg("host_pinned_gb", max),
        "host_peak_gb": agg("host_peak_gb", max),
        "alloc_retries": agg("alloc_retries", max),
        "gpu_limit_gb": agg("gpu_limit_gb", max),
        "steps_measured": len(steady),
        # every step, the first included: its optimizer step allocates the optimizer state
        **{
            k: max((r[k] for r in records if r.get(k) is not None), default=None)
            for k in (
                "activation_peak_allocated_gb",
                "activation_peak_reserved_gb",
                "optimizer_peak_allocated_gb",
                "optimizer_peak_reserved_gb",
                "offloaded_gb",
                "offloaded_param_shaped",
            )
        },
        "first_step_peak_reserved_gb": records[0].get("peak_reserved_gb") if records else None,
        "run_peak_reserved_gb": max(
            (r["peak_reserved_gb"] for r in records if r.get("peak_reserved_gb") is not None), default=None
        ),
        "reserved_spread_after_10_gb": round(max(late) - min(late), 3) if len(late) >= 2 else None,
        "reserved_creep_after_10_gb": round(max(held_late) - min(held_late), 3) if len(held_late) >= 2 else None,
        "steps": [{k: r.get(k) for k in STEP_FIELDS} for r in records],
    }


def run_one(args, name: str, seq: int, shape: str = "equal") -> dict:
    tag = f"{name}_{seq}" + ("" if shape == "equal" else f"_{shape}")
    out_dir = os.path.join(args.out, "runs", tag.replace("+", "-"))
    cmd = build_command(args, name, seq, out_dir, shape)
    t0 = time.time()
    proc = run_job(cmd, args.timeout, cwd=ROOT)  # a run past --timeout is killed whole and recorded as rc 124
    log = proc.stdout + proc.stderr
    with open(os.path.join(args.out, "bench.log"), "a") as f:
        f.write(f"\n===== {name} @ {seq} {shape} (rc={proc.returncode})\n$ {shlex.join(cmd)}\n{log[-4000:]}\n")
    result = {
        "config": name,
        "seq_tokens": seq,
        "workload": shape,
        "rc": proc.returncode,
        "wall_s": round(time.time() - t0, 1),
        "command": shlex.join(cmd),
        "oom": "OutOfMemoryError" in log or "CUDA out of memory" in log,
    }
    errors = [line[len("error:") :].strip() for line in log.splitlines() if line.startswith("error:")]
    if proc.returncode == 2 and errors:  # refused before any model was loaded: say why in the table
        result["refused"] = errors[0]
    jsonl = os.path.join(out_dir, "memory.jsonl")
    if os.path.exists(jsonl):
        records = [json.loads(line) for line in open(jsonl)]
        result.update(measurement(records, proc.returncode, args.steps, args.steps if args.profile else None))
    profile = os.path.join(out_dir, f"profile_step{args.steps}")
    if args.profile and os.path.exists(profile + ".json"):
        result["profile"] = json.load(open(profile + ".json"))
        os.makedirs(os.path.join(args.out, "profiles"), exist_ok=True)
        kept = os.path.join(args.out, "profiles", tag.replace("+", "-"))
        with open(kept + ".md", "w") as f:
            f.write(f"# {name}, {seq} tokens, {shape} pairs\n\n" + open(profile + ".md").read())
        if os.path.exists(profile + ".trace.json.gz"):
            shutil.copy(profile + ".trace.json.gz", kept + ".trace.json.gz")
    snap = os.path.join(out_dir, "memory_snapshot_rank0.pickle")
    if os.path.exists(snap):
        result["peak_holders"] = peak_holders(snap)
    summary = os.path.join(out_dir, "train_summary.json")
    if os.path.exists(summary):
        s = json.load(open(summary))
        result.update(
            losses=s["losses"],
            allocator=s["allocator"],
            wrapped=s["wrapped"],
            grad_norms=[log.get("grad_norm") for log in s["train_logs"]],
            planner_predicted_reserved_gb=s.get("planner_predicted_reserved_gb"),
        )
    return result


def matmul_tflops() -> float | None:
    """This GPU's measured bf16 matmul rate (8192^3, mean of 10 after 3 warm-ups): what a kernel reaches here, beside
    the card's peak that MFU is taken of (longdpo/training/flops.py)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    rate = 10 * 2 * 8192**3 / (start.elapsed_time(end) / 1e3) / 1e12
    del a, b
    torch.cuda.empty_cache()
    return round(rate, 1)


def environment(args) -> dict:
    import importlib.metadata as md

    info = {
        "python": platform.python_version(),
        "host": platform.node(),
        "mode": args.mode,
        "memory_cap_gb": args.memory_cap_gb,
        "command": args.command,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    for pkg in ("torch", "transformers", "trl", "deepspeed", "accelerate", "datasets"):
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            info[pkg] = None
    try:
        import torch

        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        info["gpu_count"] = torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - reporting only
        info["gpu"] = None
    return info


def measurement(records: list[dict], rc: int, steps: int, profiled_step: int | None = None) -> dict:
    """A run's figures from its telemetry. A run that died before its last step (an OOM in step 2, say) is not a
    measurement: what it reached is kept under `reached` (shown beside its failure, never read as its figures: the
    table, the chart and the planner's calibration read only the measured keys)."""
    if rc != 0 and len(records) < steps:
        last = records[-1] if records else {}
        keys = ("peak_allocated_gb", "peak_reserved_gb", "step_time_s")
        return {"reached": {"steps": len(records), **{k: last.get(k) for k in keys}}}
    return summarise(records, profiled_step)


def render_table(results: list[dict]) -> str:
    def f(v, spec=".2f"):
        return format(v, spec) if isinstance(v, (int, float)) else "n/a"

    lines = [
        "| Seqlen | Workload | Config | Peak Allocated (GB) | Above weights (GB) | Peak Reserved (GB) | "
        "Frag gap (GB) | Step Time (s) | Mean step (s) | Real tokens/s | MFU (of peak) | Reserved spread after "
        "step 10 (GB) | Reserved above the largest allocation, spread after step 10 (GB) | Host RSS (GB) | "
        "Pinned host (GB) | Host peak (GB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        head = f"| {r['seq_tokens']} | {r.get('workload', 'equal')} | {r['config']} |"
        if r["rc"] != 0 and r.get("peak_allocated_gb") is None:
            if r["oom"]:
                status = "OOM"
            elif r["rc"] == 124:
                status = "timed out"
            elif r.get("refused"):
                status = "refused: " + r["refused"].replace("|", "\\|")
            else:
                status = f"failed (rc {r['rc']})"
            if reached := r.get("reached"):
                n = reached["steps"]
                status += (
                    f" in step {n + 1} (step {n}: {f(reached['peak_allocated_gb'])} GB allocated, "
                    f"{f(reached['peak_reserved_gb'])} GB reserved, {f(reached['step_time_s'])} s)"
                )
            lines.append(f"{head} {status} | | | | | | | | | | | | |")
            continue
        lines.append(
            f"{head} {f(r['peak_allocated_gb'])} | {f(r.get('above_weights_gb'))} | "
            f"{f(r['peak_reserved_gb'])} | "
            f"{f(r['frag_gap_gb'])} | {f(r['step_time_s'])} | {f(r.get('mean_step_time_s'))} | "
            f"{f(r['tokens_per_s'], '.0f')} | {f(r.get('mfu_of_peak'), '.1%')} | "
            f"{f(r.get('reserved_spread_after_10_gb'))} | {f(r.get('reserved_creep_after_10_gb'))} | "
            f"{f(r['host_rss_gb'])} | {f(r['host_pinned_gb'])} | {f(r.get('host_peak_gb'))} |"
        )
    return "\n".join(lines) + "\n"


def timed_steps(row: dict) -> dict[int, dict]:
    """A row's timed steps by step number: step 1 warms up, and a profiled (last) step is not timed."""
    steps = row["steps"][1 : -1 if row.get("profile") else None]
    return {s["step"]: s for s in steps if s.get("step_time_s") is not None}


def by_pair_size(results: list[dict]) -> str:
    """On a mix, where the speed goes by pair size: each length's timed steps in thirds by the tokens of their pair
    (the same pairs in the same order in every row), each row's mean step in each third, its MFU there (model FLOPs
    over time, so the FLOP-weighted mean of the steps') and its speed against the library-only setup's row (the
    first `stock` row of that length), so a mix's ratio shows which pairs hold it."""
    tables = []
    for seq in sorted({r["seq_tokens"] for r in results}):
        rows = [r for r in results if r["seq_tokens"] == seq and r.get("workload") == "mixed" and r.get("steps")]
        if not rows:
            continue
        tokens = {s["step"]: s["tokens"] for s in rows[0]["steps"] if s.get("tokens")}
        order = sorted((n for n in timed_steps(rows[0]) if n in tokens), key=lambda n: tokens[n])
        thirds = [order[i * len(order) // 3 : (i + 1) * len(order) // 3] for i in range(3)]
        if not all(thirds):
            continue
        base = next((r for r in rows if r["config"].split("+")[0] == STOCK), None)

        def third(row, part) -> tuple[float, float | None] | None:
            steps = timed_steps(row)
            if not set(part) <= set(steps):
                return None
            time = sum(steps[n]["step_time_s"] for n in part)
            mfus = [steps[n].get("mfu") for n in part]
            util = sum(m * steps[n]["step_time_s"] for m, n in zip(mfus, part)) / time if None not in mfus else None
            return time / len(part), util

        head = " | ".join(
            f"{min(tokens[n] for n in t):,}-{max(tokens[n] for n in t):,} tokens ({len(t)} steps)" for t in thirds
        )
        lines = [f"| {seq} mixed: mean step by pair size | {head} |", "|---|---|---|---|"]
        refs = [base and third(base, part) for part in thirds]
        for r in rows:
            cells = []
            for part, ref in zip(thirds, refs):
                got = third(r, part)
                if got is None:
                    cells.append("n/a")
                    continue
                util = f", MFU {got[1]:.1%}" if got[1] is not None else ""
                ratio = f" ({ref[0] / got[0]:.2f}x)" if ref and r is not base else ""
                cells.append(f"{got[0]:.2f} s{util}{ratio}")
            lines.append(f"| {r['config']} | " + " | ".join(cells) + " |")
        tables.append("\n".join(lines) + "\n")
    return "\n".join(tables)


# The curves of the merged chart: label -> configurations, the first one measured at a length taking that point
# (the shipped recipes use 3 MLP chunks at 12k and 8 beyond).
SUMMARY_CURVES = {
    "stock TRL": ["stock"],
    "TRL + offloading": ["stock+offload"],
    "TRL + offloading + Liger (library flags only)": ["stock+liger+offload"],
    "ours + Liger (the 12B recipes)": ["layer+liger+chunked3+head+offload", "layer+liger+chunked8+head+offload"],
    "ours without Liger (no Triton)": ["layer+lean+chunked3+head+offload", "layer+lean+chunked8+head+offload"],
}


def plot(results: list[dict], path: str, curves: dict[str, list[str]] | None = None) -> None:
    """Memory above the weights per sequence length, one curve per configuration (or per `curves` label)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = curves or {name: [name] for name in dict.fromkeys(r["config"] for r in results)}
    above = all(r.get("above_weights_gb") is not None for r in results if r.get("peak_allocated_gb") is not None)
    key = "above_weights_gb" if above else "peak_allocated_gb"
    fig, ax = plt.subplots(figsize=(9, 5))
    colors = plt.get_cmap("tab10")
    for i, (label, configs) in enumerate(curves.items()):
        pts = {}
        for config in reversed(configs):  # the first configuration listed wins a length
            pts.update({r["seq_tokens"]: r[key] for r in results if r["config"] == config and r.get(key) is not None})
        if pts:
            xs = sorted(pts)
            ax.plot(
                xs,
                [pts[x] for x in xs],
                marker="osD^v<>"[i % 7],
                color=colors(i % 10),
                label=label,
                linewidth=2,
                markersize=7,
            )
    ax.set_xlabel("tokens per sequence")
    ax.set_ylabel("GB above the weights (peak allocated)" if above else "peak allocated (GB)")
    ax.set_ylim(bottom=0)
    ax.set_title("GPU memory vs sequence length" + (" (per-rank emulation)" if above else ""))
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def split_configs(configs: str) -> list[str]:
    """ "a,b+alloc(x:1,y:2)" -> ["a", "b+alloc(x:1,y:2)"]: an allocator setting keeps its own commas."""
    return re.split(r",(?![^()]*\))", configs)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_setup_arguments(p)
    p.add_argument("--configs", default="stock,stock+offload,attn_mlp,norm_attn_mlp,layer+norm_attn_mlp")
    p.add_argument(
        "--seq-tokens",
        type=positive_ints,
        default="12288",
        help="comma-separated tokens per sequence (prompt + the longer completion)",
    )
    p.add_argument(
        "--workloads",
        default="equal",
        help=f"comma-separated pair shapes, from {', '.join(WORKLOADS)} (longdpo/data/synthetic.py WORKLOADS)",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=1024,
        help="the prompt of the equal and unequal workloads (at most a quarter of the sequence)",
    )
    p.add_argument("--steps", type=int, default=4)
    p.add_argument(
        "--mode",
        choices=("zero3", "emulate"),
        default="zero3",
        help="zero3: the real path, deepspeed launcher + AdamW; emulate: the per-rank emulation, one process, SGD in "
        "backward with gradients freed (the activation footprint of one ZeRO-3 rank)",
    )
    p.add_argument(
        "--launcher",
        choices=("deepspeed", "python"),
        default=None,
        help="defaults to deepspeed for --mode zero3, python for --mode emulate",
    )
    p.add_argument("--ds-config", default="ds_configs/zero3.json")
    p.add_argument("--port", type=int, default=29600)
    p.add_argument("--memory-cap-gb", type=float, default=None, help="emulate a smaller GPU (e.g. 80 for an H100)")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument(
        "--skip-preflight",
        action="store_true",
        help="run configurations the planner predicts will not fit (to measure how close they come)",
    )
    p.add_argument(
        "--snapshot",
        action="store_true",
        help="record CUDA memory history for 2 steps and write what holds the peak (analyze_snapshot.py)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile the last step (not timed) and write where its time went (longdpo/training/profiling.py) to "
        "results.json and profiles/<config>_<tokens>.md, its whole trace to profiles/<config>_<tokens>"
        ".trace.json.gz",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="RESULTS_JSON",
        help="run nothing: merge these results.json files' per-rank emulation rows into one table and chart in --out",
    )
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    args.command = shlex.join([sys.executable, "tools/bench_memory.py", *(sys.argv[1:] if argv is None else argv)])
    for name in split_configs(args.configs):
        try:
            LeverSet.read(name)
        except ValueError as e:
            p.error(str(e))
    unknown = [w for w in args.workloads.split(",") if w not in WORKLOADS]
    if unknown:
        p.error(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    args.launcher = args.launcher or ("python" if args.mode == "emulate" else "deepspeed")
    if args.mode == "emulate" and args.launcher != "python":
        p.error("--mode emulate runs one process: use --launcher python")
    return args


def write_outputs(out: str, environment: dict, results: list[dict], curves: dict | None = None) -> None:
    """results.json, results.md and the chart; a benchmark rewrites them after every run, so one stopped half-way
    keeps what it measured. A mix's steps by pair size compare rows of one invocation only (not a merge's)."""
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"environment": environment, "results": results}, f, indent=1)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(render_table(results))
        if "merged_from" not in environment and (sizes := by_pair_size(results)):
            f.write("\n" + sizes)
    plot(results, os.path.join(out, "memory_vs_length.png"), curves)


def merge(paths: list[str], out: str) -> list[dict]:
    """One table and chart of many runs' per-rank emulation rows (GB above the same weights, so they compare), the
    newest row of each (configuration, length, workload) winning; each row keeps the results file it came from."""
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing or not paths:
        sys.exit(
            f"error: --merge needs results.json files written by this benchmark; not found: {missing or 'none given'}"
        )
    runs = [(path, json.load(open(path))) for path in paths]
    # one-invocation files only (not an earlier merge), per-rank emulation rows, oldest first: the newest row wins
    runs = sorted(
        ((p, d) for p, d in runs if d["environment"].get("mode") == "emulate"),
        key=lambda run: run[1]["environment"]["date"],
    )
    rows = {}
    for path, data in runs:
        for r in data["results"]:
            # rows from before workloads were named ran equal pairs; names in their one spelling (longdpo/levers/)
            r = {"workload": "equal", **r, "config": LeverSet.read(r["config"]).name}
            rows[(r["config"], r["seq_tokens"], r["workload"])] = {**r, "source": os.path.relpath(path, ROOT)}
    results = sorted(rows.values(), key=lambda r: (r["seq_tokens"], r["config"]))
    os.makedirs(out, exist_ok=True)
    write_outputs(out, {"merged_from": sorted({r["source"] for r in results})}, results, SUMMARY_CURVES)
    return results


# One line per run on stdout: enough to compare the runs from the log alone (the per-step records are in --out)
SUMMARY_LINE = (
    "config",
    "seq_tokens",
    "workload",
    "rc",
    "above_weights_gb",
    "peak_reserved_gb",
    "step_time_s",
    "mean_step_time_s",
    "tokens_per_s",
    "model_tflops_per_step",
    "mfu_of_peak",
    "reserved_spread_after_10_gb",
    "reserved_creep_after_10_gb",
    "planner_predicted_reserved_gb",
)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    os.makedirs(args.out, exist_ok=True)
    env = {**environment(args), "matmul_tflops": matmul_tflops()}
    results = []
    runs = [
        (seq, shape, name)
        for seq in args.seq_tokens
        for shape in args.workloads.split(",")
        for name in (LeverSet.read(n).name for n in split_configs(args.configs))
    ]
    for seq, shape, name in runs:
        results.append(run_one(args, name, seq, shape))
        print(json.dumps({k: results[-1].get(k) for k in SUMMARY_LINE}), flush=True)
        write_outputs(args.out, env, results)
    return results


if __name__ == "__main__":
    main()
