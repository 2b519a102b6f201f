"""One DPO run, step by step, and its state in one object (launch/train_dpo.py calls the steps in order).

The order matters: the allocator setting before torch starts CUDA (it is read once, then), every check before any
model is loaded (a 12B model takes minutes to load; a typo must not), the process group with TRL's DPOConfig.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from longdpo.config import HelpRequested, RecipeError, parse_cli, read_memory_section, trainer_default
from longdpo.model import allocator

logger = logging.getLogger("train_dpo")
EXIT_PREEMPTED = 75  # saved and stopped on a signal (longdpo/cluster/resilience.py); the SLURM example requeues on it
ERROR_GRACE_S = 10  # how long a rank other than 0 waits before saying an error rank 0 says too


class OutOfMemory(Exception):
    """A CUDA OOM during training, with the report that says what would have fitted."""


class NonFinite(Exception):
    """A non-finite loss or gradient norm stopped the run."""


class Run:
    """Everything one run builds, in the order it is built."""

    def __init__(self, argv: list[str]):
        self.cli = parse_cli(argv)
        self.recipe = self.args = self.tokenizer = self.trainer = self.prediction = None
        self.seq = None  # tokens per sequence the planner plans for (max_length, or the data's longest pair)
        self.earlier_run: list[str] = []  # what --overwrite_output_dir replaces once every check has passed
        self.set_aside: str | None = None  # where it waits until training starts (resilience.set_aside_earlier_run)

    @property
    def is_main(self) -> bool:
        return self.args.process_index == 0 if self.args else int(os.environ.get("RANK", 0)) == 0

    # ---- 1. before torch is imported --------------------------------------------------------------------------

    def set_allocator(self) -> None:
        """The allocator setting (read once, at CUDA's start) and the memory callback that records it."""
        if self.cli["recipe"] is None:
            raise RecipeError("No recipe: pass `--recipe recipes/tiny_mistral/dpo_quickstart.yaml` (or another YAML).")
        memory = read_memory_section(self.cli["recipe"], self.cli["overrides"])
        record = allocator.apply(memory.allocator_conf)  # torch is not even imported yet
        from longdpo.training.callbacks import MemoryCallback

        self.memory_callback = MemoryCallback(memory, record)

    # ---- 2. every check, no model loaded ----------------------------------------------------------------------

    def check_at_start(self) -> None:
        """The recipe, the processes against the GPUs, the output dir, the planner's verdict (against the GPU, or
        this machine's memory without one): every problem reported at once."""
        import torch

        from longdpo.checks import Problems, check_processes_per_gpu, check_recipe
        from longdpo.cluster import resilience
        from longdpo.config import load_recipe
        from longdpo.data import plan_on_data
        from longdpo.planner.plan import planned_length

        recipe = self.recipe = load_recipe(self.cli["recipe"], self.cli["overrides"])
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        problems = Problems()
        if torch.cuda.is_available():
            with problems.check():
                check_processes_per_gpu(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), torch.cuda.device_count())
        with problems.check():
            check_recipe(recipe, world_size=self.world_size, cuda_available=torch.cuda.is_available())
        self.output_dir = recipe.trainer.get("output_dir", trainer_default("output_dir"))
        with problems.check():
            self.earlier_run = resilience.check_output_dir(self.output_dir, self.cli["resume"], self.cli["overwrite"])
        try:
            self.seq = planned_length(recipe)
        except RecipeError:  # max_length: null on files: the preflight waits for the data's longest pair
            self.seq = None
        self.pair_tokens = None
        self.plan_on_data = plan_on_data(recipe)  # the preflight waits for the pairs (longest; shared rows)
        if not self.plan_on_data and (not problems.found or recipe.model.architecture or recipe.model.name_or_path):
            with problems.check():
                self._preflight(problems_found=bool(problems.found))
        problems.raise_if_any()

    def _preflight(self, problems_found: bool = False) -> None:
        from longdpo.planner.preflight import preflight

        try:
            self.prediction = preflight(
                self.recipe, self.world_size, self.cli["preflight"], self.seq, self.pair_tokens, problems_found
            )
        except RecipeError:
            raise
        except Exception:
            if not problems_found:
                raise
            # a recipe already refused (a folder that holds no model, sp_size 0) cannot be planned: its problems say why

    def _checked(self) -> None:
        """Every check has passed: the disk, and only then the earlier run set aside (--overwrite_output_dir)."""
        from longdpo.cluster import resilience
        from longdpo.cluster.distributed import stale_build_locks

        if self.recipe.run.check_disk:
            warning = resilience.disk_check(self.recipe, self.output_dir, self.cli["save"])
            if warning and self.is_main:
                logger.warning(warning)
        if self.is_main:
            self.set_aside = resilience.set_aside_earlier_run(self.output_dir, self.earlier_run)
            for lock in stale_build_locks():
                logger.warning(
                    "stale build lock %s (over 30 min old): if DeepSpeed's start hangs here, delete it", lock
                )

    # ---- 3. TRL's arguments: the process group starts here ----------------------------------------------------

    def training_arguments(self) -> None:
        """DPOConfig from the recipe's top level, logging, the per-GPU memory cap, and the guard that saves on
        signals and stops on non-finite values."""
        import torch
        from trl import DPOConfig

        from longdpo import patches
        from longdpo.checks import resolve_report_to
        from longdpo.cluster import resilience
        from longdpo.model import liger
        from longdpo.model.checkpointing import uses_transformers_layer_checkpointing

        recipe, memory = self.recipe, self.recipe.memory
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
        self.liger_config = liger.take(kwargs)  # applied to the models before our patches, not by the Trainer
        kwargs.setdefault("ddp_timeout", 7200)  # a 64k step and a 12B save take minutes; a hang fails in 2 h
        # older checkpoints are rotated only once the new one is complete (resilience), not by the Trainer
        keep_checkpoints = kwargs.pop("save_total_limit", None)
        patches.distributed_on_cpu()
        try:
            self.args = DPOConfig(**kwargs)  # with `deepspeed` set this starts the process group
        except ValueError as e:  # transformers' and TRL's own checks of their fields, e.g. `logging_steps: 0`
            raise RecipeError(f"TRL's DPOConfig refuses this recipe: {e}") from None
        _check_optimizer(self.args)
        level = logging.INFO if self.is_main else logging.WARNING
        logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", level=level)
        logging.getLogger("longdpo").setLevel(level)
        if not self.plan_on_data:
            self._checked()  # every check has passed, TRL's too: only now may an earlier run be set aside
        if memory.memory_cap_gb and torch.cuda.is_available():
            total = torch.cuda.get_device_properties(self.args.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, memory.memory_cap_gb * 1e9 / total), self.args.device)
        self.guard = resilience.ResilienceCallback(
            recipe.run.save_on_signals, keep_checkpoints, recipe.run.on_nonfinite
        )

    def resume_point(self) -> None:
        """The complete checkpoint to resume from (rank 0 first: it moves incomplete ones aside; the others then
        agree); a preemption marker from an earlier run is cleared once the run starts again."""
        from longdpo.cluster import resilience
        from longdpo.cluster.distributed import process_group

        dist = process_group()
        requested = self.cli["resume"]
        resume = resilience.resolve_resume(requested, self.args.output_dir, True) if self.is_main else None
        if dist:
            dist.barrier()
        if not self.is_main:
            resume = resilience.resolve_resume(requested, self.args.output_dir, False)
        resilience.check_resume_model(resume, self.recipe.model)
        marker = os.path.join(self.args.output_dir, resilience.PREEMPTED)
        if self.is_main and os.path.exists(marker):
            os.remove(marker)
        done = resilience.steps_done(resume)
        if done is not None and 0 < self.args.max_steps <= done and self.is_main:
            logger.warning(
                "%s already reached max_steps %d (step %d): nothing left to train; raise `max_steps` to train further",
                resume,
                self.args.max_steps,
                done,
            )
        self.resume = resume

    # ---- 4. data, 5. models, 6. trainer -----------------------------------------------------------------------

    def load_data(self) -> None:
        """The tokenizer and the preference data, checked against the chat template, `max_length` and the model's
        vocabulary; with `max_length: null` or `data.shared_prompt` on files, the planner's verdict on the pairs as
        measured (the longest; the costliest shared row)."""
        from longdpo.data import (
            check_chat_template,
            check_some_pair_fits,
            load_eval_data,
            load_train_data,
            measured_for_plan,
        )
        from longdpo.model.build import load_architecture, load_tokenizer

        recipe, t = self.recipe, self.recipe.trainer
        self.tokenizer = load_tokenizer(recipe.model)
        self.train_raw = load_train_data(recipe.data)
        dropped_roles = check_chat_template(self.tokenizer, self.train_raw)
        max_length = t.get("max_length", trainer_default("max_length"))
        check_some_pair_fits(
            self.tokenizer, self.train_raw, max_length, t.get("truncation_mode", trainer_default("truncation_mode"))
        )
        if dropped_roles and self.is_main:
            logger.warning(dropped_roles)
        self.eval_raw = load_eval_data(recipe.data)
        if self.eval_raw is not None:
            check_chat_template(self.tokenizer, self.eval_raw, "eval_files")
        vocab_size = load_architecture(recipe.model).vocab_size
        if len(self.tokenizer) > vocab_size:
            raise RecipeError(
                f"The tokenizer has {len(self.tokenizer)} tokens but the model's vocab_size is "
                f"{vocab_size}; use a matching `model.tokenizer`."
            )
        if self.plan_on_data:
            seq, self.pair_tokens = measured_for_plan(recipe, self.tokenizer, self.train_raw)
            self.seq = self.seq or seq
            self._preflight()
            self._checked()

    def build_models(self) -> None:
        """The policy (Liger's kernels, then our levers) and the reference (an identical copy for random-init runs;
        none for LoRA, whose reference is the base with the adapters off)."""
        from longdpo.model import liger, padding_mask
        from longdpo.model.build import build_model
        from longdpo.model.checkpointing import apply_memory_patches
        from longdpo.model.emulation import parameter_bytes, sgd_in_backward

        recipe, args, memory = self.recipe, self.args, self.recipe.memory
        model = build_model(recipe.model)
        ref_model = None
        if recipe.model.architecture and not args.precompute_ref_log_probs and not recipe.model.use_peft:
            ref_model = build_model(recipe.model)  # same config, same seed -> identical weights (step-0 loss ln 2)
        if self.liger_config is not None:  # before our levers, so that they wrap Liger's kernels (model/liger.py)
            self.liger_config = liger.apply([model, ref_model], self.liger_config, memory.lean_norm)
        self.callbacks, label = [self.memory_callback, self.guard], None
        if memory.profile_step:  # labels beneath the levers' wrappers, so that recomputes are labelled too
            from longdpo.training import profiling

            label = profiling.instrument
            profiling.instrument_reference(ref_model)
            self.callbacks.append(profiling.ProfileCallback(memory.profile_step))
        wrapped = apply_memory_patches(
            model, memory.checkpointing, memory.tiled_mlp, memory.mlp_chunks, memory.lean_norm, label=label
        )
        drop_mask, line = padding_mask.decide(memory.padding_mask, model.config)
        if drop_mask:
            padding_mask.install(model)
            padding_mask.install(ref_model)
        if self.is_main:
            logger.info(line)
        if recipe.data.shared_prompt:
            from longdpo.model import shared_prompt

            for m in (model, ref_model):
                shared_prompt.use_shared_attention(m)
            if self.is_main:
                logger.info(
                    "attention: each pair's prompt computed once (data.shared_prompt): one sequence [prompt, chosen, "
                    "rejected] per pair, PyTorch's SDPA in two calls"
                )
        wrapped["lean_lm_head"] = int(memory.lean_lm_head)  # routed around training, in train()
        wrapped["liger"] = int(self.liger_config is not None)
        self.sp = None
        if recipe.parallelism.sp_size > 1:  # routes attention through Ulysses for every model of this process
            from longdpo.model.sequence_parallel import SequenceParallel

            # Ulysses' micro-batch: TRL's two rows per pair, or one shared row per pair (longdpo/model/shared_prompt.py)
            rows = (1 if recipe.data.shared_prompt else 2) * args.per_device_train_batch_size
            self.sp = SequenceParallel(recipe.parallelism.sp_size, rows, model)
        if memory.sgd_in_backward:
            sgd_in_backward(model, args.learning_rate)
        self.memory_callback.weights_gb = parameter_bytes(model, ref_model) / 1e9
        # ZeRO-3 partitions each parameter as it is constructed (zero.Init): no rank holds the whole model
        self.built_partitioned = all(hasattr(p, "ds_id") for p in model.parameters())  # before LoRA's adapters
        self.model, self.ref_model, self.wrapped = model, ref_model, wrapped

    def build_trainer(self) -> None:
        from longdpo.model import lora
        from longdpo.training.trainer import RecipeDPOTrainer

        recipe = self.recipe
        try:
            self.trainer = RecipeDPOTrainer(
                model=self.model,
                ref_model=self.ref_model,
                args=self.args,
                train_dataset=self.train_raw,
                eval_dataset=self.eval_raw,
                processing_class=self.tokenizer,
                callbacks=self.callbacks,
                peft_config=lora.peft_config(recipe.model),
                memory_callback=self.memory_callback,
                guard=self.guard,
                sp=self.sp,
                shared_prompt=recipe.data.shared_prompt_min_saving if recipe.data.shared_prompt else None,
                offload_pin_memory=recipe.memory.offload_pin_memory,
                offload_keep_layers=recipe.memory.offload_keep_layers,
            )
        except (ValueError, NotImplementedError) as e:  # DPOTrainer's own checks of its arguments
            raise RecipeError(f"TRL's DPOTrainer refuses this recipe: {e}") from None
        if recipe.model.use_peft and self.is_main:
            logger.info(lora.trainable_summary(self.trainer.model))

    def log_scale(self) -> None:
        """The length report (and a warning for truncated pairs) and one line on the run's scale and levers."""
        from longdpo.data import length_report, truncation_warning

        args, recipe = self.args, self.recipe
        self.report = length_report(self.trainer.train_dataset, len(self.train_raw), args.max_length)
        self.dp_size = args.world_size // recipe.parallelism.sp_size
        global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * self.dp_size
        if self.is_main:
            memory, allocated = recipe.memory, self.memory_callback.allocator
            logger.info("length report (tokens per sequence = prompt + longer completion): %s", self.report)
            if recipe.data.shared_prompt:
                logger.info(
                    "shared prompt: %.0f%% fewer tokens through the model than TRL's two rows per pair; a batch "
                    "that saves less than %.0f%% runs as TRL's rows (data.shared_prompt_min_saving)",
                    100 * self.report["shared_prompt_saves"],
                    100 * recipe.data.shared_prompt_min_saving,
                )
            truncated = truncation_warning(self.report)
            if truncated:
                logger.warning(truncated)
            logger.info(
                "scale: %d ranks (sequence parallel %d x data parallel %d), %d pairs per optimizer step, up to %d "
                "tokens per step (2 x max_length x pairs); checkpointing=%s wrapped=%s tiled_mlp=%d allocator=%s (%s)",
                args.world_size,
                recipe.parallelism.sp_size,
                self.dp_size,
                global_batch,
                2 * (args.max_length or self.report["tokens_max"]) * global_batch,
                memory.checkpointing,
                {k: v for k, v in self.wrapped.items() if v},
                memory.tiled_mlp,
                allocated["allocator_conf"],
                allocated["source"],
            )

    def put_back_earlier_run(self) -> None:
        """The run stopped before training: an earlier run set aside by --overwrite_output_dir goes back."""
        from longdpo.cluster import resilience

        if self.is_main:
            resilience.put_back_earlier_run(self.set_aside)
            self.set_aside = None

    def signalled_during_setup(self) -> bool:
        """A save signal (or the launcher gone) while the models loaded: stop before the first step, which the
        launcher's kill (30 s after its SIGTERM) may cut short at long context. Nothing was trained, so nothing is
        saved; an earlier run set aside by --overwrite_output_dir goes back."""
        from longdpo.cluster.distributed import max_over_ranks

        guard = self.guard
        guard.note_launcher_gone()
        if not max_over_ranks([float(guard.signal_received is not None)])[0]:
            return False
        earlier = self.set_aside is not None
        self.put_back_earlier_run()
        if self.is_main:
            logger.warning(
                "%s before training started: stopped with nothing trained or saved%s; run the same command again "
                "to start",
                guard.stop_reason or "another rank was signalled",
                " (the earlier run in output_dir is back in place)" if earlier else "",
            )
        return True

    # ---- 7. train, 8. save, 9. summary ------------------------------------------------------------------------

    def train(self) -> None:
        """Train; an out-of-memory error becomes a report, a non-finite value a stop that names the checkpoint to
        resume from, a signal a saved checkpoint."""
        import torch

        from longdpo import patches
        from longdpo.cluster import resilience
        from longdpo.planner.preflight import oom_report

        if self.is_main:  # training starts: the earlier run this one replaces goes now
            resilience.delete_set_aside(self.set_aside)
            self.set_aside = None
        try:
            with patches.trl_log_prob_function(self.recipe.memory.lean_lm_head):
                self.result = self.trainer.train(resume_from_checkpoint=self.resume)
        except torch.OutOfMemoryError as e:
            raise OutOfMemory(
                oom_report(
                    e,
                    self.recipe,
                    self.world_size,
                    self.memory_callback.records,
                    self.memory_callback.allocator["allocator_conf"],
                    resilience.last_complete(self.args.output_dir),
                    self.seq,
                    self.pair_tokens,
                )
            ) from None
        if self.guard.stopped:
            step, quantity = self.guard.stopped
            last = resilience.last_complete(self.args.output_dir)
            raise NonFinite(
                f"step {step}: the {quantity} is not finite; stopped there and saved nothing. "
                + (
                    f"Last complete checkpoint: {last} (resume from it with `--resume_from_checkpoint "
                    f"{last}`, e.g. with a lower learning_rate)."
                    if last
                    else "No checkpoint had been saved."
                )
            )
        if self.preempted and self.is_main:
            logger.warning(
                "%s: saved checkpoint-%d and stopped; resume with --resume_from_checkpoint auto",
                self.guard.stop_reason or "another rank was signalled",
                self.guard.preempted_at,
            )

    @property
    def preempted(self) -> bool:
        return self.guard.preempted_at is not None

    def save(self) -> None:
        """The final model (under ZeRO-3 a gathered 16-bit model that reloads with from_pretrained), its tokenizer
        and model card, and for LoRA the adapter merged into the base weights when asked."""
        from longdpo.model import lora

        if not self.cli["save"]:
            return
        output_dir, model_args = self.args.output_dir, self.recipe.model
        self.trainer.save_model(output_dir)
        if self.is_main:
            self.tokenizer.save_pretrained(output_dir)
            name_model_card(output_dir, model_args)
            if model_args.lora_save_merged:
                logger.info(
                    "adapter merged into the base weights: %s", lora.save_merged(output_dir, model_args, self.tokenizer)
                )

    def write_summary(self) -> dict:
        """train_summary.json: losses and logs per step, the length report, what was wrapped, the allocator, the
        partitioning, and the planner's prediction beside the measured peak."""
        import torch

        from longdpo.cluster.distributed import gather
        from longdpo.model.emulation import local_parameters

        trainer, args, prediction, records = self.trainer, self.args, self.prediction, self.memory_callback.records
        summary = {
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "train_logs": [h for h in trainer.state.log_history if "loss" in h],  # rewards, logps, ... per step
            "eval_logs": [h for h in trainer.state.log_history if "eval_loss" in h],
            "train_loss": self.result.training_loss,
            "world_size": args.world_size,
            "sequence_parallel": {"sp_size": self.recipe.parallelism.sp_size, "dp_size": self.dp_size},
            "shared_prompt": self.recipe.data.shared_prompt,
            # the policy's forwards (with LoRA the reference's too) run as shared rows and as TRL's two rows
            "shared_prompt_forwards": trainer.shared_prompt_counts,
            "length_report": self.report,
            "skipped_steps": [{"step": step, "quantity": quantity} for step, quantity in self.guard.skipped],
            "wrapped": self.wrapped,
            "allocator": self.memory_callback.allocator,
            "built_partitioned": self.built_partitioned,
            "partition_numel_per_rank": gather(sum(t.numel() for t in local_parameters(trainer.model_wrapped))),
            "total_numel": sum(getattr(p, "ds_numel", p.numel()) for p in self.model.parameters()),
            "planner_predicted_reserved_gb": prediction.peak_reserved_gb if prediction else None,
            "planner_breakdown_gb": prediction.breakdown if prediction else None,
            "measured_reserved_gb": max(
                (r["peak_reserved_gb"] for r in records if r["peak_reserved_gb"] is not None), default=None
            ),  # None without a GPU
        }
        if self.is_main and prediction and torch.cuda.is_available():
            logger.info(
                "planner predicted peak reserved %.2f GB; measured %.2f GB",
                prediction.peak_reserved_gb,
                summary["measured_reserved_gb"],
            )
        if self.is_main:
            with open(os.path.join(args.output_dir, "train_summary.json"), "w") as f:
                json.dump(summary, f, indent=1, default=str)
        return summary


