"""A run's preference pairs: the tokenizer and the training and evaluation data, checked against the chat template,
`max_length` and the model's vocabulary before any model is loaded."""

from __future__ import annotations

import logging

from longdpo.config import Recipe, RecipeError, trainer_default
from longdpo.data.lengths import check_some_pair_fits, pair_lengths
from longdpo.data.loading import check_chat_template, load_eval_data, load_train_data
from longdpo.model.build import load_architecture, load_tokenizer

logger = logging.getLogger("train_dpo")


class Pairs:
    def __init__(self, recipe: Recipe, is_main: bool):
        t = recipe.trainer
        self.tokenizer = load_tokenizer(recipe.model)
        self.train = load_train_data(recipe.data)
        dropped_roles = check_chat_template(self.tokenizer, self.train)
        max_length = t.get("max_length", trainer_default("max_length"))
        check_some_pair_fits(
            self.tokenizer, self.train, max_length, t.get("truncation_mode", trainer_default("truncation_mode"))
        )
        if dropped_roles and is_main:
            logger.warning(dropped_roles)
        self.eval = load_eval_data(recipe.data)
        if self.eval is not None:
            check_chat_template(self.tokenizer, self.eval, "eval_files")
        vocab_size = load_architecture(recipe.model).vocab_size
        if len(self.tokenizer) > vocab_size:
            raise RecipeError(
                f"The tokenizer has {len(self.tokenizer)} tokens but the model's vocab_size is "
                f"{vocab_size}; use a matching `model.tokenizer`."
            )

    def lengths(self) -> list[tuple[int, int, int]]:
        """(prompt, chosen, rejected) tokens of every training pair, as TRL tokenizes them (one pass)."""
        return pair_lengths(self.tokenizer, self.train)
