"""Lean LM-head backward (`memory.lean_lm_head`): TRL's fused log-prob head without a full-size fp32 weight gradient.

TRL 1.16 scores tokens with `ChunkedLogProbFunction`: the logits never exist whole, but its backward loops over
token chunks *outside* vocabulary chunks, so the LM-head weight gradient has to be accumulated in one fp32 buffer of
the whole weight (vocab x hidden x 4 bytes: 2.68 GB for Mistral-NeMo's 131072 x 5120) and is then cast to bf16
(another 1.34 GB). At 12k tokens that is the largest holder left once activations are offloaded and the norms are
lean. Here the loops are swapped: vocabulary chunks outside, token chunks inside. Each vocabulary chunk's weight
gradient is summed over all tokens in a small fp32 buffer (VOCAB_CHUNK x hidden) and written once into the bf16
gradient. The same tiles are recomputed with the same kernels (TRL's Triton fold on GPU, its torch fold elsewhere),
so the FLOPs are TRL's, every weight-gradient row is summed in fp32 in the same token order, and the hidden-state
gradient stays an fp32 accumulation over vocabulary chunks, as in TRL.

Only the backward changes; the class is a subclass of TRL's, swapped in for TRL's fused forward while training
(longdpo/patches.py, `trl_log_prob_function`).

Both heads (TRL's as shipped and the lean one) run here as `HookSafeLogProb`: TRL's forward and backward, with the
LM-head weight and bias kept on `ctx` instead of in the saved tensors. What was broken: under DeepSpeed ZeRO-3 with
`activation_offloading`, the forward runs under saved-tensor hooks, and a tensor saved through hooks comes back as a
new plain tensor aliasing whatever the parameter held at unpack time (under ZeRO-3: an empty partition), without the
`ds_status` / `ds_id` attributes that TRL's backward needs to gather the weight again. Seen as `AttributeError:
'Tensor' object has no attribute 'ds_status'` in `maybe_gather_lm_head_ctx` at the first backward (TRL 1.16, one
H200, the deepspeed launcher). Kept on `ctx`, the backward gets the parameter itself, as autograd gives it without
hooks, and gathers it; the hooks never see the head's weight.
"""

from __future__ import annotations

import torch
import trl.trainer.utils as trl_utils
from trl.kernels import chunked_logprob as trl_kernel

from longdpo import patches
from longdpo.levers import Key, Lever
from longdpo.model.forwards import PROFILE_LABEL

# Vocabulary columns per backward tile: the fp32 weight-gradient buffer is VOCAB_CHUNK x hidden x 4 bytes (168 MB at
# hidden 5120), the recomputed tile TOKEN_CHUNK_SIZE x VOCAB_CHUNK in the compute dtype.
VOCAB_CHUNK = 8192


