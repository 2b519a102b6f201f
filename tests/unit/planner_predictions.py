"""The planner's numbers for every committed GPU row and for the shipped recipes on a few machines, recorded in
tests/unit/planner_predictions.json and held there by tests/unit/test_planner.py, so that a change of them is a
deliberate one. After such a change, record them again:

    python tests/unit/planner_predictions.py
"""

from __future__ import annotations

import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

from gpu_results import acceptance_rows, benchmark_rows, setup_from_argv, setup_from_result  # noqa: E402

from longdpo.checks import check_deepspeed_config  # noqa: E402
from longdpo.config import load_recipe  # noqa: E402
from longdpo.planner.plan import load_calibration, plan, predict  # noqa: E402

RECORDED = os.path.join(ROOT, "tests", "unit", "planner_predictions.json")
MACHINES = (  # (GPUs, GB per GPU, host GB per node, DeepSpeed config)
    (8, 80.0, 1000.0, "ds_configs/zero3.json"),
    (1, 80.0, 128.0, None),
    (8, 40.0, 200.0, "ds_configs/zero3.json"),
    (2, 24.0, 64.0, "ds_configs/zero3.json"),
)
VARIANT_MACHINES = (
    (8, 80.0, 1000.0, "ds_configs/zero3.json"),
    (8, 40.0, 300.0, "ds_configs/zero3.json"),
    (1, 60.0, 100.0, "ds_configs/zero3.json"),
    (4, 30.0, 2000.0, "ds_configs/zero3.json"),
    (1, 80.0, 64.0, None),
)
UNEQUAL_12K = {"pairs": 4, "seq_tokens": 12288, "prompt_tokens": 1024, "rejected_tokens": 10000}
VARIANTS = {  # overrides of the 12B recipes that reach every proposal the planner makes
    "nooffload": {"activation_offloading": False},
    "mask": {"memory": {"padding_mask": "keep"}, "data": {"synthetic": UNEQUAL_12K}},
    "alloc": {"memory": {"allocator_conf": "max_split_size_mb:64"}},
    "batch2": {"per_device_train_batch_size": 2, "data": {"global_batch_size": None}},
    "plain": {
        "activation_offloading": False,
        "use_liger_kernel": False,
        "memory": {"mlp_chunks": 0, "lean_lm_head": False},
        "data": {"shared_prompt": False},
    },
    "keep2": {"memory": {"offload_keep_layers": 2, "offload_pin_memory": False}},
}
# The 12B LoRA recipe, 40 layers, as each run read it (its result folder's commands)
LORA_12B = {
    "gpu_2026-12-04_lora12b/ours_64k": ("gpu_acceptance/recipes_1991352", []),
    "gpu_2026-12-04_lora12b/ours_128k": (
        "gpu_acceptance/recipes_1991352",
        ["--max_length", "131072", "--memory.offload_pin_memory", "false"]
        + ["--data.synthetic", "{pairs: 4, seq_tokens: 131072, prompt_tokens: 4096}"],
    ),
    "gpu_2026-12-06_lora12b_128k_long_prompt_h100/lora128k_long": (  # the prompt once (data.shared_prompt)
        "gpu_2026-12-06_lora12b_128k_long_prompt_h100",
        ["--max_length", "131072"]
        + ["--data.synthetic", '{"pairs": 4, "seq_tokens": 131072, "prompt_tokens": 117965, "rejected_tokens": 11796}'],
    ),
}


def lora_12b_setup(name: str):
    recipes, args = LORA_12B[name]
    recipe = os.path.join("results", recipes, "dpo_lora_64k.yaml")
    return setup_from_argv(["python", "launch/train_dpo.py", "--recipe", recipe, *args])


def predictions() -> dict:
    """The planner's numbers for every committed row and for the shipped recipes on a few machines."""
    cal = load_calibration()

    def numbers(p, proposals: bool = False) -> dict:
        out = {k: getattr(p, k) for k in ("peak_allocated_gb", "peak_reserved_gb", "activation_peak_gb")}
        out.update(optimizer_peak_gb=p.optimizer_peak_gb, host_per_node_gb=p.host_per_node_gb)
        if proposals:
            out.update(fits=p.fits, suggestions=[[peak, host] for _, peak, host in p.suggestions])
        return out

    def planned(path: str, overrides: dict, gpus: int, gpu: float, host: float, ds: str | None) -> dict:
        ds_config = check_deepspeed_config(os.path.join(ROOT, ds)) if ds else None
        return numbers(plan(load_recipe(path, overrides), gpus, gpu, 1, ds_config, host), proposals=True)

    out = {"rows": {}, "acceptance": {}, "lora_12b": {}, "recipes": {}}
    for env, row, src in benchmark_rows():
        key = f"{src} | {row['config']} | {row['seq_tokens']} | {row.get('workload', 'equal')}"
        out["rows"][key] = numbers(predict(setup_from_result(env, row), cal))
    for path in sorted(glob.glob(os.path.join(ROOT, "results", "gpu_acceptance", "*runs.json"))):
        for _env, row, src, s in acceptance_rows(path):
            out["acceptance"][f"{src} | {row['run']}"] = numbers(predict(s, cal))
    for name in LORA_12B:
        out["lora_12b"][name] = numbers(predict(lora_12b_setup(name), cal))
    for path in sorted(glob.glob("recipes/*/*.yaml", root_dir=ROOT)):
        for gpus, gpu, host, ds in MACHINES:
            out["recipes"][f"{path} | {gpus} | {gpu} | {host} | {ds}"] = planned(path, {}, gpus, gpu, host, ds)
    for path in (
        "recipes/nemotron12b/dpo_12k.yaml",
        "recipes/nemotron12b/dpo_64k.yaml",
        "recipes/nemotron12b/dpo_lora_64k.yaml",
    ):
        for name, overrides in VARIANTS.items():
            for gpus, gpu, host, ds in VARIANT_MACHINES:
                key = f"{path} | {name} | {gpus} | {gpu} | {host} | {ds}"
                out["recipes"][key] = planned(path, overrides, gpus, gpu, host, ds)
    return out


if __name__ == "__main__":
    with open(RECORDED, "w") as f:
        json.dump(predictions(), f, indent=0, sort_keys=True)
    print(f"wrote {os.path.relpath(RECORDED)}")
