"""Will it fit? The planner's command line (`python launch/plan_memory.py`, or `python -m longdpo.planner.cli`).

    python launch/plan_memory.py --recipe recipes/nemotron12b/dpo_12k.yaml --gpus 8 --gpu-memory 80GB
    python launch/plan_memory.py --recipe recipes/nemotron12b/dpo_12k.yaml --gpus 8 --gpu-memory 80GB \\
        --deepspeed ds_configs/zero3.json --max_length 65536          # any recipe override works here too

The recipe goes through the same start-up checks as training (those about the machine it runs on aside: this one
need not be a training node). Exit status: 0 fits (or no --gpu-memory / --host-memory given), 1 does not fit, 2 bad
input.
"""

from __future__ import annotations

import argparse
import os
import sys

from longdpo import patches
from longdpo.checks import check_deepspeed_config, check_recipe
from longdpo.config import RecipeError, load_recipe, parse_overrides, trainer_default
from longdpo.data.lengths import pair_lengths
from longdpo.data.loading import load_train_data
from longdpo.model.build import load_tokenizer
from longdpo.planner.plan import needs_pairs, plan, render


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (a GPU count, a layer count, a sequence length)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


def positive_ints(text: str) -> list[int]:
    """An argparse type: comma-separated whole numbers >= 1 (`--seq-tokens 12288,32768`)."""
    return [positive_int(part) for part in text.split(",")]


def _gb(value: str, flag: str) -> float:
    try:
        gb = float(value.upper().removesuffix("GB"))
    except ValueError:
        gb = 0.0
    if not gb > 0:  # 0, a negative size or nan: a typo
        raise RecipeError(f"{flag} {value!r} is not a size; write it in GB, e.g. 80GB.")
    return gb


def measured_pairs(recipe) -> list[tuple[int, int, int]] | None:
    """Where the plan depends on the pairs (files or a Hub dataset with `max_length: null`, or a lever that says
    so), their token lengths measured here as the entrypoint measures them (TRL's tokenization, one pass)."""
    if not needs_pairs(recipe):
        return None
    return pair_lengths(load_tokenizer(recipe.model), load_train_data(recipe.data))


def main(argv=None) -> int:
    patches.quiet_deprecation_warnings()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", required=True)
    p.add_argument("--gpus", type=positive_int, default=8, help="GPUs per node")
    p.add_argument("--nodes", type=positive_int, default=1)
    p.add_argument("--gpu-memory", default=None, help="per GPU, e.g. 80GB")
    p.add_argument(
        "--host-memory", default=None, help="host RAM per node, e.g. 1000GB (checks activation and ZeRO CPU offload)"
    )
    p.add_argument(
        "--deepspeed",
        default=None,
        help="DeepSpeed JSON ('none': no DeepSpeed); default: the recipe's `deepspeed`, else ds_configs/zero3.json on "
        "several GPUs and none on one",
    )
    args, rest = p.parse_known_args(argv)
    try:
        recipe = load_recipe(args.recipe, parse_overrides(rest))
        if args.deepspeed is None:
            args.deepspeed = recipe.trainer.get("deepspeed") or (
                "ds_configs/zero3.json" if args.gpus * args.nodes > 1 else "none"
            )
        ds = None
        if args.deepspeed != "none" and not recipe.memory.sgd_in_backward:
            ds = check_deepspeed_config(args.deepspeed)
            recipe.trainer.setdefault("deepspeed", args.deepspeed)
        check_recipe(recipe, world_size=args.gpus * args.nodes, cuda_available=True, on_this_machine=False)
        memory, host = (
            None if v is None else _gb(v, name)
            for v, name in ((args.gpu_memory, "--gpu-memory"), (args.host_memory, "--host-memory"))
        )
        pairs = measured_pairs(recipe)
        result = plan(recipe, args.gpus, memory, args.nodes, ds, host, pairs=pairs)
    except (RecipeError, ValueError) as e:
        for line in str(e).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    if pairs and recipe.trainer.get("max_length", trainer_default("max_length")) is None:
        longest = max(p + max(c, r) for p, c, r in pairs)
        print(f"max_length: null: the data's longest pair is {longest} tokens; planning for it")
    if pairs and result.terms.shared_rows:
        print(
            f"the costliest pair puts {result.terms.pair_tokens} tokens through the model as one row; planning for it"
        )
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


def cli() -> None:
    """The `longdpo-plan` command."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
