"""Long runs survive the cluster: save on a signal and resume the same curve, skip half-written checkpoints, check
the disk before loading anything, stop on a non-finite loss (longdpo/cluster/)."""

import json
import math
import os
import shutil
import signal
import subprocess
import time

import pytest
from conftest import (
    BIN,
    FAULTS,
    ROOT,
    TINY,
    TRAIN,
    ZERO3,
    ZERO3_STEPS,
    free_port,
    job_env,
    launch_command,
    run_train,
    summary,
)

from longdpo import checks
from longdpo.cluster import checkpoints, output_dir
from longdpo.cluster.distributed import run_job
from longdpo.config import RecipeError, load_recipe, parse_overrides
from longdpo.planner.plan import checkpoint_bytes, checkpoints_kept

ARGS = ["--max_steps", "6", "--save_steps", "2", "--report_to", "none"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run every interrupted one must reproduce."""
    out = tmp_path_factory.mktemp("straight")
    run_train(out, *ARGS)
    return out


def steps_ran(out) -> list[int]:
    return [json.loads(line)["step"] for line in open(os.path.join(out, "memory.jsonl"))]


def test_every_saved_checkpoint_is_marked_complete(straight):
    for step in (2, 4, 6):
        assert checkpoints.why_incomplete(os.path.join(straight, f"checkpoint-{step}")) is None


def test_sigterm_saves_at_that_step_exits_75_and_resume_continues_the_curve(straight, tmp_path):
    proc = run_train(tmp_path, *ARGS, check=False, script=FAULTS, env={"FAULT": "signal:3:SIGTERM"})
    assert proc.returncode == 75, proc.stdout[-3000:]
    assert "SIGTERM received: saved checkpoint-3 and stopped" in proc.stdout
    assert json.load(open(tmp_path / "preempted.json"))["step"] == 3
    assert checkpoints.why_incomplete(str(tmp_path / "checkpoint-3")) is None
    assert not (tmp_path / "model.safetensors").exists()  # no final model: the run is not finished
    run_train(tmp_path, *ARGS, "--resume_from_checkpoint", "auto")
    assert steps_ran(tmp_path) == [1, 2, 3, 4, 5, 6]  # 1-3 before the signal, 4-6 after, none twice
    assert summary(tmp_path)["losses"] == pytest.approx(summary(straight)["losses"], abs=1e-6)
    assert not (tmp_path / "preempted.json").exists()


def test_a_signal_while_the_models_load_stops_before_training_and_puts_an_overwritten_run_back(straight, tmp_path):
    """The launcher kills the ranks 30 s after its SIGTERM: a first long-context step started then is cut short, so
    the run stops before it; --overwrite_output_dir's earlier run, not yet deleted, goes back."""
    shutil.copytree(straight, tmp_path, dirs_exist_ok=True)
    before = {p: os.path.getsize(tmp_path / p) for p in os.listdir(tmp_path) if (tmp_path / p).is_file()}
    proc = run_train(
        tmp_path, *ARGS, "--overwrite_output_dir", check=False, script=FAULTS, env={"FAULT": "signal:0:SIGTERM"}
    )
    assert proc.returncode == 75, proc.stdout[-3000:]
    assert "SIGTERM received before training started: stopped with nothing trained or saved" in proc.stdout
    assert "the earlier run in output_dir is back in place" in proc.stdout
    after = {p: os.path.getsize(tmp_path / p) for p in os.listdir(tmp_path) if (tmp_path / p).is_file()}
    assert after == before and not any(p.startswith(output_dir.SET_ASIDE_PREFIX) for p in os.listdir(tmp_path))
    assert steps_ran(tmp_path) == steps_ran(straight)  # the earlier run's records, no step of the stopped one


def test_half_written_checkpoint_is_skipped_and_kept(straight, tmp_path):
    for step in (2, 4, 6):
        shutil.copytree(straight / f"checkpoint-{step}", tmp_path / f"checkpoint-{step}")
    half = tmp_path / "checkpoint-6"  # killed while saving: no weights, no trainer state, no completion record
    for name in ("model.safetensors", "trainer_state.json", checkpoints.COMPLETE):
        (half / name).unlink()
    proc = run_train(tmp_path, *ARGS, "--resume_from_checkpoint", str(half), check=False)
    assert proc.returncode == 2 and "is not complete (no completion record" in proc.stdout
    assert "resume from " + str(tmp_path / "checkpoint-4") in proc.stdout and "Traceback" not in proc.stdout
    proc = run_train(tmp_path, *ARGS, "--resume_from_checkpoint", "true")
    assert f"skipped {half}: no completion record" in proc.stdout
    assert (tmp_path / "incomplete-checkpoint-6" / "optimizer.pt").exists()  # moved aside, nothing deleted
    assert steps_ran(tmp_path) == [5, 6]
    assert summary(tmp_path)["losses"] == pytest.approx(summary(straight)["losses"], abs=1e-6)


def test_resuming_with_another_model_is_one_line_before_the_model_is_built(straight, tmp_path):
    """The checkpoint's model and the recipe's differ (a layer fewer; LoRA on): one line naming the difference, exit
    2, nothing moved or deleted, and no model built (torch would refuse the optimizer state with a traceback)."""
    shutil.copytree(straight / "checkpoint-4", tmp_path / "checkpoint-4")
    proc = run_train(tmp_path, *ARGS, "--resume_from_checkpoint", "true", "--model.num_hidden_layers", "1", check=False)
    errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stdout, proc.stdout[-3000:]
    assert (
        len(errors) == 1
        and "was written by a model with num_hidden_layers 2, and this recipe builds one with" in (errors[0])
    )
    assert "Tokenizing train dataset" not in proc.stdout
    lora = load_recipe(TINY, parse_overrides(["--model.use_peft", "true"])).model
    with pytest.raises(RecipeError, match="holds a full fine-tuning run's weights, and this recipe sets `model.use"):
        checkpoints.check_resume_model(str(tmp_path / "checkpoint-4"), lora)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4"]


def test_an_output_dir_under_a_file_is_one_line_and_creates_nothing(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(RecipeError, match="cannot be created: .*notes.txt is a file; set `output_dir` to a folder"):
        output_dir.check_output_dir(str(tmp_path / "notes.txt" / "run"), None, False)
    with pytest.raises(RecipeError, match="is a file; set `output_dir` to a folder path"):
        output_dir.check_output_dir(str(tmp_path / "notes.txt"), None, False)
    assert output_dir.check_output_dir(str(tmp_path / "new" / "run"), None, False) == []
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]


def test_resuming_from_a_folder_that_does_not_exist_names_the_accepted_values(tmp_path):
    """`--resume_from_checkpoint maybe` (a typo of true/auto) used to read "Checkpoint maybe is not complete"."""
    with pytest.raises(RecipeError, match=r"maybe: no such folder; pass a checkpoint folder, `true` .* or `auto`"):
        checkpoints.resolve_resume("maybe", str(tmp_path), True)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(RecipeError, match="is not complete .it is not a folder"):
        checkpoints.resolve_resume(str(tmp_path / "a_file"), str(tmp_path), True)


def test_resume_true_without_a_complete_checkpoint_is_one_line(tmp_path):
    proc = run_train(tmp_path, *ARGS, "--resume_from_checkpoint", "true", check=False)
    assert proc.returncode == 2 and "No complete checkpoint in" in proc.stdout and "Traceback" not in proc.stdout


def test_nan_loss_stops_at_that_step_and_names_the_last_checkpoint(tmp_path):
    proc = run_train(tmp_path, *ARGS, check=False, script=FAULTS, env={"FAULT": "nan:3"})
    assert proc.returncode == 4, proc.stdout[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("error:")]
    assert line == [
        f"error: step 3: the loss is not finite; stopped there and saved nothing. Last complete "
        f"checkpoint: {tmp_path / 'checkpoint-2'} (resume from it with `--resume_from_checkpoint "
        f"{tmp_path / 'checkpoint-2'}`, e.g. with a lower learning_rate)."
    ]
    assert not (tmp_path / "checkpoint-3").exists() and not (tmp_path / "model.safetensors").exists()
    assert checkpoints.why_incomplete(str(tmp_path / "checkpoint-2")) is None


def same_weights(a, b) -> bool:
    from safetensors.torch import load_file

    wa, wb = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    return wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa)


