"""Activation offloading (`activation_offloading`, TRL's): TRL's offloader (pinned or pageable host memory), kept away
from ZeRO-3 parameters, with a ledger of what it copies to the host.

TRL skips a saved tensor when it is an `nn.Parameter` or when its storage is one that `model.parameters()` held when
the offloader was built. Under DeepSpeed ZeRO-3 those storages are empty placeholders: a gathered weight lives in a
buffer allocated at each gather, so a view of one that reaches the hooks would be copied to the host and back on every
micro-step, and pinned there until the backward. Here every saved tensor that aliases a currently gathered ZeRO-3
parameter stays where it is (looked up by shape, then by address: cheap). The LM head's weight never reaches the
hooks at all (longdpo/levers/lean_lm_head.py, HookSafeLogProb).

The ledger counts, per optimizer step, the bytes copied to the host and the copied tensors that share storage with
a parameter (which should be none); the memory callback writes both into the telemetry (`offloaded_gb`,
`offloaded_param_shaped`). Shape alone cannot tell: at 65,536 tokens a pair's flattened hidden state (131,072 x 5,120)
has the shape of Mistral-NeMo's embedding matrix, and a shape-only count read 1 on the GPU for an activation.

`memory.offload_keep_layers: K` keeps the saved activations of the last K decoder layers on the GPU: K layer inputs
(T x H x 2 bytes each under layer checkpointing) move from host memory to the GPU, for runs whose host RAM is the
limit and whose GPU has room (the planner prices both). The last layers, because their tensors are the first the
backward needs: they would be copied back at once.

Planner: the layer checkpoint's inputs (T x H x 2 bytes a layer) leave the GPU for (L - K + E) host blocks, where E
(`offload_extra_blocks`, fitted) counts what is saved after the last layer (the final norm's and the LM head's
inputs); pinned blocks are rounded up to a power of two (torch's pinned caching allocator) times a fitted factor,
and twice that on pairs of many lengths (a cached block of every smaller size class beside the largest).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from trl.models import get_act_offloading_ctx_manager

from longdpo.levers import Key, Lever
from longdpo.model.forwards import in_backward
from longdpo.recipe_values import RecipeError, is_number


class Ledger:
    def __init__(self):
        self.bytes = 0
        self.param_shaped = 0

    def take(self) -> tuple[int, int]:
        """(bytes, parameter-shaped tensors) copied to the host since the last call."""
        taken = (self.bytes, self.param_shaped)
        self.bytes = self.param_shaped = 0
        return taken


class _Kept:
    """A saved tensor left in place (it aliases a gathered ZeRO-3 parameter, or belongs to a kept layer)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor


class _KeepLast:
    """On from the end of decoder layer L-K-1 to the final norm: tensors saved then are the inputs (and, without the
    layer checkpoint, the insides) of the last K layers. The switch is the previous layer's forward hook, which runs
    before layer L-K's checkpoint saves its inputs wherever the checkpoint sits relative to module hooks (transformers
    5 checkpoints `forward`, inside the hooks; a checkpoint around `__call__` would save the inputs before the layer's
    own pre-hook)."""

    def __init__(self, model: torch.nn.Module, keep_layers: int):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
        backbone = getattr(base, "model", None)
        layers = getattr(backbone, "layers", None)
        if layers is None or not hasattr(backbone, "embed_tokens") or not hasattr(backbone, "norm"):
            raise RecipeError(
                f"`memory.offload_keep_layers` needs a decoder with model.layers, embed_tokens and norm; "
                f"{type(base).__name__} has not: set `memory.offload_keep_layers: 0`."
            )
        self.on = False
        backbone.embed_tokens.register_forward_pre_hook(self._off)
        backbone.norm.register_forward_pre_hook(self._off)
        layers[len(layers) - keep_layers - 1].register_forward_hook(self._on)

    def _off(self, *args):
        self.on = False

    def _on(self, *args):
        # a checkpoint around `__call__` replays this hook in the backward, where nothing is offloaded
        if torch.is_grad_enabled() and not in_backward():
            self.on = True