def name_model_card(output_dir: str, model_args) -> None:
    """TRL's model card names the base model by Hub id only: a local directory or a random initialisation read
    "a fine-tuned version of [None](https://huggingface.co/None)" and `pipeline(model="None")`. Say what it was."""
    card = os.path.join(output_dir, "README.md")
    if not os.path.exists(card):
        return
    base = model_args.name_or_path or f"a random initialisation of `{model_args.architecture}`"
    with open(card) as f:
        text = f.read()
    text = text.replace(
        "a fine-tuned version of [None](https://huggingface.co/None)", f"a fine-tuned version of {base}"
    )
    text = text.replace('model="None"', f'model="{output_dir}"')
    with open(card, "w") as f:
        f.write(text)


def _check_optimizer(args) -> None:
    """An `optim` whose package is missing (bitsandbytes for the 8-bit ones, torchao, ...) fails only when the
    trainer makes the optimizer, after the models loaded, with an ImportError traceback: asked here instead."""
    from transformers import Trainer

    try:
        Trainer.get_optimizer_cls_and_kwargs(args)
    except ImportError as e:
        name = getattr(args.optim, "value", args.optim)
        raise RecipeError(f"`optim: {name}` needs a package that is not installed: {e}") from None
    except ValueError:  # optimizers built around the model (GaLore, APOLLO): the trainer checks those itself
        pass


