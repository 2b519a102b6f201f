"""Where a step's time goes (`memory.profile_step: N`): a torch.profiler trace of optimizer step N, broken down by
module kind and phase, written to the output dir as profile_step<N>.json / .md, with the whole trace beside them
(profile_step<N>.trace.json.gz: open it in https://ui.perfetto.dev to see which kernels run side by side).

Each decoder module's forward runs inside a labelled range (attention, MLP, norm; the LM head inside its autograd
function), installed beneath every checkpoint wrapper, so a recompute in backward is labelled as one. Every GPU kernel
is then charged to the innermost label around the op that launched it:

  forward:<kind>     the module's forward in the forward pass (forward:reference: the reference model's layers)
  recompute:<kind>   the same forward replayed in backward by a checkpoint
  backward:<kind>    autograd's backward nodes, by node (attention, matmul, norm, activation, LM head, other)
  offload copies     device<->host copies (activation offloading; they overlap compute on their own stream)
  communication      NCCL kernels (ZeRO-3's parameter gathers and gradient reduce-scatters)
  optimizer          the optimizer step

Sums of kernel times per row, read from the step's trace (each kernel once, charged where the trace shows its
launch; tools/analyze_trace.py reads the same trace for what overlapped); the step's wall time is reported beside them
(copies and compute overlap). Without a GPU the rows are the labelled ops' own CPU time.
"""

from __future__ import annotations

import gzip
import json
import os
import time
from collections import defaultdict

import torch
from transformers import TrainerCallback

from longdpo.model.families import decoder_modules
from longdpo.model.forwards import PROFILE_LABEL, in_backward

AUTOGRAD_NODE = "autograd::engine::evaluate_function: "  # the profiler's range around each backward node
# backward node names (autograd's class names) -> kind; the shared prompt's rejected-part attention is its own
# autograd function (longdpo/levers/shared_prompt.py)
_BACKWARD_KINDS = (
    ("Attention", "attention"),
    ("PromptAndTail", "attention"),
    ("Flash", "attention"),
    ("Cudnn", "attention"),
    ("Mm", "matmul"),
    ("Addmm", "matmul"),
    ("Bmm", "matmul"),
    ("Linear", "matmul"),
    ("RMSNorm", "norm"),
    ("Norm", "norm"),
    ("Silu", "activation"),
    ("SiLU", "activation"),
    ("Swiglu", "activation"),
    ("SwiGLU", "activation"),
    ("LogProb", "lm_head"),
)


def label(module: torch.nn.Module, kind: str) -> None:
    """Run `module.forward` inside a `forward:<kind>` range (`recompute:<kind>` when replayed in backward)."""
    forward = module.forward

    def labelled(*args, **kwargs):
        phase = "recompute" if in_backward() else "forward"
        with torch.profiler.record_function(f"{PROFILE_LABEL}{phase}:{kind}"):
            return forward(*args, **kwargs)

    module.forward = labelled


def instrument(model: torch.nn.Module) -> int:
    """Label the decoder's attention, MLP and norm modules (after the lean norms replace their forwards, before any
    checkpoint wrapper: the run labels between the levers' kernel and recompute stages). Returns a count."""
    layers, final_norm = decoder_modules(model)
    count = 0
    for layer in layers:
        for module, kind in (
            (layer.self_attn, "attention"),
            (layer.mlp, "mlp"),
            (layer.input_layernorm, "norm"),
            (layer.post_attention_layernorm, "norm"),
        ):
            label(module, kind)
            count += 1
    label(final_norm, "norm")
    return count + 1


def instrument_reference(ref_model: torch.nn.Module | None) -> None:
    """Label the reference model's decoder layers `forward:reference` (it runs under no_grad: forward only)."""
    if ref_model is not None:
        for layer in decoder_modules(ref_model)[0]:
            label(layer, "reference")


def backward_row(node: str) -> str:
    """`backward:<kind>` of an autograd node's name (its class name, as in `PromptAndTailBackward`)."""
    return "backward:" + next((k for key, k in _BACKWARD_KINDS if key in node), "other")


def _row(event) -> str:
    """The innermost label around a profiler event (the profiler's events in process: a run without a GPU)."""
    e = event
    while e is not None:
        named = _range({"name": e.name})
        if named:
            return named[0]
        e = e.cpu_parent
    return "other"


def breakdown(events) -> dict[str, float]:
    """Milliseconds of CPU time per row: the leaf ops' own time (a run without a GPU, whose trace holds no kernels)."""
    rows: dict[str, float] = defaultdict(float)
    for e in events:
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CPU and not e.cpu_children:
            rows[_row(e)] += e.self_cpu_time_total / 1e3
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]))


