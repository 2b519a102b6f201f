"""Will it fit? A per-rank memory model of a recipe, calibrated from the committed GPU results.

Per rank, in bytes (P = parameters, R = ranks ZeRO-3 shards over, T = tokens per micro-batch and rank =
2 x max_length x batch / sp_size, L = layers, H = hidden size):

  model states   ZeRO-3: (2 param + 2 grad + 12 fp32 master/Adam) x P / R, offloaded parts moved to host;
                 one process + sgd_in_backward: 2 x P (no gradient or optimizer state survives)
  reference      2 x P / R under ZeRO-3 (TRL shards it), 2 x P in one process, 0 with precompute_ref_log_probs
  LoRA           A adapter parameters (counted by PEFT): frozen weights 2 x P (/ R under ZeRO-3), adapters
                 16 x A (fp32 weight, gradient, Adam moments; / R under ZeRO-3); no reference copy (TRL switches the
                 adapters off); activations as for full fine-tuning of the same configuration (an upper bound: the
                 frozen weights need no weight-gradient buffers; not yet measured on a GPU with LoRA)
  transient      max(backward, optimizer step):
                   backward = gathered weights (ZeRO-3: 2 x the largest layer or embedding)
                            + T x L x H x stored_bytes(policy)    what checkpoints keep per layer (2 = the layer
                                                                 checkpoint's bf16 input; 0 when TRL offloads it)
                            + T x per_token_bytes(config) x H / H_cal   one layer's backward, the LM head,
                                                                 gradients: fitted per configuration on the 12B
                                                                 architecture (H_cal = 5120), scaled by width
                   step     = ZeRO-3: step_bytes_per_param x min(P / R, 1e9): DeepSpeed steps the optimizer one
                              sub-group (sub_group_size, 1e9 parameters by default) at a time, with an fp32 copy of
                              its gradients and the optimizer's buffers for it; measured on the real path
  peak           the activation peak (model states + reference + backward) and the optimizer-step peak (model
                 states + reference + step) are reported apart: with few layers per rank the step's is the larger
  reserved       max(model states + reference + backward x reserved_factor(config, mode),
                     model states + reference + step + zero3 gap)   each non-resident part x allocator_factor;
                 the factors are measured: fragmentation grows with the activations' churn, not with the resident
                 weights (12k -> 64k, one configuration: gap / activations 1.38, 1.39, 1.39), and it is fitted
                 apart on the real path where a configuration was measured there (fewer layers, less churn than
                 the 40-layer per-rank emulation); under ZeRO-3 the
                 optimizer phase leaves a gap of its own (gathers, buckets, sub-group buffers)
  host           activation offloading: (L - K + E) blocks of T x H x 2 bytes per rank, pinned ones rounded up to
                 a power of two (torch's pinned caching allocator) x pinned_factor; K = memory.offload_keep_layers,
                 whose layer inputs stay on the GPU as T x K x H x 2 checkpointed bytes; E = offload_extra_blocks,
                 what is saved after the last layer (the final norm's and the LM head's inputs: measured 1.92-1.99);
                 ZeRO-3 CPU offload: 12 x P / R (optimizer) and 2 x P / R per offloaded model's parameters per rank;
                 where anything is offloaded, + host_process_gb (the process's own resident memory); times the
                 ranks of a node

The fitted numbers live in longdpo/planner/calibration.json (`python launch/plan_memory.py --calibrate` rebuilds it
from results/); a configuration without measurements borrows its nearest measured relative and says so.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field, replace

from longdpo.config import Recipe, RecipeError, trainer_default

GB = 1e9
SUB_GROUP = 1e9  # DeepSpeed ZeRO-3's default sub_group_size: parameters per optimizer sub-step
CALIBRATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration.json")
# bf16 bytes kept per token, per layer, per hidden unit by each policy's checkpoints (before offloading)
STORED_BYTES = {"layer": 2.0, "attn_mlp": 16.0, "norm_attn": 14.0, "norm_attn_mlp": 8.0}


@dataclass
class Setup:
    """What the planner needs to know about a run (built from a recipe + the launch shape)."""

    params: int
    layer_params: int
    embed_params: int
    layers: int
    hidden: int
    seq: int
    batch: int = 1
    ranks: int = 1
    ranks_per_node: int = 1
    zero3: bool = False
    offload_optimizer: bool = False
    offload_param: bool = False
    emulate: bool = False  # one process, sgd_in_backward
    precompute_ref: bool = False
    config: str = "stock"  # calibration key: stock / stock+offload / layer+norm_attn_mlp+offload / ...
    allocator_conf: str | None = None
    sp: int = 1  # sequence-parallel group size: each rank holds 1/sp of every sequence
    offload_pinned: bool = True  # pinned host blocks are rounded up to a power of two; pageable ones are not
    offload_keep_layers: int = 0  # with offloading, layers whose checkpointed inputs stay on the GPU
    lora_params: int = 0  # LoRA: trainable adapter parameters (0: full fine-tuning)
    model_type: str = "mistral"
    pair_tokens: int | None = None  # data.shared_prompt: one row per pair, prompt + chosen + rejected + 1
    padding_mask: bool = False  # TRL's padding mask kept, and the pairs pad

    @property
    def masked(self) -> bool:
        """TRL's padding mask reaches attention as a seq x seq mask per row (a shared row brings its own attention)."""
        return self.padding_mask and not self.pair_tokens

    @property
    def tokens(self) -> int:
        """Tokens whose activations this rank holds: the chosen + rejected sequences (or the one shared row), or its
        1/sp shard of them."""
        return (self.pair_tokens or 2 * self.seq) * self.batch // self.sp


