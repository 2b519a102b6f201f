"""The named lever configurations the benchmark runs (tools/bench_memory.py `--configs`), the GPU acceptance suite
starts from, and the planner's calibration reads back from committed results: each is a set of recipe overrides on
top of BASE. `stock` is TRL as a user gets it; every other name lists what it switches on.
"""

BENCH_RECIPE = "recipes/nemotron12b/dpo_12k.yaml"  # the benchmark's default recipe (model, data, trainer settings)


def add_setup_arguments(parser) -> None:
    """The benchmark's options that fix a row's setup: its recipe, layer count and GPU count. tools/bench_memory.py
    parses them to run, the planner's calibration to read a recorded command line back (same defaults)."""
    parser.add_argument("--recipe", default=BENCH_RECIPE)
    parser.add_argument("--layers", type=int, default=None, help="cut the model to this many layers (the real path on "
                                                                  "one GPU: --mode zero3 --layers 8)")
    parser.add_argument("--gpus", type=int, default=1)

# Neutral memory settings every configuration starts from, then its own switches on top.
BASE = {"memory.checkpointing": "layer", "memory.allocator_conf": "null", "memory.empty_cache_steps": "0",
        "memory.tiled_mlp": "0", "memory.mlp_chunks": "0", "memory.lean_norm": "false", "memory.lean_lm_head": "false",
        "memory.offload_pin_memory": "true",
        "activation_offloading": "false", "use_liger_kernel": "false"}
CONFIGS = {
    # TRL 1.16 DPOTrainer as a user gets it: transformers' per-layer checkpointing, nothing of ours.
    "stock": {},
    "stock+offload": {"activation_offloading": "true"},
    # NeMo-RL PR #926's rows: attention + MLP checkpointed per module (its baseline), + norms, + allocator.
    "attn_mlp": {"memory.checkpointing": "attn_mlp"},
    "norm_attn": {"memory.checkpointing": "norm_attn"},
    "norm_attn_mlp": {"memory.checkpointing": "norm_attn_mlp"},
    "norm_attn_mlp+alloc64": {"memory.checkpointing": "norm_attn_mlp", "memory.allocator_conf": "max_split_size_mb:64"},
    "norm_attn_mlp+expandable": {"memory.checkpointing": "norm_attn_mlp",
                                 "memory.allocator_conf": "expandable_segments:True"},
    "norm_attn_mlp+empty_cache": {"memory.checkpointing": "norm_attn_mlp", "memory.empty_cache_steps": "1"},
    # Nested checkpointing done right, then with tiling and TRL's activation offloading.
    "layer+norm_attn_mlp": {"memory.checkpointing": "layer+norm_attn_mlp"},
    "layer+norm_attn+tiled": {"memory.checkpointing": "layer+norm_attn", "memory.tiled_mlp": "8"},
    "layer+norm_attn_mlp+offload": {"memory.checkpointing": "layer+norm_attn_mlp", "activation_offloading": "true"},
    "layer+norm_attn+tiled+offload": {"memory.checkpointing": "layer+norm_attn", "memory.tiled_mlp": "8",
                                      "activation_offloading": "true"},
    # The MLP split into chunks of its tokens, each chunk its own checkpoint (aimed at the 12k snapshot's largest holder).
    "layer+norm_attn+chunked4+offload": {"memory.checkpointing": "layer+norm_attn", "memory.mlp_chunks": "4",
                                         "activation_offloading": "true"},
    "layer+norm_attn+chunked8+offload": {"memory.checkpointing": "layer+norm_attn", "memory.mlp_chunks": "8",
                                         "activation_offloading": "true"},
    # Lean norms (recipes/lean_norm.py), aimed at the 64k snapshot's largest holder: fp32 copies in the norms'
    # backward. With them the norms need no checkpoint of their own; attention nested or not.
    "layer+lean+chunked8+offload": {"memory.lean_norm": "true", "memory.mlp_chunks": "8",
                                    "activation_offloading": "true"},
    "layer+attn+lean+chunked4+offload": {"memory.checkpointing": "layer+attn_mlp", "memory.lean_norm": "true",
                                         "memory.mlp_chunks": "4", "activation_offloading": "true"},
    "layer+attn+lean+chunked8+offload": {"memory.checkpointing": "layer+attn_mlp", "memory.lean_norm": "true",
                                         "memory.mlp_chunks": "8", "activation_offloading": "true"},
    "layer+lean+chunked4+offload": {"memory.lean_norm": "true", "memory.mlp_chunks": "4",
                                    "activation_offloading": "true"},
}
# "+head": the lean LM-head backward (recipes/lean_lm_head.py), aimed at the 12k floor: TRL's fp32 buffer of the whole
# LM-head weight gradient. Added to the configurations that led at 12k and at 32k-64k.
for _n in (2, 3):
    CONFIGS[f"layer+lean+chunked{_n}+offload"] = {**CONFIGS["layer+lean+chunked4+offload"], "memory.mlp_chunks": str(_n)}
