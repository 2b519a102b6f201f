"""Multi-process runs on a CPU-only machine (the CPU test path of DeepSpeed ZeRO-3 over gloo); launching a
multi-process job so that a timeout leaves none of its processes behind; naming stale JIT-build locks.

accelerate 1.16 picks a distributed backend from the detected accelerator; on a CPU-only box it detects none, so
under the `deepspeed` launcher (LOCAL_RANK set, no --use_cpu) every rank silently runs as a single process with a
world of one, and DeepSpeed then rejects the batch arithmetic. Nothing upstream maps "no accelerator" to gloo here,
so we tell its backend detection: device `cpu`, backend `gloo`. A no-op whenever a GPU is visible.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import time


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


def skip_cpu_shm_allreduce() -> bool:
    """Keep DeepSpeed from building its CPU shared-memory allreduce at `init_distributed` (a no-op on a GPU).

    ZeRO-3 training never calls it (only DeepSpeed inference's `inference_all_reduce` does), and it costs three
    ways: a g++ build at every first init; a file lock in ~/.cache/torch_extensions held during each load, which a
    rank killed mid-load leaves behind, so that every later DeepSpeed process on the machine waits on it forever
    (this hung CI); and a 66 MB /dev/shm segment per rank that is never unlinked, so each run leaked RAM until the
    24 GB test box had 3 GB left. DeepSpeed reads which ops it may build from one table, `__compatible_ops__`."""
    import torch

    if torch.cuda.is_available():
        return False
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # said, so that DeepSpeed does not guess it with a warning
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    return True


def stale_build_locks(max_age_s: float = 1800) -> list[str]:
    """Lock files of torch's extension builds (DeepSpeed JIT ops) older than any build takes. torch holds one while a
    process builds or loads an op; a process killed meanwhile leaves it, and later processes then wait on it forever
    at DeepSpeed's start. Deleting it is the fix."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()  # where torch builds them
    now = time.time()
    return sorted(p for p in glob.glob(os.path.join(root, "**", "lock"), recursive=True)
                  if now - os.path.getmtime(p) > max_age_s)


def run_job(cmd: list[str], timeout: float, **popen_kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run` in a process group of its own. On timeout every process of the job is killed (a launcher's
    ranks too, which would otherwise live on holding ports, memory and file locks) and the return code is 124,
    with the output so far."""
    popen_kwargs = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **popen_kwargs}
    with subprocess.Popen(cmd, start_new_session=True, **popen_kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            return subprocess.CompletedProcess(cmd, 124, out, err)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def max_over_ranks(values: list[float]) -> list[float]:
    """Element-wise MAX of `values` over every rank (one all-reduce; a CUDA tensor under NCCL); as given in one
    process."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()