@dataclass
class Plan:
    breakdown: dict  # GB per component
    peak_allocated_gb: float
    peak_reserved_gb: float
    activation_peak_gb: float  # allocated, during forward/backward
    optimizer_peak_gb: float  # allocated, during the optimizer step
    host_per_node_gb: float  # pinned activations + ZeRO CPU offload, all ranks of a node
    calibrated_from: str
    gpu_memory_gb: float | None = None
    host_memory_gb: float | None = None  # per node
    suggestions: list = field(default_factory=list)  # (change, predicted reserved GB, host GB per node)
    checkpoint_gb: float | None = None  # one checkpoint on disk (checkpoint_bytes)
    checkpoints_kept: int = 0

    def limits(self):
        """(predicted, limit, where) for each limit that was given."""
        for used, limit, where in (
            (self.peak_reserved_gb, self.gpu_memory_gb, "per GPU"),
            (self.host_per_node_gb, self.host_memory_gb, "of host memory per node"),
        ):
            if limit is not None:
                yield used, limit, where

    @property
    def fits(self) -> bool | None:
        """Every limit that was given holds; None when none was given."""
        checks = [used <= limit for used, limit, _ in self.limits()]
        return all(checks) if checks else None


def count_params(config) -> tuple[int, int, int]:
    """(total, per decoder layer, largest embedding) of a Mistral/Llama-shaped config, from its sizes."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    attn = h * hd * (config.num_attention_heads * 2 + config.num_key_value_heads * 2)
    layer = attn + 3 * h * i + 2 * h
    embed = v * h
    total = layer * config.num_hidden_layers + embed * (1 if config.tie_word_embeddings else 2) + h
    return total, layer, embed


def model_flops_per_step(
    s: Setup, attn_width: int, with_reference: bool = True, pair: tuple[int, int, int] | None = None
) -> float:
    """Model FLOPs of one DPO step of this rank (recomputation not counted, as MFU conventions want): policy
    forward + backward = 3 x forward, reference forward = 1 x. Forward = 2 x matmul parameters (all but the input
    embedding) per token + attention, 4 x attention width per (query, key) pair per layer: causal over a sequence of
    T tokens, 2 x T^2 x width. `pair`: (prompt, chosen, rejected) tokens of each pair, counted as run, padding left
    out: TRL's two rows P + C and P + R, or with `s.pair_tokens` the shared row [P, C, R], whose rejected tokens see
    the prompt and themselves (query-key pairs (P+C)^2/2 + (P+R)^2/2 - P^2/2). Without it, two rows of `s.seq`."""
    p, c, r = pair or (0, s.seq, s.seq)
    tokens, squares = (
        (p + c + r, (p + c) ** 2 + (p + r) ** 2 - p**2)
        if s.pair_tokens
        else (2 * p + c + r, (p + c) ** 2 + (p + r) ** 2)
    )
    matmul_params = s.params - s.embed_params
    # under sequence parallelism a rank runs the linear layers on its 1/sp of the tokens and attention on 1/sp of
    # the heads over the whole sequence: both terms divide by sp
    forward = s.batch * (2 * matmul_params * tokens + 2 * s.layers * squares * attn_width) / s.sp
    return forward * (3 + (1 if with_reference else 0))


def config_name(
    policy: str,
    tiled_mlp: int,
    offload: bool,
    mlp_chunks: int = 0,
    lean_norm: bool = False,
    lean_lm_head: bool = False,
    liger: bool = False,
) -> str:
    name = "stock" if policy == "layer" else policy
    if lean_norm:
        name += "+lean"
    if liger:
        name += "+liger"
    if lean_lm_head:
        name += "+head"
    if tiled_mlp:
        name += "+tiled"
    if mlp_chunks:
        name += "+chunked"
    return name + ("+offload" if offload else "")


def stored_bytes(config: str) -> float:
    if "offload" in config and config.split("+")[0] in ("stock", "layer"):
        return 0.0  # TRL offloads the layer checkpoint's inputs to host memory
    policy = re.split(r"\+(?:lean|liger|head|tiled|chunked|offload)", config)[0]
    if policy == "stock" or policy.startswith("layer"):
        return STORED_BYTES["layer"]
    return STORED_BYTES.get(policy, STORED_BYTES["attn_mlp"])


def pinned_bytes(nbytes: float) -> float:
    """What torch's pinned caching allocator holds for a block of `nbytes`: the next power of two."""
    return 2 ** math.ceil(math.log2(nbytes))


