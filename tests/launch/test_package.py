"""The package stands alone: a wheel built from this repository, installed into a fresh environment (no checkout on
its path), plans and trains the quickstart from another directory, reading nothing but what it ships."""

import glob
import os
import shutil
import subprocess
import sys
import sysconfig

from conftest import ROOT, job_env, run_job

STEPS = ["--max_steps", "2", "--save_strategy", "no", "--report_to", "none", "--no_final_save"]


def test_a_wheel_plans_and_trains_the_quickstart_from_anywhere(tmp_path):
    dist, env, elsewhere, source = (tmp_path / name for name in ("dist", "env", "elsewhere", "source"))
    # built from a copy of what the wheel holds, so that the build's own folders stay out of the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), source / name)
    for name in ("longdpo", "recipes"):
        shutil.copytree(os.path.join(ROOT, name), source / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(source)],
        check=True,
        capture_output=True,
    )
    (wheel,) = glob.glob(str(dist / "longdpo-*.whl"))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    # the fresh environment sees this one's dependencies (torch, TRL, ...) but not its editable longdpo: a path in a
    # .pth file is added to sys.path, the .pth files inside it (the editable install's finder) are not run
    python = str(env / "bin" / "python")
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    with open(os.path.join(site, "dependencies.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, wheel],
        check=True,
        capture_output=True,
    )
    elsewhere.mkdir()
    clean = {k: v for k, v in job_env().items() if k != "PYTHONPATH"}  # nothing of the checkout on the path
    where = subprocess.run(
        [python, "-c", "import longdpo; print(longdpo.__file__)"],
        cwd=elsewhere,
        env=clean,
        capture_output=True,
        text=True,
    )
    assert where.stdout.startswith(site), where.stdout + where.stderr  # the wheel's copy, not the checkout
    quickstart = "recipes/tiny_mistral/dpo_quickstart.yaml"  # no such file here: the one the package ships
    planned = run_job(
        [python, "-m", "longdpo.planner.cli", "--recipe", quickstart, "--gpus", "1"], 300, cwd=elsewhere, env=clean
    )
    assert planned.returncode == 0 and "predicted peak reserved" in planned.stdout, planned.stdout + planned.stderr
    trained = run_job([python, "-m", "longdpo.train", "--recipe", quickstart, *STEPS], 300, cwd=elsewhere, env=clean)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    summary = elsewhere / "outputs" / "tiny_mistral_quickstart" / "train_summary.json"
    assert summary.exists() and not os.path.exists(os.path.join(ROOT, "longdpo", "recipes"))
