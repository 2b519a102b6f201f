"""launch/train_dpo.py with one fault injected, for the tests of what a run does when things go wrong. Launched like
train_dpo.py, with the same arguments; the fault comes from the environment variable FAULT (test code only: the
library itself reads no fault switches):

    FAULT=nan:3            the loss of step 3 is NaN on every rank
    FAULT=oom:3            step 3 starts with a CUDA out-of-memory error (none can be provoked on a CPU)
    FAULT=signal:3:SIGUSR1 after step 3, rank 0 signals its whole process group, as SLURM signals a job
    FAULT=signal:0:SIGTERM the same while the models load (once the trainer is built, before the first step)
    FAULT=disk:1000000     the output dir's disk has this many bytes free
"""

import os
import runpy
import signal

import torch

from longdpo import checks
from longdpo.cluster.signals import ResilienceCallback
from longdpo.training.callbacks import MemoryCallback

KIND, _, REST = os.environ["FAULT"].partition(":")
STEP, _, NAME = REST.partition(":")

if KIND == "nan":  # TRL's loss itself, so that our trainer's guard sees it as it would a real one
    from trl import DPOTrainer

    trl_loss = DPOTrainer.compute_loss

    def nan_at_step(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = trl_loss(self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if model.training and self.state.global_step + 1 == int(STEP):
            out = (out[0] * float("nan"), *out[1:]) if return_outputs else out * float("nan")
        return out

    DPOTrainer.compute_loss = nan_at_step
elif KIND == "oom":
    begin = MemoryCallback.on_step_begin

    def oom(self, args, state, control, **kwargs):
        if state.global_step + 1 == int(STEP):
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return begin(self, args, state, control, **kwargs)

    MemoryCallback.on_step_begin = oom
elif KIND == "signal" and int(STEP) > 0:
    end = ResilienceCallback.on_step_end

    def signal_then_end(self, args, state, control, **kwargs):
        if state.global_step == int(STEP) and state.is_world_process_zero:
            os.killpg(os.getpgrp(), getattr(signal, NAME))
        return end(self, args, state, control, **kwargs)

    ResilienceCallback.on_step_end = signal_then_end
elif KIND == "signal" and int(STEP) == 0:
    from longdpo.training import run

    build = run.build_trainer

    def build_then_signal(start, *args):
        trainer = build(start, *args)
        if start.is_main:
            os.killpg(os.getpgrp(), getattr(signal, NAME))
        return trainer

    run.build_trainer = build_then_signal
elif KIND == "disk":
    checks.free_bytes = lambda output_dir: int(STEP)
else:
    raise SystemExit(f"unknown FAULT {os.environ['FAULT']!r}")

runpy.run_path(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "launch", "train_dpo.py"),
    run_name="__main__",
)