for _name in ("layer+norm_attn_mlp+offload", "layer+attn+lean+chunked4+offload", "layer+lean+chunked4+offload",
              "layer+lean+chunked2+offload", "layer+lean+chunked3+offload",
              "layer+attn+lean+chunked8+offload", "layer+lean+chunked8+offload"):
    CONFIGS[_name.replace("+offload", "+head+offload")] = {**CONFIGS[_name], "memory.lean_lm_head": "true"}
# The leanest 64k configuration with pageable host memory for the offloaded activations: exact sizes instead of pinned
# blocks rounded up to a power of two (128k: 40 x 2.68 GB = 107 GB instead of 40 x 4 GB = 160 GB, over a 128 GB host).
CONFIGS["layer+lean+chunked8+head+offload_pageable"] = {**CONFIGS["layer+lean+chunked8+head+offload"],
                                                        "memory.offload_pin_memory": "false"}
# NeMo-RL PR #926's two allocator levers on the leanest configuration: cache emptying every step, expandable segments.
CONFIGS["layer+lean+chunked8+head+offload+empty_cache"] = {**CONFIGS["layer+lean+chunked8+head+offload"],
                                                           "memory.empty_cache_steps": "1"}
# The same with expandable segments, aimed at its 64k fragmentation gap (23 GB reserved above the 16.8 GB allocated).
CONFIGS["layer+lean+chunked8+head+offload+expandable"] = {**CONFIGS["layer+lean+chunked8+head+offload"],
                                                          "memory.allocator_conf": "expandable_segments:True"}
# The best library-only setup (TRL's checkpointing + activation offloading + Liger's RMSNorm/SwiGLU/RoPE kernels),
# and our levers composed with Liger's kernels (recipes/liger.py): Liger's norms or our lean ones, MLP chunks of
# Liger's SwiGLU or none. GPU only (Triton).
LIGER = {"use_liger_kernel": "true"}
CONFIGS["stock+liger"] = dict(LIGER)
CONFIGS["stock+offload+liger"] = {**CONFIGS["stock+offload"], **LIGER}
CONFIGS["layer+liger+head+offload"] = {**CONFIGS["stock+offload"], **LIGER, "memory.lean_lm_head": "true"}
for _n in (2, 3, 8):
    CONFIGS[f"layer+liger+chunked{_n}+head+offload"] = {**CONFIGS["layer+liger+head+offload"],
                                                        "memory.mlp_chunks": str(_n)}
    CONFIGS[f"layer+lean+liger+chunked{_n}+head+offload"] = {**CONFIGS[f"layer+liger+chunked{_n}+head+offload"],
                                                             "memory.lean_norm": "true"}
# The library-only configurations are TRL as it comes: its padding mask reaches the attention (ours drop it where
# causal attention already excludes the padding, recipes/padding_mask.py). Set last, so that no configuration of
# ours inherits it.
BASE["memory.padding_mask"] = "auto"
for _name in ("stock", "stock+offload", "stock+liger", "stock+offload+liger"):
    CONFIGS[_name] = {**CONFIGS[_name], "memory.padding_mask": "keep"}
