"""Long runs survive the cluster: save on preemption, resume only from complete checkpoints, check the disk, stop on
a non-finite loss or gradient norm.

Preemption. SIGUSR1 and SIGTERM (`run.save_on_signals`) only raise a flag; at the next optimizer-step boundary every
rank agrees on it (one MAX all-reduce per step, shared with the non-finite check), the Trainer saves a checkpoint of
that step, and the process exits with status 75 after writing `preempted.json` to the output dir.
Resuming with `--resume_from_checkpoint auto` continues the same curve. A signal that comes while the models load
stops the run before its first step (nothing to save), since the launcher's kill would cut a long first step short.
The launcher going away counts as a signal too. SIGTERM to the `deepspeed` command ends it at once without telling
anyone (DeepSpeed 0.19's runner installs no handler on one node): its per-node `deepspeed.launcher.launch` and the
ranks lived on, training and saving nothing, until a SIGTERM sent by hand to that inner launcher. So each rank
notes the launcher processes above it at start-up and checks them at every step boundary. Inner launchers that do get
the signal (DeepSpeed's per-node launcher, torch's elastic agent under `accelerate launch`) pass SIGTERM on and kill
the ranks 30 s later, which a long-context step and a 12B save may outlast: on SLURM ask for SIGUSR1 ahead of the
time limit and keep the launcher from dying of it (launch/multinode/slurm_dpo.sh shows both).

One run per output dir. A dir that holds an earlier run's checkpoints or records is refused at start-up unless the
run resumes it (`--resume_from_checkpoint`) or `--overwrite_output_dir` deletes them first: training into it would
overwrite some checkpoints and leave others, and a later resume could pick up the other run's.

Complete checkpoints. After every rank has written its part of `checkpoint-N` (ZeRO shards included), rank 0 writes
`checkpoint_complete.json`, the list of every file and its size, last. A checkpoint counts as complete when that
record exists and every file in it is there with its size. Older checkpoints are rotated away (`save_total_limit`)
only after the new one is complete. On resume the newest complete checkpoint is used; newer incomplete ones are moved
aside to `incomplete-checkpoint-N` (kept, never deleted) and named in the log.

Disk. At start-up, before any model is loaded: the size of one checkpoint (ZeRO-3: 16 bytes per parameter for the
fp32 master weights, Adam moments and 16-bit states, plus the 16-bit model; one process: the weights plus two Adam
moments in the parameter dtype) times the checkpoints kept, against the free space of the output dir. A warning
when they will not all fit, an error when not even one does.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal
import tempfile

import torch
from transformers import TrainerCallback

from longdpo.cluster.distributed import max_over_ranks
from longdpo.config import RecipeError

logger = logging.getLogger(__name__)
COMPLETE = "checkpoint_complete.json"
PREEMPTED = "preempted.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# What a run leaves in its output dir besides checkpoints, and so what marks the dir as holding a run
RUN_RECORDS = (PREEMPTED, "train_summary.json", "memory.jsonl", "memory_summary.md", "memory.png", "runs")


# ---- complete checkpoints ------------------------------------------------------------------------------------------


def mark_complete(folder: str) -> None:
    """Record every file of a finished checkpoint with its size (written last, then renamed into place)."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            if name != COMPLETE:
                files[os.path.relpath(path, folder)] = os.path.getsize(path)
    tmp = os.path.join(folder, COMPLETE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"files": files}, f, indent=0)
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
        if (m := _CHECKPOINT.match(name)) and os.path.isdir(os.path.join(output_dir, name))
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


def earlier_run(output_dir: str) -> list[str]:
    """The names in `output_dir` that an earlier run wrote: its checkpoints (complete or not) and its records."""
    if not os.path.isdir(output_dir):
        return []
    return sorted(
        name
        for name in os.listdir(output_dir)
        if _CHECKPOINT.match(name)
        or name in RUN_RECORDS
        or name.startswith(("incomplete-checkpoint-", SET_ASIDE_PREFIX))
    )


