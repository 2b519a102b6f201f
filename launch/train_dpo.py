"""DPO training entrypoint: TRL DPOTrainer + our memory levers, on DeepSpeed ZeRO-3 or a single process.

    # quickstart: tiny Mistral on the shipped preference data, one process (CPU when no GPU is present)
    python launch/train_dpo.py --recipe recipes/tiny_mistral/dpo_quickstart.yaml

    # DeepSpeed launcher, ZeRO-3 (the config may also be given as --deepspeed ds_configs/zero3.json)
    deepspeed --num_gpus 8 launch/train_dpo.py ds_configs/zero3.json --recipe recipes/nemotron12b/dpo_12k.yaml

    # accelerate, ZeRO-3 (launch/accelerate/zero3.yaml points at ds_configs/zero3.json)
    accelerate launch --config_file launch/accelerate/zero3.yaml launch/train_dpo.py --recipe <yaml>

Any `--key value` overrides the recipe (`--max_steps 10`, `--memory.checkpointing attn_mlp`).
`--resume_from_checkpoint <dir|true|auto>` continues a run from a complete checkpoint (true: the newest; auto: the
newest if there is one, else from step 0); `--overwrite_output_dir` deletes an earlier run's checkpoints and records
in output_dir first (a used output_dir is refused otherwise); `--no_final_save` skips saving the final model;
`--skip-preflight` runs even when the planner predicts it will not fit.
Exit status: 0 done, 2 a recipe or command-line problem, 3 out of GPU memory, 4 a non-finite loss or gradient norm,
75 saved and stopped on a signal (preemption: resume with `--resume_from_checkpoint auto`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# TRL's trainers send a usage ping to huggingface.co from a background thread; training needs no network, so none
# unless the user asks for it (HF_HUB_DISABLE_TELEMETRY=0). huggingface_hub reads this once, at import.
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from recipes import allocator  # noqa: E402
from recipes.config import (HelpRequested, RecipeError, parse_cli, quiet_deprecated_checkpointing_calls,  # noqa: E402
                            read_memory_section)

logger = logging.getLogger("train_dpo")


def name_model_card(output_dir: str, model_args) -> None:
    """TRL's model card names the base model by Hub id only: a local directory or a random initialisation read
    "a fine-tuned version of [None](https://huggingface.co/None)" and `pipeline(model="None")`. Say what it was."""
    card = os.path.join(output_dir, "README.md")
    if not os.path.exists(card):
        return
    base = model_args.name_or_path or f"a random initialisation of `{model_args.architecture}`"
    with open(card) as f:
        text = f.read()
    text = text.replace("a fine-tuned version of [None](https://huggingface.co/None)", f"a fine-tuned version of {base}")
    text = text.replace('model="None"', f'model="{output_dir}"')
    with open(card, "w") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> dict:
    """One DPO run, in the order that matters: the allocator before CUDA, every check before a model is loaded."""
    quiet_deprecated_checkpointing_calls()
    cli = parse_cli(sys.argv[1:] if argv is None else argv)
    memory_callback = set_allocator(cli)
    recipe, world_size, prediction = check_at_start(cli)
    args, liger_config, guard = training_arguments(recipe)
    is_main = args.process_index == 0
    resume = _resolve_resume(cli["resume"], args.output_dir, is_main)
    _say_if_finished(resume, args.max_steps, is_main)
    tokenizer, train_raw, eval_raw = load_data(recipe, is_main)
    model, ref_model, wrapped, sp, callbacks = build_models(recipe, args, liger_config, memory_callback, guard)
    # ZeRO-3 partitions each parameter as the model is constructed (zero.Init): no rank holds the whole model
    built_partitioned = all(hasattr(p, "ds_id") for p in model.parameters())  # before LoRA adds its adapters
    trainer = build_trainer(recipe, args, model, ref_model, tokenizer, train_raw, eval_raw, callbacks,
                            memory_callback, guard, sp)
    report, dp_size = log_scale(recipe, args, trainer, len(train_raw), wrapped, memory_callback, is_main)
    result = train(trainer, resume, recipe, world_size, memory_callback, guard)
    if guard.preempted_at is not None:
        if is_main:
            logger.warning("%s: saved checkpoint-%d and stopped; resume with --resume_from_checkpoint auto",
                           guard.stop_reason or "another rank was signalled", guard.preempted_at)
        return {"preempted_at": guard.preempted_at, "signal": guard.signal_received}
    if cli["save"]:
        save(trainer, args.output_dir, recipe.model, tokenizer, is_main)
    return write_summary(trainer, result, recipe, args, report, dp_size, guard, wrapped, memory_callback, model,
                         built_partitioned, prediction, is_main)


def set_allocator(cli: dict):
    """Step 1, before torch is imported: the allocator setting (it is read once, at CUDA's start) and the memory
    callback that records it."""
    if cli["recipe"] is None:
        raise RecipeError("No recipe: pass `--recipe recipes/tiny_mistral/dpo_quickstart.yaml` (or another YAML).")
    memory = read_memory_section(cli["recipe"], cli["overrides"])
    allocator_record = allocator.apply(memory.allocator_conf)  # torch is not even imported yet
    from recipes.callbacks import MemoryCallback

    return MemoryCallback(memory, allocator_record)


def check_at_start(cli: dict):
    """Step 2, no model loaded yet: the recipe, the processes against the GPUs, the output dir, the planner's verdict
    (against the GPU, or this machine's memory without one) and the disk, every problem reported at once."""
    import torch

    from recipes import resilience
    from recipes.config import load_recipe, trainer_default
    from recipes.distributed import stale_build_locks
    from recipes.validate import Problems, check_processes_per_gpu, check_recipe

    recipe = load_recipe(cli["recipe"], cli["overrides"])
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    problems, prediction, earlier = Problems(), None, []
    if torch.cuda.is_available():
        with problems.check():
            check_processes_per_gpu(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), torch.cuda.device_count())
    with problems.check():
        check_recipe(recipe, world_size=world_size, cuda_available=torch.cuda.is_available())
    output_dir = recipe.trainer.get("output_dir", trainer_default("output_dir"))
    with problems.check():
        earlier = resilience.check_output_dir(output_dir, cli["resume"], cli["overwrite"])
    if not problems.found or recipe.model.architecture or recipe.model.name_or_path:
        with problems.check():
            prediction = preflight(recipe, world_size, enforce=cli["preflight"])
    problems.raise_if_any()
    if recipe.run.check_disk:
        disk_check(recipe, cli["save"])
    if int(os.environ.get("RANK", 0)) == 0:  # every check has passed: only now is anything deleted
        resilience.delete_earlier_run(output_dir, earlier)
        for lock in stale_build_locks():
            logger.warning("stale build lock %s (over 30 min old): if DeepSpeed's start hangs here, delete it", lock)
    return recipe, world_size, prediction


def training_arguments(recipe):
    """Step 3: TRL's DPOConfig from the recipe's top level (this starts the process group under DeepSpeed), logging,
    the per-GPU memory cap, and the guard that saves on signals and stops on non-finite values."""
    import torch
    from trl import DPOConfig

    from recipes import liger, resilience
    from recipes.checkpointing import uses_transformers_layer_checkpointing
    from recipes.distributed import skip_cpu_shm_allreduce, teach_accelerate_cpu_gloo
    from recipes.validate import resolve_report_to

    memory = recipe.memory
    kwargs = dict(recipe.trainer)
    kwargs["activation_checkpointing"] = uses_transformers_layer_checkpointing(memory.checkpointing)
    kwargs["report_to"] = resolve_report_to(kwargs)
    kwargs.setdefault("include_num_input_tokens_seen", "non_padding")
    kwargs.setdefault("dataloader_pin_memory", torch.cuda.is_available())  # on CPU torch warns it is unused
    kwargs.setdefault("bf16", torch.cuda.is_available() and recipe.model.dtype == "bfloat16")
    if recipe.parallelism.sp_size > 1:  # evaluation's extra logits forward cannot be sequence-parallel
        kwargs.setdefault("prediction_loss_only", True)
    if memory.sgd_in_backward:  # the update happens in backward; the Trainer's SGD then finds no gradients
        kwargs.update(optim="sgd", max_grad_norm=0.0)
    liger_config = liger.take(kwargs)  # applied to the models before our patches, not by the Trainer
    kwargs.setdefault("ddp_timeout", 7200)  # a 64k step and a 12B save take minutes; a hang fails in 2 h
    # older checkpoints are rotated only once the new one is complete (recipes/resilience.py), not by the Trainer
    keep_checkpoints = kwargs.pop("save_total_limit", None)
    teach_accelerate_cpu_gloo()
    skip_cpu_shm_allreduce()
    args = DPOConfig(**kwargs)  # with `deepspeed` set this starts the process group
    level = logging.INFO if args.process_index == 0 else logging.WARNING
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", level=level)
    logging.getLogger("recipes").setLevel(level)
    if memory.memory_cap_gb and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(args.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, memory.memory_cap_gb * 1e9 / total), args.device)
    guard = resilience.ResilienceCallback(recipe.run.save_on_signals, keep_checkpoints, recipe.run.on_nonfinite)
    return args, liger_config, guard


