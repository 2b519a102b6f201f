"""Each pair's prompt computed once (longdpo/levers/shared_prompt.py): on every supported family, float32, the loss,
TRL's metrics and every parameter gradient equal TRL's two-row path, on pairs whose completions differ in length,
with prompts of one token, and under the memory levers."""

import pytest
import torch
import torch.nn.functional as F
from conftest import loss_and_grads
from test_padding_mask import metrics_after

from longdpo.checks import trl_loss_types
from longdpo.levers import shared_prompt


def assert_same(dpo_batch, atol=1e-6, **levers):
    base_loss, base_grads, base_metrics = metrics_after(dpo_batch, **levers)
    loss, grads, metrics = metrics_after(dpo_batch, shared=True, **levers)
    assert torch.allclose(loss, base_loss, atol=atol), (loss, base_loss)
    assert metrics.keys() == base_metrics.keys() and "rewards/margins" in metrics
    for key, value in base_metrics.items():  # rewards, log-probs, mean logits, entropy, accuracy, token count
        assert metrics[key] == pytest.approx(value, rel=atol, abs=atol), key
    for name, g in grads.items():
        scale = max(1.0, base_grads[name].abs().max().item())  # a loss with large gradients rounds in proportion
        assert g.abs().max() > 0 or base_grads[name].abs().max() == 0, name
        assert torch.allclose(g, base_grads[name], atol=atol * scale), (name, (g - base_grads[name]).abs().max())


def test_shared_rows_give_the_two_row_loss_metrics_and_gradients(dpo_batch):
    _, inputs, _ = dpo_batch
    lengths = inputs["attention_mask"].sum(1)
    assert (lengths.chunk(2)[0] != lengths.chunk(2)[1]).all()  # unequal completions
    assert_same(dpo_batch)


def spy_on_forward(dpo_batch, min_saving):
    """What the embedding and the attention of a shared-prompt model see of TRL's batch: input shapes, layouts and
    the wrapper's counts."""
    trainer, inputs, _ = dpo_batch
    seen, layouts = [], []
    real = shared_prompt.shared_attention

    def spy(*args, row_layout=None, **kwargs):
        layouts.append(row_layout)
        return real(*args, row_layout=row_layout, **kwargs)

    from transformers import AttentionInterface

    AttentionInterface.register(shared_prompt.NAME, spy)
    try:
        from longdpo.model.build import build_model

        model = build_model(dpo_batch[2])
        model.model.embed_tokens.register_forward_hook(lambda m, a, out: seen.append(a[0].shape))
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model)
        model.set_attn_implementation(shared_prompt.NAME)
        counts = shared_prompt.wrap(model, min_saving)
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
        with torch.no_grad():
            model(
                input_ids=inputs["input_ids"],
                attention_mask=inputs["attention_mask"],
                labels=labels,
                fused_lm_head=True,
            )
    finally:
        AttentionInterface.register(shared_prompt.NAME, real)
    return seen, layouts, counts, shared_prompt.layout(inputs["input_ids"], inputs["attention_mask"], labels)


def test_the_model_sees_one_row_per_pair_with_the_prompt_once(dpo_batch):
    """The embedding sees n rows of |P|+|C|+|R|+1 tokens (padded to the longest), and attention gets their layout."""
    seen, layouts, counts, pairs = spy_on_forward(dpo_batch, 0.0)
    inputs = dpo_batch[1]
    assert counts == {"shared": 1, "two_rows": 0}
    assert seen == [torch.Size([len(pairs), max(p + c + r + x for p, c, r, x in pairs)])]
    assert layouts and all(layout == pairs for layout in layouts)
    real_tokens = inputs["attention_mask"].sum().item()
    prompts = sum(p for p, _, _, _ in pairs)
    assert sum(p + c + r + x for p, c, r, x in pairs) == real_tokens - prompts + len(pairs)