def offloads_layer_inputs(config: str) -> bool:
    """TRL's offloading of the layer checkpoint's inputs: what `memory.offload_keep_layers` keeps part of."""
    return config.endswith("+offload") and stored_bytes(config) == 0


def allocator_key(s: Setup, with_config: bool = True) -> str | None:
    """Allocator factors are fitted per setting, mode and configuration: max_split_size_mb:64 scaled what is not
    resident 2.5x under real ZeRO-3 with norm_attn_mlp (4 layers), 1.5x with stock's layer checkpointing (1 layer),
    and 0.97x in one process with SGD in backward (40 layers). Without a measurement of the configuration, the mean
    of the setting's measurements in that mode."""
    if not s.allocator_conf:
        return None
    key = f"{s.allocator_conf} @ {'zero3' if s.zero3 else 'one process'}"
    return f"{key} / {s.config}" if with_config else key


def _allocator_factor(s: Setup, cal: dict) -> float:
    factors = cal.get("allocator_factors", {})
    if not s.allocator_conf:
        return 1.0
    if allocator_key(s) in factors:
        return factors[allocator_key(s)]
    same = [v for k, v in factors.items() if k.startswith(allocator_key(s, with_config=False) + " / ")]
    return sum(same) / len(same) if same else 1.0


def load_calibration(path: str = CALIBRATION) -> dict:
    with open(path) as f:
        return json.load(f)


