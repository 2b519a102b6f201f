"""Right-padded pairs run without an attention mask (longdpo/levers/padding_mask.py): on pairs whose chosen and rejected
differ in length, the loss, TRL's metrics and every gradient equal the masked path's, on every supported family;
the attention really gets no mask; a batch that needs its mask keeps it."""

import math

import pytest
import torch
from conftest import TINY, loss_and_grads, run_train, summary

from longdpo.levers import LeverSet, padding_mask


def metrics_after(dpo_batch, **kwargs):
    """The loss, the gradients and TRL's logged metrics of one step (num_tokens: this batch's count)."""
    trainer = dpo_batch[0]
    trainer._metrics["train"].clear()
    before = trainer._total_train_tokens  # TRL logs a running total
    model, loss, grads, _ = loss_and_grads(dpo_batch, "none", **kwargs)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss, grads, {**metrics, "num_tokens": metrics["num_tokens"] - before}


def masks_seen_by_attention(model, inputs) -> list:
    seen = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("attention_mask")), with_kwargs=True)
    with torch.no_grad():
        model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    return seen


def test_unequal_pairs_give_the_masked_paths_loss_metrics_and_gradients(dpo_batch):
    trainer, inputs, _ = dpo_batch
    lengths = inputs["attention_mask"].sum(1)
    chosen, rejected = lengths.chunk(2)
    assert (chosen != rejected).all() and (lengths < inputs["attention_mask"].shape[1]).any()  # real padding
    masked_loss, masked_grads, masked_metrics = metrics_after(dpo_batch)
    loss, grads, metrics = metrics_after(dpo_batch, drop_mask=True)
    assert abs(loss.item() - math.log(2)) > 1e-3  # a real gradient signal: policy != reference
    assert torch.allclose(loss, masked_loss, atol=1e-6)
    assert metrics.keys() == masked_metrics.keys() and "rewards/margins" in metrics and "num_tokens" in metrics
    for key, value in masked_metrics.items():  # rewards, log-probs, mean logits, entropy, accuracy, token count
        assert metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key
    for name, g in grads.items():
        assert g.abs().max() > 0 or masked_grads[name].abs().max() == 0, name
        assert torch.allclose(g, masked_grads[name], atol=1e-6), name


def test_the_attention_gets_no_mask_only_when_the_batch_is_right_padded(dpo_batch):
    _, inputs, family = dpo_batch
    from longdpo.model.build import build_model

    model = build_model(family)
    assert all(m is not None for m in masks_seen_by_attention(model, inputs))  # TRL's path: a mask per layer
    padding_mask.install(model)
    assert all(m is None for m in masks_seen_by_attention(model, inputs))
    left = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"].flip(1)}
    assert all(m is not None for m in masks_seen_by_attention(model, left))  # left padding keeps its mask


def test_right_padding_and_the_start_up_decision():
    ones_then_zeros = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    assert padding_mask.right_padded(ones_then_zeros)
    assert not padding_mask.right_padded(torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))  # left padding
    assert not padding_mask.right_padded(torch.tensor([[1, 0, 1, 0]]))  # a hole: packed or custom
    from longdpo.model.build import build_model

    config = build_model(__import__("conftest").TINY_ARGS).config
    assert padding_mask.decide("auto", config)[0] and not padding_mask.decide("keep", config)[0]
    with pytest.raises(Exception, match="`memory.padding_mask` must be auto or keep"):
        padding_mask.LEVER.check(LeverSet(padding_mask="off"), None)


@pytest.mark.launcher
def test_entrypoint_curve_and_metrics_equal_with_and_without_the_mask(tmp_path):
    """Three AdamW steps through the entrypoint, `auto` against `keep`: the start-up line says which; the curve and
    TRL's logged metrics, token counts included, agree (float32 attention with and without a mask differs by
    rounding only)."""
    run = ["--max_steps", "3", "--save_strategy", "no", "--report_to", "none"]
    auto = run_train(tmp_path / "auto", *run, recipe=TINY)
    keep = run_train(tmp_path / "keep", *run, "--memory.padding_mask", "keep", recipe=TINY)
    assert "attention: no mask for right-padded pairs" in auto.stdout
    assert "attention: TRL's padding mask is kept" in keep.stdout
    a, k = summary(tmp_path / "auto")["train_logs"], summary(tmp_path / "keep")["train_logs"]
    for x, y in zip(a, k):
        for key in (
            "loss",
            "grad_norm",
            "rewards/chosen",
            "rewards/margins",
            "logps/rejected",
            "logits/chosen",
            "entropy",
            "num_tokens",
            "num_input_tokens_seen",
        ):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-6), key
