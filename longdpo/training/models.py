"""A run's models: the policy and the reference, built (or loaded) and put through the levers' model stages
(longdpo/levers/: kernels, then what backward recomputes, then how attention runs), with profiling labels between
the kernels and the recompute wrappers, so that a recompute is labelled too."""

from __future__ import annotations

import logging

from longdpo.config import Recipe
from longdpo.levers import Build, levers
from longdpo.model.build import build_model
from longdpo.model.emulation import parameter_bytes, sgd_in_backward
from longdpo.training import profiling

logger = logging.getLogger("train_dpo")


class Models:
    def __init__(self, recipe: Recipe, build: Build):
        s, args = recipe.levers, build.args
        self.policy = build_model(recipe.model)
        # a random-init run's reference is an identical copy (same config, same seed: step-1 loss ln 2); LoRA's is
        # the base with the adapters off, and a precomputed one needs no model
        self.reference = None
        if recipe.model.architecture and not args.precompute_ref_log_probs and not recipe.model.use_peft:
            self.reference = build_model(recipe.model)
        both = [self.policy, self.reference]
        if build.core_attention:
            for model in filter(None, both):
                model.set_attn_implementation(build.core_attention)
        for lever in levers():
            lever.replace_kernels(s, both, build)
        if recipe.memory.profile_step:
            profiling.instrument(self.policy)
            profiling.instrument_reference(self.reference)
            build.callbacks.append(profiling.ProfileCallback(recipe.memory.profile_step))
        for lever in levers():
            lever.wrap_recompute(s, self.policy, build)
        for lever in levers():
            lever.route_attention(s, both, build)
        if build.is_main:
            for line in build.messages:
                logger.info(line)
        if recipe.memory.sgd_in_backward:
            sgd_in_backward(self.policy, args.learning_rate)
        self.weights_gb = parameter_bytes(self.policy, self.reference) / 1e9
        # ZeRO-3 partitions each parameter as it is constructed (zero.Init): no rank holds the whole model
        self.built_partitioned = all(hasattr(p, "ds_id") for p in self.policy.parameters())  # before LoRA's adapters
