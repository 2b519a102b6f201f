"""Each pair's prompt computed once (`data.shared_prompt`): prefix-sharing DPO.

TRL runs a pair as a batch of two rows, prompt + chosen and prompt + rejected, so the prompt goes through the policy
and the reference twice. Here each pair is one row

    [prompt P, chosen C, x, rejected R]      positions 0..|P|+|C|-1, then |P|-1, |P|..|P|+|R|-1

where x is a copy of the prompt's last token at the prompt's last position. x and R attend to the prompt (all but its
last token, which x stands in for) and to themselves, never to C: queries P+C run causal attention over P+C; queries
x+R run over keys [P without its last token, x, R] with a lower-right causal bias. Every token then sees exactly the
tokens and positions it sees in TRL's rows, so the hidden state of each of C's and R's tokens, and of the token before
each, is the one TRL computes: x's hidden state is the prompt's last, the one that scores R's first token. (Without x
that one position would have to score two labels, and TRL's fused LM head scores one per position.) The row costs
|P| + |C| + |R| + 1 tokens instead of 2|P| + |C| + |R| plus padding.

Sharing pays where the prompt is a large part of the pair; where it is short, the row's extra attention call and
bookkeeping cost more than the prompt tokens saved: on one H100 at 32k tokens, with the rejected part's call then on
flash, a batch that saved 2% of the tokens ran 17% slower, one that saved 45% ran 1.65x faster (docs/BENCHMARKS.md). So
a batch runs shared only when its shared rows are at least `min_saving` (`data.shared_prompt_min_saving`) fewer
tokens than TRL's rows; other batches run as TRL's rows without a mask (the same arithmetic either way).

TRL's DPO code is left untouched: the policy's and the reference's forward (TRL's fused-LM-head forward) are wrapped.
The wrapper builds the shared rows from TRL's batch (the labels say where each completion starts), runs the model once
with `position_ids` and pre-shifted `shift_labels`, and puts every per-token output back where TRL's rows have it, zero
where the label is -100 as TRL's head does. TRL computes the loss, the rewards and every metric on the same tensors as
without sharing, for every loss type and `ld_alpha`.

Under sequence parallelism (longdpo/levers/sequence_parallel.py) this wrapper calls the sequence-parallel one, which
splits the shared rows over the group's ranks; Ulysses' all-to-all gives this attention whole rows for a share of the
heads, so the layout holds as it is.

The attention is registered through transformers' attention interface (`NAME`); transformers builds no mask for it.
The chosen part's call is PyTorch's scaled_dot_product_attention with `is_causal`; the rejected part's runs as two
blocks merged by their log-sum-exp (`PromptAndTail`), on cuDNN's kernel on a GPU. Called without a layout (a model
used outside DPO's forward), it is causal attention over the whole row, TRL's right-padded batch without its mask
(longdpo/levers/padding_mask.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from trl.trainer.utils import FusedCausalLMOutput

from longdpo.levers import Key, Lever
from longdpo.recipe_values import RecipeError, is_number, trainer_default

NAME = "longdpo_shared_prompt"
FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")
# What TRL's DPO forward passes besides the batch; anything else (images, token types) is not a text-only pair.
PASSED_THROUGH = {"use_cache", "output_router_logits"}


def shared_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, row_layout=None, **kw):
    """query (batch, heads, seq, dim), key/value (batch, kv_heads, seq, dim) -> (batch, seq, heads, dim).
    `row_layout`: (prompt, chosen, rejected, x) per row, passed through the model's forward by `wrap`."""
    if row_layout is None:
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, is_causal=True)
    out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
    groups = getattr(module, "num_key_value_groups", 1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    two_blocks = not dropout and PromptAndTail.runs_on(query)
    for row, (p, c, r, x) in enumerate(row_layout):
        head, end = p + c, p + c + x + r
        q, k, v = query[row : row + 1], key[row : row + 1], value[row : row + 1]
        if head:
            first, _ = sdpa_attention_forward(
                module, q[:, :, :head], k[:, :, :head], v[:, :, :head], None, dropout, scaling, is_causal=True
            )
            out[row, :head] = first[0]
        if end > head:
            blocks = q[:, :, head:end], k[:, :, head:end], v[:, :, head:end], k[:, :, : p - x], v[:, :, : p - x]
            if p - x and two_blocks:
                second = PromptAndTail.apply(*blocks, scale)
            else:  # no prompt to see, or what the two blocks' kernels do not take
                second = lower_right_call(*blocks, groups, scale, dropout)
            out[row, head:end] = second[0].transpose(0, 1)
    return out, None


def lower_right_call(q, k_tail, v_tail, k_prompt, v_prompt, groups, scale, dropout=0.0):
    """The queries [x, R] over the keys [prompt without its last token, x, R] as one lower-right causal call over the
    keys copied together and repeated per head group (PyTorch's flash or memory-efficient kernel on a GPU);
    `PromptAndTail` takes the same arguments but `groups`."""
    keys, values = torch.cat([k_prompt, k_tail], dim=2), torch.cat([v_prompt, v_tail], dim=2)
    return F.scaled_dot_product_attention(
        q,
        repeat_kv(keys, groups),
        repeat_kv(values, groups),
        attn_mask=causal_lower_right(q.shape[2], keys.shape[2]),
        dropout_p=dropout,
        scale=scale,
    )


class PromptAndTail(torch.autograd.Function):
    """The queries [x, R] over the keys [prompt without its last token, x, R]: every prompt key, and the tail's keys
    causally. As one call this is lower-right causal attention, which only PyTorch's flash (FlashAttention-2) and
    memory-efficient kernels take, over keys copied together; as two blocks (the prompt without a mask, the tail with
    square `is_causal`) each runs on cuDNN's kernel (1.6x the flash call on an H100), without copying the prompt's
    keys next to the tail's and without repeating key/value heads per group. The blocks' outputs merge by their
    log-sum-exp; the backward runs each block's backward with the merged output and log-sum-exp, which is the exact
    gradient of the merged attention (ring attention's identity)."""

    @staticmethod
    def runs_on(q) -> bool:
        """Where its kernels take these queries: the CPU, and cuDNN's attention on a Hopper or newer GPU in bf16 or
        fp16 with head dim up to 128 (where it was measured and checked); elsewhere the lower-right call runs."""
        if q.device.type == "cpu":
            return True
        return (
            q.is_cuda
            and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[-1] <= 128
            and torch.backends.cuda.cudnn_sdp_enabled()
            and torch.cuda.get_device_capability(q.device) >= (9, 0)
        )

    @staticmethod
    def forward(ctx, q, k_tail, v_tail, k_prompt, v_prompt, scale):
        kernel = _Kernel(q, scale)
        (o1, l1), (o2, l2) = kernel.forward(q, k_prompt, v_prompt, False), kernel.forward(q, k_tail, v_tail, True)
        lse = torch.logaddexp(l1, l2)
        out = (o1 * (l1 - lse).exp().unsqueeze(-1) + o2 * (l2 - lse).exp().unsqueeze(-1)).to(q.dtype)
        out = kernel.layout(out)
        ctx.save_for_backward(q, k_tail, v_tail, k_prompt, v_prompt, out, lse)
        ctx.kernel = kernel
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k_tail, v_tail, k_prompt, v_prompt, out, lse = ctx.saved_tensors
        kernel = ctx.kernel
        grad = kernel.layout(grad)
        dq1, dk_p, dv_p = kernel.backward(grad, q, k_prompt, v_prompt, out, lse, False)
        dq2, dk_t, dv_t = kernel.backward(grad, q, k_tail, v_tail, out, lse, True)
        return dq1 + dq2, dk_t, dv_t, dk_p, dv_p, None


class _Kernel:
    """One block of attention with its log-sum-exp, forward and backward, through PyTorch's kernels: cuDNN on a CUDA
    GPU, the CPU's flash kernel otherwise. Both take keys and values with fewer heads than the queries as they are
    (grouped-query attention) and return their gradients in that shape, so nothing is repeated per group."""

    def __init__(self, q, scale):
        self.cuda, self.scale, self.saved = q.is_cuda, scale, {}

    @staticmethod
    def layout(t):
        """(batch, heads, seq, dim) stored as (batch, seq, heads, dim), as the kernels write their outputs."""
        return t.transpose(1, 2).contiguous().transpose(1, 2)

    def forward(self, q, k, v, causal):
        if not self.cuda:
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=self.scale)
            return _accumulating(o), lse
        o, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=self.scale
        )
        self.saved[causal] = (cq, ck, mq, mk, seed, offset, lse.shape, lse.stride())
        return _accumulating(o), lse.reshape(o.shape[:3])

    def backward(self, grad, q, k, v, out, lse, causal):
        if not self.cuda:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad, q, k, v, out, lse, 0.0, causal, scale=self.scale
            )
        cq, ck, mq, mk, seed, offset, shape, stride = self.saved[causal]
        # the merged log-sum-exp laid out as this block's forward wrote its own: per head by default, per token when
        # torch keeps plans per length class (memory.reuse_attention_plans), whose cached backward plan serves every
        # length of the class and must not meet a stride that depends on the length
        lse = torch.empty_strided(shape, stride, dtype=lse.dtype, device=lse.device).copy_(lse.reshape(shape))
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad,
            q,
            k,
            v,
            out,
            lse,
            seed,
            offset,
            None,  # no bias (the Python binding passes None as an undefined tensor)
            cq,
            ck,
            mq,
            mk,
            0.0,
            causal,
            scale=self.scale,
        )


