"""Will it fit? Per-rank memory plan of a recipe before launch, and the planner's calibration.

    python launch/plan_memory.py --recipe recipes/nemotron12b/dpo_12k.yaml --gpus 8 --gpu-memory 80GB
    python launch/plan_memory.py --recipe recipes/nemotron12b/dpo_12k.yaml --gpus 8 --gpu-memory 80GB \
        --deepspeed ds_configs/zero3.json --max_length 65536          # any recipe override works here too
    python launch/plan_memory.py --calibrate                          # refit longdpo/planner/calibration.json

Exit status: 0 fits (or no --gpu-memory / --host-memory given), 1 does not fit, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from longdpo.checks import check_max_length
from longdpo.config import RecipeError, load_recipe, parse_overrides
from longdpo.data import check_data_args
from longdpo.model.build import check_model_args
from longdpo.patches import quiet_deprecation_warnings
from longdpo.planner.levers import positive_int
from longdpo.planner.plan import CALIBRATION, plan, render

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gb(value: str, flag: str) -> float:
    try:
        gb = float(value.upper().removesuffix("GB"))
    except ValueError:
        gb = 0.0
    if not gb > 0:  # 0, a negative size or nan: a typo
        raise RecipeError(f"{flag} {value!r} is not a size; write it in GB, e.g. 80GB.")
    return gb


def measured_on_data(recipe) -> tuple[int | None, int | None]:
    """Where the plan depends on the pairs (files or a Hub dataset with `max_length: null`, or `data.shared_prompt`),
    (seq, pair_tokens) measured here as the entrypoint measures them (TRL's tokenization, one pass over the data)."""
    from longdpo.data import load_train_data, measured_for_plan, plan_on_data

    if not plan_on_data(recipe):
        return None, None
    from longdpo.model.build import load_tokenizer

    seq, pair_tokens = measured_for_plan(recipe, load_tokenizer(recipe.model), load_train_data(recipe.data))
    if seq:
        print(f"max_length: null: the data's longest pair is {seq} tokens; planning for it")
    if pair_tokens:
        print(f"data.shared_prompt: the costliest pair puts {pair_tokens} tokens through the model; planning for it")
    return seq, pair_tokens


def main(argv=None) -> int:
    quiet_deprecation_warnings()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe")
    p.add_argument("--gpus", type=positive_int, default=8, help="GPUs per node")
    p.add_argument("--nodes", type=positive_int, default=1)
    p.add_argument("--gpu-memory", default=None, help="per GPU, e.g. 80GB")
    p.add_argument(
        "--host-memory", default=None, help="host RAM per node, e.g. 1000GB (checks activation and ZeRO CPU offload)"
    )
    p.add_argument(
        "--deepspeed",
        default=None,
        help="DeepSpeed JSON ('none': no DeepSpeed); default: the recipe's "
        "`deepspeed`, else ds_configs/zero3.json on several GPUs and none "
        "on one",
    )
    p.add_argument("--calibrate", action="store_true", help="refit longdpo/planner/calibration.json from results/")
    args, rest = p.parse_known_args(argv)
    if args.calibrate:
        from longdpo.planner.calibration import calibrate

        cal = calibrate()
        with open(CALIBRATION, "w") as f:
            json.dump(cal, f, indent=1)
        print(json.dumps(cal, indent=1))
        return 0
    if not args.recipe:
        p.error("--recipe is required (or --calibrate)")
    try:
        recipe = load_recipe(args.recipe, parse_overrides(rest))
        check_max_length(recipe.trainer)
        check_data_args(recipe.data)
        check_model_args(recipe.model)
        ds = None
        if args.deepspeed is None:
            args.deepspeed = recipe.trainer.get("deepspeed") or (
                "ds_configs/zero3.json" if args.gpus * args.nodes > 1 else "none"
            )
        if args.deepspeed != "none" and not recipe.memory.sgd_in_backward:
            from longdpo.checks import check_deepspeed_config

            ds = check_deepspeed_config(args.deepspeed)
        memory, host = (
            None if v is None else _gb(v, name)
            for v, name in ((args.gpu_memory, "--gpu-memory"), (args.host_memory, "--host-memory"))
        )
        seq, pair_tokens = measured_on_data(recipe)
        result = plan(recipe, args.gpus, memory, args.nodes, ds, host, seq=seq, pair_tokens=pair_tokens)
    except (RecipeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    how = "no DeepSpeed" if ds is None else f"DeepSpeed {args.deepspeed}"
    print(f"{args.recipe}: {args.nodes} node(s) x {args.gpus} GPU(s), {how}, per rank:")
    print(render(result))
    if host is None and result.host_per_node_gb:  # said, not judged: the training nodes may not be this machine
        here = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
        print(
            f"  host: {result.host_per_node_gb:.1f} GB per node needed; this machine has {here:.0f} GB of RAM "
            f"({'enough' if here >= result.host_per_node_gb else 'NOT enough'} if it is a training node; "
            "`--host-memory` checks the nodes)"
        )
    return 1 if result.fits is False else 0


if __name__ == "__main__":
    sys.exit(main())
