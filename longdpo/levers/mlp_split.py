"""The MLP over parts of its tokens, each part recomputed in backward: `memory.mlp_chunks` or `memory.tiled_mlp`.

The 14336-wide MLP intermediates are the largest activations of a decoder layer; split over the tokens, backward
holds one part's at a time.

Chunks (`memory.mlp_chunks: N`): each of N contiguous chunks of every MLP's tokens in its own non-reentrant
checkpoint. Chunks of the flattened tokens, not of the sequence dimension: DPO runs chosen and rejected as a batch of
2, where a sequence slice is strided and each projection pays for it (tools/probe_kernels.py measures both). Nested in
transformers' layer checkpoint the chunks cost no extra MLP forward (`_wrap_chunked_mlp`).

Tiles (`memory.tiled_mlp: N`): DeepSpeed's TiledMLP runs each MLP over N sequence tiles and recomputes it in
backward; it is an autograd.Function, so a layer checkpoint's replay runs it in full (3 MLP forwards a step).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from longdpo.levers import Key, Lever
from longdpo.model.families import decoder_modules
from longdpo.model.forwards import counted, in_backward
from longdpo.recipe_values import RecipeError, is_number


def _wrap_tiled_mlp(mlp: torch.nn.Module, shards: int) -> None:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP  # deepspeed only where tiles are asked for

    forward = counted(mlp, mlp.forward)
    params = list(mlp.parameters())

    def tiled_forward(x):
        if not (mlp.training and torch.is_grad_enabled()):
            return forward(x)
        return TiledMLP.apply(lambda _self, x_shard: forward(x_shard), mlp, x, shards, params)

    mlp.forward = tiled_forward


def _under_non_reentrant_layer_checkpoint(layer: torch.nn.Module | None) -> bool:
    """Asked in the forward: does transformers' per-layer checkpoint of `layer` run non-reentrant now? (A reentrant
    one runs its forward under no_grad, so the chunked path is not taken there at all.)"""
    func = getattr(layer, "_gradient_checkpointing_func", None)
    return bool(
        getattr(layer, "gradient_checkpointing", False) and getattr(func, "keywords", {}).get("use_reentrant") is False
    )


def _wrap_chunked_mlp(mlp: torch.nn.Module, chunks: int, layer: torch.nn.Module | None = None) -> None:
    """Each chunk of the MLP's tokens in its own checkpoint: backward holds one chunk's intermediates.

    Each chunk runs in the forward and in its own recompute: 2 MLP forwards per step, as for an unchunked nested MLP
    (the tests count them). In a non-reentrant layer checkpoint's replay (in backward) the chunks' checkpoints are
    entered again - they save their inputs, which is all the layer's backward needs of the MLP - but their forwards
    do not run: that replay's outputs are thrown away (torch stops it at the last chunk's input). A reentrant layer
    checkpoint uses its replay's outputs, so there the chunks run; which kind ran is recorded in the forward, since TRL
    re-enables checkpointing (with other arguments) around reference forwards between a forward and its backward."""
    forward = counted(mlp, mlp.forward)
    replay_free = False

    def chunked_forward(x):
        nonlocal replay_free
        in_replay = in_backward()
        # Every training forward through the layer checkpoint records its kind, the reentrant one too (it runs under
        # no_grad): with LoRA under ZeRO-3, TRL re-enables checkpointing as reentrant after step 1, and a replay that
        # skipped the chunks there would give wrong gradients.
        if (
            mlp.training
            and not in_replay
            and (torch.is_grad_enabled() or getattr(layer, "gradient_checkpointing", False))
        ):
            replay_free = _under_non_reentrant_layer_checkpoint(layer)
        if not (mlp.training and torch.is_grad_enabled()):
            return forward(x)
        run = torch.empty_like if in_replay and replay_free else forward
        flat = x.reshape(-1, x.shape[-1])
        parts = [checkpoint(run, part, use_reentrant=False) for part in flat.chunk(chunks)]
        return torch.cat(parts).view(*x.shape[:-1], -1)

    mlp.forward = chunked_forward


def split_mlps(model: torch.nn.Module, chunks: int = 0, tiles: int = 0) -> dict[str, int]:
    """Chunk or tile every decoder MLP of `model`; returns how many were wrapped."""
    if chunks and tiles:
        raise RecipeError("Set one of `memory.tiled_mlp` and `memory.mlp_chunks`: both split the MLP's tokens.")
    wrapped = {"chunked_mlp": 0, "tiled_mlp": 0}
    if not (chunks or tiles):
        return wrapped
    for layer in decoder_modules(model)[0]:
        if chunks:
            _wrap_chunked_mlp(layer.mlp, chunks, layer)
            wrapped["chunked_mlp"] += 1
        else:
            _wrap_tiled_mlp(layer.mlp, tiles)
            wrapped["tiled_mlp"] += 1
    return wrapped


class MlpSplit(Lever):
    name = "mlp_split"
    order = 40
    tokens = ("chunked<N>", "tiled<N>")
    keys = (
        Key(
            "mlp_chunks",
            int,
            0,
            "checkpoint each MLP per chunk of its tokens, this many chunks (cheaper than TiledMLP under the layer "
            "checkpoint); 0 = off.",
            priced=True,
        ),
        Key(
            "tiled_mlp",
            int,
            0,
            "split each MLP over this many sequence tiles (DeepSpeed TiledMLP); 0 = off.",
            priced=True,
        ),
    )

    def check(self, s, ctx):
        for key in ("mlp_chunks", "tiled_mlp"):
            value = getattr(s, key)
            if not is_number(value, whole=True) or value < 0:
                raise RecipeError(f"`memory.{key}` must be a whole number >= 0, got {value!r}.")
        if s.mlp_chunks and s.tiled_mlp:
            raise RecipeError("Set one of `memory.tiled_mlp` and `memory.mlp_chunks`: both split the MLP's tokens.")

    def patches_decoder(self, s):
        return bool(s.mlp_chunks or s.tiled_mlp)

    def configure(self, s, build):
        build.mlp_recomputes_itself = bool(s.mlp_chunks or s.tiled_mlp)

    def wrap_recompute(self, s, model, build):
        build.wrapped.update(split_mlps(model, s.mlp_chunks, s.tiled_mlp))

    def price(self, s, setup, terms, cal):
        pass  # in the coefficients fitted per lever set (its token in the priced name)

    def spell(self, s, priced=False):
        for key, token in (("mlp_chunks", "chunked"), ("tiled_mlp", "tiled")):
            if getattr(s, key):
                return token if priced else f"{token}{getattr(s, key)}"
        return None

    def read(self, token):
        if token == "tiled":  # the earliest benchmark rows' name for 8 tiles
            return {"tiled_mlp": 8}
        for key, prefix in (("mlp_chunks", "chunked"), ("tiled_mlp", "tiled")):
            count = token.removeprefix(prefix)
            if token.startswith(prefix) and count.isdigit() and int(count) > 0:
                return {key: int(count)}
        return None


LEVER = MlpSplit()