def _say_if_finished(resume, max_steps: int, is_main: bool) -> None:
    from recipes import resilience

    done = resilience.steps_done(resume)
    if done is not None and 0 < max_steps <= done and is_main:
        logger.warning("%s already reached max_steps %d (step %d): nothing left to train; raise `max_steps` to train "
                       "further", resume, max_steps, done)


def load_data(recipe, is_main: bool):
    """Step 4: the tokenizer and the preference data, checked against the chat template and the model's vocabulary."""
    from recipes.config import trainer_default
    from recipes.data import check_chat_template, check_some_pair_fits, load_eval_data, load_train_data
    from recipes.modeling import load_architecture, load_tokenizer

    tokenizer = load_tokenizer(recipe.model)
    train_raw = load_train_data(recipe.data)
    dropped_roles = check_chat_template(tokenizer, train_raw)
    t = recipe.trainer
    check_some_pair_fits(tokenizer, train_raw, t.get("max_length", trainer_default("max_length")),
                         t.get("truncation_mode", trainer_default("truncation_mode")))
    if dropped_roles and is_main:
        logger.warning(dropped_roles)
    eval_raw = load_eval_data(recipe.data)
    if eval_raw is not None:
        check_chat_template(tokenizer, eval_raw, "eval_files")
    vocab_size = load_architecture(recipe.model).vocab_size
    if len(tokenizer) > vocab_size:
        raise RecipeError(f"The tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab_size}; "
                          "use a matching `model.tokenizer`.")
    return tokenizer, train_raw, eval_raw


