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
"""

from __future__ import annotations

from collections import defaultdict

import torch


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
    """A saved tensor left in place (it aliases a gathered ZeRO-3 parameter)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor


def offload_context(model: torch.nn.Module, pin_memory: bool = True):
    """TRL's activation-offloading context for `model`, with the ZeRO-3 guard and a `ledger` attribute."""
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

    def pack(tensor):
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
