"""Save on preemption, stop (or skip) on a non-finite loss or gradient norm, mark checkpoints complete.

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
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal

import psutil
import torch
import torch.distributed as dist
from transformers import TrainerCallback

from longdpo.cluster.checkpoints import mark_complete, rotate
from longdpo.cluster.distributed import max_over_ranks
from longdpo.cluster.output_dir import PREEMPTED

logger = logging.getLogger(__name__)


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

    def __init__(self, signals: list[str], keep: int | None, on_nonfinite: str = "stop", layout: dict | None = None):
        """`layout`: how the run is laid out (its ranks, its pairs per optimizer step), recorded in each checkpoint's
        completion record so that a resume on another number of ranks keeps the global batch."""
        self.layout = layout or {}
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
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank's files (ZeRO shards) are written
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if state.is_world_process_zero and os.path.isdir(folder):
            mark_complete(folder, self.layout)
            rotate(args.output_dir, self.keep, state.best_model_checkpoint)
            if self.preempted_at is not None:
                with open(os.path.join(args.output_dir, PREEMPTED), "w") as f:
                    json.dump({"step": state.global_step, "signal": self.signal_received, "checkpoint": folder}, f)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        return control