def build_models(recipe, args, liger_config, memory_callback, guard):
    """Step 5: the policy (Liger's kernels, then our patches) and the reference (an identical copy for random-init
    runs; none for LoRA, whose reference is the base with the adapters off)."""
    from recipes import liger, padding_mask
    from recipes.checkpointing import apply_memory_patches
    from recipes.emulation import parameter_bytes, sgd_in_backward
    from recipes.modeling import build_model

    memory = recipe.memory
    model = build_model(recipe.model)
    ref_model = None
    if recipe.model.architecture and not args.precompute_ref_log_probs and not recipe.model.use_peft:
        ref_model = build_model(recipe.model)  # same config, same seed -> identical weights (step-0 loss = ln 2)
    if liger_config is not None:  # before our patches, so that they wrap Liger's kernels (recipes/liger.py)
        liger_config = liger.apply([model, ref_model], liger_config, memory.lean_norm)
    callbacks, label = [memory_callback, guard], None
    if memory.profile_step:  # labels beneath the patches' wrappers, so that recomputes are labelled too
        from recipes import profiling

        label = profiling.instrument
        profiling.instrument_reference(ref_model)
        callbacks.append(profiling.ProfileCallback(memory.profile_step))
    wrapped = apply_memory_patches(model, memory.checkpointing, memory.tiled_mlp, memory.mlp_chunks,
                                   memory.lean_norm, label=label)
    drop_mask, line = padding_mask.decide(memory.padding_mask, model.config)
    if drop_mask:
        padding_mask.install(model)
        padding_mask.install(ref_model)
    if args.process_index == 0:
        logger.info(line)
    wrapped["lean_lm_head"] = int(memory.lean_lm_head)  # routed around training, in train()
    wrapped["liger"] = int(liger_config is not None)
    sp = None
    if recipe.parallelism.sp_size > 1:  # routes attention through Ulysses for every model of this process
        from recipes.sequence_parallel import SequenceParallel

        sp = SequenceParallel(recipe.parallelism.sp_size, 2 * args.per_device_train_batch_size, model)
    if memory.sgd_in_backward:
        sgd_in_backward(model, args.learning_rate)
    memory_callback.weights_gb = parameter_bytes(model, ref_model) / 1e9
    return model, ref_model, wrapped, sp, callbacks


