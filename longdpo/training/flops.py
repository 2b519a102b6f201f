"""Useful work per second: the model FLOPs of each training step and their share of the GPU's peak (MFU).

Model FLOPs are the matmuls and the causal attention a step must do, counted once: a checkpoint's recompute is not
counted, as MFU conventions want. Per token, a forward does 2 x the matmul parameters (every parameter but the input
embedding); per (query, key) pair of causal attention, 4 x the attention width per layer (QK^T and PV). The policy's
backward is 2 forwards (input and weight gradients), 1 with LoRA (the frozen weights take no gradient); the reference
runs forward only, and not at all with `precompute_ref_log_probs`. A batch's pairs are counted as they run, padding
left out: TRL's two rows prompt + chosen and prompt + rejected, or one row [prompt, chosen, rejected] where a lever
runs them so (the shared prompt), whose rejected tokens see the prompt and themselves. Under sequence parallelism a
rank does 1/K of it.

MFU is a step's model FLOPs over its time and the card's dense bf16 peak (`PEAK_BF16_TFLOPS`, the vendor's figure;
a card not listed has no MFU). Telemetry records both per step (`model_tflops`, `mfu`), and where a lever may run a
batch as one row per pair, how many of the step's pairs ran so (`pairs`, `shared_pairs`; a rank's own).
"""

from __future__ import annotations

import torch

# Dense bf16 peak of each card, TFLOP/s (NVIDIA's data sheets; the most specific name first)
PEAK_BF16_TFLOPS = (
    ("GH200", 989.4),
    ("H200", 989.4),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.5),
    ("H100", 989.4),
    ("A100", 312.0),
    ("L40S", 362.1),
)


def peak_tflops(device_name: str | None) -> float | None:
    """The dense bf16 peak of a card by its name (torch.cuda.get_device_name), or None when it is not listed."""
    return next((peak for name, peak in PEAK_BF16_TFLOPS if device_name and name in device_name), None)


def pair_forward_flops(
    prompt: int, chosen: int, rejected: int, one_row: bool, matmul_params: int, layers: int, attn_width: int
) -> float:
    """One forward of one pair: TRL's rows P + C and P + R, or the row [P, C, R] (the rejected tokens attend to the
    prompt and to themselves: query-key pairs (P+C)^2/2 + (P+R)^2/2 - P^2/2)."""
    p, c, r = prompt, chosen, rejected
    tokens = p + c + r if one_row else 2 * p + c + r
    squares = (p + c) ** 2 + (p + r) ** 2 - (p**2 if one_row else 0)  # twice the causal (query, key) pairs
    return 2 * matmul_params * tokens + 2 * layers * squares * attn_width


def batch_pairs(inputs: dict) -> tuple[list[tuple[int, int, int]], int]:
    """(prompt, chosen, rejected) real tokens of each pair of TRL's DPO batch (its rows: chosen..., rejected...; a
    row is prompt, completion, right padding), and the batch's padded width."""
    real = inputs["attention_mask"].sum(1).tolist()
    completion = inputs["completion_mask"].sum(1).tolist()
    n = len(real) // 2
    pairs = [(real[i] - completion[i], completion[i], completion[n + i]) for i in range(n)]
    return pairs, inputs["input_ids"].shape[1]


class StepFlops:
    """Counts the model FLOPs of each micro-batch a rank trains on; `take` gives a step's and starts the next."""

    def __init__(self, config, matmul_params: int, lora: bool, with_reference: bool, shards: int, one_row=None):
        """`one_row(pairs, width) -> bool`: whether a batch runs one row per pair (a lever's choice), or None."""
        self.layers = config.num_hidden_layers
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.attn_width = config.num_attention_heads * head_dim
        self.matmul_params = matmul_params
        self.passes = (2 if lora else 3) + (1 if with_reference else 0)  # policy forward + backward, reference
        self.shards, self.one_row = shards, one_row
        self.flops, self.pairs, self.shared_pairs = 0.0, 0, 0

    def add(self, inputs: dict) -> None:
        pairs, width = batch_pairs(inputs)
        one_row = bool(self.one_row and self.one_row(pairs, width))
        forward = sum(
            pair_forward_flops(p, c, r, one_row, self.matmul_params, self.layers, self.attn_width) for p, c, r in pairs
        )
        self.flops += self.passes * forward / self.shards
        self.pairs, self.shared_pairs = self.pairs + len(pairs), self.shared_pairs + len(pairs) * one_row

    def take(self) -> dict:
        step = {"model_tflops": round(self.flops / 1e12, 4)}
        if self.one_row:  # whether the prompt was computed once is a step's own choice: say which steps it made
            step.update(pairs=self.pairs, shared_pairs=self.shared_pairs)
        self.flops, self.pairs, self.shared_pairs = 0.0, 0, 0
        return step


def mfu(model_tflops: float | None, step_time_s: float) -> float | None:
    """A step's share of this card's dense bf16 peak, or None without a GPU, a listed card or a count."""
    if model_tflops is None or not torch.cuda.is_available():
        return None
    peak = peak_tflops(torch.cuda.get_device_name())
    return round(model_tflops / (step_time_s * peak), 4) if peak else None
