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

Sums of kernel times per row; the step's wall time is reported beside them (copies and compute overlap).
"""

from __future__ import annotations

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
    """The innermost label around a profiler event."""
    e = event
    while e is not None:
        name = e.name
        if name.startswith(PROFILE_LABEL):
            return name[len(PROFILE_LABEL) :]
        if name.startswith(AUTOGRAD_NODE):
            return backward_row(name[len(AUTOGRAD_NODE) :])
        if name.startswith("Optimizer.step"):  # torch optimizers' own range (DeepSpeed's step: its ops' rows)
            return "optimizer"
        e = e.cpu_parent
    return "other"


def breakdown(events) -> dict[str, float]:
    """Milliseconds of GPU kernel time per row (CPU time of the labelled ops when no kernel ran: CPU-only runs)."""
    rows: dict[str, float] = defaultdict(float)
    for e in events:
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CPU:
            continue
        kernels = getattr(e, "kernels", [])
        for k in kernels:
            name = k.name.lower()
            if "memcpy" in name and ("dtoh" in name or "htod" in name):
                row = "offload copies"
            elif "nccl" in name:
                row = "communication"  # ZeRO-3's parameter gathers and gradient reduce-scatters
            else:
                row = _row(e)
            rows[row] += k.duration / 1e3
        if not kernels and not torch.cuda.is_available() and not e.cpu_children:
            rows[_row(e)] += e.self_cpu_time_total / 1e3  # leaf ops' own CPU time
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
        rows = breakdown(prof.events())
        base = os.path.join(args.output_dir, f"profile_step{self.step}")
        os.makedirs(args.output_dir, exist_ok=True)
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
        prof.export_chrome_trace(base + ".trace.json.gz")  # torch gzips a .gz path