def test_skip_leaves_the_nonfinite_step_out_and_goes_on(tmp_path):
    proc = run_train(
        tmp_path,
        "--max_steps",
        "4",
        "--save_steps",
        "1",
        "--report_to",
        "none",
        "--run.on_nonfinite",
        "skip",
        script=FAULTS,
        env={"FAULT": "nan:3"},
    )
    assert "step 3: the loss is not finite; its update was left out" in proc.stdout
    assert summary(tmp_path)["skipped_steps"] == [{"step": 3, "quantity": "loss"}]
    assert same_weights(tmp_path / "checkpoint-2", tmp_path / "checkpoint-3")  # no update at step 3
    assert not same_weights(tmp_path / "checkpoint-3", tmp_path / "checkpoint-4")  # step 4 trains again
    losses = summary(tmp_path)["losses"]
    assert len(losses) == 4 and math.isfinite(losses[3])


def test_disk_too_small_for_one_checkpoint_stops_before_loading(tmp_path):
    proc = run_train(tmp_path, *ARGS, check=False, script=FAULTS, env={"FAULT": "disk:1000000"})
    assert proc.returncode == 2
    assert (
        "error: one checkpoint needs 0.0 GB but" in proc.stdout and "set `output_dir` to a larger disk" in proc.stdout
    )
    assert not (tmp_path / "memory.jsonl").exists()  # nothing ran