def _accumulating(o):
    """A block's output in the precision its merge sums in (float32, or float64 for float64 inputs)."""
    return o.to(torch.promote_types(o.dtype, torch.float32))


AttentionInterface.register(NAME, shared_attention)


def cut_to_max_length(prompt: int, chosen: int, rejected: int, max_length: int | None):
    """A pair's (prompt, chosen, rejected) tokens as TRL's collator cuts them to `max_length` (keep_start): each
    completion to what the prompt leaves; None where the prompt alone fills `max_length` (TRL drops the pair)."""
    if not max_length:
        return prompt, chosen, rejected
    if prompt >= max_length:
        return None
    return prompt, min(chosen, max_length - prompt), min(rejected, max_length - prompt)


def row_tokens(prompt: int, chosen: int, rejected: int) -> int:
    """The tokens of one pair's shared row: [prompt, chosen, x, rejected], x a copy of the prompt's last token."""
    return prompt + chosen + rejected + int(prompt > 0)


def tokens_of_pair(prompt: int, chosen: int, rejected: int, min_saving: float) -> int:
    """The tokens one pair puts through the model: its shared row where that saves `min_saving` of TRL's two rows
    (2 x (prompt + the longer completion)), else those two rows (the choice `wrap` makes per batch)."""
    two_rows, shared = 2 * (prompt + max(chosen, rejected)), row_tokens(prompt, chosen, rejected)
    return shared if 1 - shared / two_rows >= min_saving else two_rows


