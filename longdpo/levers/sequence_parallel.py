"""Sequence-parallel DPO (`parallelism.sp_size: K`) with DeepSpeed Ulysses.

Every chosen/rejected sequence is split into K contiguous shards, one per rank of a sequence-parallel (SP) group of
K consecutive ranks; the world_size / K groups are data parallel. Attention runs through DeepSpeed's
`UlyssesSPAttentionHF`: an all-to-all turns (local sequence, all heads) into (whole sequence, heads / K), the core
attention (sdpa / flash) runs causally on the whole sequence, and a second all-to-all turns it back. Everything else
(norms, MLP, the fused LM head) is per token and runs on the local shard only, so activations per rank shrink K-fold.

TRL's DPO code is left untouched. The policy's and the reference's forward (TRL's fused-LM-head forward) are wrapped:
  - the batch, which every rank of the group holds whole, is padded to a sequence length divisible by K and to the
    micro-batch size Ulysses was built for (a short last batch), with labels -100, so padding scores nothing;
  - each rank runs the model on its shard with global `position_ids` and pre-shifted `shift_labels` (the label of
    position t is token t+1, which may live on the next rank), so no token's log-prob is lost at a shard border;
  - per-token outputs (log-probs, entropy, mean logits, top-1, mask) are all-gathered along the sequence and cut back
    to the unpadded shape, so TRL computes the loss, rewards and metrics on exactly the tensors it would see without
    SP. Backward of the gather hands each rank the gradient of its own shard.
With `data.shared_prompt` the shared-prompt wrapper (longdpo/levers/shared_prompt.py) calls this one with its rows,
their position ids and pre-shifted labels; Ulysses is then built for one row per pair, and a batch that runs as TRL's
two rows per pair goes through in two calls of that size.
Gradient scale: DeepSpeed (and DDP) average gradients over all world_size ranks, but the K ranks of a group hold
partial gradients of one and the same loss, which must be summed. The gather's backward therefore multiplies by K,
and the averaged gradient equals the data-parallel average of the per-pair gradients, as without SP.

Data: the K ranks of a group must see the same pairs. The trainer's dataloader is sharded over data-parallel ranks
(world_size / K) instead of all ranks (`shard_over_data_parallel_ranks`).

Right padding (TRL's collator) with causal attention means real tokens never attend to padding, so the attention mask
can be dropped (Ulysses discards it anyway); this is also why sliding-window attention is refused.

Planner: each rank holds 1/K of every sequence's tokens (the Ulysses all-to-all buffers are not calibrated).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from trl.trainer.utils import FusedCausalLMOutput

from longdpo.levers import Key, Lever
from longdpo.recipe_values import RecipeError, is_number, trainer_default

SUPPORTED_ATTENTION = ("sdpa", "flash_attention_2")


def check_sp_size(sp_size) -> None:
    """The value alone: every count of ranks divides by it, so the start-up checks ask this first."""
    if not is_number(sp_size, whole=True) or sp_size < 1:
        raise RecipeError(
            f"`parallelism.sp_size` must be a positive integer (1: no sequence parallelism), got {sp_size!r}."
        )


def check_sequence_parallel(
    sp_size, world_size: int, arch, trainer: dict, attn_implementation: str, evaluating: bool = False
) -> None:
    """Start-up checks, before any model is built. `arch` is the model's config (heads, sliding window)."""
    check_sp_size(sp_size)
    if sp_size == 1:
        return
    if world_size % sp_size:
        divisors = [k for k in range(1, world_size + 1) if world_size % k == 0]
        raise RecipeError(
            f"`parallelism.sp_size: {sp_size}` must divide the number of processes ({world_size}): launch a multiple "
            f"of {sp_size} GPUs, or set sp_size to one of {divisors}."
        )
    heads, kv_heads = arch.num_attention_heads, arch.num_key_value_heads
    if heads % sp_size:
        raise RecipeError(
            f"`parallelism.sp_size: {sp_size}` must divide the model's {heads} attention heads "
            "(Ulysses gives each rank heads / sp_size of them)."
        )
    if kv_heads % sp_size and sp_size % kv_heads:
        raise RecipeError(
            f"`parallelism.sp_size: {sp_size}` and the model's {kv_heads} key/value heads must divide "
            "one another (Ulysses splits or replicates them)."
        )
    if attn_implementation not in SUPPORTED_ATTENTION:
        raise RecipeError(
            f"`parallelism.sp_size > 1` needs `model.attn_implementation` sdpa or flash_attention_2 "
            f"(the attention runs without a materialised mask); got {attn_implementation!r}."
        )
    window = getattr(arch, "sliding_window", None)
    max_length = trainer.get("max_length", trainer_default("max_length"))
    if window is not None and (max_length is None or window < max_length):
        raise RecipeError(
            f"The model uses sliding-window attention ({window} tokens) shorter than max_length "
            f"({max_length}); sequence parallelism runs full causal attention. Set max_length <= "
            f"{window} or `parallelism.sp_size: 1`."
        )
    if trainer.get("padding_free"):
        raise RecipeError(
            "`padding_free: true` packs the pairs into one row; sequence parallelism needs the padded "
            "batch. Set `padding_free: false` or `parallelism.sp_size: 1`."
        )
    if trainer.get("precompute_ref_log_probs"):
        raise RecipeError(
            "`precompute_ref_log_probs: true` runs the reference over the dataset before training, "
            "outside the sequence-parallel forward. Set it to false with `parallelism.sp_size > 1` "
            "(the reference is then sequence-parallel too)."
        )
    if trainer.get("prediction_loss_only") is False:
        raise RecipeError(
            "`prediction_loss_only: false` makes evaluation recompute full logits outside the "
            "sequence-parallel forward; remove it (sequence parallelism sets it to true)."
        )
    train_bs = trainer.get("per_device_train_batch_size", trainer_default("per_device_train_batch_size"))
    if (
        evaluating
        and trainer.get("per_device_eval_batch_size", trainer_default("per_device_eval_batch_size")) > train_bs
    ):
        raise RecipeError(
            f"With `parallelism.sp_size > 1`, `per_device_eval_batch_size` must be <= "
            f"per_device_train_batch_size ({train_bs}): Ulysses is built for one micro-batch size."
        )


