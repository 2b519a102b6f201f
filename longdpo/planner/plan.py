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
                 optimizer phase leaves a gap of its own (gathers, buckets, sub-group buffers); pairs of many lengths
                 (a dataset, a synthetic mix) on the default allocator grow what is not resident by a measured factor
                 (blocks cut for earlier shapes stay cached: 1.44x in one process, 40 layers, 32k), up to the GPU's
                 memory, where the allocator frees its cache and retries; the verdict is the largest pair's
  host           activation offloading: (L - K + E) blocks of T x H x 2 bytes per rank, pinned ones rounded up to
                 a power of two (torch's pinned caching allocator) x pinned_factor; K = memory.offload_keep_layers,
                 whose layer inputs stay on the GPU as T x K x H x 2 checkpointed bytes; E = offload_extra_blocks,
                 what is saved after the last layer (the final norm's and the LM head's inputs: measured 1.92-1.99);
                 ZeRO-3 CPU offload: 12 x P / R (optimizer) and 2 x P / R per offloaded model's parameters per rank;
                 where anything is offloaded, + host_process_gb (the process's own resident memory); times the
                 ranks of a node

Each lever's terms come from its declaration (longdpo/levers/: `geometry` for the tokens a rank holds, `price` for
the bytes); this module adds the rest. The fitted numbers live in longdpo/planner/calibration.json, fitted from the
committed GPU results by `python tools/calibrate_planner.py`; the per-token coefficients are fitted per lever set
(its `priced_name`), and a lever set without measurements borrows its nearest measured relative and says so.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace

from longdpo.config import Recipe, RecipeError, trainer_default
from longdpo.data.synthetic import spec_pairs, synthetic_pair
from longdpo.levers import LeverSet, levers, setup_facts
from longdpo.model.build import load_architecture
from longdpo.model.lora import adapter_params

GB = 1e9
# Closer than this share of a limit, a longer pair or a fuller allocator can run out: the planner says so beside
# its verdict, and training warns when a step comes this close to the GPU's memory.
NEAR_THE_LIMIT = 0.05


def near_the_limit(used: float, limit: float) -> bool:
    """Less than NEAR_THE_LIMIT of `limit` left after `used`."""
    return limit - used < NEAR_THE_LIMIT * limit


SUB_GROUP = 1e9  # DeepSpeed ZeRO-3's default sub_group_size: parameters per optimizer sub-step
CALIBRATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration.json")
# Lever sets the planner proposes whole (measured: the first the best at 12k, 5.56 GB for 1.07x stock's time; the
# second the least memory at 12k-64k, for 1.09-1.12x stock's time)
PRESETS = ("layer+norm_attn_mlp+offload", "layer+lean+chunked8+head+offload")


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
    levers: LeverSet = field(default_factory=LeverSet)
    lora_params: int = 0  # LoRA: trainable adapter parameters (0: full fine-tuning)
    model_type: str = "mistral"
    pair_tokens: int | None = None  # measured on the data: the most tokens one pair's shared row puts through
    pads: bool = False  # a batch's rows differ in length (TRL pads them)
    lengths_vary: bool = False  # pairs of many lengths follow one another (a dataset, a synthetic mix)


@dataclass
class Terms:
    """The levers' terms of one Setup (longdpo/levers/: `geometry`, then `price`)."""

    priced_name: str
    pair_tokens: int  # tokens one pair puts through the model: TRL's two rows of seq, or its shared row
    shards: int = 1  # a rank holds 1/shards of them
    shared_rows: bool = False
    tokens: int = 0  # tokens whose activations this rank holds
    stored_bytes: float = 2.0  # bf16 bytes per token, layer and hidden unit that checkpoints keep on the GPU
    saves_layer_inputs: bool = False  # the checkpoints keep each layer's input (transformers' layer checkpoint)
    offloads_layer_inputs: bool = False  # and those inputs go to the host
    kept_layers: int = 0  # layers whose inputs stay on the GPU although offloaded
    host_bytes: float = 0.0  # per rank, what the levers put on the host
    masked: bool = False  # TRL's padding mask reaches attention
    mask_bytes: float = 0.0
    allocator_factor: float = 1.0
    allocator_key: str | None = None
    mix_factor: float = 1.0  # pairs of many lengths on the default allocator: reserved grows past a fixed shape's
    upper_bound_without: list = field(default_factory=list)  # (key, why): unmeasured sets borrow these without it
    notes: list = field(default_factory=list)


def terms_of(s: Setup, cal: dict) -> Terms:
    terms = Terms(priced_name=s.levers.priced_name, pair_tokens=2 * s.seq)
    for lever in levers():
        lever.geometry(s.levers, s, terms)
    terms.tokens = terms.pair_tokens * s.batch // terms.shards
    for lever in levers():
        lever.price(s.levers, s, terms, cal)
    return terms


def tokens(s: Setup) -> int:
    """Tokens whose activations one rank holds: the chosen and rejected sequences (or the shared row), or its
    shard of them."""
    terms = Terms(priced_name="", pair_tokens=2 * s.seq)
    for lever in levers():
        lever.geometry(s.levers, s, terms)
    return terms.pair_tokens * s.batch // terms.shards


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
    terms: Terms | None = None

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


def model_shape(config) -> dict:
    """The Setup fields a model's configuration gives: its parameter counts, layers and width."""
    total, layer, embed = count_params(config)
    return {
        "params": total,
        "layer_params": layer,
        "embed_params": embed,
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
    }


def load_calibration(path: str = CALIBRATION) -> dict:
    with open(path) as f:
        return json.load(f)


def _coefficients(s: Setup, terms: Terms, cal: dict) -> tuple[dict, str]:
    configs, name = cal["configs"], terms.priced_name
    if name in configs:
        return configs[name], f"measurements of this lever set ({name})"
    for key, why in terms.upper_bound_without:
        without = s.levers.replace(**{key: getattr(LeverSet(), key)}).priced_name
        if without in configs:
            return configs[without], f"measurements of {without}, the same levers without {why}"
    # the nearest measured relative: the levers an unmeasured set keeps (offloading or not), the rest at defaults
    kept = {k.name: getattr(s.levers, k.name) for lever in levers() if lever.kept_in_fallback for k in lever.keys}
    fallback = LeverSet(**kept).priced_name
    return configs[fallback], (
        f"measurements of {fallback}: this combination of levers ({name}) was not measured, "
        "so its nearest measured relative stands in (expect less memory than predicted)"
    )


def predict(
    s: Setup, cal: dict | None = None, gpu_memory_gb: float | None = None, host_memory_gb: float | None = None
) -> Plan:
    cal = cal or load_calibration()
    terms = terms_of(s, cal)
    coef, source = _coefficients(s, terms, cal)
    p, r = s.params, s.ranks
    a = s.lora_params
    lora = cal.get("lora", {}).get(terms.priced_name) if a else None
    if lora:
        coef, source = lora, f"LoRA measurements of this lever set ({terms.priced_name})"
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
    stored = terms.tokens * s.hidden * (s.layers * terms.stored_bytes + 2.0 * terms.kept_layers)
    per_token = terms.tokens * coef["per_token_bytes"] * s.hidden / cal.get("hidden", s.hidden)
    mask = terms.mask_bytes
    backward = gathered + stored + per_token
    allocated = states + ref + max(backward + mask, step)
    factor = coef.get("reserved_factor_zero3", coef["reserved_factor"]) if s.zero3 else coef["reserved_factor"]
    reserved = states + ref + max(backward * factor + mask, step + gap) * terms.allocator_factor
    if terms.mix_factor != 1.0:
        # Blocks cut for earlier pairs stay cached, so a larger pair arriving later takes fresh segments: reserved
        # grows by mix_factor. The allocator frees its cache and retries before it runs out, so what must fit is
        # the largest pair's fixed-shape figure; past the GPU's memory the growth only costs speed.
        grown = states + ref + (reserved - states - ref) * terms.mix_factor
        limit = gpu_memory_gb * GB if gpu_memory_gb else math.inf
        if grown > max(reserved, limit):
            terms.notes.append(
                "on pairs of many lengths the CUDA allocator's cache grows to this GPU's memory: it will free its "
                "cache and retry (slower; the proposals below say what avoids it)"
            )
        # capped a hair under the limit: the rounded figure must not read as over a GPU of 85.0177 GB
        reserved = min(grown, max(reserved, limit - 0.005 * GB))
    host = terms.host_bytes
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
    source += "".join(f"; {note}" for note in terms.notes)
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
        terms=terms,
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


def needs_pairs(recipe: Recipe) -> bool:
    """Whether the plan depends on the pairs themselves (files or a Hub dataset): with `max_length: null`, their
    longest; where a lever says so (the shared prompt: the costliest shared row)."""
    if recipe.data.synthetic:
        return False
    no_max_length = recipe.trainer.get("max_length", trainer_default("max_length")) is None
    return no_max_length or any(lever.needs_pairs(recipe.levers, recipe) for lever in levers())


def setup_from_recipe(
    recipe: Recipe,
    gpus: int,
    nodes: int = 1,
    ds_config: dict | None = None,
    pairs: list[tuple[int, int, int]] | None = None,
) -> Setup:
    """`pairs`: (prompt, chosen, rejected) tokens of each pair measured on the data (longdpo.data.lengths), where
    `needs_pairs` says the plan depends on them; synthetic pairs say their shape themselves."""
    arch = load_architecture(recipe.model)
    lora_params = 0
    if recipe.model.use_peft:
        lora_params = adapter_params(recipe.model)
    t, spec = recipe.trainer, recipe.data.synthetic
    zero = (ds_config or {}).get("zero_optimization", {})
    seq = planned_length(recipe, max((p + max(c, r) for p, c, r in pairs), default=0) if pairs else None)
    if spec:
        pairs = spec_pairs(spec, seq)
    facts = setup_facts(recipe.levers, recipe, seq, pairs, synthetic=bool(spec)) if pairs is not None else {}
    return Setup(
        **model_shape(arch),
        seq=seq,
        batch=t.get("per_device_train_batch_size", trainer_default("per_device_train_batch_size")),
        ranks=gpus * nodes,
        ranks_per_node=gpus,
        zero3=zero.get("stage") == 3,
        offload_optimizer=zero.get("offload_optimizer", {}).get("device") == "cpu",
        offload_param=zero.get("offload_param", {}).get("device") == "cpu",
        emulate=recipe.memory.sgd_in_backward,
        precompute_ref=bool(t.get("precompute_ref_log_probs")),
        levers=recipe.levers,
        lora_params=lora_params,
        model_type=getattr(arch, "model_type", "mistral"),
        pads=pairs_pad(recipe),
        lengths_vary=not spec or "mix_seed" in spec,
        **facts,
    )


def pairs_pad(recipe: Recipe) -> bool:
    """Whether a batch's rows differ in length (TRL pads them): synthetic pairs say so; real preference data almost
    always has chosen and rejected answers of different lengths."""
    spec = recipe.data.synthetic
    if not spec or "mix_seed" in spec:
        return True
    _, chosen, rejected = synthetic_pair(spec, spec["seq_tokens"])
    return rejected != chosen


def _proposals(s: Setup, plan_of):
    """(rank, kind, change, Setup): the changes of the recipe's own switches, cheapest first (speed cost, then
    hardware, then the task itself); two changes of one kind are never paired."""
    found = []
    for lever in levers():
        for rank, change, settings in lever.proposals(s.levers, s, lambda ls: plan_of(replace(s, levers=ls))):
            found.append((rank, change.split(":")[0], change, replace(s, levers=settings)))
    for preset in PRESETS:
        settings = s.levers.with_priced_from(LeverSet.read(preset))
        if settings.priced_name != s.levers.priced_name:
            found.append((2, "preset", s.levers.changes_to(settings), replace(s, levers=settings)))
    if s.zero3 and not s.offload_optimizer:
        found.append(
            (
                4,
                "zero3_offload",
                "ds_configs/zero3_offload.json (optimizer state and parameters on CPU)",
                replace(s, offload_optimizer=True, offload_param=True),
            )
        )
    if s.zero3 and s.ranks == 1 and not s.offload_param:  # ZeRO-3 on one GPU partitions nothing
        found.append(
            (4, "one_process", "one process without DeepSpeed (`python launch/train_dpo.py`)", replace(s, zero3=False))
        )
    if s.zero3:
        found.append((4, "gpus", f"{s.ranks * 2} GPUs instead of {s.ranks}", replace(s, ranks=s.ranks * 2)))
    if s.batch > 1:
        found.append(
            (
                4,
                "batch",
                "per_device_train_batch_size: 1 (raise gradient_accumulation_steps to keep the batch)",
                replace(s, batch=1),
            )
        )
    found.append((4, "max_length", f"max_length: {s.seq // 2}", replace(s, seq=s.seq // 2)))
    return sorted(found, key=lambda proposal: proposal[0])


def suggest(
    s: Setup, gpu_memory_gb: float | None, cal: dict | None = None, host_memory_gb: float | None = None
) -> list[tuple[str, float, float]]:
    """Single changes that fit, cheapest first (a lever's own search for the smallest change that fits comes
    first); when none does, the cheapest pairs of changes that do (up to 3)."""
    cal = cal or load_calibration()

    def plan_of(setup: Setup) -> Plan:
        return predict(setup, cal, gpu_memory_gb, host_memory_gb)

    out = []
    for lever in levers():
        found = lever.fitting_change(s.levers, s, lambda ls: plan_of(replace(s, levers=ls)))
        if found:
            change, alt = found
            out.append((change, alt.peak_reserved_gb, alt.host_per_node_gb))
    for _, _, change, alt in _proposals(s, plan_of):
        alt_plan = plan_of(alt)
        if alt_plan.fits:
            out.append((change, alt_plan.peak_reserved_gb, alt_plan.host_per_node_gb))
    if out:
        return out
    seen = set()
    for _, kind, change, alt in _proposals(s, plan_of):
        for _, second_kind, second, both in _proposals(alt, plan_of):
            pair = frozenset((change, second))
            if second_kind == kind or pair in seen:
                continue
            seen.add(pair)
            both_plan = plan_of(both)
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
    pairs: list[tuple[int, int, int]] | None = None,
) -> Plan:
    s = setup_from_recipe(recipe, gpus, nodes, ds_config, pairs)
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
        verdict = f"  verdict: {'FITS' if used <= limit else 'DOES NOT FIT'} in {limit:g} GB {where}"
        if used <= limit:
            close = f", under {NEAR_THE_LIMIT:.0%}: a longer pair can run out" if near_the_limit(used, limit) else ""
            verdict += f" ({limit - used:.1f} GB to spare{close})"
        lines.append(verdict)
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
