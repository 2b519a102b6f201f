"""The memory `TrainerCallback`: per-step telemetry of GPU and host memory, time, and useful work (model FLOPs and
their share of the card's peak, longdpo/training/flops.py).

Per optimizer step, on every rank, it measures peak allocated / peak reserved / fragmentation gap (reserved -
allocated at peak) / allocator retries and OOMs / host RSS and pinned host memory / step time / real (unpadded)
tokens per second, how far its peak reserved is from the GPU's limit (`headroom_gb`: the card's memory, or
`memory.memory_cap_gb`, less peak reserved; a warning once a step comes within 5% of it or the allocator has had to
free its cache and retry), and the step's peak host memory (`host_peak_gb`: the process's peak resident set since
the step began, read on Linux from /proc; RSS read at the step's end misses pageable offloading, whose host copies
are freed by then). Rank 0 logs the max over ranks to `memory.jsonl` in the output dir and into the Trainer logs
(so TensorBoard). Peaks are reset at each step start. At the end: `memory_summary.md` (NeMo-RL PR #926's table
format) and `memory.png`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time

import psutil
import torch
from transformers import TrainerCallback

from longdpo import patches
from longdpo.cluster.distributed import max_over_ranks
from longdpo.config import MemoryArgs
from longdpo.planner import plan
from longdpo.training.flops import mfu

logger = logging.getLogger(__name__)
GB = 1e9
# Per-rank values reduced with MAX across ranks, in this order.
_REDUCED = (
    "peak_allocated_gb",
    "peak_reserved_gb",
    "frag_gap_gb",
    "alloc_retries",
    "ooms",
    "host_rss_gb",
    "host_pinned_gb",
    "host_peak_gb",
    "step_time_s",
)


def _restart_host_peak() -> bool:
    """Linux: restart this process's peak resident set (VmHWM), so that the step's own peak can be read at its end.
    False where that cannot be done (another OS, or /proc read-only)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _host_peak() -> float | None:
    """GB: this process's peak resident set since the last restart (VmHWM of /proc/self/status)."""
    try:
        with open("/proc/self/status") as f:
            found = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) * 1024 / GB if found else None


def _host_memory() -> tuple[float, float | None]:
    rss = psutil.Process().memory_info().rss / GB
    pinned = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # pinned blocks owned by the host caching allocator (TRL's activation offloading allocates there)
        pinned = torch.cuda.host_memory_stats().get("allocated_bytes.peak", 0) / GB
    return rss, pinned


def near_the_limit(step: int, limit_gb: float, peak_reserved_gb: float, new_retries: int) -> str | None:
    """The warning for a step within plan.NEAR_THE_LIMIT of the GPU's memory (the planner's line) or whose allocator
    had to free its cache and retry a cudaMalloc (a step that nearly ran out, and ran slower for it); None for a step
    with room."""
    headroom = limit_gb - peak_reserved_gb
    if not plan.near_the_limit(peak_reserved_gb, limit_gb) and not new_retries:
        return None
    retried = f"; the allocator freed its cache and retried {new_retries} time(s)" if new_retries else ""
    return (
        f"step {step} reserved {peak_reserved_gb:.1f} GB of the GPU's {limit_gb:.1f} GB ({headroom:.1f} GB left"
        f"{retried}): a longer pair can run out of memory. `python launch/plan_memory.py` with this recipe names the "
        "levers that make room, or lower data.max_length"
    )


