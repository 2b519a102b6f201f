"""One run per output dir. A dir that holds an earlier run's checkpoints or records is refused at start-up unless the
run resumes it (`--resume_from_checkpoint`) or `--overwrite_output_dir` replaces them: training into it would
overwrite some checkpoints and leave others, and a later resume could pick up the other run's.

`--overwrite_output_dir` moves the earlier run into one hidden folder of output_dir (a rename: instant for checkpoints
of any size) once every start-up check has passed, and deletes it only once training starts: a run stopped before
then (a bad data file, a setting TRL's trainer refuses, a model that fails to load, Ctrl-C, a save signal) puts it
back, so a refused rerun loses nothing. A folder left by a killed process counts as part of an earlier run.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

from longdpo.cluster.checkpoints import CHECKPOINT
from longdpo.config import RecipeError

logger = logging.getLogger(__name__)
PREEMPTED = "preempted.json"
# What a run leaves in its output dir besides checkpoints, and so what marks the dir as holding a run
RUN_RECORDS = (PREEMPTED, "train_summary.json", "memory.jsonl", "memory_summary.md", "memory.png", "runs")
SET_ASIDE_PREFIX = ".overwritten-"


def earlier_run(output_dir: str) -> list[str]:
    """The names in `output_dir` that an earlier run wrote: its checkpoints (complete or not) and its records."""
    if not os.path.isdir(output_dir):
        return []
    return sorted(
        name
        for name in os.listdir(output_dir)
        if CHECKPOINT.match(name)
        or name in RUN_RECORDS
        or name.startswith(("incomplete-checkpoint-", SET_ASIDE_PREFIX))
    )


def check_output_dir(output_dir: str, resume, overwrite: bool) -> list[str]:
    """Start-up check of the output dir; returns what `--overwrite_output_dir` is to replace (nothing is moved
    here: other checks may still refuse the run)."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise RecipeError(f"`output_dir` {output_dir!r} is a file; set `output_dir` to a folder path.")
    existing = os.path.abspath(output_dir)  # the folder it will be created in (nothing is created here)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise RecipeError(
            f"`output_dir` {output_dir!r} cannot be created: {existing} is a file; set `output_dir` to a folder path."
        )
    if not os.access(existing, os.W_OK):
        raise RecipeError(f"`output_dir` {output_dir!r} cannot be written ({existing} is not writable for you).")
    found = earlier_run(output_dir)
    if overwrite and resume is not None:
        raise RecipeError(
            "--overwrite_output_dir deletes the checkpoints that --resume_from_checkpoint would "
            "continue from; pass one of the two."
        )
    if found and resume is None and not overwrite:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise RecipeError(
            f"`output_dir` {output_dir} holds an earlier run ({shown}); resume it with "
            "`--resume_from_checkpoint auto`, choose another `output_dir`, or pass "
            "`--overwrite_output_dir` to delete that run's checkpoints and records first."
        )
    return found if overwrite else []


def set_aside_earlier_run(output_dir: str, names: list[str]) -> str | None:
    if not names:
        return None
    aside = tempfile.mkdtemp(prefix=SET_ASIDE_PREFIX, dir=output_dir)
    for name in names:
        os.rename(os.path.join(output_dir, name), os.path.join(aside, name))
    logger.warning(
        "--overwrite_output_dir: the earlier run's %s set aside in %s until training starts", ", ".join(names), aside
    )
    return aside


def delete_set_aside(aside: str | None) -> None:
    if aside and os.path.isdir(aside):
        names = sorted(os.listdir(aside))
        shutil.rmtree(aside)
        logger.warning(
            "--overwrite_output_dir: deleted the earlier run's %s from %s", ", ".join(names), os.path.dirname(aside)
        )


def put_back_earlier_run(aside: str | None) -> None:
    """The run stopped before training: the earlier run goes back where it was (a name this run wrote meanwhile,
    unless an empty folder, keeps the earlier one's copy in `aside`, said in one line)."""
    if not aside or not os.path.isdir(aside):
        return
    output_dir, kept = os.path.dirname(aside), []
    for name in sorted(os.listdir(aside)):
        target = os.path.join(output_dir, name)
        if os.path.isdir(target) and not os.listdir(target):
            os.rmdir(target)
        if os.path.exists(target):
            kept.append(name)
        else:
            os.rename(os.path.join(aside, name), target)
    if kept:
        logger.warning("the earlier run's %s kept in %s (this run wrote the same names)", ", ".join(kept), aside)
    else:
        os.rmdir(aside)
        logger.warning("stopped before training: the earlier run is back in %s, untouched", output_dir)


class EarlierRun:
    """What `--overwrite_output_dir` replaces in `output_dir`: set aside once every check has passed, put back if
    the run stops before training, deleted when training starts. Rank 0 acts; the other ranks hold nothing."""

    def __init__(self, output_dir: str, names: list[str], acts: bool):
        self.output_dir, self.names, self.acts = output_dir, names, acts
        self.aside: str | None = None

    def set_aside(self) -> None:
        if self.acts:
            self.aside = set_aside_earlier_run(self.output_dir, self.names)

    def put_back(self) -> bool:
        """Returns whether an earlier run went back."""
        aside, self.aside = self.aside, None
        if self.acts and aside:
            put_back_earlier_run(aside)
        return aside is not None

    def delete(self) -> None:
        aside, self.aside = self.aside, None
        if self.acts:
            delete_set_aside(aside)