def build_trainer(recipe, args, model, ref_model, tokenizer, train_raw, eval_raw, callbacks, memory_callback, guard,
                  sp):
    """Step 6: the trainer, with TRL's activation offloading kept away from ZeRO-3 parameters and the fused LM-head
    forwards made sequence-parallel."""
    from recipes import lora
    from recipes.trainer import RecipeDPOTrainer

    trainer = RecipeDPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=train_raw,
                               eval_dataset=eval_raw, processing_class=tokenizer, callbacks=callbacks,
                               peft_config=lora.peft_config(recipe.model), memory_callback=memory_callback,
                               guard=guard, sp=sp)
    if recipe.model.use_peft and args.process_index == 0:
        logger.info(lora.trainable_summary(trainer.model))
    if args.activation_offloading:  # TRL's offloader, kept away from ZeRO-3 parameters, pinned or pageable
        from recipes.offloading import offload_context

        trainer.maybe_activation_offload_context = offload_context(trainer.model, recipe.memory.offload_pin_memory)
        memory_callback.offload_ledger = trainer.maybe_activation_offload_context.ledger
    if sp:
        sp.wrap(trainer.model)  # TRL's fused-LM-head forwards, policy and reference
        sp.wrap(trainer.ref_model)
        trainer._tp_size = sp.k  # TRL's token count gathers every rank: a group holds each token K times
    return trainer


def log_scale(recipe, args, trainer, raw_pairs: int, wrapped, memory_callback, is_main: bool):
    """The length report (and a warning for truncated pairs) and one line on the run's scale and levers."""
    from recipes.data import length_report, truncation_warning

    report = length_report(trainer.train_dataset, raw_pairs, args.max_length)
    dp_size = args.world_size // recipe.parallelism.sp_size
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * dp_size
    if is_main:
        memory = recipe.memory
        logger.info("length report (tokens per sequence = prompt + longer completion): %s", report)
        truncated = truncation_warning(report)
        if truncated:
            logger.warning(truncated)
        logger.info(
            "scale: %d ranks (sequence parallel %d x data parallel %d), %d pairs per optimizer step, up to %d "
            "tokens per step (2 x max_length x pairs); checkpointing=%s wrapped=%s tiled_mlp=%d allocator=%s (%s)",
            args.world_size, recipe.parallelism.sp_size, dp_size, global_batch,
            2 * (args.max_length or report["tokens_max"]) * global_batch,
            memory.checkpointing, {k: v for k, v in wrapped.items() if v}, memory.tiled_mlp,
            memory_callback.allocator["allocator_conf"], memory_callback.allocator["source"],
        )
    return report, dp_size


