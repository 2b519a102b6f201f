"""TRL's DPOTrainer with what a run adds around a step: memory telemetry in every training log, the non-finite guard
(longdpo/cluster/signals.py), the model FLOPs of each micro-batch (longdpo/training/flops.py), and the places the
levers' `wrap_trainer` stage reaches into (longdpo/levers/): the dataloaders (sequence parallelism shards them over
data-parallel ranks only) and the count of tokens seen.
"""

from __future__ import annotations

from trl import DPOTrainer


class RecipeDPOTrainer(DPOTrainer):
    def __init__(self, *args, memory_callback, guard, **kwargs):
        self.recipe_memory, self.recipe_guard = memory_callback, guard
        self.loader_wrappers: list = []  # each dataloader passes through these (a lever's)
        self.tokens_seen_divisor = 1  # ranks that hold the same pairs: transformers sums every rank's batch
        self.step_flops = None  # longdpo/training/flops.py: the model FLOPs of each training micro-batch
        super().__init__(*args, **kwargs)

    def log(self, logs, start_time=None):
        if self.model.training:
            logs.update(self.recipe_memory.telemetry_logs())
        super().log(logs, start_time)

    def _wrapped(self, loader):
        for wrap in self.loader_wrappers:
            loader = wrap(loader)
        return loader

    def get_train_dataloader(self):
        return self._wrapped(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        return self._wrapped(super().get_eval_dataloader(eval_dataset))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if model.training:
            self.recipe_guard.saw_loss(out[0] if return_outputs else out)
            if self.step_flops is not None:
                self.step_flops.add(inputs)
        return out

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm)
        self.recipe_guard.saw_grad_norm(grad_norm)
        return grad_norm

    def _track_num_input_tokens(self, inputs):
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        if self.tokens_seen_divisor > 1:
            seen = self.state.num_input_tokens_seen - before
            self.state.num_input_tokens_seen = before + seen // self.tokens_seen_divisor
