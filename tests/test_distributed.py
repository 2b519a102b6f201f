"""recipes/distributed.py: no DeepSpeed shared-memory op on CPU, and a timed-out job leaves no process behind."""

import time

import pytest
import torch

from recipes.distributed import run_job, skip_cpu_shm_allreduce


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

    assert skip_cpu_shm_allreduce()
    assert build_shm_op() is None  # what DeepSpeed's TorchBackend calls at init_distributed
