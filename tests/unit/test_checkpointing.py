"""Every checkpointing policy changes nothing numerically, really recomputes, and keeps checkpoints plain."""

import pytest
import torch
from conftest import TINY_ARGS as TINY
from conftest import loss_and_grads

from longdpo.config import RecipeError
from longdpo.levers import LeverSet, patch_policy
from longdpo.levers.checkpointing import INNER, POLICIES, uses_layer_checkpoint
from longdpo.model.build import build_model


@pytest.fixture(scope="module")
def reference(dpo_batch):
    return loss_and_grads(dpo_batch, "none")


# (policy, TiledMLP tiles, MLP chunks)
CASES = [(p, 0, 0) for p in POLICIES if p != "none"] + [
    ("none", 4, 0),
    ("layer+norm_attn", 4, 0),
    ("norm_attn", 2, 0),
    ("none", 0, 4),
    ("layer", 0, 4),
    ("layer+norm_attn", 0, 4),
    ("norm_attn", 0, 3),
]


@pytest.mark.parametrize("policy,tiles,chunks", CASES)
def test_loss_and_every_gradient_equal_unpatched(dpo_batch, reference, policy, tiles, chunks):
    _, ref_loss, ref_grads, _ = reference
    model, loss, grads, _ = loss_and_grads(dpo_batch, policy, tiles, chunks)
    assert abs(loss.item() - 0.6931) > 1e-3  # a real gradient signal: policy != reference
    assert torch.allclose(loss, ref_loss, atol=1e-6)
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], atol=1e-6), name


@pytest.mark.parametrize(
    "policy,chunks", [("none", 0), ("layer", 0), ("layer+attn_mlp", 4), ("layer+norm_attn", 4), ("norm_attn_mlp", 0)]
)
def test_lean_norm_changes_no_loss_or_gradient(dpo_batch, reference, policy, chunks):
    _, ref_loss, ref_grads, _ = reference
    model, loss, grads, wrapped = loss_and_grads(dpo_batch, policy, chunks=chunks, lean=True)
    per_layer = 4 if model.config.model_type == "qwen3" else 2  # Qwen3: q_norm and k_norm inside attention too
    assert wrapped["lean_norm"] == per_layer * len(model.model.layers) + 1
    assert torch.allclose(loss, ref_loss, atol=1e-6)
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], atol=1e-5), name


def test_lean_lm_head_changes_no_loss_or_gradient(dpo_batch, reference, monkeypatch):
    """The lean LM-head backward in place of TRL's, with the lean norms and MLP chunks: the tied head of Qwen2.5's
    small models gets the embedding's gradient plus the head's, as unpatched."""
    from longdpo import patches
    from longdpo.levers import lean_lm_head

    calls = []
    backward = lean_lm_head.LeanLMHeadLogProb.backward
    monkeypatch.setattr(
        lean_lm_head.LeanLMHeadLogProb,
        "backward",
        staticmethod(lambda ctx, *grads: calls.append(1) or backward(ctx, *grads)),
    )
    _, ref_loss, ref_grads, _ = reference
    with patches.trl_log_prob_function(lean_lm_head.LeanLMHeadLogProb):
        model, loss, grads, _ = loss_and_grads(dpo_batch, "layer", chunks=2, lean=True)
    assert calls  # the lean backward ran
    assert model.config.tie_word_embeddings == (model.config.model_type == "qwen2")
    assert torch.allclose(loss, ref_loss, atol=1e-6)
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], atol=1e-5), name