def check_output_dir(output_dir: str, resume, overwrite: bool) -> list[str]:
    """Start-up check of the output dir; returns what `--overwrite_output_dir` is to replace (nothing is moved
    here: other checks may still refuse the run)."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise RecipeError(f"`output_dir` {output_dir!r} is a file; set `output_dir` to a folder path.")
    existing = os.path.abspath(output_dir)  # the folder it will be created in (nothing is created here)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise RecipeError(
            f"`output_dir` {output_dir!r} cannot be created: {existing} is a file; set `output_dir` to a folder path."
        )
    if not os.access(existing, os.W_OK):
        raise RecipeError(f"`output_dir` {output_dir!r} cannot be written ({existing} is not writable for you).")
    found = earlier_run(output_dir)
    if overwrite and resume is not None:
        raise RecipeError(
            "--overwrite_output_dir deletes the checkpoints that --resume_from_checkpoint would "
            "continue from; pass one of the two."
        )
    if found and resume is None and not overwrite:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise RecipeError(
            f"`output_dir` {output_dir} holds an earlier run ({shown}); resume it with "
            "`--resume_from_checkpoint auto`, choose another `output_dir`, or pass "
            "`--overwrite_output_dir` to delete that run's checkpoints and records first."
        )
    return found if overwrite else []


# --overwrite_output_dir moves the earlier run into one hidden folder of output_dir (a rename: instant for checkpoints
# of any size) and deletes it only once training starts: a run stopped before then (a bad data file, a setting TRL's
# trainer refuses, a model that fails to load, Ctrl-C) puts it back, so a refused rerun loses nothing. A folder left
# by a killed process counts as part of an earlier run (earlier_run), so the next start sees it.
SET_ASIDE_PREFIX = ".overwritten-"


def set_aside_earlier_run(output_dir: str, names: list[str]) -> str | None:
    if not names:
        return None
    aside = tempfile.mkdtemp(prefix=SET_ASIDE_PREFIX, dir=output_dir)
    for name in names:
        os.rename(os.path.join(output_dir, name), os.path.join(aside, name))
    logger.warning(
        "--overwrite_output_dir: the earlier run's %s set aside in %s until training starts", ", ".join(names), aside
    )
    return aside


def delete_set_aside(aside: str | None) -> None:
    if aside and os.path.isdir(aside):
        names = sorted(os.listdir(aside))
        shutil.rmtree(aside)
        logger.warning(
            "--overwrite_output_dir: deleted the earlier run's %s from %s", ", ".join(names), os.path.dirname(aside)
        )


def put_back_earlier_run(aside: str | None) -> None:
    """The run stopped before training: the earlier run goes back where it was (a name this run wrote meanwhile,
    unless an empty folder, keeps the earlier one's copy in `aside`, said in one line)."""
    if not aside or not os.path.isdir(aside):
        return
    output_dir, kept = os.path.dirname(aside), []
    for name in sorted(os.listdir(aside)):
        target = os.path.join(output_dir, name)
        if os.path.isdir(target) and not os.listdir(target):
            os.rmdir(target)
        if os.path.exists(target):
            kept.append(name)
        else:
            os.rename(os.path.join(aside, name), target)
    if kept:
        logger.warning("the earlier run's %s kept in %s (this run wrote the same names)", ", ".join(kept), aside)
    else:
        os.rmdir(aside)
        logger.warning("stopped before training: the earlier run is back in %s, untouched", output_dir)


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
    from longdpo.model.build import load_architecture

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


# ---- disk ----------------------------------------------------------------------------------------------------------


def free_bytes(output_dir: str) -> int:
    path = os.path.abspath(output_dir)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def check_disk(output_dir: str, one_checkpoint: float, kept: int, final_weights: float) -> str | None:
    """A RecipeError when not even one checkpoint (or the final model) fits; a warning line when all of them do
    not; None when they do."""
    free = free_bytes(output_dir)
    first = one_checkpoint if kept else final_weights
    total = kept * one_checkpoint + final_weights
    if first > free:
        what = "one checkpoint" if kept else "the final model"
        raise RecipeError(
            f"{what} needs {first / 1e9:.1f} GB but {output_dir} has {free / 1e9:.1f} GB free; free "
            "space there or set `output_dir` to a larger disk."
        )
    if total > free:
        return (
            f"disk: {kept} checkpoint(s) of {one_checkpoint / 1e9:.1f} GB plus the final model "
            f"({final_weights / 1e9:.1f} GB) need {total / 1e9:.1f} GB, {output_dir} has {free / 1e9:.1f} GB "
            "free: lower `save_total_limit` or free space before the later saves"
        )
    return None


def disk_check(recipe, output_dir: str, final_save: bool) -> str | None:
    """A recipe's checkpoints and final model against the output dir's free space, before any model is loaded: an
    error when not even one fits, a warning line (returned) when not all kept ones do."""
    from longdpo.checks import check_deepspeed_config
    from longdpo.model.build import load_architecture
    from longdpo.planner.plan import checkpoint_bytes, checkpoints_kept, count_params

    try:
        params = count_params(load_architecture(recipe.model))[0]
    except (AttributeError, KeyError, TypeError):  # an architecture the planner cannot size
        return None
    t = recipe.trainer
    dtype_bytes = 4 if recipe.model.dtype == "float32" else 2
    ds_path = t.get("deepspeed") or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    zero3 = bool(ds_path) and check_deepspeed_config(ds_path).get("zero_optimization", {}).get("stage") == 3
    final, lora = params * dtype_bytes, 0
    if recipe.model.use_peft:  # the adapters (fp32), and the merged model when asked
        from longdpo.model.lora import adapter_params

        lora = adapter_params(recipe.model)
        final = lora * 4 + (final if recipe.model.lora_save_merged else 0)
    one = checkpoint_bytes(params, dtype_bytes, zero3, not t.get("save_only_model"), lora)
    return check_disk(output_dir, one, checkpoints_kept(t), final if final_save else 0)


# ---- preemption and non-finite values ------------------------------------------------------------------------------

_CODES = {None: 0.0, "gradient norm": 1.0, "loss": 2.0}  # MAX over ranks: a bad loss (the cause) outranks its norm
# How launchers appear in a process's argv (a console script, or `python -m module`)
LAUNCHER_SCRIPTS = {"deepspeed", "accelerate", "torchrun"}
LAUNCHER_MODULES = {
    "deepspeed.launcher.launch",
    "deepspeed.launcher.runner",
    "torch.distributed.run",
    "torch.distributed.launch",
    "accelerate.commands.launch",
}


def launcher_processes() -> list[tuple]:
    """(process, name) of each launcher above this process, nearest first: for `deepspeed`, the per-node
    `deepspeed.launcher.launch` and the `deepspeed` command; for `accelerate launch`, that command. None under a
    plain `python`."""
    import psutil

    found, proc = [], psutil.Process().parent()
    while proc is not None and proc.pid > 1:
        try:
            argv = proc.cmdline()[:4]
            parent = proc.parent()
        except psutil.Error:
            break
        name = next((a for a in argv if os.path.basename(a) in LAUNCHER_SCRIPTS or a in LAUNCHER_MODULES), None)
        if name is None:
            break
        found.append((proc, os.path.basename(name)))
        proc = parent
    return found


def launcher_gone(launchers: list[tuple]) -> str | None:
    """How the first launcher that has exited is named in the log ('the launcher `deepspeed` (pid 123)'), or None.
    A process that has exited but is not yet reaped by its parent (a zombie) has exited."""
    import psutil

    for proc, name in launchers:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                continue
        except psutil.Error:
            pass
        return f"the launcher `{name}` (pid {proc.pid}) exited"
    return None


def _innermost_is_deepspeed(optimizer) -> bool:
    while optimizer is not None:
        if type(optimizer).__module__.startswith("deepspeed"):
            return True
        optimizer = getattr(optimizer, "optimizer", None)
    return False


class ResilienceCallback(TrainerCallback):
    """Saves and stops on a signal (all ranks at the same step); on a non-finite loss or gradient norm stops, or with
    `skip` leaves that step's update out; marks each checkpoint complete and rotates the old ones after it.

    Skipping: without DeepSpeed the step's gradients are dropped before the optimizer step (every rank agrees
    first), so neither weights nor optimizer state move. DeepSpeed ZeRO-3 (0.19) already discards an update whose
    global gradient norm is not finite (stage3.py `step`: an invalid norm counts as an overflow, the gradients are
    cleared); a non-finite loss there is skipped the same way once its gradients are non-finite, as a NaN loss's are."""

    def __init__(self, signals: list[str], keep: int | None, on_nonfinite: str = "stop"):
        self.keep = keep
        self.skip = on_nonfinite == "skip"
        self.skipped: list[tuple[int, str]] = []  # (step, quantity) left out with `skip`
        self.signal_received: str | None = None  # a signal's name, or "launcher exited"
        self.stop_reason: str | None = None  # for the log: "SIGTERM received", "the launcher `deepspeed` ... exited"
        self.nonfinite: str | None = None  # "gradient norm", on this rank, this step
        self._loss_bad: torch.Tensor | None = None  # any non-finite loss this step, read at the step's end (no sync)
        self.preempted_at: int | None = None
        self.stopped: tuple[int, str] | None = None  # (step, quantity)
        for name in signals:
            signal.signal(getattr(signal, name), self._on_signal)
        self.launchers = launcher_processes() if signals else []

    def _on_signal(self, signum, frame):
        self.signal_received = signal.Signals(signum).name  # acted on at the next step boundary
        self.stop_reason = f"{self.signal_received} received"

    def saw_loss(self, loss: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss.detach()).all()
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad

    def saw_grad_norm(self, grad_norm) -> None:
        if grad_norm is not None and not math.isfinite(float(grad_norm)):
            self.nonfinite = self.nonfinite or "gradient norm"

    def _local_nonfinite(self) -> str | None:
        if self._loss_bad is not None and bool(self._loss_bad):
            self.nonfinite = "loss"
        self._loss_bad = None
        return self.nonfinite

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if not self.skip or _innermost_is_deepspeed(optimizer):  # DeepSpeed's step already ran, in backward
            return control
        (bad,) = max_over_ranks([_CODES[self._local_nonfinite()]])
        if bad:
            optimizer.zero_grad(set_to_none=True)  # parameters without gradients are not updated
        return control

    def note_launcher_gone(self) -> None:
        """The launcher having exited counts as a signal (checked at step boundaries and before training)."""
        if self.signal_received is None and (gone := launcher_gone(self.launchers)):
            self.signal_received, self.stop_reason = "launcher exited", gone

    def on_step_end(self, args, state, control, **kwargs):
        self.note_launcher_gone()
        preempt, nonfinite = max_over_ranks([float(self.signal_received is not None), _CODES[self._local_nonfinite()]])
        self.nonfinite = None
        quantity = "loss" if nonfinite == 2.0 else "gradient norm"
        if nonfinite and self.skip:
            self.skipped.append((state.global_step, quantity))
            if state.is_world_process_zero:
                logger.warning(
                    "step %d: the %s is not finite; its update was left out (run.on_nonfinite: skip)",
                    state.global_step,
                    quantity,
                )
        elif nonfinite:  # stop here, save nothing: the weights may already hold the bad update
            self.stopped = (state.global_step, quantity)
            control.should_training_stop = True
            control.should_save = False
        if preempt and not self.stopped:
            self.preempted_at = state.global_step
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank's files (ZeRO shards) are written
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if state.is_world_process_zero and os.path.isdir(folder):
            mark_complete(folder)
            rotate(args.output_dir, self.keep, state.best_model_checkpoint)
            if self.preempted_at is not None:
                with open(os.path.join(args.output_dir, PREEMPTED), "w") as f:
                    json.dump({"step": state.global_step, "signal": self.signal_received, "checkpoint": folder}, f)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        return control