def _coefficients(config: str, cal: dict) -> tuple[dict, str]:
    configs = cal["configs"]
    if config in configs:
        return configs[config], f"measurements of this configuration ({config})"
    if "+liger" in config and config.replace("+liger", "") in configs:  # Liger's kernels keep less, not more
        without = config.replace("+liger", "")
        return configs[without], (
            f"measurements of {without}, the same levers without Liger's kernels (an upper bound: Liger keeps less)"
        )
    # nearest measured relative: same offload choice, stock checkpointing
    fallback = "stock+offload" if config.endswith("+offload") else "stock"
    return configs[fallback], (
        f"measurements of {fallback}: this combination of levers ({config}) was not measured, "
        "so its nearest measured relative stands in (expect less memory than predicted)"
    )


def predict(
    s: Setup, cal: dict | None = None, gpu_memory_gb: float | None = None, host_memory_gb: float | None = None
) -> Plan:
    cal = cal or load_calibration()
    coef, source = _coefficients(s.config, cal)
    p, r = s.params, s.ranks
    a = s.lora_params
    lora = cal.get("lora", {}).get(s.config) if a else None
    if lora:
        coef, source = lora, f"LoRA measurements of this configuration ({s.config})"
    if s.emulate:
        states, ref, step = 2.0 * p, (0.0 if s.precompute_ref else 2.0 * p), 0.0
        gathered = gap = 0.0
    elif a:  # LoRA: frozen bf16 weights, fp32 adapters with gradient and Adam moments, no reference
        shard = r if s.zero3 else 1
        states, ref = (2.0 * p + 16.0 * a) / shard, 0.0
        # the optimizer steps the adapters only: no full-model step transient and no optimizer-phase gap (measured:
        # 1-layer ZeRO-3 LoRA reserved 5.84 GB where the full fine-tuning gap alone is 7.27 GB)
        step, gap = (4.0 * min(a / shard, SUB_GROUP) if s.zero3 else 0.0), 0.0
        gathered = 2.0 * max(s.layer_params, s.embed_params) if s.zero3 else 0.0
    elif s.zero3:
        per_param = 2 + 2 + (0 if s.offload_optimizer else 12) - (2 if s.offload_param else 0)
        states = per_param * p / r
        ref = 0.0 if s.precompute_ref else (0 if s.offload_param else 2.0) * p / r
        zero3 = cal.get("zero3", {})
        # with the optimizer offloaded, DeepSpeed runs the step on the host (not measured here)
        step = 0.0 if s.offload_optimizer else zero3.get("step_bytes_per_param", 4.0) * min(p / r, SUB_GROUP)
        gap = zero3.get("gap_gb", 0.0) * GB
        gathered = 2.0 * max(s.layer_params, s.embed_params)
    else:  # one process, torch AdamW: param + grad + 2 moments in the parameter dtype (bf16)
        states, ref, step, gathered, gap = 8.0 * p, (0.0 if s.precompute_ref else 2.0 * p), 0.0, 0.0, 0.0
    keep = s.offload_keep_layers if offloads_layer_inputs(s.config) else 0
    stored = s.tokens * s.hidden * (s.layers * stored_bytes(s.config) + 2.0 * keep)
    per_token = s.tokens * coef["per_token_bytes"] * s.hidden / cal.get("hidden", s.hidden)
    # kept on pairs that pad, TRL's mask becomes an explicit seq x seq mask per row (bool, and the additive form
    # attention builds from it): a few large blocks, so outside the fragmentation of the per-token churn (measured
    # at 32k: +7.25 GB allocated, +5.9 GB reserved)
    mask = cal.get("mask_bytes_per_element", 0.0) * 2 * s.batch * s.seq**2 if s.masked else 0
    backward = gathered + stored + per_token
    allocated = states + ref + max(backward + mask, step)
    allocator = _allocator_factor(s, cal)
    factor = coef.get("reserved_factor_zero3", coef["reserved_factor"]) if s.zero3 else coef["reserved_factor"]
    reserved = states + ref + max(backward * factor + mask, step + gap) * allocator
    host = 0.0
    if s.config.endswith("+offload"):
        block = s.tokens * s.hidden * 2
        per_block = pinned_bytes(block) * cal["pinned_factor"] if s.offload_pinned else block
        # the layer inputs, and the blocks saved after the last layer (the final norm's and the LM head's inputs)
        host += (s.layers - keep + cal.get("offload_extra_blocks", 0.0)) * per_block
    if s.zero3 and not a:  # optimizer state; policy parameters; the reference's (offloaded with the same config)
        host += (12.0 * s.offload_optimizer + 2.0 * s.offload_param * (1 if s.precompute_ref else 2)) * p / r
    if host:  # what each process holds itself beside what it offloads
        host += cal.get("host_process_gb", 0.0) * GB
    host *= s.ranks_per_node
    breakdown = {
        "model_states": states,
        "reference_model": ref,
        "gathered_weights": gathered,
        "activations_checkpointed": stored,
        "activations_peak_layer_and_lm_head": per_token,
        **({"attention_mask_of_padded_pairs": mask} if mask else {}),
        "optimizer_step_transient": step,
        "allocator_overhead": reserved - allocated,
    }
    if s.model_type != "mistral" or s.hidden != cal.get("hidden", s.hidden):
        source += (
            f"; calibrated on the 12B Mistral architecture (hidden {cal.get('hidden')}); this is {s.model_type} "
            f"(hidden {s.hidden}), modelled from it: expect more than the 10% error held there"
        )
    if a and not lora:
        source += f"; LoRA ({a / 1e6:.1f} M adapter parameters): activations taken from full fine-tuning"
    if s.sp > 1:
        source += f"; sequence parallel {s.sp}: per-rank tokens / {s.sp} (Ulysses all-to-all buffers not calibrated)"
    return Plan(
        breakdown={k: round(v / GB, 2) for k, v in breakdown.items()},
        peak_allocated_gb=round(allocated / GB, 2),
        peak_reserved_gb=round(reserved / GB, 2),
        activation_peak_gb=round((states + ref + backward + mask) / GB, 2),
        optimizer_peak_gb=round((states + ref + step) / GB, 2),
        host_per_node_gb=round(host / GB, 1),
        calibrated_from=source,
        gpu_memory_gb=gpu_memory_gb,
        host_memory_gb=host_memory_gb,
    )


