"""The named lever configurations: what the benchmark runs (tools/bench_memory.py `--configs`), what the GPU
acceptance suite starts from, and what the planner's calibration reads back from committed results. Each is a
`Levers`, typed like the recipe keys it sets. `stock` is TRL as a user gets it; every other name lists what it
switches on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

BENCH_RECIPE = "recipes/nemotron12b/dpo_12k.yaml"  # the benchmark's default recipe (model, data, trainer settings)
TRL_FLAGS = ("activation_offloading", "use_liger_kernel")  # top-level DPOConfig keys
DATA_FLAGS = ("shared_prompt",)  # `data.` keys; the others are `memory.` keys


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (a GPU count, a layer count, a sequence length)."""
    import argparse

    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


def positive_ints(text: str) -> list[int]:
    """An argparse type: comma-separated whole numbers >= 1 (`--seq-tokens 12288,32768`)."""
    return [positive_int(part) for part in text.split(",")]


def add_setup_arguments(parser) -> None:
    """The benchmark's options that fix a row's setup: its recipe, layer count and GPU count. tools/bench_memory.py
    parses them to run, the planner's calibration to read a recorded command line back (same defaults)."""
    parser.add_argument("--recipe", default=BENCH_RECIPE)
    parser.add_argument(
        "--layers",
        type=positive_int,
        default=None,
        help="cut the model to this many layers (the real path on one GPU: --mode zero3 --layers 8)",
    )
    parser.add_argument("--gpus", type=positive_int, default=1)


@dataclass(frozen=True)
class Levers:
    """The memory settings of one configuration; the defaults are the neutral base every configuration starts from
    (TRL's layer checkpointing, nothing else), whatever the recipe it runs with says."""

    checkpointing: str = "layer"
    tiled_mlp: int = 0
    mlp_chunks: int = 0
    lean_norm: bool = False
    lean_lm_head: bool = False
    offload_pin_memory: bool = True
    allocator_conf: str | None = None
    empty_cache_steps: int = 0
    padding_mask: str = "auto"
    activation_offloading: bool = False
    use_liger_kernel: bool = False
    shared_prompt: bool = False

    def overrides(self) -> dict[str, str]:
        """As the entrypoint's command-line overrides (`--memory.mlp_chunks 8`, `--activation_offloading true`)."""

        def text(value) -> str:
            return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)

        def key(name: str) -> str:
            return name if name in TRL_FLAGS else f"data.{name}" if name in DATA_FLAGS else f"memory.{name}"

        return {key(k): text(v) for k, v in asdict(self).items()}


OFFLOAD = Levers(activation_offloading=True)
LIGER = {"use_liger_kernel": True}
CONFIGS: dict[str, Levers] = {
    # TRL 1.16 DPOTrainer as a user gets it: transformers' per-layer checkpointing, its padding mask, nothing of ours.
    "stock": Levers(padding_mask="keep"),
    "stock+offload": replace(OFFLOAD, padding_mask="keep"),
    "stock+liger": Levers(padding_mask="keep", **LIGER),
    # the best library-only setup: TRL's checkpointing + activation offloading + Liger's RMSNorm/SwiGLU/RoPE kernels
    "stock+offload+liger": replace(OFFLOAD, padding_mask="keep", **LIGER),
    # NeMo-RL PR #926's rows: attention + MLP checkpointed per module (its baseline), + norms, + allocator.
    "attn_mlp": Levers(checkpointing="attn_mlp"),
    "norm_attn": Levers(checkpointing="norm_attn"),
    "norm_attn_mlp": Levers(checkpointing="norm_attn_mlp"),
    "norm_attn_mlp+alloc64": Levers(checkpointing="norm_attn_mlp", allocator_conf="max_split_size_mb:64"),
    "norm_attn_mlp+expandable": Levers(checkpointing="norm_attn_mlp", allocator_conf="expandable_segments:True"),
    "norm_attn_mlp+empty_cache": Levers(checkpointing="norm_attn_mlp", empty_cache_steps=1),
    # Nested checkpointing done right, then with tiling and TRL's activation offloading.
    "layer+norm_attn_mlp": Levers(checkpointing="layer+norm_attn_mlp"),
    "layer+norm_attn+tiled": Levers(checkpointing="layer+norm_attn", tiled_mlp=8),
    "layer+norm_attn_mlp+offload": replace(OFFLOAD, checkpointing="layer+norm_attn_mlp"),
    "layer+norm_attn+tiled+offload": replace(OFFLOAD, checkpointing="layer+norm_attn", tiled_mlp=8),
}
# The MLP in chunks of its tokens, each chunk its own checkpoint; lean norms (no fp32 copies in the norms' backward),
# with or without attention nested; the lean LM-head backward ("+head"); pageable offloading; PR #926's allocator
# levers on the leanest; our levers on Liger's kernels.
for _n in (4, 8):
    CONFIGS[f"layer+norm_attn+chunked{_n}+offload"] = replace(OFFLOAD, checkpointing="layer+norm_attn", mlp_chunks=_n)
    CONFIGS[f"layer+attn+lean+chunked{_n}+offload"] = replace(
        OFFLOAD, checkpointing="layer+attn_mlp", lean_norm=True, mlp_chunks=_n
    )
for _n in (2, 3, 4, 8):
    CONFIGS[f"layer+lean+chunked{_n}+offload"] = replace(OFFLOAD, lean_norm=True, mlp_chunks=_n)
for _name in (
    "layer+norm_attn_mlp+offload",
    "layer+attn+lean+chunked4+offload",
    "layer+lean+chunked2+offload",
    "layer+lean+chunked3+offload",
    "layer+lean+chunked4+offload",
    "layer+attn+lean+chunked8+offload",
    "layer+lean+chunked8+offload",
):
    CONFIGS[_name.replace("+offload", "+head+offload")] = replace(CONFIGS[_name], lean_lm_head=True)
_LEANEST = CONFIGS["layer+lean+chunked8+head+offload"]
CONFIGS["layer+lean+chunked8+head+offload_pageable"] = replace(_LEANEST, offload_pin_memory=False)
CONFIGS["layer+lean+chunked8+head+offload+empty_cache"] = replace(_LEANEST, empty_cache_steps=1)
CONFIGS["layer+lean+chunked8+head+offload+expandable"] = replace(_LEANEST, allocator_conf="expandable_segments:True")
CONFIGS["layer+liger+head+offload"] = replace(OFFLOAD, lean_lm_head=True, **LIGER)
for _n in (2, 3, 8):
    CONFIGS[f"layer+liger+chunked{_n}+head+offload"] = replace(CONFIGS["layer+liger+head+offload"], mlp_chunks=_n)
    CONFIGS[f"layer+lean+liger+chunked{_n}+head+offload"] = replace(
        CONFIGS[f"layer+liger+chunked{_n}+head+offload"], lean_norm=True
    )
# Each pair's prompt computed once, on our leanest Liger configuration and on the library-only setup's levers.
for _n in (3, 8):
    CONFIGS[f"layer+liger+chunked{_n}+head+offload+shared"] = replace(
        CONFIGS[f"layer+liger+chunked{_n}+head+offload"], shared_prompt=True
    )