def offload_context(model: torch.nn.Module, pin_memory: bool = True, keep_layers: int = 0):
    """TRL's activation-offloading context for `model`, with the ZeRO-3 guard, a `ledger` attribute and the last
    `keep_layers` decoder layers' saved tensors left on the GPU."""
    ctx = get_act_offloading_ctx_manager(model, use_pin_memory=pin_memory)
    ledger = ctx.ledger = Ledger()
    params = list(model.parameters())
    shapes = {tuple(getattr(p, "ds_shape", p.shape)) for p in params}
    zero3 = defaultdict(list)  # shape -> ZeRO-3 parameters of that shape
    for p in params:
        if hasattr(p, "ds_id"):
            zero3[tuple(p.ds_shape)].append(p)
    trl_pack, trl_unpack = ctx.pack_hook, ctx.unpack_hook
    keep = _KeepLast(model, keep_layers) if keep_layers else None

    def pack(tensor):
        if keep is not None and keep.on:
            return _Kept(tensor)
        shape = tuple(tensor.shape)
        for p in zero3.get(shape, ()):
            if p.numel() and p.data_ptr() == tensor.data_ptr():
                return _Kept(tensor)
        tensor_id = trl_pack(tensor)
        entry = ctx.tracker.get(tensor_id)
        if entry is not None and entry[1]:  # TRL's tracker: (tensor, copied to host, ...)
            ledger.bytes += tensor.numel() * tensor.element_size()
            if shape in shapes:  # shaped like a parameter: is it one (a view of its current storage)?
                storage = tensor.untyped_storage().data_ptr()
                ledger.param_shaped += any(p.numel() and p.untyped_storage().data_ptr() == storage for p in params)
        return tensor_id

    def unpack(packed):
        return packed.tensor if isinstance(packed, _Kept) else trl_unpack(packed)

    ctx.pack_hook, ctx.unpack_hook = pack, unpack
    return ctx


def pinned_bytes(nbytes: float) -> float:
    """What torch's pinned caching allocator holds for a block of `nbytes`: the next power of two."""
    return 2 ** math.ceil(math.log2(nbytes))