def test_disk_arithmetic(monkeypatch):
    p = 12_250_000_000  # Mistral-NeMo 12B
    one = checkpoint_bytes(p, 2, zero3=True, with_optimizer=True)
    assert one / 1e9 == pytest.approx(220.5)  # 16 B/param of ZeRO states + the 16-bit model
    assert checkpoint_bytes(p, 2, zero3=False, with_optimizer=False) == 2 * p
    assert checkpoints_kept({"save_strategy": "no"}) == 0
    assert checkpoints_kept({"max_steps": 100, "save_steps": 10, "save_total_limit": 2}) == 2
    assert checkpoints_kept({"max_steps": 100, "save_steps": 10}) == 10
    assert checkpoints_kept({"max_steps": 100, "save_steps": 0.25}) == 4
    monkeypatch.setattr(checks, "free_bytes", lambda output_dir: int(500e9))
    assert checks.disk_space("/tmp/x", one, 1, 2 * p) is None
    warning = checks.disk_space("/tmp/x", one, 3, 2 * p)
    assert "3 checkpoint(s) of 220.5 GB" in warning and "lower `save_total_limit`" in warning
    with pytest.raises(RecipeError, match="one checkpoint needs 661.5 GB but /tmp/x has 500.0 GB"):
        checks.disk_space("/tmp/x", one * 3, 1, 0)


def test_zero3_sigusr1_saves_every_rank_at_one_step_and_resumes_the_curve(ds2, tmp_path):
    """2 processes, ZeRO-3 over gloo, launched as the SLURM example launches (the launcher ignores SIGUSR1); the
    signal goes to every process of the job at step 3. Then a ZeRO shard goes missing from the newest checkpoint:
    resume skips it and continues from the one before, on the same curve (ds2's, the same run uninterrupted)."""
    args = [*ZERO3_STEPS, "--per_device_train_batch_size", "2", "--recipe", TINY]

    def launch(out, *extra, env=None, script=TRAIN):
        cmd = (
            f"trap '' USR1; exec {os.path.join(BIN, 'deepspeed')} --num_gpus 2 --master_port {free_port()} "
            f"{script} {ZERO3} --output_dir {out} {' '.join(args)} {' '.join(extra)}"
        )
        full_env = {
            **os.environ,
            "PATH": BIN + os.pathsep + os.environ["PATH"],
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **(env or {}),
        }
        return run_job(["bash", "-c", cmd], 300, cwd=ROOT, env=full_env, stderr=subprocess.STDOUT)

    cut = tmp_path / "cut"
    proc = launch(cut, env={"FAULT": "signal:3:SIGUSR1"}, script=FAULTS)
    assert proc.returncode == 75, proc.stdout[-3000:]
    assert json.load(open(cut / "preempted.json"))["step"] == 3
    shards = sorted(os.listdir(cut / "checkpoint-3" / "global_step3"))
    assert sum("optim_states" in name for name in shards) == 2  # both ranks' optimizer shards, complete
    assert checkpoints.why_incomplete(str(cut / "checkpoint-3")) is None
    damaged = tmp_path / "damaged"
    shutil.copytree(cut, damaged)
    assert launch(cut, "--resume_from_checkpoint", "auto").returncode == 0
    assert steps_ran(cut) == [1, 2, 3, 4]
    assert summary(cut)["losses"] == pytest.approx(summary(ds2)["losses"], abs=1e-5)

    shard = next(n for n in shards if "optim_states" in n and "rank_1" in n)
    (damaged / "checkpoint-3" / "global_step3" / shard).unlink()
    assert checkpoints.why_incomplete(str(damaged / "checkpoint-3")) == f"global_step3/{shard} is missing"
    proc = launch(damaged, "--resume_from_checkpoint", "auto")
    assert proc.returncode == 0 and "moved aside to" in proc.stdout
    assert steps_ran(damaged)[-2:] == [3, 4]  # from checkpoint-2
    assert summary(damaged)["losses"] == pytest.approx(summary(ds2)["losses"], abs=1e-5)