def train(trainer, resume, recipe, world_size: int, memory_callback, guard):
    """Step 7: train; an out-of-memory error becomes a report (telemetry, the planner's changes, the last checkpoint)
    and a non-finite value a stop that names the checkpoint to resume from."""
    import torch

    from recipes import lean_lm_head, resilience

    output_dir = trainer.args.output_dir
    try:
        with lean_lm_head.routed(recipe.memory.lean_lm_head):
            result = trainer.train(resume_from_checkpoint=resume)
    except torch.OutOfMemoryError as e:
        raise OutOfMemory(oom_report(e, recipe, world_size, memory_callback, output_dir)) from None
    if guard.stopped:
        step, quantity = guard.stopped
        last = resilience.last_complete(output_dir)
        raise NonFinite(f"step {step}: the {quantity} is not finite; stopped there and saved nothing. "
                        + (f"Last complete checkpoint: {last} (resume from it with `--resume_from_checkpoint {last}`, "
                           "e.g. with a lower learning_rate)." if last else "No checkpoint had been saved."))
    return result


def save(trainer, output_dir: str, model_args, tokenizer, is_main: bool) -> None:
    """The final model (under ZeRO-3 a gathered 16-bit model that reloads with from_pretrained), its tokenizer and
    model card, and for LoRA the adapter merged into the base weights when asked."""
    from recipes import lora

    trainer.save_model(output_dir)
    if is_main:
        tokenizer.save_pretrained(output_dir)
        name_model_card(output_dir, model_args)
        if model_args.lora_save_merged:
            logger.info("adapter merged into the base weights: %s", lora.save_merged(output_dir, model_args, tokenizer))


def write_summary(trainer, result, recipe, args, report, dp_size, guard, wrapped, memory_callback, model,
                  built_partitioned: bool, prediction, is_main: bool) -> dict:
    """train_summary.json: losses and logs per step, the length report, what was wrapped, the allocator, the
    partitioning, and the planner's prediction beside the measured peak."""
    import torch

    from recipes.emulation import local_parameters

    summary = {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "train_logs": [h for h in trainer.state.log_history if "loss" in h],  # rewards, logps, ... per step
        "eval_logs": [h for h in trainer.state.log_history if "eval_loss" in h],
        "train_loss": result.training_loss,
        "world_size": args.world_size,
        "sequence_parallel": {"sp_size": recipe.parallelism.sp_size, "dp_size": dp_size},
        "length_report": report,
        "skipped_steps": [{"step": step, "quantity": quantity} for step, quantity in guard.skipped],
        "wrapped": wrapped,
        "allocator": memory_callback.allocator,
        "built_partitioned": built_partitioned,
        "partition_numel_per_rank": _gather(sum(t.numel() for t in local_parameters(trainer.model_wrapped))),
        "total_numel": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
        "planner_predicted_reserved_gb": prediction.peak_reserved_gb if prediction else None,
        "planner_breakdown_gb": prediction.breakdown if prediction else None,
        "measured_reserved_gb": max((r["peak_reserved_gb"] for r in memory_callback.records
                                     if r["peak_reserved_gb"] is not None), default=None),  # None without a GPU
    }
    if is_main and prediction and torch.cuda.is_available():
        logger.info("planner predicted peak reserved %.2f GB; measured %.2f GB",
                    prediction.peak_reserved_gb, summary["measured_reserved_gb"])
    if is_main:
        with open(os.path.join(args.output_dir, "train_summary.json"), "w") as f:
            json.dump(summary, f, indent=1, default=str)
    return summary


EXIT_PREEMPTED = 75  # saved and stopped on a signal (recipes/resilience.py); the SLURM example requeues on it


HELP_KEYS = """
Recipe keys. The top level takes every field of TRL's DPOConfig (learning_rate, beta, loss_type, max_length,
per_device_train_batch_size, ...: https://huggingface.co/docs/trl/dpo_trainer); the sections are ours:"""
HELP_END = """
Shipped recipes: recipes/*/ (tiny_mistral, nemotron12b, llama3_8b, qwen2_5_14b, qwen3_14b). Will it fit:
python launch/plan_memory.py --recipe <yaml> --gpus 8 --gpu-memory 80GB.
"""


class OutOfMemory(Exception):
    """A CUDA OOM during training, with the report that says what would have fitted."""


class NonFinite(Exception):
    """A non-finite loss or gradient norm stopped the run."""


