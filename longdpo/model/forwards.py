"""Small facts about module forwards that the levers' wrappers share: whether autograd is replaying a forward in
backward (a checkpoint's recompute), a count of a module's real forwards (the tests count recomputes with it), and
the prefix of the ranges a profiled step is labelled with (longdpo/training/profiling.py)."""

from __future__ import annotations

import functools

import torch

PROFILE_LABEL = "longdpo:"  # `longdpo:forward:attention`, `longdpo:recompute:mlp`, ...


def in_backward() -> bool:
    """torch's own test in its checkpoint unpack hook (torch/utils/checkpoint.py): a backward pass is running."""
    return torch._C._current_graph_task_id() != -1


def counted(module: torch.nn.Module, forward):
    """`forward` counting its executions in `module.forward_calls` (a checkpointed module runs twice a step)."""
    module.forward_calls = 0

    @functools.wraps(forward)
    def run(*args, **kwargs):
        module.forward_calls += 1
        return forward(*args, **kwargs)

    return run