def layout(input_ids, attention_mask, labels):
    """Per pair (prompt, chosen, rejected, x) lengths from TRL's batch [chosen rows..., rejected rows...]: each row is
    prompt, completion, right padding (TRL's `flush_left`); labels are -100 except on the completion."""
    real = attention_mask.sum(1) if attention_mask is not None else torch.full_like(input_ids[:, 0], input_ids.shape[1])
    completion = (labels != -100).sum(1)
    prompt = (real - completion).tolist()
    completion = completion.tolist()
    n = input_ids.shape[0] // 2
    pairs = []
    for i in range(n):
        p = prompt[i]
        if p != prompt[n + i] or not torch.equal(input_ids[i, :p], input_ids[n + i, :p]):
            raise RuntimeError("shared_prompt: a pair's chosen and rejected rows do not start with the same prompt")
        pairs.append((p, completion[i], completion[n + i], int(p > 0)))
    return pairs


def saving(pairs, length: int) -> float:
    """The share of the tokens of TRL's rows (2 per pair, `length` each) that the shared rows (one per pair, padded to
    the longest) do without. `pairs`: (prompt, chosen, rejected, ...) tokens of each."""
    width = max(row_tokens(*pair[:3]) for pair in pairs)
    return 1 - width / (2 * length)


def runs_shared(pairs, length: int, min_saving: float) -> bool:
    """Whether a batch runs as shared rows: it saves at least `min_saving` of TRL's rows' tokens."""
    return saving(pairs, length) >= min_saving