def _resolve_resume(requested, output_dir: str, is_main: bool):
    """The complete checkpoint to resume from (rank 0 first: it moves incomplete ones aside; the others then agree).
    A preemption marker from an earlier run is cleared once the run starts again."""
    from recipes import resilience

    dist = _distributed()
    resume = resilience.resolve_resume(requested, output_dir, True) if is_main else None
    if dist:
        dist.barrier()
    if not is_main:
        resume = resilience.resolve_resume(requested, output_dir, False)
    marker = os.path.join(output_dir, resilience.PREEMPTED)
    if is_main and os.path.exists(marker):
        os.remove(marker)
    return resume


def disk_check(recipe, final_save: bool) -> None:
    """Checkpoints and the final model against the output dir's free space, before any model is loaded."""
    from recipes import resilience
    from recipes.config import trainer_default
    from recipes.modeling import load_architecture
    from recipes.planner import count_params

    try:
        params = count_params(load_architecture(recipe.model))[0]
    except (AttributeError, KeyError, TypeError):  # an architecture the planner cannot size
        return
    t = recipe.trainer
    dtype_bytes = 4 if recipe.model.dtype == "float32" else 2
    ds_path = t.get("deepspeed") or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    zero3 = False
    if ds_path:
        from recipes.validate import check_deepspeed_config

        zero3 = check_deepspeed_config(ds_path).get("zero_optimization", {}).get("stage") == 3
    final, lora = params * dtype_bytes, 0
    if recipe.model.use_peft:  # the adapters (fp32), and the merged model when asked
        from recipes.lora import adapter_params

        lora = adapter_params(recipe.model)
        final = lora * 4 + (final if recipe.model.lora_save_merged else 0)
    one = resilience.checkpoint_bytes(params, dtype_bytes, zero3, not t.get("save_only_model"), lora)
    warning = resilience.check_disk(t.get("output_dir", trainer_default("output_dir")), one, resilience.checkpoints_kept(t),
                                    final if final_save else 0)
    if warning and int(os.environ.get("RANK", 0)) == 0:
        logger.warning(warning)


def _gpu_memory_gb(recipe) -> float | None:
    import torch

    if recipe.memory.memory_cap_gb:  # the per-GPU budget the run is held to (also on CPU, for planning)
        return recipe.memory.memory_cap_gb
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)  # this rank's own GPU, before anything lands on GPU 0 by default
        return torch.cuda.get_device_properties(local_rank).total_memory / 1e9
    return None