def test_rotation_keeps_the_newest_complete_checkpoints_and_the_best(straight, tmp_path):
    for step in (2, 4, 6):
        shutil.copytree(straight / f"checkpoint-{step}", tmp_path / f"checkpoint-{step}")
    (tmp_path / "checkpoint-6" / checkpoints.COMPLETE).unlink()  # incomplete: does not count, is not deleted
    checkpoints.rotate(str(tmp_path), 1, best=str(tmp_path / "checkpoint-2"))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    checkpoints.rotate(str(tmp_path), 1)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4", "checkpoint-6"]


def test_zero3_skip_leaves_the_nonfinite_step_out(tmp_path):
    """2 processes, ZeRO-3 over gloo: a NaN loss at step 3 on every rank; DeepSpeed discards that update (its
    gradient norm is not finite) and training goes on."""
    run_train(
        tmp_path,
        "--max_steps",
        "4",
        "--save_steps",
        "1",
        "--report_to",
        "none",
        "--run.on_nonfinite",
        "skip",
        "--per_device_train_batch_size",
        "2",
        launcher="deepspeed",
        procs=2,
        script=FAULTS,
        env={"FAULT": "nan:3"},
    )
    assert summary(tmp_path)["skipped_steps"] == [{"step": 3, "quantity": "loss"}]
    assert same_weights(tmp_path / "checkpoint-2", tmp_path / "checkpoint-3")
    assert not same_weights(tmp_path / "checkpoint-3", tmp_path / "checkpoint-4")


def test_resume_keeps_the_telemetry_of_the_steps_before_and_says_when_nothing_is_left(straight, tmp_path):
    """Resumed from step 4 in the run's own folder: memory.jsonl holds steps 1-6 once each (5 and 6 were logged by
    the first run too) and the end-of-run table covers all six. Resuming the finished run says so."""
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    shutil.rmtree(run / "checkpoint-6")
    run_train(run, *ARGS, "--resume_from_checkpoint", "true")
    assert steps_ran(run) == [1, 2, 3, 4, 5, 6]
    assert (run / "memory_summary.md").read_text().startswith("Steady state over steps 2..6")
    proc = run_train(run, *ARGS, "--resume_from_checkpoint", "true")
    assert "already reached max_steps 6 (step 6): nothing left to train" in proc.stdout


@pytest.mark.parametrize("launcher", ["deepspeed", "accelerate"])
def test_sigterm_to_the_launcher_command_saves_on_every_rank_and_leaves_no_process(tmp_path, launcher):
    """`kill <pid of the command you typed>`, 2 processes on ZeRO-3 over gloo. `deepspeed` dies of it at once and
    tells nobody; `accelerate launch` passes it on. Either way every rank saves at its next step boundary, exits 75,
    and nothing of the job is left running."""
    import psutil

    cmd = launch_command(
        tmp_path,
        "--max_steps",
        "100000",
        "--save_steps",
        "100000",
        "--report_to",
        "none",
        "--per_device_train_batch_size",
        "2",
        launcher=launcher,
        procs=2,
    )
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 240
        while not (tmp_path / "memory.jsonl").exists() or len(steps_ran(tmp_path)) < 2:  # training is under way
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)  # EOF once every process holding the output has exited
        # ... or is exiting: the kernel closes a process's files before it becomes a zombie (seen once as "running")
        _, left = psutil.wait_procs([p for p in psutil.process_iter() if _session(p) == proc.pid], timeout=10)
        left = [p for p in left if _status(p) not in (psutil.STATUS_ZOMBIE, None)]
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if _alive_in_session(proc.pid) else None
    assert left == [], left
    marker = json.load(open(tmp_path / "preempted.json"))
    assert checkpoints.why_incomplete(marker["checkpoint"]) is None
    assert 2 <= marker["step"] < 100000 and marker["step"] == max(steps_ran(tmp_path))
    shards = os.listdir(os.path.join(marker["checkpoint"], f"global_step{marker['step']}"))
    assert sum("optim_states" in name for name in shards) == 2  # both ranks saved
    assert f"saved checkpoint-{marker['step']} and stopped" in out  # the path that exits 75
    if launcher == "deepspeed":  # its per-node launcher, left running when the command died, reports the ranks
        assert "exits with return code = 75" in out, out[-3000:]
    # (`accelerate launch` itself ends 143, killed by the signal it passed on: preempted.json is the record to read)