@pytest.mark.parametrize(
    "policy, levers",
    [("layer", {}), ("layer+norm_attn_mlp", {"lean": True}), ("layer+norm_attn", {"chunks": 3}), ("attn_mlp", {})],
)
def test_with_the_memory_levers(dpo_batch, policy, levers):
    """Checkpointing recomputes the shared attention in backward with the same layout; chunked MLPs reorder sums."""
    base_loss, base_grads = loss_and_grads(dpo_batch, policy, **levers)[1:3]
    loss, grads = loss_and_grads(dpo_batch, policy, shared=True, **levers)[1:3]
    atol = 1e-5 if levers.get("chunks") else 1e-6
    assert torch.allclose(loss, base_loss, atol=atol)
    for name, g in grads.items():
        assert torch.allclose(g, base_grads[name], atol=atol), (name, (g - base_grads[name]).abs().max())


@pytest.fixture(scope="module")
def short_prompt_batch(family):
    """Pairs whose prompt is one token, and one whose completions max_length cuts."""
    from conftest import make_dpo_batch
    from datasets import Dataset

    from longdpo.model.build import build_byte_tokenizer

    tokenizer = build_byte_tokenizer(family.tokenizer)
    one = tokenizer.decode(tokenizer("Q", add_special_tokens=False)["input_ids"][:1])
    rows = [
        {"prompt": one, "chosen": " the answer is four", "rejected": " five"},
        {"prompt": one, "chosen": " yes", "rejected": " no, it is not so at all"},
        {"prompt": "A long prompt " * 5, "chosen": " cut after a few words", "rejected": " cut too, after a few"},
    ]
    return make_dpo_batch(family, Dataset.from_list(rows), 3, 80)


def test_one_token_prompts_and_cut_completions(short_prompt_batch):
    trainer, inputs, _ = short_prompt_batch
    labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
    pairs = shared_prompt.layout(inputs["input_ids"], inputs["attention_mask"], labels)
    assert min(p for p, *_ in pairs) <= 2  # a one-token prompt (and the BOS some families add)
    assert any(p + max(c, r) == 80 for p, c, r, _ in pairs) and any(c != r for _, c, r, _ in pairs), pairs
    assert_same(short_prompt_batch)


def test_a_batch_that_saves_too_little_runs_as_trls_rows(dpo_batch):
    """Below `min_saving` the model sees TRL's 2n rows and attention no layout (causal, no mask); the loss, metrics
    and gradients are TRL's. At exactly the batch's saving it is shared."""
    inputs = dpo_batch[1]
    labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
    pairs = shared_prompt.layout(inputs["input_ids"], inputs["attention_mask"], labels)
    saves = shared_prompt.saving(pairs, inputs["input_ids"].shape[1])
    assert 0.1 < saves < 0.9
    seen, layouts, counts, _ = spy_on_forward(dpo_batch, saves + 1e-6)
    assert counts == {"shared": 0, "two_rows": 1}
    assert seen == [inputs["input_ids"].shape] and layouts and all(layout is None for layout in layouts)
    assert spy_on_forward(dpo_batch, saves)[2] == {"shared": 1, "two_rows": 0}
    base_loss, base_grads, _ = metrics_after(dpo_batch)
    loss, grads, _ = metrics_after(dpo_batch, shared=True, min_saving=saves + 1e-6)
    assert torch.allclose(loss, base_loss, atol=1e-6)
    for name, g in grads.items():
        assert torch.allclose(g, base_grads[name], atol=1e-6), name


@pytest.fixture(scope="module")
def mistral_batch():
    from conftest import FAMILIES, make_dpo_batch

    from longdpo.data.loading import load_preferences

    return make_dpo_batch(FAMILIES["mistral"], load_preferences(["recipes/data/arithmetic_preferences.jsonl"]), 4, 128)


