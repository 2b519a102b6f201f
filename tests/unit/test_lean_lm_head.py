"""The lean LM-head backward gives TRL's gradients and never holds an fp32 buffer of the whole weight."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from trl.kernels import chunked_logprob as trl_kernel

from longdpo.levers import LeverSet, lean_lm_head


def run(fn, hidden, weight, bias, targets, outputs):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    b = bias.clone().requires_grad_() if bias is not None else None
    logprobs, entropy, *_ = fn.apply(h, w, b, targets, 0.7, 24, None, 1.0, outputs)
    loss = (logprobs * torch.linspace(-1, 1, len(logprobs))).sum()
    if entropy is not None:
        loss = loss + 0.3 * entropy.sum()
    loss.backward()
    return logprobs.detach(), h.grad, w.grad, b.grad if b is not None else None


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("with_bias,outputs", [(False, ("entropy",)), (True, ()), (False, trl_kernel.OPTIONAL_OUTPUTS)])
def test_gradients_match_trl_across_chunks(monkeypatch, dtype, atol, with_bias, outputs):
    # 3 token chunks (the last short) x vocabulary chunks of 10 inside TRL's 24: every loop boundary is crossed
    monkeypatch.setattr(trl_kernel, "TOKEN_CHUNK_SIZE", 8)
    monkeypatch.setattr(lean_lm_head, "VOCAB_CHUNK", 10)
    torch.manual_seed(0)
    hidden = torch.randn(21, 16).to(dtype)
    weight = torch.randn(53, 16).to(dtype)
    bias = torch.randn(53).to(dtype) if with_bias else None
    targets = torch.randint(0, 53, (21,))
    ref = run(trl_kernel.ChunkedLogProbFunction, hidden, weight, bias, targets, outputs)
    lean = run(lean_lm_head.LeanLMHeadLogProb, hidden, weight, bias, targets, outputs)
    assert torch.equal(lean[0], ref[0])  # the forward is TRL's
    for got, want in zip(lean[1:], ref[1:]):
        if want is None:
            assert got is None
            continue
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.allclose(got.float(), want.float(), atol=atol, rtol=1e-3)


class LargestFp32(TorchDispatchMode):
    """The numel of the largest fp32 tensor any op produces while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def test_backward_never_builds_an_fp32_weight_sized_buffer(monkeypatch):
    monkeypatch.setattr(lean_lm_head, "VOCAB_CHUNK", 64)
    hidden, weight = torch.randn(32, 16, dtype=torch.bfloat16), torch.randn(512, 16, dtype=torch.bfloat16)
    targets = torch.randint(0, 512, (32,))
    sizes = {}
    for fn in (trl_kernel.ChunkedLogProbFunction, lean_lm_head.LeanLMHeadLogProb):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logprobs = fn.apply(h, w, None, targets, 1.0, 512, None, 1.0, ())[0]
        with LargestFp32() as probe:
            logprobs.sum().backward()
        sizes[fn.__name__] = probe.largest
    assert sizes["ChunkedLogProbFunction"] >= weight.numel()  # TRL: an fp32 gradient of the whole weight
    assert sizes["LeanLMHeadLogProb"] <= max(64 * 16, hidden.numel(), 32 * 64)  # one vocabulary chunk at most


def test_routed_swaps_trls_fused_head_only_inside_the_block():
    import trl.trainer.utils as trl_utils

    lever = lean_lm_head.LEVER
    with lever.during_training(LeverSet(lean_lm_head=False), None):
        assert trl_utils._ChunkedLogProbFunction is lean_lm_head.HookSafeLogProb
    with pytest.raises(RuntimeError), lever.during_training(LeverSet(lean_lm_head=True), None):
        assert trl_utils._ChunkedLogProbFunction is lean_lm_head.LeanLMHeadLogProb
        raise RuntimeError("training failed")
    assert trl_utils._ChunkedLogProbFunction is trl_kernel.ChunkedLogProbFunction


@pytest.mark.parametrize("fn", [lean_lm_head.HookSafeLogProb, lean_lm_head.LeanLMHeadLogProb])
def test_backward_gets_the_head_parameter_itself_under_saved_tensor_hooks(monkeypatch, fn):
    """Activation offloading runs the forward under saved-tensor hooks. A parameter saved through them comes back as
    a new plain tensor, so under ZeRO-3 TRL's backward could not gather it (no `ds_status`). Ours never saves it."""
    import trl.trainer.utils as trl_utils

    seen = []
    real_gather = trl_utils.maybe_gather_lm_head_ctx
    monkeypatch.setattr(trl_utils, "maybe_gather_lm_head_ctx", lambda *p: seen.append(p) or real_gather(*p))
    torch.manual_seed(0)
    hidden, targets = torch.randn(12, 16), torch.randint(0, 40, (12,))
    weight = torch.nn.Parameter(torch.randn(40, 16))
    packed = []

    def pack(t):
        packed.append(t)
        return t

    results = {}
    for cls in (trl_kernel.ChunkedLogProbFunction, fn):
        seen.clear(), packed.clear()
        weight.grad = None
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # identity hooks, as a no-op offloader
            logprobs, *_ = cls.apply(hidden, weight, None, targets, 1.0, 24, None, 1.0, ())
        logprobs.sum().backward()
        results[cls] = (seen[-1][0] is weight, any(t is weight for t in packed), weight.grad.clone())
    assert results[trl_kernel.ChunkedLogProbFunction][:2] == (False, True)  # TRL's: through the hooks, a copy back
    assert results[fn][:2] == (True, False)  # ours: the parameter itself, never through the hooks
    torch.testing.assert_close(results[fn][2], results[trl_kernel.ChunkedLogProbFunction][2], atol=1e-5, rtol=0)