# The GPU rows come from the exported trace, not from the profiler's events in process: on 64k steps (H100, 12B
# emulation) the events' kernel lists summed to more kernel time than the step's wall with nothing overlapping (61.7 s
# in a 50.5 s step; 32.9 s in a 28.8 s one): the forward rows (forward:reference, :attention, :mlp) held kernels twice.
# The trace, each kernel tied to its launch by correlation id, summed to the wall.
PREFIXES = (PROFILE_LABEL, "recipes:")  # the labels (traces written before the rename say recipes:)
UNLABELLED = ("unlabelled", None)  # (row, autograd node) of a launch outside every label and node
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def load_trace(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _range(e: dict) -> tuple | None:
    """(row, autograd node or None) of a range that names a row: a `longdpo:` label, an autograd node or a torch
    optimizer's step (DeepSpeed's step: its ops' rows)."""
    name = e.get("name", "")
    prefix = next((p for p in PREFIXES if name.startswith(p)), None)
    if prefix:
        return name[len(prefix) :], None
    if name.startswith(AUTOGRAD_NODE):
        node = name[len(AUTOGRAD_NODE) :]
        return backward_row(node), node
    if name.startswith("Optimizer.step"):
        return "optimizer", None
    return None


def _launch_rows(events: list[dict]) -> dict:
    """correlation id -> (row, node): the innermost label or autograd node around the call that launched it, one sweep
    per CPU thread (ranges nest on a thread: a stack of the open ones)."""
    per_thread = defaultdict(list)  # tid -> (ts, order, what): ranges sort before launches at the same ts
    for e in events:
        named = _range(e) if e.get("ph") == "X" else None
        if named:
            per_thread[e["tid"]].append((e["ts"], 0, (e["ts"] + e["dur"], named)))
        elif e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {}):
            per_thread[e["tid"]].append((e["ts"], 1, e["args"]["correlation"]))
    rows = {}
    for items in per_thread.values():
        open_ranges: list[tuple] = []
        for ts, order, what in sorted(items, key=lambda item: item[:2]):
            while open_ranges and open_ranges[-1][0] < ts:
                open_ranges.pop()
            if order == 0:
                open_ranges.append(what)
            else:
                rows[what] = open_ranges[-1][1] if open_ranges else UNLABELLED
    return rows


def trace_kernels(events: list[dict]) -> list[dict]:
    """Every GPU kernel and copy of a trace with its stream, interval, row and autograd node (what was around the call
    that launched it); device<->host copies are `offload copies`, NCCL kernels `communication`."""
    launched = _launch_rows(events)
    ks = []
    for e in events:
        if e.get("cat") not in DEVICE_CATEGORIES:
            continue
        name = e.get("name", "?")
        lower = name.lower()
        if "memcpy" in lower and ("dtoh" in lower or "htod" in lower):
            row, node = "offload copies", None
        elif "nccl" in lower:
            row, node = "communication", None  # ZeRO-3's parameter gathers and gradient reduce-scatters
        else:
            row, node = launched.get(e.get("args", {}).get("correlation"), UNLABELLED)
        stream = e.get("args", {}).get("stream", e.get("tid"))
        ks.append(
            {"row": row, "node": node, "name": name, "stream": stream, "start": e["ts"], "end": e["ts"] + e["dur"]}
        )
    return ks


def trace_breakdown(events: list[dict]) -> dict[str, float]:
    """Milliseconds of GPU time per row, each kernel and copy of the trace counted once."""
    rows: dict[str, float] = defaultdict(float)
    for k in trace_kernels(events):
        rows[k["row"]] += (k["end"] - k["start"]) / 1e3
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]))


def render(rows: dict[str, float], wall_ms: float, step: int) -> str:
    total = sum(rows.values())
    what = "GPU kernel time" if torch.cuda.is_available() else "CPU time of the ops (no GPU)"
    lines = [
        f"Step {step}: wall {wall_ms:.0f} ms; {total:.0f} ms of {what}; copies and communication overlap compute.",
        "",
        "| where | ms | share |",
        "|---|---|---|",
    ]
    lines += [f"| {k} | {v:.1f} | {v / total:.1%} |" for k, v in rows.items()] if total else []
    return "\n".join(lines) + "\n"


class ProfileCallback(TrainerCallback):
    """Profile one optimizer step (1-based) and write its breakdown to the output dir (rank 0)."""

    def __init__(self, step: int):
        self.step = step
        self.profiler = None
        self._start = None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 != self.step:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.__enter__()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.profiler is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - self._start) * 1e3
        self.profiler.__exit__(None, None, None)
        prof, self.profiler = self.profiler, None
        if not state.is_world_process_zero:
            return
        base = os.path.join(args.output_dir, f"profile_step{self.step}")
        os.makedirs(args.output_dir, exist_ok=True)
        prof.export_chrome_trace(base + ".trace.json.gz")  # torch gzips a .gz path
        rows = trace_breakdown(load_trace(base + ".trace.json.gz")) or breakdown(prof.events())
        with open(base + ".json", "w") as f:
            json.dump(
                {
                    "step": self.step,
                    "wall_ms": round(wall_ms, 1),
                    "kernel_ms": {k: round(v, 2) for k, v in rows.items()},
                },
                f,
                indent=1,
            )
        with open(base + ".md", "w") as f:
            f.write(render(rows, wall_ms, self.step))