def exit_status(main, help_text) -> int:
    """Run `main` and map how it ended to the exit status: 0 done, 2 a recipe or command-line problem (one line per
    problem), 3 out of GPU memory, 4 a non-finite loss or gradient norm, 75 saved and stopped on a signal."""
    from longdpo.cluster.distributed import process_group

    try:
        try:
            summary = main()
        except HelpRequested:
            print(help_text())
            return 0
        if dist := process_group():
            dist.barrier()  # no rank tears the process group down while another still uses it
        if "preempted_at" in summary:
            return EXIT_PREEMPTED
    except RecipeError as e:  # a recipe's mistake is every rank's: said once, by rank 0
        if int(os.environ.get("RANK", 0)) != 0:
            # The launchers end every rank as soon as one exits with an error: a rank that returned at once was
            # seen (1 run in 4, 2 CPU ranks) to get rank 0 killed before it printed. So the other ranks wait for
            # rank 0 to say it, and say it themselves only if still alive then (the error was theirs alone).
            time.sleep(ERROR_GRACE_S)
        for line in str(e).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    except OutOfMemory as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except NonFinite as e:
        print(f"error: {e}", file=sys.stderr)
        return 4
    finally:
        if dist := process_group():
            dist.destroy_process_group()
    return 0


def exit_now(code: int) -> None:
    """End as Python's forked multiprocessing workers do: flush, then os._exit, skipping the interpreter's teardown.

    After destroy_process_group, gloo groups that DeepSpeed and accelerate still reference keep their worker
    threads; torn down with the interpreter, one was now and then destroyed still joinable ("terminate called
    without an active exception", SIGABRT, rc 250 after a finished run). Every output is written and closed here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
