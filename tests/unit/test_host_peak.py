"""The step's host peak (`host_peak_gb`): host memory taken and given back inside a step is seen at the step's end,
where RSS no longer shows it, and the next step starts from what is resident then. Pageable activation offloading
is such memory: its host copies live from the forward to the backward and are freed before the step ends."""

import json

import numpy as np
import pytest
from transformers import TrainerControl, TrainerState, TrainingArguments

from longdpo.config import MemoryArgs
from longdpo.training import callbacks

pytestmark = pytest.mark.skipif(
    not callbacks._restart_host_peak(), reason="the peak resident set is read from Linux's /proc only"
)


def test_memory_taken_and_given_back_within_a_step_is_its_peak(tmp_path):
    cb = callbacks.MemoryCallback(MemoryArgs())
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    state, control = TrainerState(), TrainerControl()
    for step, taken in ((1, 400_000_000), (2, 0)):
        state.global_step = step
        cb.on_step_begin(args, state, control)
        if taken:
            block = np.ones(taken, dtype=np.uint8)  # every page written: resident
            del block  # a block this large is its own mapping: freed, it leaves the process at once
        cb.on_step_end(args, state, control)
    first, second = (json.loads(line) for line in open(tmp_path / "memory.jsonl"))
    # 0.4 GB passed through step 1 (0.1 GB allowed for whatever else the process did meanwhile); step 2 took nothing
    assert first["host_peak_gb"] - first["host_rss_gb"] >= 0.3, first
    assert second["host_peak_gb"] - second["host_rss_gb"] < 0.1, second
