"""DPO training entrypoint: TRL DPOTrainer + our memory levers, on DeepSpeed ZeRO-3 or a single process.

    # quickstart: tiny Mistral on the shipped preference data, one process (CPU when no GPU is present)
    python launch/train_dpo.py --recipe recipes/tiny_mistral/dpo_quickstart.yaml

    # DeepSpeed launcher, ZeRO-3 (the config may also be given as --deepspeed ds_configs/zero3.json)
    deepspeed --num_gpus 8 launch/train_dpo.py ds_configs/zero3.json --recipe recipes/nemotron12b/dpo_12k.yaml

    # accelerate, ZeRO-3 (launch/accelerate/zero3.yaml points at ds_configs/zero3.json)
    accelerate launch --config_file launch/accelerate/zero3.yaml launch/train_dpo.py --recipe <yaml>

    # installed as a package (`pip install .`): the same, from any directory
    python -m longdpo.train --recipe recipes/tiny_mistral/dpo_quickstart.yaml

Any `--key value` overrides the recipe (`--max_steps 10`, `--memory.checkpointing attn_mlp`).
`--resume_from_checkpoint <dir|true|auto>` continues a run from a complete checkpoint (true: the newest; auto: the
newest if there is one, else from step 0); `--overwrite_output_dir` replaces an earlier run's checkpoints and records
in output_dir (deleted once training starts; a run stopped before then puts them back; a used output_dir is refused
otherwise); `--no_final_save` skips saving the final model;
`--skip-preflight` runs even when the planner predicts it will not fit.
Exit status: 0 done, 2 a recipe or command-line problem, 3 out of GPU memory, 4 a non-finite loss or gradient norm,
75 saved and stopped on a signal (preemption: resume with `--resume_from_checkpoint auto`; a signal while the
models load stops before the first step, with nothing to save).
"""

from __future__ import annotations

import logging
import os
import sys

# TRL's trainers send a usage ping to huggingface.co from a background thread; training needs no network, so none
# unless the user asks for it (HF_HUB_DISABLE_TELEMETRY=0). huggingface_hub reads this once, at import.
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from longdpo import patches  # noqa: E402
from longdpo.cluster.distributed import say_recipe_error  # noqa: E402
from longdpo.config import HelpRequested, RecipeError, describe_keys, parse_cli, read_raw  # noqa: E402
from longdpo.levers import allocator  # noqa: E402


def usage() -> str:
    return f"""{__doc__}
Recipe keys. The top level takes every field of TRL's DPOConfig (learning_rate, beta, loss_type, max_length,
per_device_train_batch_size, ...: https://huggingface.co/docs/trl/dpo_trainer); the sections are ours:
{describe_keys()}

Shipped recipes: recipes/*/ (tiny_mistral, nemotron12b, llama3_8b, qwen2_5_14b, qwen3_14b). Will it fit:
python launch/plan_memory.py --recipe <yaml> --gpus 8 --gpu-memory 80GB.
"""


def main(argv: list[str] | None = None) -> int:
    """One DPO run; returns the exit status. The allocator setting is applied before torch is imported (the CUDA
    allocator reads it once, when it starts); everything after it lives in longdpo/training/run.py."""
    patches.quiet_deprecation_warnings()
    try:
        cli = parse_cli(sys.argv[1:] if argv is None else argv)
        if cli["recipe"] is None:
            raise RecipeError("No recipe: pass `--recipe recipes/tiny_mistral/dpo_quickstart.yaml` (or another YAML).")
        allocator_record = allocator.apply_from_recipe(read_raw(cli["recipe"], cli["overrides"]))
    except HelpRequested:
        print(usage())
        return 0
    except RecipeError as e:
        return say_recipe_error(e)
    from longdpo.training.run import run  # waits for the allocator setting above: it imports torch

    return run(cli, allocator_record)


def exit_now(code: int) -> None:
    """End as Python's forked multiprocessing workers do: flush, then os._exit, skipping the interpreter's teardown.

    After destroy_process_group, gloo groups that DeepSpeed and accelerate still reference keep their worker
    threads; torn down with the interpreter, one was now and then destroyed still joinable ("terminate called
    without an active exception", SIGABRT, rc 250 after a finished run). Every output is written and closed here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cli() -> None:
    """The `longdpo-train` command."""
    exit_now(main())


if __name__ == "__main__":
    cli()
