"""DPO training entrypoint: TRL DPOTrainer + our memory levers, on DeepSpeed ZeRO-3 or a single process.

    # quickstart: tiny Mistral on the shipped preference data, one process (CPU when no GPU is present)
    python launch/train_dpo.py --recipe recipes/tiny_mistral/dpo_quickstart.yaml

    # DeepSpeed launcher, ZeRO-3 (the config may also be given as --deepspeed ds_configs/zero3.json)
    deepspeed --num_gpus 8 launch/train_dpo.py ds_configs/zero3.json --recipe recipes/nemotron12b/dpo_12k.yaml

    # accelerate, ZeRO-3 (launch/accelerate/zero3.yaml points at ds_configs/zero3.json)
    accelerate launch --config_file launch/accelerate/zero3.yaml launch/train_dpo.py --recipe <yaml>

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

import os
import sys

# TRL's trainers send a usage ping to huggingface.co from a background thread; training needs no network, so none
# unless the user asks for it (HF_HUB_DISABLE_TELEMETRY=0). huggingface_hub reads this once, at import.
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from longdpo import patches  # noqa: E402
from longdpo.config import describe_keys  # noqa: E402
from longdpo.training.run import Run, exit_now, exit_status  # noqa: E402


def usage() -> str:
    return f"""{__doc__}
Recipe keys. The top level takes every field of TRL's DPOConfig (learning_rate, beta, loss_type, max_length,
per_device_train_batch_size, ...: https://huggingface.co/docs/trl/dpo_trainer); the sections are ours:
{describe_keys()}

Shipped recipes: recipes/*/ (tiny_mistral, nemotron12b, llama3_8b, qwen2_5_14b, qwen3_14b). Will it fit:
python launch/plan_memory.py --recipe <yaml> --gpus 8 --gpu-memory 80GB.
"""


def main(argv: list[str] | None = None) -> dict:
    """One DPO run, in the order that matters: the allocator before CUDA, every check before a model is loaded."""
    patches.quiet_deprecation_warnings()
    run = Run(sys.argv[1:] if argv is None else argv)
    run.set_allocator()  # before torch is imported: the allocator reads its setting once, at CUDA's start
    run.check_at_start()  # the recipe, the output dir, the planner's verdict: every problem at once
    try:
        run.training_arguments()  # TRL's DPOConfig; under DeepSpeed this starts the process group
        run.resume_point()
        run.load_data()  # tokenizer and pairs, checked before any model exists
        run.build_models()
        run.build_trainer()
        run.log_scale()
    except BaseException:  # stopped before training: --overwrite_output_dir's earlier run goes back, untouched
        run.put_back_earlier_run()
        raise
    if run.signalled_during_setup():
        return {"preempted_at": None, "signal": run.guard.signal_received}
    run.train()
    if run.preempted:
        return {"preempted_at": run.guard.preempted_at, "signal": run.guard.signal_received}
    run.save()
    return run.write_summary()


if __name__ == "__main__":
    exit_now(exit_status(main, usage))