class HookSafeLogProb(trl_kernel.ChunkedLogProbFunction):
    """TRL's fused LM head, its weight and bias held on `ctx` rather than saved through saved-tensor hooks."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, *args):
        ctx.head_params = (weight, bias)
        save = ctx.save_for_backward  # TRL's forward saves (hidden, weight, bias, targets, log_z, entropy)
        ctx.save_for_backward = lambda h, _weight, _bias, *rest: save(h, None, None, *rest)
        with torch.profiler.record_function(f"{PROFILE_LABEL}forward:lm_head"):  # a row of a profiled step
            return trl_kernel.ChunkedLogProbFunction.forward(ctx, hidden, weight, bias, *args)

    @staticmethod
    def backward(ctx, *grads):
        return trl_kernel.ChunkedLogProbFunction.backward(_WithHeadParams(ctx), *grads)


class _WithHeadParams:
    """`ctx` as TRL's backward reads it: saved_tensors with the head's parameters put back in their places."""

    def __init__(self, ctx):
        hidden, _, _, *rest = ctx.saved_tensors
        self.saved_tensors = (hidden, *ctx.head_params, *rest)
        self._ctx = ctx

    def __getattr__(self, name):
        return getattr(self._ctx, name)


class LeanLMHeadLogProb(HookSafeLogProb):
    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None, *_):
        hidden, weight, bias, targets, log_z, entropy = _WithHeadParams(ctx).saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        n_tokens, token_chunk = hidden.shape[0], trl_kernel.TOKEN_CHUNK_SIZE
        dtype, device = ctx.compute_dtype, hidden.device
        grad_logprobs = grad_logprobs.float().contiguous() if grad_logprobs is not None else None
        grad_entropy = grad_entropy.float().contiguous() if grad_entropy is not None else None
        with trl_utils.maybe_gather_lm_head_ctx(weight, bias):  # ZeRO-3: the full weight, as in TRL's backward
            vocab, width = weight.shape[0], min(ctx.chunk_size, VOCAB_CHUNK)
            grad_hidden = torch.zeros(hidden.shape, device=device, dtype=torch.float32) if needs_hidden else None
            grad_weight = torch.empty(weight.shape, device=device, dtype=weight.dtype) if needs_weight else None
            grad_bias = torch.empty(bias.shape, device=device, dtype=bias.dtype) if needs_bias else None
            weight_acc = torch.empty((width, weight.shape[1]), device=device, dtype=torch.float32)
            mm_buf = torch.empty((min(n_tokens, token_chunk), width), device=device, dtype=dtype)
            for start in range(0, vocab, width):
                end = min(start + width, vocab)
                w_chunk = weight[start:end].to(dtype)
                acc = weight_acc[: end - start].zero_()
                bias_acc = torch.zeros(end - start, device=device, dtype=torch.float32) if needs_bias else None
                for t0 in range(0, n_tokens, token_chunk):
                    t1 = min(t0 + token_chunk, n_tokens)
                    hidden_chunk = hidden[t0:t1].to(dtype)
                    tile = mm_buf[: t1 - t0, : end - start]
                    torch.mm(hidden_chunk, w_chunk.t(), out=tile)
                    if bias is not None:
                        tile.add_(bias[start:end].to(dtype))
                    _logit_grad(
                        ctx,
                        tile,
                        targets[t0:t1],
                        log_z[t0:t1],
                        entropy[t0:t1],
                        grad_logprobs[t0:t1] if grad_logprobs is not None else None,
                        grad_entropy[t0:t1] if grad_entropy is not None else None,
                        start,
                    )
                    if needs_hidden:
                        trl_kernel._addmm_fp32(grad_hidden[t0:t1], tile, w_chunk)
                    if needs_weight:
                        trl_kernel._addmm_fp32(acc, tile.t(), hidden_chunk)
                    if needs_bias:
                        bias_acc += tile.sum(dim=0, dtype=torch.float32)
                if needs_weight:
                    grad_weight[start:end].copy_(acc)
                if needs_bias:
                    grad_bias[start:end].copy_(bias_acc)
        grad_hidden = grad_hidden.to(hidden.dtype) if needs_hidden else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def _logit_grad(ctx, tile, targets, log_z, entropy, grad_logprobs, grad_entropy, vocab_start: int) -> None:
    """Overwrite a recomputed logits tile with the loss gradient w.r.t. it: TRL's own fold (Triton on GPU)."""
    n, cols = tile.shape
    if trl_kernel._use_triton(tile.device):
        import triton  # on GPUs only (TRL's kernel takes its torch fold elsewhere), where Triton is installed

        fold = trl_kernel._backward_kernel[(n, triton.cdiv(cols, trl_kernel._BLOCK_SIZE))]
    else:
        fold = trl_kernel._backward_tile
    fold(
        tile,
        tile.stride(0),
        targets,
        log_z,
        entropy,
        grad_logprobs if grad_logprobs is not None else log_z,
        grad_entropy if grad_entropy is not None else log_z,
        vocab_start,
        cols,
        HAS_LOGPROB_GRAD=grad_logprobs is not None,
        HAS_ENTROPY_GRAD=grad_entropy is not None,
        BLOCK_SIZE=trl_kernel._BLOCK_SIZE,
        **ctx.kernel_args,
    )


class LeanLMHead(Lever):
    name = "lean_lm_head"
    order = 50
    tokens = ("head",)
    flag = ("lean_lm_head", True, "head")
    keys = (
        Key(
            "lean_lm_head",
            bool,
            False,
            "TRL's fused LM head with its backward looping over vocabulary chunks outside token chunks: no fp32 "
            "buffer of the whole LM-head weight gradient.",
            priced=True,
        ),
    )

    def during_training(self, s, build):
        # TRL's head always runs hook-safe (what ZeRO-3 with activation offloading needs); lean when asked
        return patches.trl_log_prob_function(LeanLMHeadLogProb if s.lean_lm_head else HookSafeLogProb)

    def configure(self, s, build):
        build.wrapped["lean_lm_head"] = int(s.lean_lm_head)

    def price(self, s, setup, terms, cal):
        pass  # in the coefficients fitted per lever set (its token in the priced name)


LEVER = LeanLMHead()