def build_rows(input_ids, labels, pairs):
    """The shared rows (ids, positions, shifted labels), right-padded to the longest."""
    n = len(pairs)
    ids, positions, targets = [], [], []
    for i, (p, c, r, x) in enumerate(pairs):
        rej = n + i
        ids.append(torch.cat([input_ids[i, : p + c], input_ids[rej, p - x : p + r]]))
        positions.append(torch.cat([torch.arange(p + c), torch.arange(p - x, p + r)]))
        stop = labels.new_full((1,), -100)
        chosen_targets = torch.cat([labels[i, 1 : p + c], stop]) if p + c else labels[i, :0]
        rejected_targets = torch.cat([labels[rej, p - x + 1 : p + r], stop]) if x + r else labels[rej, :0]
        targets.append(torch.cat([chosen_targets, rejected_targets]))
    width = max(len(t) for t in ids)

    def stack(rows, value):
        return torch.stack([F.pad(t, (0, width - len(t)), value=value) for t in rows])

    device = input_ids.device
    return stack(ids, 0), stack(positions, 0).to(device), stack(targets, -100)


def scatter_back(shared: torch.Tensor | None, pairs, length: int) -> torch.Tensor | None:
    """Per-token outputs of the shared rows at the places TRL's rows (chosen..., rejected...) have them, length - 1
    positions each (position t scores token t + 1), zero elsewhere."""
    if shared is None:
        return None
    n = len(pairs)
    out = shared.new_zeros(2 * n, length - 1)
    for i, (p, c, r, x) in enumerate(pairs):
        chosen, rejected = max(p + c - 1, 0), max(x + r - 1, 0)
        out[i, :chosen] = shared[i, :chosen]
        out[n + i, p - x : p - x + rejected] = shared[i, p + c : p + c + rejected]
    return out


def wrap(model: torch.nn.Module, min_saving: float = 0.0) -> dict:
    """Wrap `model.forward` (TRL's fused-LM-head forward; a DeepSpeed engine's module) to run each pair as one row
    when that saves at least `min_saving` of the tokens. Returns the counts of forwards run shared and as TRL's rows."""
    model = getattr(model, "module", model)
    fused = model.forward
    counts = {"shared": 0, "two_rows": 0}

    def shared_forward(*args, input_ids=None, attention_mask=None, labels=None, fused_lm_head=False, **kwargs):
        if args or input_ids is None or labels is None or not fused_lm_head or set(kwargs) - PASSED_THROUGH:
            raise RuntimeError(
                "shared_prompt wraps TRL's DPO forward of text pairs "
                f"(model(input_ids=..., labels=..., fused_lm_head=True)); got another call: {sorted(kwargs)}"
            )
        pairs = layout(input_ids, attention_mask, labels)
        if not runs_shared(pairs, input_ids.shape[1], min_saving):
            # TRL's rows; the mask is not needed (right padding under causal attention) and attention ignores it
            counts["two_rows"] += 1
            return fused(input_ids=input_ids, labels=labels, fused_lm_head=True, **kwargs)
        counts["shared"] += 1
        ids, positions, targets = build_rows(input_ids, labels, pairs)
        out = fused(
            input_ids=ids,
            position_ids=positions,
            shift_labels=targets,
            fused_lm_head=True,
            row_layout=pairs,
            **kwargs,
        )
        fields = {f: scatter_back(getattr(out, f), pairs, input_ids.shape[1]) for f in FIELDS}
        loss = -fields["log_probs"].sum() / fields["label_mask"].sum().clamp(min=1)
        return FusedCausalLMOutput(loss=loss, aux_loss=out.aux_loss, **fields)

    model.forward = shared_forward
    return counts


def _one_pair_per_batch(recipe) -> bool:
    """Each batch's tokens are one pair's (with more pairs, the batch's decision and padding depend on which pairs
    meet, and the plan keeps TRL's two rows, an upper bound)."""
    return recipe.trainer.get("per_device_train_batch_size", trainer_default("per_device_train_batch_size")) == 1


