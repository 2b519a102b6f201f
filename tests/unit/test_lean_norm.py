"""The lean RMSNorm computes what the stock module computes, across chunk boundaries, and saves far less."""

import pytest
import torch
from transformers.models.mistral.modeling_mistral import MistralRMSNorm

from longdpo.levers import lean_norm


def pair(dtype):
    torch.manual_seed(0)
    stock = MistralRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        stock.weight.uniform_(0.5, 1.5)
    lean = MistralRMSNorm(64, eps=1e-5).to(dtype)
    lean.load_state_dict(stock.state_dict())
    lean_norm.make_lean(lean)
    return stock, lean


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_forward_and_gradients_match_stock_across_chunks(monkeypatch, dtype, atol):
    monkeypatch.setattr(lean_norm, "CHUNK_TOKENS", 7)  # 3 x 10 tokens: chunks straddle sequences
    stock, lean = pair(dtype)
    x = (torch.randn(3, 10, 64) * 3).to(dtype)
    dy = torch.randn(3, 10, 64).to(dtype)
    outs = []
    for norm in (stock, lean):
        xi = x.clone().requires_grad_()
        y = norm(xi)
        y.backward(dy)
        outs.append((y.detach(), xi.grad, norm.weight.grad))
    (y0, gx0, gw0), (y1, gx1, gw1) = outs
    assert y1.dtype == y0.dtype and gx1.dtype == gx0.dtype and gw1.dtype == gw0.dtype
    assert torch.equal(y1, y0)  # the same ops and casts, row by row
    assert torch.allclose(gx1.float(), gx0.float(), atol=atol)
    assert torch.allclose(gw1.float(), gw0.float(), atol=atol * 10, rtol=1e-2)


def test_saves_the_input_and_one_scale_per_token():
    stock, lean = pair(torch.bfloat16)
    x = torch.randn(2, 256, 64, dtype=torch.bfloat16, requires_grad=True)

    def saved_bytes(norm):
        seen = {}

        def pack(t):
            if not isinstance(t, torch.nn.Parameter):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            norm(x)
        return sum(seen.values())

    assert saved_bytes(lean) == x.numel() * 2 + 2 * 256 * 4  # bf16 input + fp32 rstd
    assert saved_bytes(stock) >= 3 * x.numel() * 2  # an fp32 copy (2x) and the normalised bf16 copy, at least


def test_rejects_a_module_that_is_not_an_rmsnorm():
    with pytest.raises(TypeError, match="not a Mistral/Llama/Qwen2-style RMSNorm"):
        lean_norm.make_lean(torch.nn.LayerNorm(8))
