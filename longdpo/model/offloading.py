"""Activation offloading: TRL's offloader (pinned or pageable host memory), kept away from ZeRO-3 parameters, with a
ledger of what it copies to the host.

TRL skips a saved tensor when it is an `nn.Parameter` or when its storage is one that `model.parameters()` held when
the offloader was built. Under DeepSpeed ZeRO-3 those storages are empty placeholders: a gathered weight lives in a
buffer allocated at each gather, so a view of one that reaches the hooks would be copied to the host and back on every
micro-step, and pinned there until the backward. Here every saved tensor that aliases a currently gathered ZeRO-3
parameter stays where it is (looked up by shape, then by address: cheap). The LM head's weight never reaches the
hooks at all (recipes/lean_lm_head.HookSafeLogProb).

The ledger counts, per optimizer step, the bytes copied to the host and the copied tensors that share storage with
a parameter (which should be none); the memory callback writes both into the telemetry (`offloaded_gb`,
`offloaded_param_shaped`). Shape alone cannot tell: at 65,536 tokens a pair's flattened hidden state (131,072 x 5,120)
has the shape of Mistral-NeMo's embedding matrix, and a shape-only count read 1 on the GPU for an activation.

`memory.offload_keep_layers: K` keeps the saved activations of the last K decoder layers on the GPU: K layer inputs
(T x H x 2 bytes each under layer checkpointing) move from host memory to the GPU, for runs whose host RAM is the
limit and whose GPU has room (launch/plan_memory.py prices both). The last layers, because their tensors are the first
the backward needs: they would be copied back at once.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from longdpo.config import RecipeError, is_number
from longdpo.model.checkpointing import _in_backward


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


def check(keep_layers, offloading: bool, num_layers) -> None:
    """`num_layers`: a callable giving the model's layer count (read from its config only when layers are kept)."""
    if not is_number(keep_layers, whole=True) or keep_layers < 0:
        raise RecipeError(f"`memory.offload_keep_layers` must be a whole number >= 0, got {keep_layers!r}.")
    if keep_layers and not offloading:
        raise RecipeError(
            "`memory.offload_keep_layers` keeps part of TRL's activation offloading on the GPU; set "
            "`activation_offloading: true` too, or drop it."
        )
    if keep_layers and keep_layers >= (layers := num_layers()):
        raise RecipeError(
            f"`memory.offload_keep_layers: {keep_layers}` keeps every one of the model's {layers} layers on the GPU; "
            f"set `activation_offloading: false` instead, or keep fewer than {layers}."
        )


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
        if torch.is_grad_enabled() and not _in_backward():
            self.on = True


def offload_context(model: torch.nn.Module, pin_memory: bool = True, keep_layers: int = 0):
    """TRL's activation-offloading context for `model`, with the ZeRO-3 guard, a `ledger` attribute and the last
    `keep_layers` decoder layers' saved tensors left on the GPU."""
    from trl.models import get_act_offloading_ctx_manager

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
