"""Processes: launching a multi-process job so that a timeout leaves none of its processes behind, naming stale
JIT-build locks, the process group and collectives over it. (What multi-process runs on a CPU need of accelerate and
DeepSpeed is in longdpo/patches.py.) The entrypoint uses this module before the allocator setting is applied (and the
tests to launch jobs without torch): its imports of torch wait inside the functions."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time


def stale_build_locks(max_age_s: float = 1800) -> list[str]:
    """Lock files of torch's extension builds (DeepSpeed JIT ops) older than any build takes. torch holds one while a
    process builds or loads an op; a process killed meanwhile leaves it, and later processes then wait on it forever
    at DeepSpeed's start. Deleting it is the fix."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()  # where torch builds them
    now = time.time()
    return sorted(
        p for p in glob.glob(os.path.join(root, "**", "lock"), recursive=True) if now - os.path.getmtime(p) > max_age_s
    )


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


def process_group():
    """torch.distributed when a process group is up, else None (imported late: the allocator wants torch unloaded)."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def gather(value) -> list:
    """`value` from every rank, in rank order ([value] in one process)."""
    dist = process_group()
    if dist is None:
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


ERROR_GRACE_S = 10  # how long a rank other than 0 waits before saying an error rank 0 says too


def say_recipe_error(error: Exception) -> int:
    """A recipe's mistake is every rank's: said once, by rank 0. Returns the exit status, 2.

    The launchers end every rank as soon as one exits with an error: a rank that returned at once was seen (1 run in
    4, 2 CPU ranks) to get rank 0 killed before it printed. So the other ranks wait for rank 0 to say it, and say it
    themselves only if still alive then (the error was theirs alone)."""
    if int(os.environ.get("RANK", 0)) != 0:
        time.sleep(ERROR_GRACE_S)
    for line in str(error).splitlines():
        print(f"error: {line}", file=sys.stderr)
    return 2