def _planned(recipe, world_size, gpu_memory_gb: float | None = None):
    from recipes import planner
    from recipes.validate import check_deepspeed_config

    ds_path = recipe.trainer.get("deepspeed") or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    ds = check_deepspeed_config(ds_path) if ds_path else None
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    budget = gpu_memory_gb if gpu_memory_gb is not None else _gpu_memory_gb(recipe)
    return planner.plan(recipe, per_node, budget, max(1, world_size // per_node), ds)


def preflight(recipe, world_size: int, enforce: bool):
    """The planner's verdict before any model is loaded; refuses a run predicted not to fit (--skip-preflight).
    Without a GPU the model lives in this machine's memory: the planner's need is checked against what is free."""
    import torch

    from recipes import planner

    try:
        result = _planned(recipe, world_size)
    except (AttributeError, KeyError, TypeError, OSError) as e:  # an architecture the planner cannot model
        logger.warning("planner: cannot model this run (%s); no preflight", e)
        return None
    if int(os.environ.get("RANK", 0)) == 0 and result.gpu_memory_gb:  # no GPU and no memory cap: nothing to plan for
        logger.warning("planner: predicted peak reserved %.2f GB per rank of %.1f GB", result.peak_reserved_gb,
                       result.gpu_memory_gb)
    if enforce and result.fits is False:
        raise RecipeError(
            f"Predicted peak reserved {result.peak_reserved_gb:.1f} GB per rank exceeds the GPU's "
            f"{result.gpu_memory_gb:.1f} GB, so this run would run out of memory:\n{planner.render(result)}\n"
            "Apply one of the changes above, or pass --skip-preflight to run anyway."
        )
    if enforce and not torch.cuda.is_available():
        import psutil

        need = planner.cpu_memory_gb(result, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
        free = psutil.virtual_memory().available / 1e9
        if need > free:
            raise RecipeError(
                f"This machine has no GPU, so the model, its reference, gradients and optimizer state live in its "
                f"memory: the planner puts this run at no less than {need:.0f} GB and {free:.0f} GB are free. Run it "
                "on GPUs (the recipe's header names them) or try the pipeline here on a small model "
                "(recipes/tiny_mistral/dpo_quickstart.yaml); --skip-preflight runs it anyway.")
    return result


def oom_report(error, recipe, world_size, memory_callback, output_dir) -> str:
    import torch

    from recipes import planner, resilience

    lines = [f"CUDA out of memory during training: {str(error).splitlines()[0]}", "last steps' telemetry:"]
    lines += [f"  {json.dumps(r)}" for r in memory_callback.records[-3:]] or ["  (no step completed)"]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats = torch.cuda.memory_stats()
        gap = (stats.get("reserved_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0)) / 1e9
        lines.append(f"allocator now: fragmentation gap {gap:.2f} GB, "
                     f"setting {memory_callback.allocator['allocator_conf'] or 'default'}")
    try:
        predicted = _planned(recipe, world_size)
        # It did not fit, whatever was predicted: ask for changes predicted below both the budget and the prediction.
        budget = min(predicted.gpu_memory_gb or predicted.peak_reserved_gb, predicted.peak_reserved_gb * 0.999)
        lines.append("planner for this recipe:\n" + planner.render(_planned(recipe, world_size, budget)))
    except (AttributeError, KeyError, TypeError):
        lines.append("planner: cannot model this run")
    ckpt = resilience.last_complete(output_dir)
    lines.append(f"last saved checkpoint (intact): {ckpt}" if ckpt else "no checkpoint had been saved yet")
    return "\n".join(lines)


def _gather(value) -> list:
    dist = _distributed()
    if dist is None:
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _distributed():
    """torch.distributed when a process group is up, else None (imported late: the allocator wants torch unloaded)."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


ERROR_GRACE_S = 10  # how long a rank other than 0 waits before saying an error rank 0 says too


def run() -> int:
    try:
        try:
            summary = main()
        except HelpRequested:
            from recipes.config import describe_keys

            print(__doc__ + HELP_KEYS + describe_keys() + "\n" + HELP_END)
            return 0
        if dist := _distributed():
            dist.barrier()  # no rank tears the process group down while another still uses it
        if "preempted_at" in summary:
            return EXIT_PREEMPTED
    except RecipeError as e:  # a recipe's mistake is every rank's: said once, by rank 0
        if int(os.environ.get("RANK", 0)) != 0:
            # The launchers end every rank as soon as one exits with an error: a rank that returned at once was
            # seen (1 run in 4, 2 CPU ranks) to get rank 0 killed before it printed, and the run ended with no
            # message at all. So the other ranks wait for rank 0 to say it; they say it themselves only if they
            # are still alive then (the error was theirs alone).
            time.sleep(ERROR_GRACE_S)
        for line in str(e).splitlines():  # one line per problem found
            print(f"error: {line}", file=sys.stderr)
        return 2
    except OutOfMemory as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except NonFinite as e:
        print(f"error: {e}", file=sys.stderr)
        return 4
    finally:
        if dist := _distributed():
            dist.destroy_process_group()
    return 0


def exit_now(code: int) -> None:
    """End as Python's forked multiprocessing workers do: flush, then os._exit, skipping the interpreter's teardown.

    After destroy_process_group, gloo process groups that DeepSpeed and accelerate still reference keep their worker
    threads (4 pt_gloo_runloop + 2 gloo_tcp_loop per rank, counted on CPU); torn down with the interpreter, one was
    now and then destroyed still joinable ("terminate called without an active exception", SIGABRT, the launcher's
    rc 250 after a finished run; twice in 2-process CPU tests). Every output is already written and closed here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(run())
