"""Model FLOPs of a step (longdpo/training/flops.py), against a count by hand on a tiny model's sizes."""

from types import SimpleNamespace

import pytest
import torch

from longdpo.levers.shared_prompt import runs_shared
from longdpo.training import flops

CONFIG = SimpleNamespace(num_hidden_layers=2, hidden_size=8, num_attention_heads=2, head_dim=4)  # attention width 8
MATMUL = 1000 - 200  # every parameter but the input embedding


def batch(*pairs, width: int):
    """TRL's DPO batch of (prompt, chosen, rejected) pairs: chosen rows, then rejected rows, right-padded."""
    rows = [(p, c) for p, c, _ in pairs] + [(p, r) for p, _, r in pairs]
    attention = torch.tensor([[1] * (p + x) + [0] * (width - p - x) for p, x in rows])
    completion = torch.tensor([[0] * p + [1] * x + [0] * (width - p - x) for p, x in rows])
    return {"input_ids": torch.zeros_like(attention), "attention_mask": attention, "completion_mask": completion}


def test_a_pair_by_hand():
    # TRL's rows: prompt 4 + chosen 12 = 16 tokens, prompt 4 + rejected 6 = 10 (padding to 16 not counted)
    rows = 2 * MATMUL * (16 + 10) + 2 * 2 * (16**2 + 10**2) * 8  # matmuls; causal attention, 2 layers, width 8
    assert flops.pair_forward_flops(4, 12, 6, False, MATMUL, 2, 8) == rows
    # one row [P, C, R]: 22 tokens; R's 6 queries see the prompt's 4 keys and, causally, themselves
    query_keys = 16**2 / 2 + 6 * 4 + 6**2 / 2
    assert flops.pair_forward_flops(4, 12, 6, True, MATMUL, 2, 8) == 2 * MATMUL * 22 + 2 * 2 * 2 * query_keys * 8


def test_a_step_counts_each_micro_batch_as_it_runs():
    forward = flops.pair_forward_flops(4, 12, 6, False, MATMUL, 2, 8)
    step = flops.StepFlops(CONFIG, MATMUL, lora=False, with_reference=True, shards=1)
    assert flops.batch_pairs(batch((4, 12, 6), width=16)) == ([(4, 12, 6)], 16)
    step.add(batch((4, 12, 6), width=16))
    step.add(batch((4, 12, 6), width=16))  # two micro-batches (gradient accumulation)
    assert step.take() == {"model_tflops": round(2 * 4 * forward / 1e12, 4)}  # policy fwd + bwd (3x), reference (1x)
    assert step.take() == {"model_tflops": 0.0}  # the next step starts from nothing
    # LoRA: frozen weights take no gradient (policy forward + input gradients, 2x); no reference pass when precomputed
    lora = flops.StepFlops(CONFIG, MATMUL, lora=True, with_reference=False, shards=1)
    lora.add(batch((4, 12, 6), width=16))
    assert lora.flops == 2 * forward
    # sequence parallelism over 8: a rank does an eighth of it
    sp = flops.StepFlops(CONFIG, MATMUL, lora=False, with_reference=True, shards=8)
    sp.add(batch((4, 12, 6), width=16))
    assert sp.flops == 4 * forward / 8


def test_the_shared_prompt_counts_its_rows_where_the_batch_runs_them():
    """A long-prompt pair saves enough to run as one row; a short-prompt one runs as TRL's rows (the lever's choice)."""
    one_row = lambda pairs, width: runs_shared(pairs, width, 0.2)  # noqa: E731
    step = flops.StepFlops(CONFIG, MATMUL, lora=False, with_reference=True, shards=1, one_row=one_row)
    step.add(batch((90, 10, 8), width=100))  # saves 1 - 109/200 of the tokens
    assert step.flops == 4 * flops.pair_forward_flops(90, 10, 8, True, MATMUL, 2, 8)
    assert step.take()["shared_pairs"] == 1
    step.add(batch((2, 98, 90), width=100))  # saves 5%: TRL's rows
    assert step.flops == 4 * flops.pair_forward_flops(2, 98, 90, False, MATMUL, 2, 8)
    # the step says how many of its pairs ran as one row: here one of the two micro-batches
    step.add(batch((90, 10, 8), width=100))
    assert {k: v for k, v in step.take().items() if k != "model_tflops"} == {"pairs": 2, "shared_pairs": 1}
    assert "shared_pairs" not in flops.StepFlops(CONFIG, MATMUL, lora=False, with_reference=True, shards=1).take()


def test_the_peak_of_the_card_and_mfu():
    assert flops.peak_tflops("NVIDIA H200") == flops.peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert flops.peak_tflops("NVIDIA H100 PCIe") == 756.0 and flops.peak_tflops("a card nobody lists") is None
    if not torch.cuda.is_available():
        assert flops.mfu(500.0, 1.0) is None  # no GPU: no share of one


@pytest.mark.launcher
def test_telemetry_records_the_model_flops_of_each_step(tmp_path):
    import json

    from conftest import run_train

    run_train(tmp_path, "--max_steps", "2", "--save_strategy", "no", "--report_to", "none")
    records = [json.loads(line) for line in open(tmp_path / "memory.jsonl")]
    assert len(records) == 2 and all(r["model_tflops"] > 0 for r in records)
    assert all(r["mfu"] is None for r in records) or torch.cuda.is_available()
