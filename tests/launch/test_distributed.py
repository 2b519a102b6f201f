"""Processes: no DeepSpeed shared-memory op on CPU (longdpo/patches.py), a timed-out job leaves no process behind, a
stale build lock is named at start (longdpo/cluster/distributed.py)."""

import os
import time

import pytest
import torch
from conftest import run_train

from longdpo.cluster.distributed import run_job, stale_build_locks
from longdpo.patches import distributed_on_cpu


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, waiting to be reaped
    except FileNotFoundError:
        return False


def test_timeout_kills_every_process_of_the_job(tmp_path):
    # bash stands in for a launcher, its background sleep for a rank: plain subprocess.run would leave the rank
    pid_file = tmp_path / "rank.pid"
    proc = run_job(["bash", "-c", f"sleep 120 & echo $! > {pid_file}; echo launched; wait"], timeout=3)
    assert proc.returncode == 124 and "launched" in proc.stdout
    rank = int(pid_file.read_text())
    deadline = time.time() + 10
    while _running(rank) and time.time() < deadline:
        time.sleep(0.1)
    assert not _running(rank)


def test_a_job_that_finishes_keeps_its_code_and_output():
    proc = run_job(["bash", "-c", "echo out; echo err >&2; exit 3"], timeout=30)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "out\n", "err\n")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU shared-memory op is only skipped without a GPU")
def test_deepspeed_builds_no_shared_memory_allreduce_on_cpu():
    from deepspeed.comm.torch import build_shm_op

    assert distributed_on_cpu()
    assert build_shm_op() is None  # what DeepSpeed's TorchBackend calls at init_distributed


def test_a_stale_build_lock_is_named_before_deepspeed_starts(tmp_path):
    """A lock left by a process killed mid-build makes every later DeepSpeed start wait forever: say which file."""
    fresh, stale = tmp_path / "ext" / "op_a" / "lock", tmp_path / "ext" / "op_b" / "lock"
    for lock in (fresh, stale):
        lock.parent.mkdir(parents=True)
        lock.touch()
    hour_ago = time.time() - 3600
    os.utime(stale, (hour_ago, hour_ago))
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_EXTENSIONS_DIR", env["TORCH_EXTENSIONS_DIR"])
        assert stale_build_locks() == [str(stale)]  # a fresh lock may be a build in progress
    proc = run_train(tmp_path / "run", "--max_steps", "1", "--report_to", "none", env=env)
    assert f"stale build lock {stale}" in proc.stdout and str(fresh) not in proc.stdout