def planned_length(recipe: Recipe, longest_pair: int | None = None) -> int:
    """The tokens per sequence to plan for: `max_length` (TRL's default when unset); with `max_length: null` (no
    truncation) the data's longest pair: synthetic pairs say it, other data is measured (`longest_pair`)."""
    max_length = recipe.trainer.get("max_length", trainer_default("max_length"))
    if max_length is not None:
        return max_length
    if recipe.data.synthetic:
        return recipe.data.synthetic["seq_tokens"]
    if longest_pair is None:
        raise RecipeError(
            "With `max_length: null` the planner plans for the data's longest pair, which needs the data "
            "(launch/plan_memory.py and the entrypoint measure it); or set `max_length`."
        )
    return longest_pair


def setup_from_recipe(
    recipe: Recipe,
    gpus: int,
    nodes: int = 1,
    ds_config: dict | None = None,
    seq: int | None = None,
    pair_tokens: int | None = None,
) -> Setup:
    """`seq`: the data's longest pair, for `max_length: null` (planned_length). `pair_tokens`: with
    `data.shared_prompt`, the tokens the costliest pair puts through the model, measured on the data
    (`longdpo.data.costliest_pair_tokens`); synthetic pairs say it themselves."""
    from longdpo.model.build import load_architecture

    arch = load_architecture(recipe.model)
    total, layer, embed = count_params(arch)
    lora_params = 0
    if recipe.model.use_peft:
        from longdpo.model.lora import adapter_params

        lora_params = adapter_params(recipe.model)
    t, mem = recipe.trainer, recipe.memory
    zero = (ds_config or {}).get("zero_optimization", {})
    offload = bool(t.get("activation_offloading"))
    return Setup(
        params=total,
        layer_params=layer,
        embed_params=embed,
        layers=arch.num_hidden_layers,
        hidden=arch.hidden_size,
        seq=planned_length(recipe, seq),
        batch=t.get("per_device_train_batch_size", trainer_default("per_device_train_batch_size")),
        ranks=gpus * nodes,
        ranks_per_node=gpus,
        zero3=zero.get("stage") == 3,
        offload_optimizer=zero.get("offload_optimizer", {}).get("device") == "cpu",
        offload_param=zero.get("offload_param", {}).get("device") == "cpu",
        emulate=mem.sgd_in_backward,
        precompute_ref=bool(t.get("precompute_ref_log_probs")),
        config=config_name(
            mem.checkpointing,
            mem.tiled_mlp,
            offload,
            mem.mlp_chunks,
            mem.lean_norm,
            mem.lean_lm_head,
            bool(t.get("use_liger_kernel")),
        ),
        allocator_conf=mem.allocator_conf,
        sp=recipe.parallelism.sp_size,
        offload_pinned=mem.offload_pin_memory,
        offload_keep_layers=mem.offload_keep_layers,
        lora_params=lora_params,
        model_type=getattr(arch, "model_type", "mistral"),
        pair_tokens=pair_tokens or shared_pair_tokens(recipe, planned_length(recipe, seq)),
        padding_mask=mem.padding_mask == "keep" and pairs_pad(recipe),
    )


