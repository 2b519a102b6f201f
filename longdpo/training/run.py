"""One DPO run, in the order that matters: every check before any model is loaded (a 12B model takes minutes to load;
a typo must not), the process group with TRL's arguments, the data before the models, the levers' stages on the
models and then on the trainer, training, the save, the summary. The allocator setting was applied before this module
was imported (longdpo/train.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys

import torch

from longdpo.cluster.checkpoints import last_complete
from longdpo.cluster.distributed import gather, max_over_ranks, process_group, say_recipe_error
from longdpo.config import RecipeError
from longdpo.data.lengths import length_report, truncation_warning
from longdpo.levers import levers, replica_ranks
from longdpo.model import lora
from longdpo.model.emulation import local_parameters
from longdpo.patches import name_model_card
from longdpo.planner.preflight import oom_report
from longdpo.training.flops import StepFlops
from longdpo.training.models import Models
from longdpo.training.pairs import Pairs
from longdpo.training.startup import StartUp
from longdpo.training.trainer import RecipeDPOTrainer

logger = logging.getLogger("train_dpo")
EXIT_PREEMPTED = 75  # saved and stopped on a signal (longdpo/cluster/signals.py); the SLURM example requeues on it


class OutOfMemory(Exception):
    """A CUDA OOM during training, with the report that says what would have fitted."""


class NonFinite(Exception):
    """A non-finite loss or gradient norm stopped the run."""


def run(cli: dict, allocator_record: dict) -> int:
    """`train`, and how it ended as the exit status: 0 done, 2 a recipe or command-line problem (one line per
    problem), 3 out of GPU memory, 4 a non-finite loss or gradient norm, 75 saved and stopped on a signal."""
    try:
        summary = train(cli, allocator_record)
        if dist := process_group():
            dist.barrier()  # no rank tears the process group down while another still uses it
        return EXIT_PREEMPTED if "preempted_at" in summary else 0
    except RecipeError as e:
        return say_recipe_error(e)
    except (OutOfMemory, NonFinite) as e:
        print(f"error: {e}", file=sys.stderr)
        return 3 if isinstance(e, OutOfMemory) else 4
    finally:
        if dist := process_group():
            dist.destroy_process_group()


def train(cli: dict, allocator_record: dict) -> dict:
    start = StartUp(cli, allocator_record)  # the recipe, every check, the planner's verdict: every problem at once
    try:
        args, guard = start.trainer_arguments()  # TRL's DPOConfig; under DeepSpeed this starts the process group
        resume = start.resume_point(args)
        pairs = Pairs(start.recipe, start.is_main)  # tokenizer and pairs, checked before any model exists
        start.plan_on(pairs)
        models = Models(start.recipe, start.build)
        trainer = build_trainer(start, guard, pairs, models)
        report = log_scale(start, trainer, pairs)
    except BaseException:  # stopped before training: --overwrite_output_dir's earlier run goes back, untouched
        start.earlier.put_back()
        raise
    if signalled_during_setup(start, guard):
        return {"preempted_at": None, "signal": guard.signal_received}
    result = fit(start, trainer, guard, resume)
    if guard.preempted_at is not None:
        return {"preempted_at": guard.preempted_at, "signal": guard.signal_received}
    save(start, trainer, pairs)
    return write_summary(start, trainer, guard, models, report, result)


def build_trainer(start: StartUp, guard, pairs: Pairs, models: Models) -> RecipeDPOTrainer:
    """TRL's DPOTrainer (LoRA through its peft_config), then the levers' `wrap_trainer` stage."""
    recipe, build = start.recipe, start.build
    memory = start.memory_callback
    memory.weights_gb = models.weights_gb
    try:
        trainer = RecipeDPOTrainer(
            model=models.policy,
            ref_model=models.reference,
            args=build.args,
            train_dataset=pairs.train,
            eval_dataset=pairs.eval,
            processing_class=pairs.tokenizer,
            callbacks=[memory, guard, *build.callbacks],
            peft_config=lora.peft_config(recipe.model),
            memory_callback=memory,
            guard=guard,
        )
    except (ValueError, NotImplementedError) as e:  # DPOTrainer's own checks of its arguments
        raise RecipeError(f"TRL's DPOTrainer refuses this recipe: {e}") from None
    for lever in levers():
        lever.wrap_trainer(recipe.levers, trainer, build)
    if start.load_universal:  # the engine, built when training starts, loads the re-partitioned optimizer state
        trainer.accelerator.state.deepspeed_plugin.deepspeed_config["checkpoint"] = {"load_universal": True}
    policy = models.policy  # its own parameters (ZeRO-3 partitions them: their whole sizes), LoRA's adapters aside
    total = sum(getattr(p, "ds_numel", p.numel()) for p in policy.parameters())
    embed = policy.get_input_embeddings().weight
    trainer.step_flops = StepFlops(
        policy.config,
        matmul_params=total - getattr(embed, "ds_numel", embed.numel()),
        lora=recipe.model.use_peft,
        with_reference=not build.args.precompute_ref_log_probs,
        shards=replica_ranks(recipe.levers),
        one_row=build.one_row_per_pair,
    )
    build.step_telemetry.append(trainer.step_flops.take)
    if recipe.model.use_peft and start.is_main:
        logger.info(lora.trainable_summary(trainer.model))
    return trainer


def log_scale(start: StartUp, trainer, pairs: Pairs) -> dict:
    """The length report (and a warning for truncated pairs) and one line on the run's scale and levers."""
    args, recipe = start.build.args, start.recipe
    report = length_report(trainer.train_dataset, len(pairs.train), args.max_length)
    global_batch = start.global_batch
    if start.is_main:
        logger.info("length report (tokens per sequence = prompt + longer completion): %s", report)
        for lever in levers():
            for line in lever.report_lines(recipe.levers, report):
                logger.info(line)
        truncated = truncation_warning(report)
        if truncated:
            logger.warning(truncated)
        logger.info(
            "scale: %d ranks (%d data parallel), %d pairs per optimizer step, up to %d tokens per step "
            "(2 x max_length x pairs); levers %s; wrapped=%s",
            args.world_size,
            start.data_parallel,
            global_batch,
            2 * (args.max_length or report["tokens_max"]) * global_batch,
            recipe.levers.name,
            {k: v for k, v in start.build.wrapped.items() if v},
        )
    return report


