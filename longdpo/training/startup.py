"""A run's start: the recipe, every check before any model is loaded, the planner's verdict, the output folder, and
TRL's arguments (the process group starts with them). Everything a user can get wrong is said here, at once, before
a 12B model spends minutes loading.
"""

from __future__ import annotations

import logging
import os

import torch
from trl import DPOConfig

from longdpo import patches
from longdpo.checks import (
    Problems,
    check_disk_space,
    check_optimizer,
    check_processes_per_gpu,
    check_recipe,
    deepspeed_config_path,
    resolve_report_to,
)
from longdpo.cluster.checkpoints import (
    check_resume_layout,
    check_resume_model,
    resolve_resume,
    steps_done,
    universal,
    written_by,
)
from longdpo.cluster.distributed import process_group, stale_build_locks
from longdpo.cluster.output_dir import PREEMPTED, EarlierRun, check_output_dir
from longdpo.cluster.signals import ResilienceCallback
from longdpo.config import RecipeError, load_recipe, trainer_default
from longdpo.levers import Build, levers, replica_ranks
from longdpo.planner.plan import needs_pairs
from longdpo.planner.preflight import preflight
from longdpo.training.callbacks import MemoryCallback

logger = logging.getLogger("train_dpo")


class StartUp:
    """The recipe and the checks of one run (built first, with no model and no process group)."""

    def __init__(self, cli: dict, allocator_record: dict):
        self.cli = cli
        recipe = self.recipe = load_recipe(cli["recipe"], cli["overrides"])
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.is_main = int(os.environ.get("RANK", 0)) == 0
        self.output_dir = recipe.trainer.get("output_dir", trainer_default("output_dir"))
        self.waits_for_pairs = needs_pairs(recipe)  # the preflight needs the data (longest pair; shared rows)
        self.prediction = None
        self.pairs = None  # the data's token counts, where the plan depends on them
        self.build = Build(world_size=self.world_size, is_main=self.is_main, state={"allocator": allocator_record})
        self.memory_callback = MemoryCallback(recipe.memory, self.build.step_telemetry, label=recipe.levers.name)
        self.load_universal = False  # the checkpoint's optimizer state is re-partitioned for this launch's ranks
        self.data_parallel = self.global_batch = 0  # ranks with their own pairs, and pairs per step (TRL's arguments)
        self.notes: list[str] = []  # start-up lines for the log, said once it is set up
        problems = Problems()
        if torch.cuda.is_available():
            with problems.check():
                check_processes_per_gpu(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), torch.cuda.device_count())
        with problems.check():
            self._resume_layout()
        with problems.check():
            check_recipe(recipe, world_size=self.world_size, cuda_available=torch.cuda.is_available())
        names = []
        with problems.check():
            names = check_output_dir(self.output_dir, cli["resume"], cli["overwrite"])
        self.earlier = EarlierRun(self.output_dir, names, acts=self.is_main)
        if not self.waits_for_pairs and (not problems.found or recipe.model.architecture or recipe.model.name_or_path):
            with problems.check():
                self._preflight(problems_found=bool(problems.found))
        problems.raise_if_any()

    def _resume_layout(self) -> None:
        """The checkpoint to resume, looked at before anything is loaded (rank 0 moves incomplete ones aside later):
        one this launch can load, and the global batch it trained with kept, unless the command line sets one (a
        requeue on other nodes keeps its data order)."""
        if self.cli["resume"] is None:
            return
        checkpoint = resolve_resume(self.cli["resume"], self.output_dir, is_main=False)
        check_resume_layout(checkpoint, deepspeed_config_path(self.recipe) is not None)
        recorded = written_by(checkpoint).global_batch if checkpoint else None
        data, given = self.recipe.data, "global_batch_size" in (self.cli["overrides"].get("data") or {})
        if recorded and not given and data.global_batch_size != recorded:
            recipe_says = f"; the recipe says {data.global_batch_size}" if data.global_batch_size else ""
            self.notes.append(
                f"data.global_batch_size {recorded}, as the checkpoint was trained{recipe_says} (pass "
                "--data.global_batch_size to change it)"
            )
            data.global_batch_size = recorded

    def _preflight(self, problems_found: bool = False) -> None:
        try:
            self.prediction = preflight(self.recipe, self.world_size, self.cli["preflight"], self.pairs, problems_found)
        except RecipeError:
            raise
        except Exception:
            if not problems_found:
                raise
            # a recipe already refused (a folder that holds no model, sp_size 0) cannot be planned: its problems say why

    def plan_on(self, pairs) -> None:
        """The preflight that waited for the pairs (their token counts, measured as TRL tokenizes them)."""
        if self.waits_for_pairs:
            self.pairs = pairs.lengths()
            self._preflight()
            self._all_checked()

    def _all_checked(self) -> None:
        """Every check has passed, TRL's too: the disk, and only then the earlier run set aside."""
        if self.recipe.run.check_disk:
            warning = check_disk_space(self.recipe, self.output_dir, self.cli["save"])
            if warning and self.is_main:
                logger.warning(warning)
        self.earlier.set_aside()
        if self.is_main:
            for lock in stale_build_locks():
                logger.warning(
                    "stale build lock %s (over 30 min old): if DeepSpeed's start hangs here, delete it", lock
                )

    def trainer_arguments(self) -> tuple[DPOConfig, ResilienceCallback]:
        """TRL's DPOConfig from the recipe's top level and the levers' `configure` stage (the process group starts
        here under DeepSpeed), logging, the per-GPU memory cap, and the guard that saves on signals and stops on
        non-finite values."""
        recipe, build = self.recipe, self.build
        kwargs = build.trainer_kwargs = dict(recipe.trainer)
        for lever in levers():
            lever.configure(recipe.levers, build)
        kwargs["report_to"] = resolve_report_to(kwargs)
        kwargs.setdefault("include_num_input_tokens_seen", "non_padding")
        kwargs.setdefault("dataloader_pin_memory", torch.cuda.is_available())  # on CPU torch warns it is unused
        kwargs.setdefault("bf16", torch.cuda.is_available() and recipe.model.dtype == "bfloat16")
        if recipe.memory.sgd_in_backward:  # the update happens in backward; the Trainer's SGD then finds no gradients
            kwargs.update(optim="sgd", max_grad_norm=0.0)
        kwargs.setdefault("ddp_timeout", 7200)  # a 64k step and a 12B save take minutes; a hang fails in 2 h
        # older checkpoints are rotated only once the new one is complete (longdpo/cluster/signals.py), not by TRL
        keep_checkpoints = kwargs.pop("save_total_limit", None)
        patches.distributed_on_cpu()
        try:
            args = build.args = DPOConfig(**kwargs)  # with `deepspeed` set this starts the process group
        except ValueError as e:  # transformers' and TRL's own checks of their fields
            raise RecipeError(f"TRL's DPOConfig refuses this recipe: {e}") from None
        check_optimizer(args)
        self.is_main = build.is_main = self.earlier.acts = args.process_index == 0
        level = logging.INFO if self.is_main else logging.WARNING
        logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", level=level)
        logging.getLogger("longdpo").setLevel(level)
        for note in self.notes if self.is_main else ():
            logger.info(note)
        if not self.waits_for_pairs:
            self._all_checked()
        cap = recipe.memory.memory_cap_gb
        if cap and torch.cuda.is_available():
            total = torch.cuda.get_device_properties(args.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 1e9 / total), args.device)
        self.data_parallel = args.world_size // replica_ranks(recipe.levers)
        self.global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * self.data_parallel
        layout = {"ranks": args.world_size, "global_batch": self.global_batch}
        guard = ResilienceCallback(recipe.run.save_on_signals, keep_checkpoints, recipe.run.on_nonfinite, layout)
        return args, guard

    def resume_point(self, args: DPOConfig) -> str | None:
        """The complete checkpoint to resume from (rank 0 first: it moves incomplete ones aside; the others then
        agree); a preemption marker from an earlier run is cleared once the run starts again."""
        dist = process_group()
        requested = self.cli["resume"]
        resume = resolve_resume(requested, args.output_dir, True) if self.is_main else None
        if dist:
            dist.barrier()
        if not self.is_main:
            resume = resolve_resume(requested, args.output_dir, False)
        check_resume_model(resume, self.recipe.model)
        writer = written_by(resume) if resume else None
        if writer and writer.deepspeed and writer.partitions != args.world_size:
            if self.is_main:
                universal(resume)
                logger.info(
                    "%s was written by %s ranks, this launch has %d: its optimizer state is loaded from DeepSpeed's "
                    "universal checkpoint, re-partitioned",
                    resume,
                    writer.partitions,
                    args.world_size,
                )
            if dist:
                dist.barrier()
            patches.separate_universal_steps()
            self.load_universal = True
        marker = os.path.join(args.output_dir, PREEMPTED)
        if self.is_main and os.path.exists(marker):
            os.remove(marker)
        done = steps_done(resume)
        if done is not None and 0 < args.max_steps <= done and self.is_main:
            logger.warning(
                "%s already reached max_steps %d (step %d): nothing left to train; raise `max_steps` to train further",
                resume,
                args.max_steps,
                done,
            )
        return resume