class SharedPrompt(Lever):
    name = "shared_prompt"
    order = 80
    tokens = ("shared",)
    flag = ("shared_prompt", True, "shared")
    keys = (
        Key(
            "shared_prompt",
            bool,
            False,
            "train each pair as one sequence [prompt, chosen, rejected], the prompt computed once for the policy and "
            "the reference (the same loss and gradients). Saves most where the prompt is most of the pair (long "
            "documents, long conversations).",
            section="data",
        ),
        Key(
            "shared_prompt_min_saving",
            float,
            0.2,
            "with `shared_prompt`, a batch runs shared only when that saves at least this share of the tokens of "
            "TRL's two rows per pair (about half the prompt's share of the pair); other batches run as TRL's rows. "
            "Where the prompt is short, sharing costs more time than it saves.",
            section="data",
        ),
    )

    def check(self, s, ctx):
        if not isinstance(s.shared_prompt, bool):
            raise RecipeError(f"`data.shared_prompt` must be true or false, got {s.shared_prompt!r}.")
        saving_wanted = s.shared_prompt_min_saving
        if not is_number(saving_wanted) or not 0 <= saving_wanted < 1:
            raise RecipeError(
                f"`data.shared_prompt_min_saving` must be a fraction in [0, 1) (e.g. 0.2), got {saving_wanted!r}."
            )
        if s.shared_prompt and s.padding_mask == "keep":
            raise RecipeError(
                "`data.shared_prompt: true` runs attention without TRL's padding mask (the shared rows need none): "
                "set `memory.padding_mask: auto` or `data.shared_prompt: false`."
            )
        if s.shared_prompt and ctx.recipe.trainer.get("padding_free"):
            raise RecipeError(
                "`data.shared_prompt: true` builds its own rows from padded pairs: set `padding_free: false` or "
                "`data.shared_prompt: false`."
            )

    def reshapes_pairs(self, s):
        return s.shared_prompt

    def configure(self, s, build):
        if s.shared_prompt:
            build.rows_per_pair = 1
            build.one_row_per_pair = functools.partial(runs_shared, min_saving=s.shared_prompt_min_saving)
            build.core_attention = NAME  # the models are built with it; sequence parallelism wraps it
            build.messages.append(
                "attention: each pair's prompt computed once (data.shared_prompt): one sequence [prompt, chosen, "
                "rejected] per pair, the rejected part's attention in two blocks (cuDNN on a GPU)"
            )

    def wrap_trainer(self, s, trainer, build):
        if not s.shared_prompt:
            return
        # TRL's fused-LM-head forwards (LoRA's reference pass is the policy's)
        build.state["shared_prompt"] = wrap(trainer.model, s.shared_prompt_min_saving)
        if trainer.ref_model is not None:
            wrap(trainer.ref_model, s.shared_prompt_min_saving)

    def report_lines(self, s, report: dict) -> list[str]:
        if not s.shared_prompt:
            return []
        return [
            f"shared prompt: {100 * report['shared_prompt_saves']:.0f}% fewer tokens through the model than TRL's "
            f"two rows per pair; a batch that saves less than {100 * s.shared_prompt_min_saving:.0f}% runs as TRL's "
            "rows (data.shared_prompt_min_saving)"
        ]

    def summary(self, s, build) -> dict:
        # the policy's forwards (with LoRA the reference's too) run as shared rows and as TRL's two rows
        return {"shared_prompt": s.shared_prompt, "shared_prompt_forwards": build.state.get("shared_prompt")}

    def needs_pairs(self, s, recipe) -> bool:
        """The plan depends on the pairs themselves: their costliest shared row."""
        return s.shared_prompt and _one_pair_per_batch(recipe)

    def setup_facts(self, s, recipe, seq: int, pairs, synthetic: bool) -> dict:
        """`pair_tokens`: the most tokens one pair puts through the model (one pair per batch), from (prompt,
        chosen, rejected) token counts cut to `seq` as TRL's collator cuts them; None where every pair runs as
        TRL's two rows of a synthetic recipe, or with more pairs per batch (the plan keeps TRL's rows then)."""
        if not s.shared_prompt or not _one_pair_per_batch(recipe) and not synthetic:
            return {}
        cut = [pair for pair in (cut_to_max_length(*pair, seq) for pair in pairs) if pair]
        costliest = max((tokens_of_pair(*pair, s.shared_prompt_min_saving) for pair in cut), default=0)
        if synthetic and costliest >= 2 * seq:
            return {}
        return {"pair_tokens": costliest or None}

    def geometry(self, s, setup, terms):
        if s.shared_prompt and setup.pair_tokens:
            terms.pair_tokens, terms.shared_rows = setup.pair_tokens, True

    def price(self, s, setup, terms, cal):
        pass  # its rows' tokens are its term (geometry)


LEVER = SharedPrompt()