class MemoryCallback(TrainerCallback):
    def __init__(self, memory: MemoryArgs, step_telemetry: list | None = None, label: str = ""):
        """`step_telemetry`: callables whose fields join each step's record (the levers'); `label`: the run's lever
        set, for the summary table."""
        self.memory = memory
        self.label = label
        self.step_telemetry = step_telemetry if step_telemetry is not None else []
        self.weights_gb: float | None = None  # parameter bytes on this rank (policy + reference), set by the run
        self.records: list[dict] = []
        self._step_start = 0.0
        self._host_peak_restarted = False
        self._tokens_at_start = 0
        self._snapshotting = False
        self._phase_peaks = None  # [allocated, reserved] peaks before the optimizer step, then during it
        self._retries = 0  # the allocator's retries so far (its counter never restarts)
        self._warned = False

    # -- helpers -------------------------------------------------------------------------------------------------
    def _keep_earlier_records(self, output_dir: str, resumed_at: int) -> None:
        """On resume, memory.jsonl keeps the steps up to the checkpoint (steps after it are trained again, and were
        logged twice before) and the end-of-run table and plot cover them too; a fresh start clears it."""
        path = os.path.join(output_dir, "memory.jsonl")
        if not os.path.exists(path):
            return
        with open(path) as f:
            kept = [r for r in (json.loads(line) for line in f if line.strip()) if r.get("step", 0) <= resumed_at]
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        self.records = kept + self.records

    @staticmethod
    def _cuda() -> bool:
        return torch.cuda.is_available() and torch.cuda.is_initialized()

    def _limit_gb(self) -> float:
        """What this rank's GPU can hold: the recipe's cap where it sets one, else the card's memory."""
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GB
        return min(self.memory.memory_cap_gb or total, total)

    # -- events --------------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.memory.telemetry:
            self._keep_earlier_records(args.output_dir, state.global_step)
        if self._cuda():
            patches.measure_optimizer_step(kwargs.get("optimizer"), self._record_phase_peaks)
            if self.memory.snapshot_steps:
                torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
                self._snapshotting = True

    def _record_phase_peaks(self, before: list, during: list) -> None:
        """The peaks before and during the optimizer step, [allocated, reserved] each (longdpo/patches.py)."""
        self._phase_peaks = (before, during)

    def on_step_begin(self, args, state, control, **kwargs):
        if self._cuda():
            torch.cuda.reset_peak_memory_stats()
            if hasattr(torch.cuda, "reset_peak_host_memory_stats"):
                torch.cuda.reset_peak_host_memory_stats()
        self._tokens_at_start = state.num_input_tokens_seen
        self._host_peak_restarted = _restart_host_peak()
        self._step_start = time.perf_counter()
        self._phase_peaks = None

    def on_step_end(self, args, state, control, **kwargs):
        if self._cuda():
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - self._step_start
        rss, pinned = _host_memory()
        host_peak = _host_peak() if self._host_peak_restarted else None
        peak_alloc = peak_res = retries = ooms = 0.0
        if self._cuda():
            stats = torch.cuda.memory_stats()
            peak_alloc = stats.get("allocated_bytes.all.peak", 0) / GB
            peak_res = stats.get("reserved_bytes.all.peak", 0) / GB
            if self._phase_peaks is not None:  # the counters restarted at the optimizer step
                peak_alloc = max(peak_alloc, self._phase_peaks[0][0] / GB)
                peak_res = max(peak_res, self._phase_peaks[0][1] / GB)
            retries, ooms = stats.get("num_alloc_retries", 0), stats.get("num_ooms", 0)
        values = [
            peak_alloc,
            peak_res,
            peak_res - peak_alloc,
            retries,
            ooms,
            rss,
            pinned or 0.0,
            host_peak or 0.0,
            elapsed,
        ]
        reduced = dict(zip(_REDUCED, max_over_ranks(values)))
        tokens = state.num_input_tokens_seen - self._tokens_at_start  # gathered over ranks by the Trainer
        record = {
            "step": state.global_step,
            **{k: round(v, 4) for k, v in reduced.items()},
            **self._split_peaks(),
            **{k: v for fields in self.step_telemetry for k, v in fields().items()},
            "tokens": tokens,
            "tokens_per_s": round(tokens / reduced["step_time_s"], 1),
            "weights_gb": round(self.weights_gb, 4) if self.weights_gb is not None else None,
            "cuda": self._cuda(),
        }
        record["mfu"] = mfu(record.get("model_tflops"), reduced["step_time_s"])
        if self._cuda():
            record["gpu_limit_gb"] = round(self._limit_gb(), 4)
            record["headroom_gb"] = round(record["gpu_limit_gb"] - reduced["peak_reserved_gb"], 4)
            retries = int(reduced["alloc_retries"])
            warning = near_the_limit(
                state.global_step, record["gpu_limit_gb"], reduced["peak_reserved_gb"], retries - self._retries
            )
            self._retries = retries
            if warning and not self._warned and state.is_world_process_zero:
                logger.warning(warning)
                self._warned = True
        if host_peak is None:
            record["host_peak_gb"] = None
        if not self._cuda():  # no GPU: the GPU fields mean nothing
            for k in (
                "peak_allocated_gb",
                "peak_reserved_gb",
                "frag_gap_gb",
                "alloc_retries",
                "ooms",
                "host_pinned_gb",
            ):
                record[k] = None
        self.records.append(record)
        if state.is_world_process_zero and self.memory.telemetry:
            os.makedirs(args.output_dir, exist_ok=True)
            with open(os.path.join(args.output_dir, "memory.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
        if self._snapshotting and state.global_step >= self.memory.snapshot_steps:
            self._dump_snapshot(args, state)

    def _split_peaks(self) -> dict:
        """The step's peaks before the optimizer step (forward/backward) and during it, max over ranks."""
        if self._phase_peaks is None:
            return {}
        (alloc_before, res_before), (alloc_during, res_during) = self._phase_peaks
        values = max_over_ranks([alloc_before / GB, res_before / GB, alloc_during / GB, res_during / GB])
        keys = (
            "activation_peak_allocated_gb",
            "activation_peak_reserved_gb",
            "optimizer_peak_allocated_gb",
            "optimizer_peak_reserved_gb",
        )
        return {k: round(v, 4) for k, v in zip(keys, values)}

    def _dump_snapshot(self, args, state):
        rank = int(os.environ.get("RANK", 0))
        path = os.path.join(args.output_dir, f"memory_snapshot_rank{rank}.pickle")
        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)
        self._snapshotting = False
        logger.info("memory snapshot written to %s (open at https://pytorch.org/memory_viz)", path)

    def telemetry_logs(self) -> dict:
        """Latest step's figures for the Trainer logs (TensorBoard): memory/<name>."""
        keep = (
            "peak_allocated_gb",
            "peak_reserved_gb",
            "frag_gap_gb",
            "alloc_retries",
            "host_rss_gb",
            "host_pinned_gb",
            "host_peak_gb",
            "step_time_s",
            "tokens_per_s",
            "model_tflops",
            "mfu",
            "headroom_gb",
        )
        last = self.records[-1] if self.records else {}
        return {f"memory/{k}": last[k] for k in keep if last.get(k) is not None}

    def on_train_end(self, args, state, control, **kwargs):
        if self._snapshotting:
            self._dump_snapshot(args, state)
        if state.is_world_process_zero and self.memory.telemetry and self.records:
            write_summary(self.records, args.output_dir, state.log_history, self.label)


def write_summary(records: list[dict], output_dir: str, log_history: list[dict] | None = None, label: str = "") -> str:
    """memory_summary.md in NeMo-RL PR #926's format (steady state: steps after the first) and memory.png."""
    steady = records[1:] or records

    def fmt(key, agg):
        vals = [r[key] for r in steady if r.get(key) is not None]
        return f"{agg(vals):.2f}" if vals else "n/a"

    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    if any(r.get("peak_allocated_gb") is not None for r in records):
        table = (
            "| Levers | Peak Allocated (GB) | Peak Reserved (GB) | Frag gap (GB) | Headroom (GB) | Host peak (GB) | "
            "Step Time (s) | Tokens/s | MFU |\n|---|---|---|---|---|---|---|---|---|\n"
            f"| {label or 'this run'} | {fmt('peak_allocated_gb', max)} | {fmt('peak_reserved_gb', max)} | "
            f"{fmt('frag_gap_gb', max)} | {fmt('headroom_gb', min)} | {fmt('host_peak_gb', max)} | "
            f"{fmt('step_time_s', med)} | {fmt('tokens_per_s', med)} | {fmt('mfu', med)} |\n"
        )
    else:  # a CPU run: no GPU memory to report, so what there is
        table = (
            "No GPU on this machine: GPU memory is not measured; host memory and time are.\n\n"
            "| Host RSS (GB) | Host peak (GB) | Step Time (s) | Tokens/s |\n|---|---|---|---|\n"
            f"| {fmt('host_rss_gb', max)} | {fmt('host_peak_gb', max)} | {fmt('step_time_s', med)} | "
            f"{fmt('tokens_per_s', med)} |\n"
        )
    path = os.path.join(output_dir, "memory_summary.md")
    with open(path, "w") as f:
        f.write(f"Steady state over steps {steady[0]['step']}..{steady[-1]['step']} (max memory, median time).\n\n")
        f.write(table)
    _plot(records, os.path.join(output_dir, "memory.png"), log_history or [])
    return path


def _plot(records: list[dict], path: str, log_history: list[dict]) -> None:
    """One picture of the run, each quantity on an axis it can be read on: the DPO loss (with ln 2, where policy =
    reference), the reward margin, the reward accuracy (0 to 1) and memory per step (GPU peak allocated / reserved
    where there is a GPU, the host's peak; from 0). Markers only on short runs, where they show the steps."""
    import matplotlib  # pyplot must wait for the backend: no screen on a training node

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    (loss, margin), (accuracy, mem) = axes
    logs = [h for h in log_history if "loss" in h and "step" in h]
    steps = [h["step"] for h in logs]
    style = {"marker": "o", "markersize": 3} if len(logs) <= 30 else {}
    loss.plot(steps, [h["loss"] for h in logs], color="tab:blue", **style)
    loss.axhline(0.6931, color="grey", linestyle=":", linewidth=1, label="ln 2 (policy = reference)")
    loss.set_title("DPO loss")
    loss.legend(fontsize=8)
    for ax, key, color, title in (
        (margin, "rewards/margins", "tab:green", "reward margin (chosen - rejected)"),
        (accuracy, "rewards/accuracies", "tab:orange", "reward accuracy"),
    ):
        if logs and all(key in h for h in logs):
            ax.plot(steps, [h[key] for h in logs], color=color, **style)
        ax.set_title(title)
    margin.axhline(0, color="grey", linewidth=0.5)
    accuracy.set_ylim(-0.02, 1.02)
    steps = [r["step"] for r in records]
    style = {"marker": "o", "markersize": 3} if len(records) <= 30 else {}
    if any(r.get("peak_allocated_gb") is not None for r in records):
        mem.plot(steps, [r["peak_allocated_gb"] for r in records], color="tab:red", label="GPU peak allocated", **style)
        mem.plot(
            steps, [r["peak_reserved_gb"] for r in records], color="tab:purple", label="GPU peak reserved", **style
        )
        limits = [r["gpu_limit_gb"] for r in records if r.get("gpu_limit_gb")]
        if limits:
            mem.axhline(min(limits), color="grey", linestyle=":", linewidth=1, label="the GPU's limit")
        mem.set_title("Memory per step")
    else:
        mem.set_title("Memory per step (no GPU: host memory only)")
    # the step's host peak where it was read (Linux), else RSS at the step's end
    host = "host_peak_gb" if all(r.get("host_peak_gb") is not None for r in records) else "host_rss_gb"
    mem.plot(steps, [r[host] for r in records], color="tab:brown", label=host[:-3].replace("_", " "), **style)
    mem.set_ylim(
        bottom=0,
        top=max(
            1e-3,
            *(v for r in records for v in (r.get("peak_reserved_gb"), r.get("gpu_limit_gb"), r[host]) if v is not None),
        )
        * 1.15,
    )
    mem.set_ylabel("GB (max over ranks)")
    mem.legend(fontsize=8, loc="lower right")
    for ax in axes.flat:
        ax.set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