class _GatherSequence(torch.autograd.Function):
    """All-gather of a (batch, local_seq, ...) tensor along dim 1; backward returns this rank's slice times `scale`."""

    @staticmethod
    def forward(ctx, x, group, rank: int, world: int, scale: float):
        send = x.to(torch.uint8) if x.dtype == torch.bool else x  # gloo has no bool all_gather
        parts = [torch.empty_like(send) for _ in range(world)]
        dist.all_gather(parts, send.contiguous(), group=group)
        ctx.rank, ctx.n, ctx.scale = rank, x.shape[1], scale
        return torch.cat(parts, dim=1).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n] * ctx.scale, None, None, None, None


class SequenceParallel:
    """The SP group of this rank, and the forward wrapper that shards a batch over it."""

    FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")

    def __init__(self, sp_size: int, micro_batch_size: int, model: torch.nn.Module):
        # deepspeed only where sequence parallelism is on: its import detects the accelerator and says so
        import deepspeed
        import deepspeed.comm as ds_dist
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        if not ds_dist.is_initialized():
            deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        self.k, self.micro_batch = sp_size, micro_batch_size
        # register_with_transformers builds the SP groups (consecutive ranks) and routes `attn_implementation`'s
        # attention through Ulysses, for every model of this process (policy and reference alike).
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model, model.config._attn_implementation, sp_size, micro_batch_size, seq_length_is_variable=True
        )
        self.group = mpu.get_sequence_parallel_group()
        self.rank = mpu.get_sequence_parallel_rank()
        self.dp_rank = ds_dist.get_rank() // sp_size
        self.dp_size = ds_dist.get_world_size() // sp_size

    def gather(self, x: torch.Tensor | None, length: int, batch: int):
        if x is None:
            return None
        return _GatherSequence.apply(x, self.group, self.rank, self.k, float(self.k))[:batch, :length]

    def wrap(self, model: torch.nn.Module) -> None:
        """Wrap `model.forward` (TRL's fused-LM-head forward, added by DPOTrainer) to run on this rank's shard.
        A DeepSpeed engine (TRL's prepared reference) is unwrapped: the engine calls its module."""
        model = getattr(model, "module", model)
        fused = model.forward

        def sp_forward(
            *args,
            input_ids=None,
            attention_mask=None,
            labels=None,
            fused_lm_head=False,
            position_ids=None,
            shift_labels=None,
            **kwargs,
        ):
            if args or input_ids is None or (labels is None) == (shift_labels is None) or not fused_lm_head:
                raise RuntimeError(
                    "sequence parallelism wraps TRL's DPO forward (model(input_ids=..., labels=..., "
                    "fused_lm_head=True), or shared-prompt rows with position_ids and shift_labels); got another call"
                )
            batch, length = input_ids.shape
            if shift_labels is None:  # TRL's rows: the label of position t is token t+1; the last scores nothing
                shift_labels, scored = F.pad(labels[:, 1:], (0, 1), value=-100), length - 1
            else:  # shared-prompt rows (longdpo/levers/shared_prompt.py): every position carries its own label
                scored = length
            if position_ids is None:
                position_ids = torch.arange(length, device=input_ids.device).expand(batch, -1)
            if batch > self.micro_batch and "row_layout" in kwargs:  # shared rows, each its own layout
                raise RuntimeError(f"{batch} shared rows exceed the {self.micro_batch} Ulysses was built for")
            # Ulysses is built for one micro-batch size: more rows (a shared-prompt run's batch that runs as TRL's
            # rows) run in several calls of that size
            outs = [
                self._forward_shard(
                    fused,
                    input_ids[i : i + self.micro_batch],
                    position_ids[i : i + self.micro_batch],
                    shift_labels[i : i + self.micro_batch],
                    kwargs,
                )
                for i in range(0, batch, self.micro_batch)
            ]
            fields = {
                f: None if outs[0][0][f] is None else torch.cat([got[f] for got, _ in outs])[:, :scored]
                for f in self.FIELDS
            }
            aux = [a for _, a in outs if a is not None]
            loss = -fields["log_probs"].sum() / fields["label_mask"].sum().clamp(min=1)
            return FusedCausalLMOutput(loss=loss, aux_loss=sum(aux) if aux else None, **fields)

        model.forward = sp_forward

    def _forward_shard(self, fused, ids, positions, shift, kwargs):
        """Rows (at most the micro-batch), padded to it and to a length divisible by K (labels -100, so padding
        scores nothing), run on this rank's shard; per-token outputs gathered back to (rows, padded length)."""
        rows, width = ids.shape
        pad = (0, -width % self.k, 0, self.micro_batch - rows)
        ids, shift = F.pad(ids, pad, value=0), F.pad(shift, pad, value=-100)
        # padding keeps increasing positions (a reset would read as a packed sequence to transformers' sdpa mask)
        given, positions = positions, torch.arange(ids.shape[1], device=ids.device).repeat(ids.shape[0], 1)
        positions[:rows, :width] = given
        n = ids.shape[1] // self.k
        mine = slice(self.rank * n, (self.rank + 1) * n)
        out = fused(
            input_ids=ids[:, mine],
            position_ids=positions[:, mine],
            shift_labels=shift[:, mine],
            fused_lm_head=True,
            **kwargs,
        )
        return {f: self.gather(getattr(out, f), ids.shape[1], rows) for f in self.FIELDS}, out.aux_loss

    def shard_over_data_parallel_ranks(self, dataloader):
        """accelerate shards batches over all ranks; the K ranks of a group must get the same ones."""
        sampler = getattr(dataloader, "batch_sampler", None)
        if sampler is None or not hasattr(sampler, "num_processes"):
            raise RuntimeError(
                f"cannot shard {type(dataloader).__name__} over data-parallel ranks "
                "(expected accelerate's BatchSamplerShard)"
            )
        sampler.num_processes, sampler.process_index = self.dp_size, self.dp_rank
        return dataloader