def signalled_during_setup(start: StartUp, guard) -> bool:
    """A save signal (or the launcher gone) while the models loaded: stop before the first step, which the
    launcher's kill (30 s after its SIGTERM) may cut short at long context. Nothing was trained, so nothing is
    saved; an earlier run set aside by --overwrite_output_dir goes back."""
    guard.note_launcher_gone()
    if not max_over_ranks([float(guard.signal_received is not None)])[0]:
        return False
    earlier = start.earlier.put_back()
    if start.is_main:
        logger.warning(
            "%s before training started: stopped with nothing trained or saved%s; run the same command again to start",
            guard.stop_reason or "another rank was signalled",
            " (the earlier run in output_dir is back in place)" if earlier else "",
        )
    return True


def fit(start: StartUp, trainer, guard, resume: str | None):
    """Train inside the levers' `during_training` contexts; an out-of-memory error becomes a report, a non-finite
    value a stop that names the checkpoint to resume from, a signal a saved checkpoint."""
    recipe, output_dir = start.recipe, start.build.args.output_dir
    start.earlier.delete()  # training starts: the earlier run this one replaces goes now
    try:
        with contextlib.ExitStack() as stack:
            for lever in levers():
                stack.enter_context(lever.during_training(recipe.levers, start.build))
            result = trainer.train(resume_from_checkpoint=resume)
    except torch.OutOfMemoryError as e:
        records = start.memory_callback.records
        raise OutOfMemory(
            oom_report(e, recipe, start.world_size, records, last_complete(output_dir), start.pairs)
        ) from None
    if guard.stopped:
        step, quantity = guard.stopped
        last = last_complete(output_dir)
        raise NonFinite(
            f"step {step}: the {quantity} is not finite; stopped there and saved nothing. "
            + (
                f"Last complete checkpoint: {last} (resume from it with `--resume_from_checkpoint "
                f"{last}`, e.g. with a lower learning_rate)."
                if last
                else "No checkpoint had been saved."
            )
        )
    if guard.preempted_at is not None and start.is_main:
        logger.warning(
            "%s: saved checkpoint-%d and stopped; resume with --resume_from_checkpoint auto",
            guard.stop_reason or "another rank was signalled",
            guard.preempted_at,
        )
    return result


