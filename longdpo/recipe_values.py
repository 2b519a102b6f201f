"""What every layer needs of a recipe's values before the schema exists (longdpo/config.py builds the schema from the
levers' declarations, and the levers check values with these): the error a recipe's mistake raises, TRL's own
defaults for top-level keys, and what counts as a number."""

from __future__ import annotations

import dataclasses


class RecipeError(ValueError):
    """A recipe or command-line problem; the message says which key or flag fixes it."""


def dpo_fields() -> dict[str, dataclasses.Field]:
    from trl import DPOConfig  # waits: this module is read before torch is imported (`read_raw`, `parse_cli`)

    return {f.name: f for f in dataclasses.fields(DPOConfig) if f.init}


def trainer_default(name: str):
    """TRL's default for a top-level recipe key (a DPOConfig field), read from DPOConfig itself."""
    f = dpo_fields()[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def is_number(value, whole: bool = False) -> bool:
    """An int (or, unless `whole`, a float) as a recipe value: YAML's `true` is a bool, which Python counts as an
    int, and is not a number here."""
    return not isinstance(value, bool) and isinstance(value, int if whole else (int, float))