class Offloading(Lever):
    name = "offloading"
    order = 60
    kept_in_fallback = True
    tokens = ("offload", "pageable", "keep<K>")
    keys = (
        Key(
            "activation_offloading",
            bool,
            None,
            "TRL's switch: saved activations go to host memory (here kept away from ZeRO-3 parameters, so that it "
            "works under ZeRO-3).",
            section="trainer",
            priced=True,
        ),
        Key(
            "offload_pin_memory",
            bool,
            True,
            "with `activation_offloading`, keep offloaded activations in pinned host memory (TRL's default: "
            "asynchronous copies, but torch's pinned cache rounds each block up to a power of two: 1.34 GB -> 2 GB at "
            "64k). False: pageable memory, exact sizes, slower copies; for runs whose offload would not fit in host "
            "RAM (the planner's host figure).",
        ),
        Key(
            "offload_keep_layers",
            int,
            0,
            "with `activation_offloading`, the saved activations of the last N decoder layers stay on the GPU: less "
            "host memory, more GPU memory (one layer input, tokens x hidden x 2 bytes, per layer kept; the planner "
            "prices both). For runs whose host RAM is the limit.",
        ),
    )

    def check(self, s, ctx):
        keep = s.offload_keep_layers
        if not is_number(keep, whole=True) or keep < 0:
            raise RecipeError(f"`memory.offload_keep_layers` must be a whole number >= 0, got {keep!r}.")
        if keep and not s.activation_offloading:
            raise RecipeError(
                "`memory.offload_keep_layers` keeps part of TRL's activation offloading on the GPU; set "
                "`activation_offloading: true` too, or drop it."
            )
        if keep and keep >= (layers := ctx.architecture().num_hidden_layers):
            raise RecipeError(
                f"`memory.offload_keep_layers: {keep}` keeps every one of the model's {layers} layers on the GPU; "
                f"set `activation_offloading: false` instead, or keep fewer than {layers}."
            )
        if not s.offload_pin_memory and not s.activation_offloading:
            raise RecipeError(
                "`memory.offload_pin_memory: false` only changes TRL's activation offloading; set "
                "`activation_offloading: true` too, or drop it."
            )
        if s.activation_offloading and not ctx.cuda_available:
            raise RecipeError(
                "TRL's activation offloading moves activations to pinned host memory from a GPU; on a "
                "CPU-only machine set `activation_offloading: false`."
            )

    def wrap_trainer(self, s, trainer, build):
        if not trainer.args.activation_offloading:
            return
        context = offload_context(trainer.model, s.offload_pin_memory, s.offload_keep_layers)
        trainer.maybe_activation_offload_context = context

        def offloaded() -> dict:
            sent, param_shaped = context.ledger.take()
            return {"offloaded_gb": round(sent / 1e9, 4), "offloaded_param_shaped": int(param_shaped)}

        build.step_telemetry.append(offloaded)

    def price(self, s, setup, terms, cal):
        if not s.activation_offloading:
            return
        if terms.saves_layer_inputs:  # TRL offloads what the layer checkpoint keeps, but for the kept layers
            terms.stored_bytes = 0.0
            terms.kept_layers = s.offload_keep_layers
        terms.offloads_layer_inputs = terms.saves_layer_inputs
        block = terms.tokens * setup.hidden * 2
        per_block = pinned_bytes(block) * cal["pinned_factor"] if s.offload_pin_memory else block
        if s.offload_pin_memory and setup.lengths_vary:
            # torch's pinned cache serves a request only from blocks of its own power-of-two size and keeps every
            # block it made: over pairs of many lengths it holds a block of each class up to the largest, a
            # geometric series bounded by twice the largest (measured on a 32k mix: 88.8 GB pinned against 45.1 GB
            # for its largest pair alone, 1.97x: the mix's six size classes)
            per_block *= 2
        terms.host_bytes += (setup.layers - terms.kept_layers + cal.get("offload_extra_blocks", 0.0)) * per_block

    def fit(self, rows, every, cal, planner):
        """From rows that offloaded the layer inputs (TRL's offloader, one pair per step): the blocks of tokens x
        hidden x 2 bytes copied beyond the layer inputs (`offloaded_gb` counts the bytes exactly: the final norm's
        and the LM head's inputs, saved after the last layer, make about 2 more), pinned memory over those blocks
        rounded up to powers of two, and the process's own resident memory beside its pinned blocks (Python, torch,
        CUDA, DeepSpeed)."""
        extra, pinned, process = [], [], []
        for _env, row, _src, s in rows:
            lever_set = s.levers
            offloads = lever_set.activation_offloading and planner.terms_of(s, cal).offloads_layer_inputs
            if not (offloads and row.get("offloaded_gb")):
                continue
            block = planner.tokens(s) * s.hidden * 2
            keep = lever_set.offload_keep_layers
            extra.append(row["offloaded_gb"] * 1e9 / block - (s.layers - keep))
            if lever_set.offload_pin_memory and row.get("host_pinned_gb") and row.get("host_rss_gb"):
                blocks = s.layers - keep + extra[-1]
                pinned.append(row["host_pinned_gb"] * 1e9 / (blocks * pinned_bytes(block)))
                process.append(row["host_rss_gb"] - row["host_pinned_gb"])

        def mean(values, default):
            return round(sum(values) / len(values), 4) if values else default

        return {
            "offload_extra_blocks": mean(extra, 0.0),
            "pinned_factor": mean(pinned, 1.0),
            "host_process_gb": mean(process, 0.0),
        }

    def proposals(self, s, setup, plan_of):
        if not s.activation_offloading:
            yield 1, "activation_offloading: true", s.replace(activation_offloading=True)
        elif s.offload_pin_memory:
            yield (
                1,
                "memory.offload_pin_memory: false (pageable host memory: exact sizes, slower copies)",
                s.replace(offload_pin_memory=False),
            )

    def fitting_change(self, s, setup, plan_of):
        """Where offloaded activations overflow the host: the fewest layers kept on the GPU that make the run fit (no
        speed cost: those copies are not made), as (change, plan), or None."""
        first = plan_of(s)
        if not first.terms.offloads_layer_inputs or first.host_memory_gb is None:
            return None
        if first.host_per_node_gb <= first.host_memory_gb:
            return None
        for keep in range(s.offload_keep_layers + 1, setup.layers):
            alt = plan_of(s.replace(offload_keep_layers=keep))
            if alt.fits:
                return f"memory.offload_keep_layers: {keep} (the last {keep} layers' activations stay on the GPU)", alt
            if alt.gpu_memory_gb is not None and alt.peak_reserved_gb > alt.gpu_memory_gb:
                return None
        return None

    def spell(self, s, priced=False):
        if not s.activation_offloading:
            return None
        if priced:
            return "offload"
        return "+".join(
            ["offload"]
            + (["pageable"] if not s.offload_pin_memory else [])
            + ([f"keep{s.offload_keep_layers}"] if s.offload_keep_layers else [])
        )

    def read(self, token):
        if token == "offload":
            return {"activation_offloading": True}
        if token in ("pageable", "offload_pageable"):  # the earliest benchmark rows wrote `offload_pageable`
            return {"activation_offloading": True, "offload_pin_memory": False}
        if token.startswith("keep") and token[4:].isdigit():
            return {"offload_keep_layers": int(token[4:])}
        return None


LEVER = Offloading()