def save(start: StartUp, trainer, pairs: Pairs) -> None:
    """The final model (under ZeRO-3 a gathered 16-bit model that reloads with from_pretrained), its tokenizer
    and model card, and for LoRA the adapter merged into the base weights when asked."""
    if not start.cli["save"]:
        return
    output_dir, model_args = start.build.args.output_dir, start.recipe.model
    trainer.save_model(output_dir)
    if start.is_main:
        pairs.tokenizer.save_pretrained(output_dir)
        name_model_card(
            output_dir, model_args.name_or_path or f"a random initialisation of `{model_args.architecture}`"
        )
        if model_args.use_peft:
            logger.info(
                "saved the adapter to %s: PeftModel.from_pretrained(base_model, %r) loads it", output_dir, output_dir
            )
        else:
            logger.info(
                "saved the model to %s: AutoModelForCausalLM.from_pretrained(%r) loads it", output_dir, output_dir
            )
        if model_args.lora_save_merged:
            logger.info(
                "adapter merged into the base weights: %s", lora.save_merged(output_dir, model_args, pairs.tokenizer)
            )


def write_summary(start: StartUp, trainer, guard, models: Models, report: dict, result) -> dict:
    """train_summary.json: losses and logs per step, the length report, the levers, what they wrapped and what each
    reports (the allocator's record, ...), the partitioning, and the planner's prediction beside the measured peak."""
    args, recipe, prediction = start.build.args, start.recipe, start.prediction
    records = start.memory_callback.records
    summary = {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "train_logs": [h for h in trainer.state.log_history if "loss" in h],  # rewards, logps, ... per step
        "eval_logs": [h for h in trainer.state.log_history if "eval_loss" in h],
        "train_loss": result.training_loss,
        "world_size": args.world_size,
        "data_parallel": start.data_parallel,
        "levers": recipe.levers.name,
        "length_report": report,
        "skipped_steps": [{"step": step, "quantity": quantity} for step, quantity in guard.skipped],
        "wrapped": start.build.wrapped,
        "built_partitioned": models.built_partitioned,
        "partition_numel_per_rank": gather(sum(t.numel() for t in local_parameters(trainer.model_wrapped))),
        "total_numel": sum(getattr(p, "ds_numel", p.numel()) for p in models.policy.parameters()),
        "planner_predicted_reserved_gb": prediction.peak_reserved_gb if prediction else None,
        "planner_breakdown_gb": prediction.breakdown if prediction else None,
        "measured_reserved_gb": max(
            (r["peak_reserved_gb"] for r in records if r["peak_reserved_gb"] is not None), default=None
        ),  # None without a GPU
    }
    for lever in levers():
        summary.update(lever.summary(recipe.levers, start.build))
    if start.is_main and prediction and torch.cuda.is_available():
        logger.info(
            "planner predicted peak reserved %.2f GB; measured %.2f GB",
            prediction.peak_reserved_gb,
            summary["measured_reserved_gb"],
        )
    if start.is_main:
        with open(os.path.join(args.output_dir, "train_summary.json"), "w") as f:
            json.dump(summary, f, indent=1, default=str)
    return summary