def _status(p) -> str | None:
    import psutil

    try:
        return p.status()
    except psutil.Error:  # gone
        return None


def _session(p) -> int | None:
    try:
        return os.getsid(p.pid)
    except OSError:
        return None


def _alive_in_session(sid: int) -> bool:
    import psutil

    return any(_session(p) == sid for p in psutil.process_iter())


def test_an_earlier_run_set_aside_goes_back_or_is_deleted(tmp_path):
    """--overwrite_output_dir's earlier run: set aside by a rename, deleted when training starts, put back when the
    run stops before; a name the stopped run wrote meanwhile keeps the earlier copy aside (an empty folder the
    stopped run made does not count), and a set-aside folder a killed process left is part of an earlier run."""
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "w").write_text("old weights")
    (tmp_path / "memory.jsonl").write_text("old")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "events").write_text("old events")
    names = output_dir.check_output_dir(str(tmp_path), None, True)
    assert names == ["checkpoint-2", "memory.jsonl", "runs"]

    aside = output_dir.set_aside_earlier_run(str(tmp_path), names)
    assert output_dir.earlier_run(str(tmp_path)) == [os.path.basename(aside)]  # a killed run's leftover counts
    (tmp_path / "runs").mkdir()  # what a stopped run may have made: an empty folder, and one record
    (tmp_path / "memory.jsonl").write_text("new")
    output_dir.put_back_earlier_run(aside)
    assert (tmp_path / "checkpoint-2" / "w").read_text() == "old weights"
    assert (tmp_path / "runs" / "events").read_text() == "old events"
    assert (tmp_path / "memory.jsonl").read_text() == "new" and os.listdir(aside) == ["memory.jsonl"]

    (tmp_path / "memory.jsonl").unlink()
    output_dir.put_back_earlier_run(aside)
    assert (tmp_path / "memory.jsonl").read_text() == "old" and not os.path.exists(aside)

    aside = output_dir.set_aside_earlier_run(str(tmp_path), output_dir.earlier_run(str(tmp_path)))
    output_dir.delete_set_aside(aside)
    assert os.listdir(tmp_path) == [] and output_dir.set_aside_earlier_run(str(tmp_path), []) is None


def test_a_used_output_dir_is_refused_unless_resumed_or_overwritten(straight, tmp_path):
    """A rerun into a folder holding another run (other learning rate, fewer steps) used to overwrite checkpoint-2
    and -4, keep the old -6 beside them, and a later resume took the old run's -6. Now: one line, exit 2, before
    any model is loaded, the folder untouched; `--overwrite_output_dir` deletes the old run first."""
    run = tmp_path / "run"
    shutil.copytree(straight, run)

    def state(folder):
        return sorted((str(p.relative_to(folder)), p.stat().st_mtime_ns) for p in folder.rglob("*"))

    before = state(run)
    rerun = ["--max_steps", "4", "--save_steps", "2", "--report_to", "none", "--learning_rate", "1e-3"]
    proc = run_train(run, *rerun, check=False)
    errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stdout, proc.stdout[-2000:]
    assert "holds an earlier run (checkpoint-2, checkpoint-4, checkpoint-6, memory.jsonl and" in errors[0]
    assert "--resume_from_checkpoint auto" in errors[0] and "--overwrite_output_dir" in errors[0]
    assert "length report" not in proc.stdout  # stopped before the data and the models
    assert state(run) == before

    proc = run_train(run, *rerun, "--overwrite_output_dir", "--resume_from_checkpoint", "auto", check=False)
    assert proc.returncode == 2 and "pass one of the two" in proc.stdout and state(run) == before

    proc = run_train(run, *rerun, "--overwrite_output_dir")
    assert "deleted the earlier run's checkpoint-2, checkpoint-4, checkpoint-6" in proc.stdout
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert steps_ran(run) == [1, 2, 3, 4]
    assert summary(run)["losses"] != summary(straight)["losses"][:4]  # the new run's curve, not a mix

    (tmp_path / "a_file").write_text("")
    proc = run_train(tmp_path / "a_file", *rerun, check=False)
    assert proc.returncode == 2 and "is a file; set `output_dir` to a folder path" in proc.stdout