def pairs_pad(recipe: Recipe) -> bool:
    """Whether a batch's rows differ in length (TRL pads them): synthetic pairs say so; real preference data almost
    always has chosen and rejected answers of different lengths."""
    spec = recipe.data.synthetic
    if not spec:
        return True
    _, chosen, rejected = synthetic_pair(spec, spec["seq_tokens"])
    return rejected != chosen


def shared_pair_tokens(recipe: Recipe, seq: int) -> int | None:
    """With `data.shared_prompt`, the tokens of one pair's shared row: synthetic pairs say their prompt; for other
    data the prompt's length is not known before tokenizing, so the plan keeps TRL's two rows (an upper bound), as
    it does for pairs that would save less than `data.shared_prompt_min_saving` (they run as TRL's rows)."""
    spec = recipe.data.synthetic
    if not recipe.data.shared_prompt or not spec:
        return None
    return shared_tokens(spec, seq, recipe.data.shared_prompt_min_saving)


def shared_tokens(spec: dict, seq: int, min_saving: float) -> int | None:
    """The shared row of a synthetic pair (`data.synthetic`) cut to `seq` tokens, or None where it saves less than
    `min_saving` of TRL's two rows (such a pair runs as TRL's rows)."""
    from longdpo.data import tokens_through_model

    tokens = tokens_through_model(*synthetic_pair(spec, seq), min_saving)
    return tokens if tokens < 2 * seq else None


def synthetic_pair(spec: dict, seq: int) -> tuple[int, int, int]:
    """(prompt, chosen, rejected) tokens of a synthetic pair (`data.synthetic`) cut to `seq` tokens."""
    prompt = spec["prompt_tokens"]
    chosen = seq - prompt
    return prompt, chosen, min(spec.get("rejected_tokens", chosen), chosen)