@pytest.mark.parametrize("policy,tiles,chunks", CASES)
def test_each_wrapped_module_really_recomputes(dpo_batch, policy, tiles, chunks):
    """One forward + backward: an inner checkpoint runs its module twice (forward, recompute). Nested in the layer
    checkpoint, three times (forward, the layer's replay, its own recompute) - except the MLP, the layer's last
    module: torch's early stop ends the layer's replay once the MLP's input is saved, so it runs twice. A tiled MLP
    runs once per tile in forward and once per tile in backward (and once more per tile in a layer replay). A
    chunked MLP runs each chunk twice, nested or not: the layer's replay saves the chunks' inputs without running
    them."""
    model, _, _, wrapped = loss_and_grads(dpo_batch, policy, tiles, chunks)
    layer = model.model.layers[0]
    nested = uses_layer_checkpoint(policy)
    inner = INNER.get(policy.removeprefix("layer+"), ())
    expected = 3 if nested else 2
    targets = {
        "norm": [layer.input_layernorm, layer.post_attention_layernorm, model.model.norm],
        "attn": [layer.self_attn],
        "mlp": [] if (tiles or chunks) else [layer.mlp],
    }
    for kind in inner:
        for module in targets[kind]:
            last_or_outside = module is layer.mlp or module is model.model.norm
            assert module.forward_calls == (2 if last_or_outside else expected), kind
    n_layers = len(model.model.layers)
    expected_wrapped = {"norm": 2 * n_layers + 1, "attn": n_layers, "mlp": 0 if (tiles or chunks) else n_layers}
    for kind in ("norm", "attn", "mlp"):
        assert wrapped[kind] == (expected_wrapped[kind] if kind in inner else 0), kind
    if tiles:
        # TiledMLP is an autograd.Function: it packs its saved input only after its forward returns, so the
        # layer's replay runs it fully before early stop.
        assert layer.mlp.forward_calls == (3 if nested else 2) * tiles
        assert wrapped["tiled_mlp"] == len(model.model.layers)
    if chunks:
        assert layer.mlp.forward_calls == 2 * chunks
        assert wrapped["chunked_mlp"] == len(model.model.layers)
    unwrapped = [m for kind, ms in targets.items() if kind not in inner for m in ms]
    for module in unwrapped:
        assert not hasattr(module, "forward_calls")


def test_chunks_are_contiguous_token_blocks(dpo_batch):
    """DPO runs chosen and rejected as one batch of 2: a slice along the sequence would be strided, so the chunks
    split the flattened tokens and every MLP projection of the policy reads one contiguous block."""
    width = build_model(dpo_batch[2]).config.intermediate_size
    seen = []

    def record(module, args):
        if isinstance(module, torch.nn.Linear) and module.out_features == width and torch.is_grad_enabled():
            seen.append((args[0].dim(), args[0].is_contiguous()))

    handle = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        loss_and_grads(dpo_batch, "layer", chunks=3)
    finally:
        handle.remove()
    assert seen and all(dim == 2 and contiguous for dim, contiguous in seen), seen


@pytest.mark.parametrize("policy", ["layer", "layer+norm_attn"])
def test_chunks_under_a_reentrant_layer_checkpoint_run_in_its_replay(dpo_batch, reference, policy):
    """A reentrant layer checkpoint (what TRL forces for PEFT under ZeRO-3) runs its forward under no_grad (the MLP
    once, whole) and uses its replay's outputs: the chunks run there, and again in their own recomputes. Every
    gradient is still the unpatched one."""
    _, ref_loss, ref_grads, _ = reference
    model, loss, grads, _ = loss_and_grads(dpo_batch, policy, chunks=4, reentrant=True)
    assert model.model.layers[0].mlp.forward_calls == 1 + 2 * 4
    assert torch.allclose(loss, ref_loss, atol=1e-6)
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], atol=1e-6), name


def test_patched_checkpoint_reloads_into_a_plain_model(tmp_path):
    from transformers import AutoModelForCausalLM

    patched = build_model(TINY)
    plain_keys = list(patched.state_dict())
    patch_policy(patched, LeverSet(checkpointing="layer+norm_attn_mlp", tiled_mlp=2))
    patch_policy(patched, LeverSet(checkpointing="none", mlp_chunks=2))
    assert list(patched.state_dict()) == plain_keys  # forwards wrapped, names untouched
    patched.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not hasattr(reloaded.model.layers[0].mlp, "forward_calls")
    for (name, a), b in zip(patched.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), name


def test_unknown_policy_and_unsupported_model_are_clear_errors():
    with pytest.raises(RecipeError, match="Did you mean `norm_attn_mlp`"):
        patch_policy(build_model(TINY), LeverSet(checkpointing="norm_atn_mlp"))
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(RecipeError, match=r"support mistral \(Mistral\), llama \(Llama-3\), qwen2 \(Qwen2.5\), qwen3"):
        patch_policy(gpt2, LeverSet(checkpointing="norm_attn"))
    assert not any(patch_policy(gpt2, LeverSet(checkpointing="layer")).values())  # nothing to patch: nothing wrapped
    with pytest.raises(RecipeError, match="Set one of `memory.tiled_mlp` and `memory.mlp_chunks`"):
        patch_policy(build_model(TINY), LeverSet(mlp_chunks=2, tiled_mlp=2))
