"""Multi-process runs on a CPU-only machine (the CPU test path of DeepSpeed ZeRO-3 over gloo).

accelerate 1.16 picks a distributed backend from the detected accelerator; on a CPU-only box it detects none, so
under the `deepspeed` launcher (LOCAL_RANK set, no --use_cpu) every rank silently runs as a single process with a
world of one, and DeepSpeed then rejects the batch arithmetic. Nothing upstream maps "no accelerator" to gloo here,
so we tell its backend detection: device `cpu`, backend `gloo`. A no-op whenever a GPU is visible.
"""

from __future__ import annotations

import os


def teach_accelerate_cpu_gloo() -> bool:
    import torch

    if torch.cuda.is_available() or int(os.environ.get("LOCAL_RANK", -1)) == -1:
        return False
    import accelerate.state as state
    from accelerate.utils.constants import TORCH_DISTRIBUTED_BACKENDS

    TORCH_DISTRIBUTED_BACKENDS.setdefault("cpu", "gloo")
    detect = state.get_torch_accelerator_backend
    if getattr(detect, "_recipes_cpu", False):
        return True

    def detect_with_cpu(check_available: bool = True):
        device_type, module = detect(check_available)
        return (device_type, module) if device_type is not None else ("cpu", None)

    detect_with_cpu._recipes_cpu = True
    state.get_torch_accelerator_backend = detect_with_cpu
    return True