# Changes from the recipe's own switches, cheapest first: speed cost, then hardware, then the task itself.
def _candidates(s: Setup):
    if s.masked:
        yield (
            "memory.padding_mask: auto (no mask for right-padded pairs: attention keeps its causal kernel)",
            replace(s, padding_mask=False),
        )
    if not s.config.endswith("+offload"):
        yield "activation_offloading: true", replace(s, config=s.config + "+offload")
    elif s.offload_pinned:
        yield (
            "memory.offload_pin_memory: false (pageable host memory: exact sizes, slower copies)",
            replace(s, offload_pinned=False),
        )
    best = "layer+norm_attn_mlp+offload"  # measured best at 12k: 5.56 GB for 1.07x stock's time
    if s.config != best:
        yield "memory.checkpointing: layer+norm_attn_mlp and activation_offloading: true", replace(s, config=best)
    leanest = "stock+lean+head+chunked+offload"  # measured least memory at 12k-64k, for 1.09-1.12x stock's time
    if s.config != leanest:
        yield (
            (
                "memory.checkpointing: layer, memory.lean_norm: true, memory.lean_lm_head: true, memory.mlp_chunks: 8 "
                "and activation_offloading: true"
            ),
            replace(s, config=leanest),
        )
    if s.allocator_conf:
        yield (
            "memory.allocator_conf: null (measured: max_split_size_mb:64 raised reserved 1.4x)",
            replace(s, allocator_conf=None),
        )
    if s.zero3 and not s.offload_optimizer:
        yield (
            "ds_configs/zero3_offload.json (optimizer state and parameters on CPU)",
            replace(s, offload_optimizer=True, offload_param=True),
        )
    if s.zero3 and s.ranks == 1 and not s.offload_param:  # ZeRO-3 on one GPU partitions nothing
        yield "one process without DeepSpeed (`python launch/train_dpo.py`)", replace(s, zero3=False)
    if s.zero3:
        yield f"{s.ranks * 2} GPUs instead of {s.ranks}", replace(s, ranks=s.ranks * 2)
    if s.batch > 1:
        yield (
            "per_device_train_batch_size: 1 (raise gradient_accumulation_steps to keep the batch)",
            replace(s, batch=1),
        )
    yield f"max_length: {s.seq // 2}", replace(s, seq=s.seq // 2)


def _fewest_kept_layers(s: Setup, cal: dict, gpu_memory_gb: float | None, host_memory_gb: float | None):
    """Where offloaded activations overflow the host: the fewest layers kept on the GPU that make the run fit (no
    speed cost: those copies are not made)."""
    if not offloads_layer_inputs(s.config) or host_memory_gb is None:
        return None
    if predict(s, cal).host_per_node_gb <= host_memory_gb:
        return None
    for keep in range(s.offload_keep_layers + 1, s.layers):
        alt = predict(replace(s, offload_keep_layers=keep), cal, gpu_memory_gb, host_memory_gb)
        if alt.fits:
            change = f"memory.offload_keep_layers: {keep} (the last {keep} layers' activations stay on the GPU)"
            return change, alt.peak_reserved_gb, alt.host_per_node_gb
        if gpu_memory_gb is not None and alt.peak_reserved_gb > gpu_memory_gb:
            return None
    return None


def suggest(
    s: Setup, gpu_memory_gb: float | None, cal: dict | None = None, host_memory_gb: float | None = None
) -> list[tuple[str, float, float]]:
    """Single changes that fit, cheapest first; when none does, the cheapest pairs of changes that do (up to 3)."""
    cal = cal or load_calibration()
    kept = _fewest_kept_layers(s, cal, gpu_memory_gb, host_memory_gb)
    out = [kept] if kept else []
    for change, alt in _candidates(s):
        alt_plan = predict(alt, cal, gpu_memory_gb, host_memory_gb)
        if alt_plan.fits:
            out.append((change, alt_plan.peak_reserved_gb, alt_plan.host_per_node_gb))
    if out:
        return out
    seen = set()
    for change, alt in _candidates(s):
        for second, both in _candidates(alt):
            pair = frozenset((change, second))
            if second.split(":")[0] == change.split(":")[0] or pair in seen:
                continue
            seen.add(pair)
            both_plan = predict(both, cal, gpu_memory_gb, host_memory_gb)
            if both_plan.fits and len(out) < 3:
                out.append((f"{change}, and {second}", both_plan.peak_reserved_gb, both_plan.host_per_node_gb))
    return out


def checkpoint_bytes(params: int, dtype_bytes: int, zero3: bool, with_optimizer: bool, lora_params: int = 0) -> float:
    """One checkpoint's size. With LoRA (`lora_params` adapter parameters) it holds the fp32 adapters and their
    optimizer state only, not the frozen weights."""
    if lora_params:
        params, dtype_bytes = lora_params, 4
    weights = params * dtype_bytes
    if not with_optimizer:
        return weights
    return weights + (16 * params if zero3 else 2 * dtype_bytes * params)


def checkpoints_kept(trainer: dict) -> int:
    """How many checkpoints the run holds on disk at once (0 when it saves none)."""
    strategy = str(trainer.get("save_strategy", "steps"))
    if strategy == "no":
        return 0
    limit = trainer.get("save_total_limit")
    max_steps = trainer.get("max_steps", -1)
    saves = None
    if strategy == "steps" and max_steps and max_steps > 0:
        every = trainer.get("save_steps", 500)
        every = every if every >= 1 else max(1, math.ceil(every * max_steps))  # a fraction of the run
        saves = max(1, max_steps // every)
    if limit:
        return min(limit, saves) if saves else limit
    return saves or 1


def plan(
    recipe: Recipe,
    gpus: int,
    gpu_memory_gb: float | None,
    nodes: int = 1,
    ds_config: dict | None = None,
    host_memory_gb: float | None = None,
    seq: int | None = None,
    pair_tokens: int | None = None,
) -> Plan:
    s = setup_from_recipe(recipe, gpus, nodes, ds_config, seq, pair_tokens)
    result = predict(s, gpu_memory_gb=gpu_memory_gb, host_memory_gb=host_memory_gb)
    t = recipe.trainer
    dtype_bytes = 4 if recipe.model.dtype == "float32" else 2
    one = checkpoint_bytes(s.params, dtype_bytes, s.zero3, not t.get("save_only_model"), s.lora_params)
    result.checkpoint_gb = round(one / GB, 1)
    result.checkpoints_kept = checkpoints_kept(t)
    if result.fits is False:
        result.suggestions = suggest(s, gpu_memory_gb, host_memory_gb=host_memory_gb)
    return result


def cpu_memory_gb(result: Plan, ranks_on_machine: int) -> float:
    """What a run without a GPU needs of the machine's memory, from a plan: every rank's device memory (which is
    host memory then) plus what the plan puts on the host. A lower bound: the plan counts 16-bit weights and a CPU
    run trains in float32."""
    return result.peak_allocated_gb * ranks_on_machine + result.host_per_node_gb


def render(result: Plan) -> str:
    lines = [f"  {k.replace('_', ' '):<38} {v:8.2f} GB" for k, v in result.breakdown.items()]
    lines += [
        f"  {'predicted activation peak allocated':<38} {result.activation_peak_gb:8.2f} GB",
        f"  {'predicted optimizer-step peak allocated':<38} {result.optimizer_peak_gb:8.2f} GB",
        f"  {'predicted peak allocated':<38} {result.peak_allocated_gb:8.2f} GB",
        f"  {'predicted peak reserved':<38} {result.peak_reserved_gb:8.2f} GB",
        f"  {'host memory per node':<38} {result.host_per_node_gb:8.1f} GB",
        f"  based on: {result.calibrated_from}",
    ]
    if result.checkpoint_gb is not None:
        lines.insert(
            -1,
            f"  {'one checkpoint on disk':<38} {result.checkpoint_gb:8.1f} GB "
            f"(this recipe keeps {result.checkpoints_kept})",
        )
    for used, limit, where in result.limits():
        lines.append(f"  verdict: {'FITS' if used <= limit else 'DOES NOT FIT'} in {limit:g} GB {where}")
    if result.fits is False:
        if result.suggestions:
            combined = ", and " in result.suggestions[0][0]
            lines.append(
                "  no single change fits; these pairs of changes would (cheapest first):"
                if combined
                else "  changes that would fit (cheapest first):"
            )
            host = result.host_memory_gb is not None
            lines += [
                f"    - {change}: {peak:.1f} GB" + (f", host {host_gb:.0f} GB per node" if host else "")
                for change, peak, host_gb in result.suggestions
            ]
        else:
            lines.append(
                "  no change or pair of changes from this recipe's switches fits: more GPUs (sequence "
                "parallelism for long sequences) or a shorter max_length"
            )
    return "\n".join(lines)
