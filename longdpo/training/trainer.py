"""TRL's DPOTrainer with what a run adds around a step: memory telemetry in every training log, the non-finite
guard (longdpo/cluster/resilience.py), TRL's activation offloading kept away from ZeRO-3 parameters
(longdpo/model/offloading.py), sequence-parallel forwards, data sharding and token counting
(longdpo/model/sequence_parallel.py). Imported after the allocator is set (it imports torch through TRL).
"""

from __future__ import annotations

from trl import DPOTrainer


class RecipeDPOTrainer(DPOTrainer):
    def __init__(
        self,
        *args,
        memory_callback,
        guard,
        sp=None,
        shared_prompt=None,
        offload_pin_memory: bool = True,
        offload_keep_layers: int = 0,
        **kwargs,
    ):
        self.recipe_memory, self.recipe_guard, self.recipe_sp = memory_callback, guard, sp
        super().__init__(*args, **kwargs)
        if self.args.activation_offloading:  # TRL's offloader, kept away from ZeRO-3 parameters, pinned or not
            from longdpo.model.offloading import offload_context

            self.maybe_activation_offload_context = offload_context(self.model, offload_pin_memory, offload_keep_layers)
            memory_callback.offload_ledger = self.maybe_activation_offload_context.ledger
        if sp:
            sp.wrap(self.model)  # TRL's fused-LM-head forwards, policy and reference
            sp.wrap(self.ref_model)
            self._tp_size = sp.k  # TRL's token count gathers every rank: a group holds each token K times
        self.shared_prompt_counts = None
        if shared_prompt is not None:  # the minimum saving; TRL's fused-LM-head forwards (LoRA's ref is the policy's)
            from longdpo.model import shared_prompt as sharing

            self.shared_prompt_counts = sharing.wrap(self.model, shared_prompt)
            if self.ref_model is not None:
                sharing.wrap(self.ref_model, shared_prompt)

    def log(self, logs, start_time=None):
        if self.model.training:
            logs.update(self.recipe_memory.telemetry_logs())
        super().log(logs, start_time)

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        return self.recipe_sp.shard_over_data_parallel_ranks(loader) if self.recipe_sp else loader

    def get_eval_dataloader(self, eval_dataset=None):
        loader = super().get_eval_dataloader(eval_dataset)
        return self.recipe_sp.shard_over_data_parallel_ranks(loader) if self.recipe_sp else loader

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if model.training:
            self.recipe_guard.saw_loss(out[0] if return_outputs else out)
        return out

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm)
        self.recipe_guard.saw_grad_norm(grad_norm)
        return grad_norm

    def _track_num_input_tokens(self, inputs):
        # transformers sums every rank's batch: the K ranks of a sequence-parallel group hold the same pairs
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        if self.recipe_sp:
            seen = self.state.num_input_tokens_seen - before
            self.state.num_input_tokens_seen = before + seen // self.recipe_sp.k