class SequenceParallelism(Lever):
    name = "sequence_parallel"
    order = 70
    tokens = ("sp<K>",)
    keys = (
        Key(
            "sp_size",
            int,
            1,
            "sequence parallelism (DeepSpeed Ulysses): each chosen/rejected sequence is split over this many ranks; "
            "attention exchanges heads for sequence all-to-all. The remaining world_size / sp_size ranks are data "
            "parallel. Must divide the number of processes and the attention heads.",
            section="parallelism",
        ),
    )

    def check(self, s, ctx):
        check_sp_size(s.sp_size)
        if s.sp_size != 1:
            check_sequence_parallel(
                s.sp_size,
                ctx.world_size,
                ctx.architecture(),
                ctx.recipe.trainer,
                ctx.recipe.model.attn_implementation,
                evaluating=ctx.evaluating,
            )

    def replica_ranks(self, s) -> int:
        return s.sp_size

    def configure(self, s, build):
        if s.sp_size > 1:  # evaluation's extra logits forward cannot be sequence-parallel
            build.trainer_kwargs.setdefault("prediction_loss_only", True)

    def route_attention(self, s, models, build):
        if s.sp_size > 1:  # routes attention through Ulysses for every model of this process
            rows = build.rows_per_pair * build.args.per_device_train_batch_size  # Ulysses' micro-batch
            build.sequence_parallel = SequenceParallel(s.sp_size, rows, models[0])

    def wrap_trainer(self, s, trainer, build):
        sp = build.sequence_parallel
        if sp is None:
            return
        sp.wrap(trainer.model)  # TRL's fused-LM-head forwards, policy and reference
        sp.wrap(trainer.ref_model)
        trainer._tp_size = sp.k  # TRL's token count gathers every rank: a group holds each token K times
        trainer.loader_wrappers.append(sp.shard_over_data_parallel_ranks)
        trainer.tokens_seen_divisor = sp.k

    def summary(self, s, build):
        return {"sequence_parallel": {"sp_size": s.sp_size, "dp_size": build.args.world_size // s.sp_size}}

    def geometry(self, s, setup, terms):
        terms.shards = s.sp_size

    def price(self, s, setup, terms, cal):
        if s.sp_size > 1:
            terms.notes.append(
                f"sequence parallel {s.sp_size}: per-rank tokens / {s.sp_size} (Ulysses all-to-all buffers not "
                "calibrated)"
            )

    def spell(self, s, priced=False):
        return f"sp{s.sp_size}" if s.sp_size > 1 and not priced else None

    def read(self, token):
        return {"sp_size": int(token[2:])} if token.startswith("sp") and token[2:].isdigit() else None


LEVER = SequenceParallelism()
