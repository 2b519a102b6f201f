"""Complete checkpoints, and the one a run resumes from, on any number of ranks.

After every rank has written its part of `checkpoint-N` (ZeRO shards included), rank 0 writes
`checkpoint_complete.json`, the list of every file and its size, last. A checkpoint counts as complete when that
record exists and every file in it is there with its size. Older checkpoints are rotated away (`save_total_limit`)
only after the new one is complete. On resume the newest complete checkpoint is used; newer incomplete ones are moved
aside to `incomplete-checkpoint-N` (kept, never deleted) and named in the log. A checkpoint written by another model
(other shapes, LoRA or not, another LoRA rank) is refused before any model is built.

Another number of ranks. The completion record also says how the run was laid out (`run`: its ranks and its pairs per
optimizer step). DeepSpeed's ZeRO checkpoints hold each rank's part of the optimizer state, which only the same
number of ranks can load; resumed on another number (a preempted 8-GPU job requeued on 4, a node more or less), the
checkpoint is converted once into DeepSpeed's universal checkpoint (`ds_to_universal`: every parameter's fp32 weights
and optimizer moments whole, `global_stepN_universal` beside the checkpoint's own, kept for the next requeue) and
loaded from it (`checkpoint.load_universal`), re-partitioned for the ranks at hand. The global batch is kept (the
checkpoint's, unless the recipe sets `data.global_batch_size`; gradient accumulation is derived anew), so the data
order continues where it stopped. A checkpoint written under DeepSpeed resumed without it, or the reverse, is one line
at start-up saying what to run.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

from longdpo.config import RecipeError
from longdpo.model.build import load_architecture

logger = logging.getLogger(__name__)
COMPLETE = "checkpoint_complete.json"
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def mark_complete(folder: str, run: dict | None = None) -> None:
    """Record every file of a finished checkpoint with its size, and `run` (how the run was laid out: `written_by`),
    written last, then renamed into place."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            if name != COMPLETE:
                files[os.path.relpath(path, folder)] = os.path.getsize(path)
    tmp = os.path.join(folder, COMPLETE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"files": files, "run": run or {}}, f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, COMPLETE))


def why_incomplete(folder: str) -> str | None:
    """None when the checkpoint is complete, else what is missing (one phrase)."""
    record = os.path.join(folder, COMPLETE)
    if not os.path.exists(record):
        return "no completion record (killed while saving?)"
    try:
        files = json.load(open(record))["files"]
    except (ValueError, KeyError):
        return "a damaged completion record"
    for name, size in files.items():
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            return f"{name} is missing"
        if os.path.getsize(path) != size:
            return f"{name} has {os.path.getsize(path)} bytes, {size} were written"
    return None


def checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint-N folder, newest first."""
    if not os.path.isdir(output_dir):
        return []
    found = [
        (int(m.group(1)), os.path.join(output_dir, name))
        for name in os.listdir(output_dir)
        if (m := CHECKPOINT.match(name)) and os.path.isdir(os.path.join(output_dir, name))
    ]
    return sorted(found, reverse=True)


def last_complete(output_dir: str) -> str | None:
    return next((path for _, path in checkpoints(output_dir) if why_incomplete(path) is None), None)


def resolve_resume(requested, output_dir: str, is_main: bool) -> str | None:
    """The checkpoint to resume from. `requested`: None (start fresh), True (the newest complete one; an error if
    there is none), "auto" (the newest complete one, else start fresh) or a checkpoint folder (must be complete)."""
    if requested is None:
        return None
    if requested not in (True, "auto"):
        if not os.path.exists(requested):
            raise RecipeError(
                f"--resume_from_checkpoint {requested}: no such folder; pass a checkpoint folder, `true` (the newest "
                "complete checkpoint in output_dir) or `auto` (that, or a fresh start when there is none)."
            )
        problem = why_incomplete(requested) if os.path.isdir(requested) else "it is not a folder"
        if problem:
            newest = last_complete(os.path.dirname(os.path.abspath(requested)))
            hint = f"resume from {newest}" if newest else "start without --resume_from_checkpoint"
            raise RecipeError(f"Checkpoint {requested} is not complete ({problem}); {hint}.")
        return requested
    skipped = []
    for _, path in checkpoints(output_dir):
        problem = why_incomplete(path)
        if problem is None:
            if skipped and is_main:
                _move_aside(skipped)
            if is_main:
                logger.info("resuming from %s", path)
            return path
        skipped.append((path, problem))
    if skipped and is_main:
        _move_aside(skipped)
    if requested == "auto":
        if is_main:
            logger.info("no complete checkpoint in %s: starting from step 0", output_dir)
        return None
    found = f" (incomplete ones moved aside: {', '.join(p for p, _ in skipped)})" if skipped else ""
    raise RecipeError(
        f"No complete checkpoint in {output_dir} to resume from{found}; start without "
        "--resume_from_checkpoint, or use `--resume_from_checkpoint auto` (resume if there is one)."
    )


def _move_aside(skipped: list[tuple[str, str]]) -> None:
    for path, problem in skipped:
        aside = os.path.join(os.path.dirname(path), "incomplete-" + os.path.basename(path))
        while os.path.exists(aside):
            aside += "-again"
        os.rename(path, aside)
        logger.warning("skipped %s: %s; moved aside to %s (nothing deleted)", path, problem, aside)


# The fields of a model's config that set its parameters' shapes. A checkpoint written by a model of other shapes
# cannot be resumed: torch refuses its optimizer state, with a traceback, once the model is built ("loaded state
# dict contains a parameter group that doesn't match the size of optimizer's group").
SHAPE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)


def check_resume_model(checkpoint: str | None, model_args) -> None:
    """Before any model is built: the checkpoint to resume was written by the model this recipe builds (the same
    shapes; LoRA adapters or full fine-tuning, with the same rank)."""
    if checkpoint is None:
        return
    fix = "resume with the model settings that wrote it, or start a new run in another `output_dir`."
    adapter = os.path.join(checkpoint, "adapter_config.json")
    if os.path.exists(adapter) != bool(model_args.use_peft):
        held = "LoRA adapters" if os.path.exists(adapter) else "a full fine-tuning run's weights"
        raise RecipeError(
            f"`--resume_from_checkpoint`: {checkpoint} holds {held}, and this recipe sets "
            f"`model.use_peft: {str(bool(model_args.use_peft)).lower()}`; {fix}"
        )
    if os.path.exists(adapter):
        with open(adapter) as f:
            rank = json.load(f).get("r")
        if rank is not None and rank != model_args.lora_r:
            raise RecipeError(
                f"`--resume_from_checkpoint`: {checkpoint} holds LoRA adapters of rank {rank}, and this recipe sets "
                f"`model.lora_r: {model_args.lora_r}`; {fix}"
            )
    config = os.path.join(checkpoint, "config.json")
    if not os.path.exists(config):
        return
    with open(config) as f:
        saved = json.load(f)
    built = load_architecture(model_args).to_dict()
    for key in SHAPE_FIELDS:
        if saved.get(key) is not None and built.get(key) is not None and saved[key] != built[key]:
            raise RecipeError(
                f"`--resume_from_checkpoint`: {checkpoint} was written by a model with {key} {saved[key]}, and this "
                f"recipe builds one with {key} {built[key]}; {fix}"
            )


@dataclass(frozen=True)
class Writer:
    """How the run that wrote a checkpoint was laid out."""

    deepspeed: bool  # DeepSpeed's optimizer state (a `latest` tag and its folder of ZeRO partitions)
    partitions: int | None  # ZeRO partitions of the optimizer state: one per rank that wrote it
    global_batch: int | None  # pairs per optimizer step (the completion record's; None in older checkpoints)


def written_by(checkpoint: str) -> Writer:
    latest = os.path.join(checkpoint, "latest")
    partitions = None
    if os.path.exists(latest):
        with open(latest) as f:
            tag = f.read().strip()
        partitions = len(glob.glob(os.path.join(checkpoint, tag, "*optim_states.pt"))) or None
    try:
        with open(os.path.join(checkpoint, COMPLETE)) as f:
            run = json.load(f).get("run") or {}
    except (OSError, ValueError):
        run = {}
    return Writer(os.path.exists(latest), partitions, run.get("global_batch"))


def check_resume_layout(checkpoint: str | None, deepspeed: bool) -> None:
    """Before any model is built: a checkpoint this launch can load, with or without DeepSpeed."""
    if checkpoint is None:
        return
    writer = written_by(checkpoint)
    weights = (
        f"or start a new run from its weights with `--model.name_or_path {checkpoint}` (its optimizer state then "
        "starts afresh)"
    )
    if writer.deepspeed and not deepspeed:
        raise RecipeError(
            f"`--resume_from_checkpoint`: {checkpoint} holds DeepSpeed's optimizer state ({writer.partitions} "
            f"partitions) and this launch has no DeepSpeed config: resume it under DeepSpeed (`deepspeed --num_gpus "
            f"N launch/train_dpo.py ds_configs/zero3.json ...`, any N), {weights}."
        )
    if not writer.deepspeed and deepspeed:
        raise RecipeError(
            f"`--resume_from_checkpoint`: {checkpoint} was written by one process without DeepSpeed, and this launch "
            f"uses DeepSpeed: resume it as it was written (`python launch/train_dpo.py ...`, no DeepSpeed config), "
            f"{weights}."
        )


def universal(checkpoint: str) -> str:
    """The universal form of a DeepSpeed checkpoint (its optimizer state re-partitionable for any number of ranks),
    converted once and kept beside the checkpoint's own; rank 0 calls this while the others wait. Returns its tag."""
    with open(os.path.join(checkpoint, "latest")) as f:
        tag = f.read().strip()
    converted = os.path.join(checkpoint, f"{tag}_universal")
    done = os.path.join(checkpoint, "latest_universal")  # DeepSpeed's converter writes it last
    if os.path.exists(done) and os.path.isdir(converted):
        return os.path.basename(converted)
    shutil.rmtree(converted, ignore_errors=True)  # a conversion stopped half-way
    logger.info("converting %s to DeepSpeed's universal checkpoint (once): %s", checkpoint, converted)
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal"]
    command += ["--input_folder", os.path.join(checkpoint, tag), "--output_folder", converted]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"DeepSpeed's ds_to_universal failed on {checkpoint}:\n{(proc.stdout + proc.stderr)[-3000:]}"
        )
    return os.path.basename(converted)


def steps_done(checkpoint: str | None) -> int | None:
    """The optimizer step a checkpoint was saved at (its trainer_state.json), or None."""
    path = os.path.join(checkpoint, "trainer_state.json") if checkpoint else None
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f).get("global_step")


def rotate(output_dir: str, keep: int | None, best: str | None = None) -> None:
    """Keep the newest `keep` complete checkpoints (transformers' save_total_limit), after the new one is complete,
    and, as transformers does, the best one (load_best_model_at_end) besides."""
    if not keep:
        return
    complete = [path for _, path in checkpoints(output_dir) if why_incomplete(path) is None]
    best = os.path.abspath(best) if best else None
    for path in complete[keep:]:
        if os.path.abspath(path) != best:
            shutil.rmtree(path, ignore_errors=True)
