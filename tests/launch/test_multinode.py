"""Two nodes on one machine, over gloo: the multi-node launch forms README gives, each node's ranks started by its own
launcher. The SLURM script runs with stand-ins for `srun` and `scontrol` (tests/launch/slurm/): it starts DeepSpeed's
launcher on each node, forwards SLURM's SIGUSR1 to the ranks, and requeues; the requeued job gets one node."""

import json
import os
import signal
import subprocess
import time

import pytest
from conftest import BIN, ROOT, TINY, free_port, job_env, summary

# 4 pairs per optimizer step, as tests/launch/test_train_zero3.py's one-node runs
STEPS = ["--max_steps", "4", "--save_steps", "2", "--report_to", "none", "--per_device_train_batch_size", "2"]
STAND_INS = os.path.join(ROOT, "tests", "launch", "slurm")


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    """The curve of one node with 2 ranks (the reference every two-node run must give)."""
    from conftest import run_train

    out = tmp_path_factory.mktemp("one_node")
    run_train(out, *STEPS, launcher="deepspeed", procs=2)
    return summary(out)["losses"]


def test_accelerate_on_two_machines_gives_one_nodes_curve(one_node, tmp_path):
    port, procs = free_port(), []
    for rank in (0, 1):
        command = [os.path.join(BIN, "accelerate"), "launch", "--config_file"]
        command += [os.path.join(ROOT, "launch", "accelerate", "zero3.yaml"), "--num_machines", "2"]
        command += ["--machine_rank", str(rank), "--num_processes", "2", "--main_process_ip", "127.0.0.1"]
        command += ["--main_process_port", str(port), os.path.join(ROOT, "launch", "train_dpo.py")]
        command += ["--recipe", TINY, "--output_dir", str(tmp_path), *STEPS]
        log = open(tmp_path.parent / f"machine{rank}.log", "w")
        procs.append(subprocess.Popen(command, cwd=ROOT, env=job_env(), stdout=log, stderr=subprocess.STDOUT))
    assert [p.wait(timeout=300) for p in procs] == [0, 0], (tmp_path.parent / "machine0.log").read_text()[-3000:]
    assert summary(tmp_path)["world_size"] == 2
    assert summary(tmp_path)["losses"] == pytest.approx(one_node, abs=1e-5)


def slurm_job(out, nodes: int) -> subprocess.Popen:
    env = job_env(
        {
            "PATH": STAND_INS + os.pathsep + BIN + os.pathsep + os.environ["PATH"],
            "SLURM_JOB_NAME": "dpo",
            "SLURM_JOB_ID": "7",
            "SLURM_JOB_NODELIST": "node[0-1]",
            "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_NNODES": str(nodes),
            "GPUS_PER_NODE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "OUTPUT_DIR": str(out),
            "REQUEUED": str(out) + ".requeued",
        }
    )
    script = os.path.join(ROOT, "launch", "multinode", "slurm_dpo.sh")
    log = open(str(out) + f".{nodes}nodes.log", "w")
    return subprocess.Popen(
        ["bash", script, TINY, *STEPS, "--data.global_batch_size", "4"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def test_slurm_job_saves_on_its_signal_and_resumes_on_other_nodes(one_node, tmp_path):
    """Two nodes x 1 rank train one node's curve; SLURM's SIGUSR1 to the batch script after step 1 makes every rank
    save at the next step (a checkpoint complete only once both nodes' ranks wrote their part) and exit 75, and the
    job requeues; requeued on one node, it resumes from that checkpoint (the optimizer state re-partitioned, the
    global batch kept) and ends on the same curve."""
    out = tmp_path / "run"
    job = slurm_job(out, nodes=2)
    deadline = time.time() + 240
    while not (out / "memory.jsonl").exists() and job.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    job.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@900` does ahead of the time limit
    assert job.wait(timeout=240) == 75, open(str(out) + ".2nodes.log").read()[-4000:]
    saved = json.load(open(out / "preempted.json"))
    checkpoint = saved["checkpoint"]
    record = json.load(open(os.path.join(checkpoint, "checkpoint_complete.json")))
    shards = [name for name in record["files"] if name.endswith("optim_states.pt")]
    assert len(shards) == 2 and record["run"] == {"ranks": 2, "global_batch": 4}  # both nodes' parts, then complete
    assert open(str(out) + ".requeued").read().split() == ["7"]
    requeued = slurm_job(out, nodes=1)
    assert requeued.wait(timeout=300) == 0, open(str(out) + ".1nodes.log").read()[-4000:]
    assert "written by 2 ranks, this launch has 1" in open(str(out) + ".1nodes.log").read()
    assert summary(out)["world_size"] == 1
    # the two-node steps (kept in the checkpoint's log) and the one-node steps after them: one node's curve
    assert summary(out)["losses"] == pytest.approx(one_node, abs=1e-5)
