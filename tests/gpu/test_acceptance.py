"""GPU acceptance suite: the real entrypoint on one GPU, every shipped recipe and lever, the checks a user relies on.

Run it with `bash tools/gpu_acceptance.sh` (installs the pinned packages from a local wheelhouse when they are
missing, writes results/gpu_acceptance/latest.log). Skipped without CUDA, so the CPU suite collects and skips it.

What runs (the 12B Mistral-NeMo architecture, random init, cut to 1-2 layers so that model states and the AdamW state
fit one GPU beside each other; each run a fresh process, several at once within the GPU's memory):
- every shipped recipes/nemotron12b/*.yaml on the deepspeed launcher (ZeRO-3), dpo_12k also through `accelerate
  launch --num_processes 1` and `python` (no DeepSpeed); a short length and the recipe's own long one (12,288 and
  65,536 tokens; dpo_128k_sp8 runs sequence-parallel over 8 ranks, so one GPU runs its per-rank length, 16,384
  tokens, with `parallelism.sp_size 1`);
- every lever alone on ZeRO-3 (checkpointing policies, lean norm, lean LM head, MLP chunks, TiledMLP, offloading
  pinned and pageable, the last of two layers kept on the GPU, allocator settings, cache emptying) and the shipped
  combinations.
Asserted per run: exit 0, step-1 loss ln 2, finite losses, telemetry written, allocator setting read back where set,
nothing parameter-shaped offloaded, planner within 10% of the measured peak reserved. Numerics, bf16: the step-1
gradient norm (all parameter gradients, under ZeRO-3 where launched so) of every lever equals stock's, and the
kernels (lean LM head vs TRL's, lean norm vs stock) match on the GPU with Triton.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from longdpo.cluster.distributed import run_job
from longdpo.data.synthetic import workload
from longdpo.levers import LeverSet, allocator, attention_plans

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TRAIN = os.path.join(ROOT, "launch", "train_dpo.py")
ZERO3 = os.path.join(ROOT, "ds_configs", "zero3.json")
ACCELERATE = os.path.join(ROOT, "launch", "accelerate", "zero3.yaml")
RECIPES = os.path.join(ROOT, "recipes", "nemotron12b")
SHORT = 4096
UNEQUAL = 4160  # 64 mod 128 (PyTorch issue 196678: cuDNN attention's backward with a mask at such lengths)
STEPS = 3
LAYER_INPUT_GB = 2 * SHORT * 5120 * 2 / 1e9  # one layer checkpoint's bf16 input at SHORT: 2 rows x 4,096 x 5,120
RUN_TIMEOUT_S = 420
# GPU memory the concurrent runs may take together (GB), each run weighted below: the card's memory less 5 GB for
# the processes' CUDA contexts (an H200: 145 of 150.7 GB; an H100 80GB: 80.5 of 85.5 GB, where the 1-layer runs go
# one at a time beside the small ones)
BUDGET_GB = float(
    os.environ.get("GPU_ACCEPTANCE_BUDGET_GB")
    or (torch.cuda.get_device_properties(0).total_memory / 1e9 - 5 if torch.cuda.is_available() else 0)
)
OUT = os.environ.get("GPU_ACCEPTANCE_OUT") or os.path.join("/tmp", "gpu_acceptance")


@dataclass
class Run:
    recipe: str
    launcher: str = "deepspeed"
    layers: int = 1
    seq: int = SHORT
    overrides: dict = field(default_factory=dict)
    weight_gb: float = 47.0  # expected peak reserved (GB), for scheduling only: 1 layer on ZeRO-3 measured 45-48
    compare: bool = True  # same model and data as `stock`: its step-1 gradient norm must match
    planned: bool = True  # the planner's prediction is held to 10%
    workload: str = "equal"  # the pairs' shape (longdpo/data/synthetic.py WORKLOADS)

    @property
    def offloads(self) -> bool:
        import yaml

        shipped = yaml.safe_load(open(os.path.join(RECIPES, self.recipe))).get("activation_offloading", False)
        return self.overrides.get("activation_offloading", str(shipped).lower()) == "true"

    def command(self, out_dir: str, port: int) -> list[str]:
        over = {
            "model.num_hidden_layers": str(self.layers),
            "max_length": str(self.seq),
            "data.synthetic": json.dumps(workload(self.workload, self.seq, STEPS + 1)),
            "data.train_files": "[]",
            "data.global_batch_size": "null",
            "max_steps": str(STEPS),
            "per_device_train_batch_size": "1",
            "gradient_accumulation_steps": "1",
            "save_strategy": "no",
            "report_to": "none",
            "logging_steps": "1",
            "output_dir": out_dir,
            **self.overrides,
        }
        args = [
            "--recipe",
            os.path.join(RECIPES, self.recipe),
            *[x for k, v in over.items() for x in (f"--{k}", v)],
            "--no_final_save",
        ]
        if self.launcher == "python":
            return [sys.executable, TRAIN, *args]
        if self.launcher == "accelerate":
            return [
                shutil.which("accelerate"),
                "launch",
                "--config_file",
                ACCELERATE,
                "--num_processes",
                "1",
                "--main_process_port",
                str(port),
                TRAIN,
                *args,
            ]
        return [shutil.which("deepspeed"), "--num_gpus", "1", "--master_port", str(port), TRAIN, ZERO3, *args]


BASE = LeverSet().overrides()  # the neutral settings every lever run starts from


def lever(*, workload: str = "equal", seq: int = SHORT, compare: bool = True, **overrides) -> Run:
    return Run("dpo_12k.yaml", overrides={**BASE, **overrides}, workload=workload, seq=seq, compare=compare)


RUNS = {
    # shipped recipes, as shipped but for layers and length, through each one-GPU launch form
    "dpo_12k/deepspeed/12k": Run("dpo_12k.yaml", layers=2, seq=12288, weight_gb=50, compare=False),
    "dpo_12k/deepspeed": Run("dpo_12k.yaml"),
    "dpo_12k/accelerate": Run("dpo_12k.yaml", launcher="accelerate"),
    "dpo_12k/python": Run("dpo_12k.yaml", launcher="python", weight_gb=22),
    "dpo_64k/deepspeed/64k": Run("dpo_64k.yaml", layers=2, seq=65536, weight_gb=77, compare=False),
    "dpo_64k/deepspeed": Run("dpo_64k.yaml"),
    "dpo_128k_sp8/deepspeed/16k_per_rank": Run(
        "dpo_128k_sp8.yaml", seq=16384, overrides={"parallelism.sp_size": "1"}, weight_gb=50, compare=False
    ),
    # every lever alone, ZeRO-3, against stock TRL (transformers' layer checkpointing, nothing of ours)
    "stock": lever(),
    "attn_mlp": lever(**{"memory.checkpointing": "attn_mlp"}),
    "norm_attn_mlp": lever(**{"memory.checkpointing": "norm_attn_mlp"}),
    "layer+norm_attn_mlp": lever(**{"memory.checkpointing": "layer+norm_attn_mlp"}),
    "lean_norm": lever(**{"memory.lean_norm": "true"}),
    "lean_lm_head": lever(**{"memory.lean_lm_head": "true"}),
    "mlp_chunks": lever(**{"memory.mlp_chunks": "4"}),
    "tiled_mlp": lever(**{"memory.tiled_mlp": "4"}),
    "offload": lever(activation_offloading="true"),
    "offload_pageable": lever(activation_offloading="true", **{"memory.offload_pin_memory": "false"}),
    # pinned by torch's cudaHostAlloc instead of registered by threads (the default): the same copies either way
    "offload/torch_pinning": lever(activation_offloading="true", **{"memory.host_pinning_threads": "0"}),
    # the last of two layers' activations kept on the GPU, against both offloaded (pageable host memory: the
    # host-peak check reads its copies being freed in the backward)
    "offload/2_layers": Run(
        "dpo_12k.yaml",
        layers=2,
        overrides={**BASE, "activation_offloading": "true", "memory.offload_pin_memory": "false"},
        compare=False,
    ),
    "offload/2_layers/keep_1": Run(
        "dpo_12k.yaml",
        layers=2,
        overrides={
            **BASE,
            "activation_offloading": "true",
            "memory.offload_pin_memory": "false",
            "memory.offload_keep_layers": "1",
        },
        weight_gb=50,
        compare=False,
    ),
    "alloc_max_split_64": lever(**{"memory.allocator_conf": "max_split_size_mb:64"}),
    "alloc_expandable": lever(**{"memory.allocator_conf": "expandable_segments:True"}),
    "empty_cache": lever(**{"memory.empty_cache_steps": "1", "memory.empty_cache_microbatches": "1"}),
    # Liger's kernels (use_liger_kernel): as the library gives them, with TRL's offloading, and under our levers
    "liger": lever(use_liger_kernel="true"),
    "stock+offload+liger": lever(activation_offloading="true", use_liger_kernel="true"),
    "layer+lean+liger+chunked3+head+offload": lever(
        activation_offloading="true",
        use_liger_kernel="true",
        **{"memory.lean_norm": "true", "memory.lean_lm_head": "true", "memory.mlp_chunks": "3"},
    ),
    # LoRA (model.use_peft): the one-GPU recipe as shipped, without DeepSpeed, short and at its 64k; and under ZeRO-3
    # with every lever (TRL forces reentrant layer checkpointing for PEFT + ZeRO-3; our checkpoints nest in it)
    "dpo_lora_64k/python": Run("dpo_lora_64k.yaml", launcher="python", weight_gb=15, compare=False),
    "dpo_lora_64k/python/64k": Run(
        "dpo_lora_64k.yaml", launcher="python", layers=2, seq=65536, weight_gb=40, compare=False
    ),
    "lora+layer+norm_attn+lean+chunked4+head+offload": Run(
        "dpo_12k.yaml",
        compare=False,
        overrides={
            **BASE,
            "activation_offloading": "true",
            "model.use_peft": "true",
            "model.lora_target_modules": "all-linear",
            "memory.checkpointing": "layer+norm_attn",
            "memory.lean_norm": "true",
            "memory.lean_lm_head": "true",
            "memory.mlp_chunks": "4",
        },
    ),
    # Pairs whose chosen and rejected differ in length (the batch padded to 4,160 tokens, 64 mod 128), with TRL's
    # padding mask and without it (ours), on stock and on the shipped recipes; prompts of 90% of the sequence
    "unequal/keep_mask": lever(**{"memory.padding_mask": "keep"}, workload="unequal", seq=UNEQUAL, compare=False),
    "unequal": lever(workload="unequal", seq=UNEQUAL, compare=False),
    "unequal/dpo_64k": Run("dpo_64k.yaml", workload="unequal", seq=UNEQUAL, compare=False),
    "long-prompt/dpo_12k": Run(
        "dpo_12k.yaml", workload="long-prompt", seq=UNEQUAL, overrides={"data.shared_prompt": "false"}, compare=False
    ),
    # each pair's prompt computed once (data.shared_prompt, which dpo_12k ships on), on stock and on the shipped
    # levers: rows [P, C] of 4,160 tokens (64 mod 128) and a rejected part of 375 against the prompt (the lower-right
    # causal call); the equal and unequal runs of the shipped recipes save too little and run as TRL's rows
    "long-prompt/stock": lever(workload="long-prompt", seq=UNEQUAL, compare=False),
    "long-prompt/shared": lever(**{"data.shared_prompt": "true"}, workload="long-prompt", seq=UNEQUAL, compare=False),
    "long-prompt/dpo_12k/shared": Run(
        "dpo_12k.yaml", workload="long-prompt", seq=UNEQUAL, overrides={"data.shared_prompt": "true"}, compare=False
    ),
    # a mix of pair shapes (a new length at every step), as shipped and with cuDNN's attention plans kept per length
    # class (memory.reuse_attention_plans: the ragged path of torch's cuDNN attention)
    "mixed/dpo_12k": Run("dpo_12k.yaml", workload="mixed", seq=UNEQUAL, compare=False),
    "mixed/dpo_12k/plans": Run(
        "dpo_12k.yaml",
        workload="mixed",
        seq=UNEQUAL,
        overrides={"memory.reuse_attention_plans": "true"},
        compare=False,
    ),
    "unequal/dpo_lora_64k/python": Run(
        "dpo_lora_64k.yaml",
        launcher="python",
        workload="unequal",
        seq=UNEQUAL,
        weight_gb=15,
        compare=False,
    ),
    # the shipped combination of the 12k headline (dpo_12k's and dpo_64k's run above, as recipes)
    "layer+lean+chunked3+head+offload": lever(
        activation_offloading="true",
        **{"memory.lean_norm": "true", "memory.lean_lm_head": "true", "memory.mlp_chunks": "3"},
    ),
}


# GPU_ACCEPTANCE_ONLY=dpo_12k,liger: only the runs whose names contain one of these (stock always: the reference).
# A subset is not the suite: its log says so and is kept apart from latest.log.
if os.environ.get("GPU_ACCEPTANCE_ONLY"):
    _only = os.environ["GPU_ACCEPTANCE_ONLY"].split(",")
    RUNS = {k: v for k, v in RUNS.items() if k == "stock" or any(part in k for part in _only)}


def relative(cmd: list[str]) -> list[str]:
    """The command as it reads from the repo root, launcher by name (what results/gpu_acceptance/runs.json keeps)."""
    launcher = "python" if cmd[0] == sys.executable else os.path.basename(cmd[0])
    return [launcher, *(os.path.relpath(a, ROOT) if a.startswith(ROOT + os.sep) else a for a in cmd[1:])]


def write_runs(results: dict, path: str) -> None:
    """What the planner calibrates from and the acceptance log summarises: per run, its command, exit status,
    per-step telemetry and train summary (without the log tail)."""
    environment = {
        "gpu": torch.cuda.get_device_name(0),
        "commit": os.environ.get("GIT_COMMIT"),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "suite": "tests/gpu/test_acceptance.py",
    }
    keep = ("argv", "rc", "wall_s", "records", "summary")
    runs = {name: {k: results[name][k] for k in keep} for name in RUNS if name in results}
    with open(path, "w") as f:
        json.dump({"environment": environment, "runs": runs}, f, indent=1)
    # the shipped recipes as these runs read them, for the planner's calibration (launch/plan_memory.py)
    kept = os.path.join(os.path.dirname(path), f"recipes_{environment['commit']}")
    shutil.copytree(RECIPES, kept, dirs_exist_ok=True)


# run -> the run whose curve it must keep: levers that only recompute, move or re-place tensors, on stock's arithmetic
# or on Liger's; a launch form on the shipped recipe's
EXACT = {
    **{
        name: "stock"
        for name in (
            "attn_mlp",
            "norm_attn_mlp",
            "layer+norm_attn_mlp",
            "offload",
            "offload_pageable",
            "offload/torch_pinning",
            "alloc_max_split_64",
            "alloc_expandable",
            "empty_cache",
        )
    },
    "stock+offload+liger": "liger",
    "dpo_12k/accelerate": "dpo_12k/deepspeed",
}
# run -> the run on the same pairs whose step-1 gradient norm it must give: the mask dropped (right padding under
# causal attention) against TRL's mask; another attention kernel, so bf16 rounding: held to the norm only
# (and each pair's prompt computed once against twice: other attention calls and matmul shapes, so bf16 rounding)
# (and a layer's saved tensors kept on the GPU against copied out and back: the same values, but on 2 layers the step-1
# norm moves in the 7th digit from run to run: cuDNN's attention backward sums dQ in an order set by thread-block
# timing, which offloading's side-stream copies change; AdamW's first step then moved the step-2 loss by 0.02)
SAME_GRADIENTS = {
    "offload/2_layers/keep_1": "offload/2_layers",
    "unequal": "unequal/keep_mask",
    "long-prompt/shared": "long-prompt/stock",
    "long-prompt/dpo_12k/shared": "long-prompt/dpo_12k",
    "mixed/dpo_12k/plans": "mixed/dpo_12k",
}


def part(runs: dict, k: int, n: int) -> dict:
    """The k-th of n parts of `runs` (1-based), for a card that runs the 12B runs one at a time: a run and the runs
    it is compared with stay in one part, groups dealt largest first to the part with fewest runs; stock in every
    part (the reference)."""
    group = {name: {name} for name in runs if name != "stock"}
    for a, b in [*EXACT.items(), *SAME_GRADIENTS.items()]:
        if a in group and b in group:
            merged = group[a] | group[b]
            for name in merged:
                group[name] = merged
    parts = [[] for _ in range(n)]
    for g in sorted({frozenset(g) for g in group.values()}, key=lambda g: (-len(g), min(g))):
        min(parts, key=len).extend(g)
    return {name: run for name, run in runs.items() if name == "stock" or name in parts[k - 1]}


# GPU_ACCEPTANCE_PART=2/3: the second of three parts (an 80 GB H100: 13 runs with stock, 8-9 minutes, each).
if os.environ.get("GPU_ACCEPTANCE_PART"):
    try:
        _k, _n = map(int, os.environ["GPU_ACCEPTANCE_PART"].split("/"))
        assert 1 <= _k <= _n
    except (ValueError, AssertionError):
        pytest.exit(f"GPU_ACCEPTANCE_PART={os.environ['GPU_ACCEPTANCE_PART']}: give k/n, e.g. 2/3", returncode=4)
    RUNS = part(RUNS, _k, _n)


def _records(out_dir: str) -> list[dict]:
    path = os.path.join(out_dir, "memory.jsonl")
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def _launch(name: str, run: Run, port: int) -> dict:
    out_dir = os.path.join(OUT, "runs", name.replace("/", "_").replace("+", "-"))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    cmd = run.command(out_dir, port)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    t0 = time.time()
    proc = run_job(cmd, RUN_TIMEOUT_S, cwd=ROOT, env=env, stderr=subprocess.STDOUT)
    result = {
        "name": name,
        "rc": proc.returncode,
        "wall_s": round(time.time() - t0, 1),
        "out_dir": out_dir,
        "argv": relative(cmd),
        "command": " ".join(cmd),
        "log_tail": proc.stdout[-5000:],
        "records": _records(out_dir),
    }
    summary = os.path.join(out_dir, "train_summary.json")
    result["summary"] = json.load(open(summary)) if os.path.exists(summary) else None
    return result


@pytest.fixture(scope="session")
def runs() -> dict:
    """Every run of RUNS, launched concurrently while their weights fit BUDGET_GB, heaviest first."""
    torch.cuda.empty_cache()
    os.makedirs(OUT, exist_ok=True)
    results, lock = {}, threading.Condition()
    in_use = [0.0]
    queue = sorted(RUNS.items(), key=lambda kv: -kv[1].weight_gb)

    def worker(name, run, port):
        try:
            results[name] = _launch(name, run, port)
        finally:
            with lock:
                in_use[0] -= run.weight_gb
                # after every run, so a suite cut short by a time limit keeps (and logs) what finished
                write_runs(results, os.path.join(OUT, "runs.json"))
                print(f"run done: {name} rc={results.get(name, {}).get('rc')} ({len(results)}/{len(RUNS)})", flush=True)
                lock.notify_all()

    threads = []
    for i, (name, run) in enumerate(queue):
        with lock:
            lock.wait_for(lambda need=run.weight_gb: in_use[0] == 0 or in_use[0] + need <= BUDGET_GB)
            in_use[0] += run.weight_gb
        t = threading.Thread(target=worker, args=(name, run, 29700 + i))
        t.start()
        threads.append(t)
        time.sleep(2)  # stagger the starts: each one imports and initialises for a while on the CPU
    for t in threads:
        t.join()
    write_runs(results, os.path.join(OUT, "runs.json"))
    print("\n" + report(results))
    return results


def report(results: dict) -> str:
    def f(v, spec=".2f"):
        return format(v, spec) if isinstance(v, (int, float)) else "-"

    lines = [
        "| run | launcher | layers | tokens | rc | step-1 loss | step-1 grad norm | peak reserved (GB) | "
        "planner (GB) | planner error | activation / optimizer-step peak allocated (GB) | offloaded per step "
        "(GB) | host peak (GB) | wall (s) |",
        "|" + "---|" * 14,
    ]
    for name, run in RUNS.items():
        r = results.get(name, {})
        s, rec = r.get("summary") or {}, r.get("records") or []
        logs = s.get("train_logs") or [{}]
        measured, predicted = s.get("measured_reserved_gb"), s.get("planner_predicted_reserved_gb")
        error = (predicted - measured) / measured if measured and predicted else None
        act = max((x.get("activation_peak_allocated_gb") or 0 for x in rec), default=None)
        opt = max((x.get("optimizer_peak_allocated_gb") or 0 for x in rec), default=None)
        off = rec[-1].get("offloaded_gb") if rec else None
        host = max((x.get("host_peak_gb") or 0 for x in rec), default=None)
        lines.append(
            f"| {name} | {run.launcher} | {run.layers} | {run.seq} {run.workload} | {r.get('rc')} | "
            f"{f(logs[0].get('loss'), '.4f')} | "
            f"{f(logs[0].get('grad_norm'), '.4f')} | {f(measured)} | {f(predicted)} | {f(error, '+.1%')} | "
            f"{f(act)} / {f(opt)} | {f(off)} | {f(host)} | {f(r.get('wall_s'), '.0f')} |"
        )
    return "\n".join(lines)


# ---- kernels on the GPU, bf16, Triton (before the runs, which need the memory) ------------------------------------


def test_lean_lm_head_matches_trls_head_on_gpu():
    from trl.kernels import chunked_logprob as trl_kernel
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as chunk

    from longdpo.levers.lean_lm_head import LeanLMHeadLogProb

    assert trl_kernel._use_triton(torch.device("cuda"))
    torch.manual_seed(0)
    hidden = torch.randn(4096, 5120, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(131072, 5120, device="cuda", dtype=torch.bfloat16) * 0.02
    targets = torch.randint(0, 131072, (4096,), device="cuda")
    got = {}
    for fn in (trl_kernel.ChunkedLogProbFunction, LeanLMHeadLogProb):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logprobs, *_ = fn.apply(h, w, None, targets, 1.0, chunk, None, 1.0, ())
        (logprobs * torch.linspace(-1, 1, len(logprobs), device="cuda")).sum().backward()
        got[fn] = (logprobs.detach(), h.grad, w.grad)
        del h, w
    (lp0, gh0, gw0), (lp1, gh1, gw1) = got.values()
    assert torch.equal(lp0, lp1)  # the forward is TRL's
    torch.testing.assert_close(gh1, gh0, atol=1e-2, rtol=1e-2)  # hidden-state gradient
    torch.testing.assert_close(gw1.float(), gw0.float(), atol=1e-2, rtol=1e-2)  # weight gradient
    del got
    torch.cuda.empty_cache()


def test_lean_norm_matches_stock_on_gpu():
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm

    from longdpo.levers.lean_norm import make_lean

    torch.manual_seed(0)
    stock = MistralRMSNorm(5120, eps=1e-5).to("cuda", torch.bfloat16)
    with torch.no_grad():
        stock.weight.uniform_(0.5, 1.5)
    lean = MistralRMSNorm(5120, eps=1e-5).to("cuda", torch.bfloat16)
    lean.load_state_dict(stock.state_dict())
    make_lean(lean)
    x = (torch.randn(2, 8192, 5120, device="cuda") * 3).to(torch.bfloat16)
    dy = torch.randn_like(x)
    outs = []
    for norm in (stock, lean):
        xi = x.clone().requires_grad_()
        y = norm(xi)
        y.backward(dy)
        outs.append((y.detach(), xi.grad, norm.weight.grad.clone()))
    for got, want in zip(outs[1], outs[0]):
        torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=2e-2)


PLANS_CHILD = """
import json, torch
from longdpo.levers.shared_prompt import PromptAndTail, lower_right_call
torch.manual_seed(0)
H, KV, D, scale, worst = 32, 8, 128, 128 ** -0.5, {}
# lengths of one power-of-two class each, in a row: the plans built for the first serve the others
def bshd(n, heads):
    return torch.randn(1, n, heads, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
for prompt, tail in ((1500, 300), (1800, 400), (2000, 500), (1600, 260)):
    q, k, v = bshd(tail, H), bshd(prompt + tail, KV), bshd(prompt + tail, KV)
    grad = torch.randn(1, tail, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    got = {}
    for name in ("two blocks", "one call"):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        kp, vp = leaves[1][:, :, :prompt], leaves[2][:, :, :prompt]
        kt, vt = leaves[1][:, :, prompt:], leaves[2][:, :, prompt:]
        if name == "two blocks":
            out = PromptAndTail.apply(leaves[0], kt, vt, kp, vp, scale)
        else:  # with a mask tensor: a plan per length, the reference
            out = lower_right_call(leaves[0], kt, vt, kp, vp, H // KV, scale)
        out.backward(grad)
        got[name] = [out.detach().float()] + [t.grad.float() for t in leaves]
    for field, a, b in zip(("out", "dq", "dk", "dv"), got["two blocks"], got["one call"]):
        err = ((a - b).abs().max() / b.abs().max()).item()
        worst[field] = max(worst.get(field, 0.0), err)
print(json.dumps(worst))
"""


def test_shared_prompt_attention_with_plans_per_length_class():
    """The rejected part's two cuDNN blocks under torch's plans per length class (memory.reuse_attention_plans): four
    pairs whose prompts and tails fall in the same power-of-two classes, in a row in one process (the first builds
    the plans, the others reuse them), against the one lower-right call with a mask (a plan per length): output and
    gradients within bf16 rounding (2% of the largest value; a log-sum-exp read at another length's stride is off by
    far more)."""
    env = {**os.environ, attention_plans.ENV_VAR: "1"}
    r = subprocess.run([sys.executable, "-c", PLANS_CHILD], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    worst = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"plans per length class, two blocks against one call, largest relative error: {worst}")
    assert all(err < 2e-2 for err in worst.values()), worst


def test_our_levers_wrap_ligers_kernels_on_gpu():
    """Liger applied before our levers (longdpo/levers/liger.py): MLP chunks split Liger's SwiGLU, the lean norm
    replaces Liger's RMSNorm, and the loss and every gradient equal the Liger-only model's (bf16)."""
    from longdpo.config import ModelArgs
    from longdpo.levers import LeverSet, patch_policy
    from longdpo.levers.lean_norm import LeanRMSNormFunction
    from longdpo.model.build import build_model

    settings = ((False, 0), (False, 4), (True, 4))  # (lean norm, MLP chunks); models built before Liger patches
    models = [
        build_model(
            ModelArgs(
                architecture="recipes/architectures/tiny_mistral.json", tokenizer="byte", dtype="bfloat16", init_seed=1
            )
        )
        .to("cuda")
        .train()
        for _ in settings
    ]
    ids = torch.randint(0, 200, (2, 256), device="cuda")
    results = []
    for model, (lean_norm, chunks) in zip(models, settings):
        levers = LeverSet(use_liger_kernel=True, checkpointing="layer+attn_mlp", mlp_chunks=chunks, lean_norm=lean_norm)
        patch_policy(model, levers)
        layer = model.model.layers[0]
        assert layer.mlp._get_name() == "LigerSwiGLUMLP"
        hidden = layer.input_layernorm(
            torch.randn(1, 8, model.config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        )
        is_lean = hidden.grad_fn.name() == LeanRMSNormFunction.__name__ + "Backward"
        assert is_lean == lean_norm, hidden.grad_fn.name()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if chunks:
            assert layer.mlp.forward_calls > 0  # our chunk wrapper ran Liger's SwiGLU
        results.append((loss.detach(), [p.grad.float() for p in model.parameters()]))
    (loss0, grads0), *others = results
    for loss, grads in others:
        torch.testing.assert_close(loss, loss0, atol=1e-2, rtol=1e-2)
        for g, g0 in zip(grads, grads0):
            assert (g - g0).norm() <= 2e-2 * g0.norm() + 1e-6  # bf16: every parameter's gradient within 2%


@pytest.mark.parametrize("name", [n for n, r in RUNS.items() if r.overrides.get("use_liger_kernel") == "true"])
def test_liger_runs_apply_ligers_kernels_under_our_levers(runs, name):
    assert runs[name]["summary"]["wrapped"]["liger"] == 1


# ---- the runs ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(RUNS))
def test_run_exits_0_starts_at_ln2_and_writes_telemetry(runs, name):
    r = runs[name]
    assert r["rc"] == 0, f"{r['command']}\nexited {r['rc']}:\n{r['log_tail']}"
    losses = r["summary"]["losses"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
    assert abs(losses[0] - math.log(2)) < 1e-3, losses
    assert [x["step"] for x in r["records"]] == list(range(1, STEPS + 1))
    assert all(x["cuda"] and x["peak_reserved_gb"] > 0 for x in r["records"])
    # how close each step came to the card (or the recipe's cap); telemetry rounds to 1e-4 GB, twice here
    assert all(0 < x["headroom_gb"] < x["gpu_limit_gb"] for x in r["records"])
    assert all(abs(x["gpu_limit_gb"] - x["peak_reserved_gb"] - x["headroom_gb"]) <= 2e-4 for x in r["records"])
    for written in ("memory_summary.md", "memory.png"):
        assert os.path.exists(os.path.join(r["out_dir"], written)), written


@pytest.mark.parametrize("name", [n for n, r in RUNS.items() if r.planned])
def test_planner_within_10_percent_of_measured_peak_reserved(runs, name):
    s = runs[name]["summary"]
    assert s, runs[name]["log_tail"]
    measured, predicted = s["measured_reserved_gb"], s["planner_predicted_reserved_gb"]
    assert predicted is not None
    assert abs(predicted - measured) <= 0.10 * measured, (predicted, measured, s["planner_breakdown_gb"])


@pytest.mark.parametrize(
    "name",
    [
        n
        for n, r in RUNS.items()
        if "memory.allocator_conf" in r.overrides and r.overrides["memory.allocator_conf"] != "null"
    ],
)
def test_allocator_setting_is_read_back_from_the_allocator(runs, name):
    allocator = runs[name]["summary"]["allocator"]
    assert allocator["path"] == "environment" and allocator["verified"] is True, allocator


@pytest.mark.parametrize("name", list(RUNS))
def test_host_memory_is_pinned_as_the_run_asked(runs, name):
    """Registered by `memory.host_pinning_threads` threads (8 unless the run says), or torch's own way for 0; the
    setting reaches torch through every launch form."""
    threads = int(RUNS[name].overrides.get("memory.host_pinning_threads", allocator.PINNING_THREADS))
    record = runs[name]["summary"]["allocator"]
    assert record["host_pinning"] == (allocator.host_pinning(threads) if threads else None), record


@pytest.mark.parametrize("name", [n for n, r in RUNS.items() if r.offloads])
def test_offloading_copies_activations_and_no_parameter(runs, name):
    records = runs[name]["records"]
    assert records and all(x.get("offloaded_gb", 0) > 0 for x in records), records
    assert all(x["offloaded_param_shaped"] == 0 for x in records), records


def _needs(*names):
    return pytest.mark.skipif(not all(n in RUNS for n in names), reason=f"a subset without {', '.join(names)}")


@_needs("offload/2_layers", "offload/2_layers/keep_1")
def test_kept_layers_are_not_offloaded(runs):
    """memory.offload_keep_layers: 1 of 2 layers: at least the kept layer's checkpointed input (tokens x hidden x 2
    bytes: 2 x 4,096 x 5,120 x 2 = 0.0839 GB) no longer goes to the host, and the first layer's and the tensors
    around the layers still do (at 4k tokens on 2 layers the LM head's and the loss's saved tensors are most of what
    is offloaded: 0.48 GB a step in all)."""
    full = [x["offloaded_gb"] for x in runs["offload/2_layers"]["records"]]
    kept = [x["offloaded_gb"] for x in runs["offload/2_layers/keep_1"]["records"]]
    print(f"offloaded per step, 2 layers: {full} GB; the last layer kept on the GPU: {kept} GB")
    assert full and len(kept) == len(full)
    # telemetry rounds to 1e-4 GB: allow that twice
    assert all(k >= LAYER_INPUT_GB - 2e-4 and f - k >= LAYER_INPUT_GB - 2e-4 for k, f in zip(kept, full)), (full, kept)


@_needs("offload/2_layers")
def test_the_host_peak_sees_pageable_offloading(runs):
    """Pageable offloading frees its host copies in the backward, before the step ends, so RSS read then misses
    them; `host_peak_gb` must not. Each of the 2 layer inputs (2 x 4,096 x 5,120 x 2 bytes = 0.0839 GB) is above
    glibc's largest mmap threshold (32 MiB), so its copy leaves the process when freed: from step 2 on (step 1 also
    builds the optimizer) the step's peak is above its end's RSS by at least those 0.168 GB, less 0.05 GB for what
    else the step may keep."""
    records = runs["offload/2_layers"]["records"][1:]
    print("host peak / RSS at the step's end (GB):", [(x["host_peak_gb"], x["host_rss_gb"]) for x in records])
    assert records and all(x["host_peak_gb"] - x["host_rss_gb"] >= 2 * LAYER_INPUT_GB - 0.05 for x in records), records


@pytest.mark.parametrize("name", [n for n, r in RUNS.items() if r.compare and n != "stock"])
def test_every_lever_gives_stocks_gradients(runs, name):
    """Same model, data and seed as `stock`: the step-1 gradient norm over all parameters (before any update) must
    not move, whatever the lever, launcher or ZeRO stage (bf16: 1%)."""
    got, want = runs[name]["summary"]["train_logs"], runs["stock"]["summary"]["train_logs"]
    assert got[0]["grad_norm"] == pytest.approx(want[0]["grad_norm"], rel=1e-2)


@pytest.mark.parametrize("name", [n for n, ref in EXACT.items() if n in RUNS and ref in RUNS])
def test_levers_that_keep_the_arithmetic_keep_the_curve(runs, name):
    """Checkpointing, offloading, allocator settings and cache emptying recompute, move or re-place the same
    tensors: the step-2 loss (after one AdamW step) equals its reference's (stock's, or Liger's on top of Liger).
    Levers that change the arithmetic (lean norm, lean head, Liger's kernels, no ZeRO; so the shipped dpo_12k) are
    held to the gradient norm only: AdamW's first update is lr x sign(gradient) for every element, so bf16 rounding
    in near-zero gradients moves the step-2 loss (measured on this suite: lean norm +0.018, Liger's kernels -0.063
    from stock's 0.754). So are TiledMLP and MLP chunks: each projection multiplies a part of the tokens, for which
    cuBLAS picks other tiles, so the bf16 rounding differs (step-1 gradient norm 1312.2715 with chunks, stock's
    1312.2694; step-2 loss 0.7504 against 0.7539). In float32 the chunks give the unpatched gradients to 1e-6 (the
    CPU suite)."""
    got, want = runs[name]["summary"]["train_logs"], runs[EXACT[name]]["summary"]["train_logs"]
    assert got[1]["loss"] == pytest.approx(want[1]["loss"], abs=2e-3)


@pytest.mark.parametrize("name", [n for n, ref in SAME_GRADIENTS.items() if n in RUNS and ref in RUNS])
def test_the_same_pairs_give_the_same_gradients(runs, name):
    """The same pairs with TRL's padding mask and without it (ours), with each prompt computed twice and once, and
    with a layer kept on the GPU: the step-1 gradient norm matches (bf16, 1%: other attention calls round
    differently) and every gradient norm is finite (no NaN from a masked or lower-right causal kernel)."""
    got, want = runs[name]["summary"]["train_logs"], runs[SAME_GRADIENTS[name]]["summary"]["train_logs"]
    assert all(math.isfinite(x["grad_norm"]) for x in got + want)
    assert got[0]["grad_norm"] == pytest.approx(want[0]["grad_norm"], rel=1e-2)
    assert runs[name]["rc"] == 0


def test_attention_kernel_on_unequal_pairs_with_and_without_the_mask():
    """Which attention kernel runs for a right-padded DPO batch of the 12B's attention shape (32 query / 8 key-value
    heads of 128, bf16, rows of 4,160 and 3,808 real tokens, padded to 4,160: 64 mod 128), through transformers' SDPA
    path with TRL's mask and with ours (none): recorded in the log; the gradients are finite either way."""
    from torch.profiler import ProfilerActivity, profile

    from longdpo.config import ModelArgs
    from longdpo.levers import padding_mask
    from longdpo.model.build import build_model

    torch.manual_seed(0)
    lengths = (UNEQUAL, UNEQUAL - 352)
    ids = torch.randint(3, 250, (2, UNEQUAL), device="cuda")
    mask = torch.zeros(2, UNEQUAL, dtype=torch.long, device="cuda")
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    kernels = {}
    for name, drop in (("TRL's mask", False), ("no mask (ours)", True)):
        model = build_model(
            ModelArgs(
                architecture="recipes/architectures/mistral_nemo_12b.json",
                tokenizer="byte",
                num_hidden_layers=1,
                dtype="bfloat16",
            )
        ).to("cuda")
        if drop:
            padding_mask.install(model)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
            (hidden.float() * mask[..., None]).square().mean().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads), name
        kernels[name] = sorted(
            {
                e.key
                for e in prof.key_averages()
                if any(w in e.key.lower() for w in ("attention", "fmha", "flash", "cudnn", "sdpa"))
            }
        )
        del model, grads, hidden
        torch.cuda.empty_cache()
    for name, names in kernels.items():
        print(f"attention kernels, {name}: {names or ['(none matched)']}")
    assert kernels["no mask (ours)"] != kernels["TRL's mask"]  # the mask changed which kernel runs
