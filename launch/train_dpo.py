"""DPO training entrypoint: TRL DPOTrainer + our memory levers, on DeepSpeed ZeRO-3 or a single process.

    # quickstart: tiny Mistral on the shipped preference data, one process (CPU when no GPU is present)
    python launch/train_dpo.py --recipe recipes/tiny_mistral/dpo_quickstart.yaml

    # DeepSpeed launcher, ZeRO-3 (the config may also be given as --deepspeed ds_configs/zero3.json)
    deepspeed --num_gpus 8 launch/train_dpo.py ds_configs/zero3.json --recipe recipes/nemotron12b/dpo_12k.yaml

    # accelerate, ZeRO-3 (launch/accelerate/zero3.yaml points at ds_configs/zero3.json)
    accelerate launch --config_file launch/accelerate/zero3.yaml launch/train_dpo.py --recipe <yaml>

Any `--key value` overrides the recipe (`--max_steps 10`, `--memory.checkpointing attn_mlp`).
`--resume_from_checkpoint <dir|true|auto>` continues a run from a complete checkpoint (true: the newest; auto: the
newest if there is one, else from step 0); `--no_final_save` skips saving the final model.
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
from recipes.config import RecipeError, parse_overrides, read_memory_section  # noqa: E402

logger = logging.getLogger("train_dpo")


def parse_cli(argv: list[str]) -> dict:
    """Split launcher arguments from recipe overrides: --recipe, --local_rank (from `deepspeed`), a positional
    DeepSpeed JSON, --deepspeed, --resume_from_checkpoint, --no_final_save; everything else is `--key value`."""
    cli = {"recipe": None, "deepspeed": None, "resume": None, "save": True, "preflight": True, "overrides": {}}
    own = ("--recipe", "--local_rank", "--local-rank", "--resume_from_checkpoint", "--deepspeed")
    rest = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg in ("--help", "-h"):
            raise HelpRequested()
        if not arg.startswith("--"):
            if not arg.endswith(".json"):
                raise RecipeError(f"Unexpected argument {arg!r}: overrides are `--key value` (e.g. `--max_steps 10`).")
            cli["deepspeed"] = arg  # `deepspeed launch/train_dpo.py ds_configs/zero3.json ...`
            continue
        key, eq, value = arg.partition("=")
        if key == "--no_final_save":  # benchmarks: a random-init 12B model is not worth 24 GB of disk
            cli["save"] = False
            continue
        if key == "--skip-preflight":
            cli["preflight"] = False
            continue
        if not eq:  # the value is the next argument, whatever it looks like
            if i >= len(argv) or argv[i].startswith("--"):
                raise RecipeError(f"`{key}` needs a value: `{key} <value>`.")
            value = argv[i]
            i += 1
        if key not in own:
            rest += [key, value]
        elif key == "--recipe":
            cli["recipe"] = value
        elif key in ("--local_rank", "--local-rank"):
            os.environ.setdefault("LOCAL_RANK", value)
        elif key == "--resume_from_checkpoint":
            cli["resume"] = {"true": True, "auto": "auto"}.get(value.lower(), value)
        else:
            cli["deepspeed"] = value
    cli["overrides"] = parse_overrides(rest)
    if cli["deepspeed"]:
        cli["overrides"]["deepspeed"] = cli["deepspeed"]
    return cli


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
    import warnings

    # TRL 1.16 calls transformers' deprecated `gradient_checkpointing_*` method names around every reference forward
    # (3 FutureWarnings a run, seen with transformers 5.24): nothing a user can act on
    warnings.filterwarnings("ignore", message=r"`(is_)?gradient_checkpointing\w*` is deprecated", category=FutureWarning)
    # ---- 1. allocator before CUDA: the memory callback is built before anything touches the GPU ----------------
    cli = parse_cli(sys.argv[1:] if argv is None else argv)
    if cli["recipe"] is None:
        raise RecipeError("No recipe: pass `--recipe recipes/tiny_mistral/dpo_quickstart.yaml` (or another YAML).")
    memory = read_memory_section(cli["recipe"], cli["overrides"])
    allocator_record = allocator.apply(memory.allocator_conf)  # torch is not even imported yet
    from recipes.callbacks import MemoryCallback

    memory_callback = MemoryCallback(memory, allocator_record)

    # ---- 2. recipe and start-up checks (no model loaded yet) ---------------------------------------------------
    import torch

    from recipes import lean_lm_head, liger, lora, resilience
    from recipes.checkpointing import apply_memory_patches, uses_transformers_layer_checkpointing
    from recipes.config import load_recipe
    from recipes.validate import check_processes_per_gpu, check_recipe, resolve_report_to

    recipe = load_recipe(cli["recipe"], cli["overrides"])
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        check_processes_per_gpu(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), torch.cuda.device_count())
    check_recipe(recipe, world_size=world_size, cuda_available=torch.cuda.is_available())
    prediction = preflight(recipe, world_size, enforce=cli["preflight"])
    if recipe.run.check_disk:
        disk_check(recipe, cli["save"])
    from recipes.distributed import stale_build_locks

    if int(os.environ.get("RANK", 0)) == 0:
        for lock in stale_build_locks():
            logger.warning("stale build lock %s (over 30 min old): if DeepSpeed's start hangs here, delete it", lock)

    from trl import DPOConfig, DPOTrainer

    from recipes.data import check_chat_template, length_report, load_eval_data, load_train_data, truncation_warning
    from recipes.distributed import skip_cpu_shm_allreduce, teach_accelerate_cpu_gloo
    from recipes.emulation import local_parameters, parameter_bytes, sgd_in_backward
    from recipes.modeling import build_model, load_architecture, load_tokenizer

    # ---- 3. logging and training arguments ---------------------------------------------------------------------
    trainer_kwargs = dict(recipe.trainer)
    trainer_kwargs["activation_checkpointing"] = uses_transformers_layer_checkpointing(memory.checkpointing)
    trainer_kwargs["report_to"] = resolve_report_to(trainer_kwargs)
    trainer_kwargs.setdefault("include_num_input_tokens_seen", "non_padding")
    trainer_kwargs.setdefault("dataloader_pin_memory", torch.cuda.is_available())  # on CPU torch warns it is unused
    trainer_kwargs.setdefault("bf16", torch.cuda.is_available() and recipe.model.dtype == "bfloat16")
    if recipe.parallelism.sp_size > 1:  # evaluation's extra logits forward cannot be sequence-parallel
        trainer_kwargs.setdefault("prediction_loss_only", True)
    if memory.sgd_in_backward:  # the update happens in backward; the Trainer's SGD then finds no gradients
        trainer_kwargs.update(optim="sgd", max_grad_norm=0.0)
    liger_config = liger.take(trainer_kwargs)  # applied below, before our patches, instead of by the Trainer
    trainer_kwargs.setdefault("ddp_timeout", 7200)  # a 64k step and a 12B save take minutes; a hang fails in 2 h
    # older checkpoints are rotated only once the new one is complete (recipes/resilience.py), not by the Trainer
    keep_checkpoints = trainer_kwargs.pop("save_total_limit", None)
    teach_accelerate_cpu_gloo()
    skip_cpu_shm_allreduce()
    args = DPOConfig(**trainer_kwargs)  # with `deepspeed` set this starts the process group
    is_main = args.process_index == 0
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", level=logging.INFO if is_main else logging.WARNING)
    logging.getLogger("recipes").setLevel(logging.INFO if is_main else logging.WARNING)

    if memory.memory_cap_gb and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(args.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, memory.memory_cap_gb * 1e9 / total), args.device)

    resume = _resolve_resume(cli["resume"], args.output_dir, is_main)
    done = resilience.steps_done(resume)
    if done is not None and 0 < args.max_steps <= done and is_main:
        logger.warning("%s already reached max_steps %d (step %d): nothing left to train; raise `max_steps` to train "
                       "further", resume, args.max_steps, done)
    guard = resilience.ResilienceCallback(recipe.run.save_on_signals, keep_checkpoints, recipe.run.on_nonfinite)

    # ---- 4. data -------------------------------------------------------------------------------------------------
    tokenizer = load_tokenizer(recipe.model)
    train_raw = load_train_data(recipe.data)
    dropped_roles = check_chat_template(tokenizer, train_raw)
    if dropped_roles and is_main:
        logger.warning(dropped_roles)
    eval_raw = load_eval_data(recipe.data)
    if eval_raw is not None:
        check_chat_template(tokenizer, eval_raw, "eval_files")

    vocab_size = load_architecture(recipe.model).vocab_size
    if len(tokenizer) > vocab_size:
        raise RecipeError(f"The tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab_size}; "
                          "use a matching `model.tokenizer`.")

    # ---- 5. model: policy (patched) and reference (an identical copy for random-init runs) ---------------------
    model = build_model(recipe.model)
    # ZeRO-3 partitions each parameter as the model is constructed (zero.Init): no rank ever holds the whole model
    built_partitioned = all(hasattr(p, "ds_id") for p in model.parameters())
    ref_model = None
    # LoRA: TRL scores the reference with the adapters off, so no copy is built (recipes/lora.py)
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
    wrapped["lean_lm_head"] = int(memory.lean_lm_head)  # routed around training, below
    wrapped["liger"] = int(liger_config is not None)
    sp = None
    if recipe.parallelism.sp_size > 1:  # routes attention through Ulysses for every model of this process
        from recipes.sequence_parallel import SequenceParallel

        sp = SequenceParallel(recipe.parallelism.sp_size, 2 * args.per_device_train_batch_size, model)
    if memory.sgd_in_backward:
        sgd_in_backward(model, args.learning_rate)
    memory_callback.weights_gb = parameter_bytes(model, ref_model) / 1e9

    # ---- 6. trainer ----------------------------------------------------------------------------------------------
    class RecipeDPOTrainer(DPOTrainer):
        def log(self, logs, start_time=None):
            if self.model.training:
                logs.update(memory_callback.telemetry_logs())
            super().log(logs, start_time)

        def get_train_dataloader(self):
            loader = super().get_train_dataloader()
            return sp.shard_over_data_parallel_ranks(loader) if sp else loader

        def get_eval_dataloader(self, eval_dataset=None):
            loader = super().get_eval_dataloader(eval_dataset)
            return sp.shard_over_data_parallel_ranks(loader) if sp else loader

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                       num_items_in_batch=num_items_in_batch)
            loss = out[0] if return_outputs else out
            if model.training and os.environ.get("RECIPES_FAULT_NAN_AT_STEP") == str(self.state.global_step + 1):
                loss = loss * float("nan")  # fault injection for the tests: a NaN loss at step N
                out = (loss, *out[1:]) if return_outputs else loss
            if model.training:
                guard.saw_loss(loss)
            return out

        def _get_grad_norm(self, model, grad_norm=None):
            grad_norm = super()._get_grad_norm(model, grad_norm)
            guard.saw_grad_norm(grad_norm)
            return grad_norm

        def _track_num_input_tokens(self, inputs):
            # transformers sums every rank's batch: the K ranks of a sequence-parallel group hold the same pairs
            before = self.state.num_input_tokens_seen
            super()._track_num_input_tokens(inputs)
            if sp:
                self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // sp.k

    trainer = RecipeDPOTrainer(
        model=model,
        ref_model=ref_model,
        args=args,
        train_dataset=train_raw,
        eval_dataset=eval_raw,
        processing_class=tokenizer,
        callbacks=callbacks,
        peft_config=lora.peft_config(recipe.model),
    )
    if recipe.model.use_peft and is_main:
        logger.info(lora.trainable_summary(trainer.model))
    if args.activation_offloading:  # TRL's offloader, kept away from ZeRO-3 parameters, pinned or pageable
        from recipes.offloading import offload_context

        trainer.maybe_activation_offload_context = offload_context(trainer.model, memory.offload_pin_memory)
        memory_callback.offload_ledger = trainer.maybe_activation_offload_context.ledger
    if sp:
        sp.wrap(trainer.model)  # TRL's fused-LM-head forwards, policy and reference
        sp.wrap(trainer.ref_model)
        trainer._tp_size = sp.k  # TRL's token count gathers every rank: a group holds each token K times
    report = length_report(trainer.train_dataset, len(train_raw), args.max_length)
    dp_size = args.world_size // recipe.parallelism.sp_size
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * dp_size
    if is_main:
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

    # ---- 7. train and save ---------------------------------------------------------------------------------------
    try:
        with lean_lm_head.routed(memory.lean_lm_head):
            result = trainer.train(resume_from_checkpoint=resume)
    except torch.OutOfMemoryError as e:
        raise OutOfMemory(oom_report(e, recipe, world_size, memory_callback, args.output_dir)) from None
    if guard.stopped:
        step, quantity = guard.stopped
        last = resilience.last_complete(args.output_dir)
        raise NonFinite(f"step {step}: the {quantity} is not finite; stopped there and saved nothing. "
                        + (f"Last complete checkpoint: {last} (resume from it with `--resume_from_checkpoint {last}`, "
                           "e.g. with a lower learning_rate)." if last else "No checkpoint had been saved."))
    if guard.preempted_at is not None:
        if is_main:
            logger.warning("%s received: saved checkpoint-%d and stopped; resume with --resume_from_checkpoint auto",
                           guard.signal_received, guard.preempted_at)
        return {"preempted_at": guard.preempted_at, "signal": guard.signal_received}
    if cli["save"]:
        trainer.save_model(args.output_dir)  # under ZeRO-3: gathers a 16-bit model that reloads with from_pretrained
        if is_main:
            tokenizer.save_pretrained(args.output_dir)
            name_model_card(args.output_dir, recipe.model)
            if recipe.model.lora_save_merged:
                logger.info("adapter merged into the base weights: %s",
                            lora.save_merged(args.output_dir, recipe.model, tokenizer))
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


class HelpRequested(Exception):
    """`--help`: print the usage and exit 0."""


HELP = __doc__ + """
Recipe keys: the top level takes every trl.DPOConfig field; the sections are documented field by field in
recipes/config.py: model: (ModelArgs), data: (DataArgs), memory: (MemoryArgs), parallelism: (ParallelismArgs),
run: (RunArgs). Shipped recipes: recipes/tiny_mistral/, recipes/nemotron12b/. Will it fit: launch/plan_memory.py.
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
    final = params * dtype_bytes
    if recipe.model.use_peft:  # checkpoints hold the adapters (fp32) and their optimizer state only
        from recipes.lora import adapter_params

        params, dtype_bytes = adapter_params(recipe.model), 4
        final = params * dtype_bytes + (final if recipe.model.lora_save_merged else 0)
    one = resilience.checkpoint_bytes(params, dtype_bytes, zero3, with_optimizer=not t.get("save_only_model"))
    warning = resilience.check_disk(t.get("output_dir", "trainer_output"), one, resilience.checkpoints_kept(t),
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
    """The planner's verdict before any model is loaded; refuses a run predicted not to fit (--skip-preflight)."""
    from recipes import planner

    try:
        result = _planned(recipe, world_size)
    except (AttributeError, KeyError, TypeError) as e:  # an architecture the planner cannot model
        logger.warning("planner: cannot model this run (%s); no preflight", e)
        return None
    if int(os.environ.get("RANK", 0)) == 0:
        logger.warning("planner: predicted peak reserved %.2f GB per rank%s", result.peak_reserved_gb,
                       f" of {result.gpu_memory_gb:.1f} GB" if result.gpu_memory_gb else "")
    if enforce and result.fits is False:
        raise RecipeError(
            f"Predicted peak reserved {result.peak_reserved_gb:.1f} GB per rank exceeds the GPU's "
            f"{result.gpu_memory_gb:.1f} GB, so this run would run out of memory:\n{planner.render(result)}\n"
            "Apply one of the changes above, or pass --skip-preflight to run anyway."
        )
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
            print(HELP)
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
        print(f"error: {e}", file=sys.stderr)
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