@pytest.mark.parametrize("loss_type", [*trl_loss_types(), "sigmoid+weighting"])
def test_every_loss_type_trl_offers(mistral_batch, loss_type):
    """TRL computes every loss from the per-token outputs the shared rows put back in place: each of its DPO
    losses, and WPO's weighting (which reads `log_sum_sq_probs`), gives the two-row loss, metrics and gradients.
    Tolerance 1e-5 of each gradient's largest entry: the two layouts sum attention in another order, which in
    float32 (2^-24 a rounding) moved gradients by up to 2.5e-6 of that entry (sppo_hard, whose loss is 42)."""
    trainer = mistral_batch[0]
    kept = trainer.loss_types, trainer.loss_weights, trainer.label_smoothing, trainer.use_weighting
    name = loss_type.split("+")[0]
    trainer.loss_types, trainer.loss_weights = [name], [1.0]
    trainer.label_smoothing = {"exo_pair": 1e-3, "robust": 0.1}.get(name, 0.0)  # exo_pair needs one above 0
    trainer.use_weighting = loss_type.endswith("+weighting")
    try:
        assert_same(mistral_batch, atol=1e-5)
    finally:
        trainer.loss_types, trainer.loss_weights, trainer.label_smoothing, trainer.use_weighting = kept


def test_bad_settings_are_one_clear_line():
    from types import SimpleNamespace

    from longdpo.levers import LeverSet

    def check(shared, min_saving, padding_free, padding_mask):
        ctx = SimpleNamespace(recipe=SimpleNamespace(trainer={"padding_free": padding_free}))
        settings = LeverSet(shared_prompt=shared, shared_prompt_min_saving=min_saving, padding_mask=padding_mask)
        shared_prompt.LEVER.check(settings, ctx)

    with pytest.raises(Exception, match="`data.shared_prompt` must be true or false"):
        check("yes", 0.2, False, "auto")
    for bad in (1, -0.1, "0.2", True):
        with pytest.raises(Exception, match="`data.shared_prompt_min_saving` must be a fraction in"):
            check(True, bad, False, "auto")
    with pytest.raises(Exception, match="set `padding_free: false`"):
        check(True, 0.2, True, "auto")
    with pytest.raises(Exception, match="set `memory.padding_mask: auto`"):
        check(True, 0.2, False, "keep")
    check(False, 0, True, "keep")


@pytest.mark.parametrize("groups", [1, 4])
def test_the_rejected_parts_two_blocks_equal_one_lower_right_causal_call(groups):
    """`PromptAndTail` (the prompt's keys without a mask, the tail's causally, merged by log-sum-exp; each block's
    backward on the merged output) against one lower-right causal call over the keys copied together: output and every
    gradient, in float64, where both are the same sums in another order (1e-12 is ~1e4 ulps at these magnitudes).
    With groups > 1 the two blocks take the key/value heads as they are and return their gradients in that shape."""
    from torch.nn.attention.bias import causal_lower_right
    from transformers.integrations.sdpa_attention import repeat_kv

    torch.manual_seed(0)
    prompt, tail, kv_heads, dim = 37, 6, 2, 8
    q = torch.randn(1, kv_heads * groups, tail, dim, dtype=torch.float64)
    k, v = (torch.randn(1, kv_heads, prompt + tail, dim, dtype=torch.float64) for _ in range(2))
    grad = torch.randn_like(q)

    def run(attention):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention(*leaves)
        out.backward(grad)
        return [out.detach()] + [t.grad for t in leaves]

    def one_call(q, k, v):
        mask = causal_lower_right(tail, prompt + tail)
        return F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask, scale=0.3)

    def two_blocks(q, k, v):
        kp, vp, kt, vt = k[:, :, :prompt], v[:, :, :prompt], k[:, :, prompt:], v[:, :, prompt:]
        return shared_prompt.PromptAndTail.apply(q, kt, vt, kp, vp, 0.3)

    for name, a, b in zip(("out", "dq", "dk", "dv"), run(one_call), run(two_blocks)):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), (name, (a - b).abs().max())
        assert a.abs().max() > 0.01, name


def test_the_two_blocks_run_where_their_kernels_take_the_queries():
    """The CPU's flash kernel takes float types; on a device without the two blocks' kernels (here: meta) the rejected
    part runs as the one lower-right call."""
    q = torch.zeros(1, 2, 3, 8)
    assert shared_prompt.PromptAndTail.runs_on(q) and shared_prompt.PromptAndTail.runs_on(q.bfloat16())
    assert not shared_prompt.PromptAndTail.runs_on(torch.zeros(1, 2, 3, 8, device="meta"))
