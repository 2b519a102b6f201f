"""Every change this project makes to a library it depends on, in one place, so that a version bump starts here.

Each entry says what was broken (or missing), how it was seen, and the version it was seen on. Our memory levers
wrap model modules' forwards on the instance (longdpo/model/) and are not library patches; the trainer subclass
(longdpo/training/trainer.py) overrides TRL's methods through inheritance. What is left is here:

1. accelerate 1.16, CPU-only machine, deepspeed launcher: accelerate picks its distributed backend from the
   detected accelerator and detects none on a CPU, so every rank ran as a single process with a world of one and
   DeepSpeed then rejected the batch arithmetic. Its backend detection is taught "cpu -> gloo" (`distributed_on_cpu`).
2. DeepSpeed 0.19.8, CPU: `init_distributed` JIT-builds a shared-memory allreduce op that ZeRO-3 training never
   calls. The build took a file lock that a killed rank left behind, hanging every later DeepSpeed start on the
   machine (seen in CI), and each rank leaked a 66 MB /dev/shm segment. The op is marked incompatible in DeepSpeed's
   op table (`distributed_on_cpu`).
3. TRL 1.16's fused LM head (`trl.trainer.utils._ChunkedLogProbFunction`): under ZeRO-3 with activation offloading
   its backward crashed at the first step (`'Tensor' object has no attribute 'ds_status'`, one H200); and its
   backward builds an fp32 gradient of the whole head. Swapped for our subclasses while training
   (`trl_log_prob_function`; the classes live in longdpo/levers/lean_lm_head.py).
4. The innermost optimizer's `step` (DeepSpeed's ZeRO optimizer, or torch's): under DeepSpeed the real step runs
   inside accelerate's backward, so no Trainer callback can tell the optimizer step's memory peak from the
   backward's. Its `step` is wrapped on the instance to record both (`measure_optimizer_step`).
5. TRL 1.16 and PEFT 0.21 call transformers 5.24's deprecated `gradient_checkpointing_*` names: a FutureWarning on
   every run that no user can act on. Filtered by its message (`quiet_deprecation_warnings`).
6. TRL 1.16's model card names the base model by Hub id only: a local directory or a random initialisation read
   "a fine-tuned version of [None](https://huggingface.co/None)" and `pipeline(model="None")`, seen in the card of
   every run from a local model. The card is rewritten after saving (`name_model_card`).
7. DeepSpeed 0.19.8, ZeRO-3 loading a universal checkpoint (`load_hp_checkpoint_state_from_checkpoint_dir_stage3`)
   gives every optimizer sub-group the same `step` tensor; torch's fused AdamW then increments it once per sub-group
   per step, and Adam's bias correction runs ahead: a run resumed that way drifted from the uninterrupted one from its
   second step (tiny model, 2 sub-groups: 6.7e-5 in the loss, then 1.8e-3). Each sub-group gets its own copy
   (`separate_universal_steps`).

This module is imported before the recipe's allocator setting is applied, when torch must not be imported yet: the
imports of torch and of the libraries that import it wait inside the functions.
"""

from __future__ import annotations

import contextlib
import os
import warnings


def distributed_on_cpu() -> bool:
    """1 and 2 above; a no-op when a GPU is visible. Returns whether it applied."""
    import torch

    if torch.cuda.is_available():
        return False
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # said, so that DeepSpeed does not guess it with a warning
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    if int(os.environ.get("LOCAL_RANK", -1)) == -1:  # one process: no backend to pick
        return True
    import accelerate.state as state
    from accelerate.utils.constants import TORCH_DISTRIBUTED_BACKENDS

    TORCH_DISTRIBUTED_BACKENDS.setdefault("cpu", "gloo")
    detect = state.get_torch_accelerator_backend
    if not getattr(detect, "_longdpo_cpu", False):

        def detect_with_cpu(check_available: bool = True):
            device_type, module = detect(check_available)
            return (device_type, module) if device_type is not None else ("cpu", None)

        detect_with_cpu._longdpo_cpu = True
        state.get_torch_accelerator_backend = detect_with_cpu
    return True


@contextlib.contextmanager
def trl_log_prob_function(function):
    """3 above: inside this block TRL's fused LM head runs as `function` (a subclass of TRL's), for every model."""
    import trl.trainer.utils as trl_utils

    previous = trl_utils._ChunkedLogProbFunction
    trl_utils._ChunkedLogProbFunction = function
    try:
        yield
    finally:
        trl_utils._ChunkedLogProbFunction = previous


def measure_optimizer_step(optimizer, record) -> None:
    """4 above: `record(before, during)` with [max allocated, max reserved] before and during each step."""
    import torch

    inner = optimizer
    while hasattr(inner, "optimizer"):  # accelerate's wrapper -> DeepSpeed's ZeRO optimizer -> ...
        if hasattr(inner, "step") and type(inner).__module__.startswith("deepspeed"):
            break
        inner = inner.optimizer
    if inner is None or not hasattr(inner, "step"):
        return
    step = inner.step

    def measured_step(*a, **k):
        before = [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()]
        torch.cuda.reset_peak_memory_stats()
        try:
            return step(*a, **k)
        finally:
            record(before, [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()])

    inner.step = measured_step


def quiet_deprecation_warnings() -> None:
    """5 above."""
    warnings.filterwarnings(
        "ignore", message=r"`(is_)?gradient_checkpointing\w*` is deprecated", category=FutureWarning
    )


def separate_universal_steps() -> None:
    """7 above."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    load = Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3
    if getattr(load, "_longdpo_steps", False):
        return

    def load_with_own_steps(self, checkpoint_dir):
        load(self, checkpoint_dir)
        for flat in self.fp32_partitioned_groups_flat:
            state = self.optimizer.state.get(flat)
            if state and hasattr(state.get("step"), "clone"):
                state["step"] = state["step"].clone()

    load_with_own_steps._longdpo_steps = True
    Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3 = load_with_own_steps


def name_model_card(output_dir: str, base: str) -> None:
    """6 above: the card in `output_dir` names `base` (a Hub id, a folder, or what a random-init model came from)."""
    card = os.path.join(output_dir, "README.md")
    if not os.path.exists(card):
        return
    with open(card) as f:
        text = f.read()
    text = text.replace(
        "a fine-tuned version of [None](https://huggingface.co/None)", f"a fine-tuned version of {base}"
    )
    text = text.replace('model="None"', f'model="{output_dir}"')
    with open(card, "w") as f:
        f.write(text)
