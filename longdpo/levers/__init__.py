"""The memory levers: each is one module of this package and declares itself there, once (`LEVER = ...`).

A declaration says everything the rest of the project needs to know about a lever:

  keys          its recipe keys (section, type, default, documentation): the recipe schema and `--help` are built
                from them, and a run's settings of every lever are one typed `LeverSet`
  check         its start-up checks, run by the checks layer before any model is loaded
  stages        how it applies to a run, each stage a method called for every lever in order (below)
  geometry,     its terms in the planner's memory model (longdpo/planner/plan.py), and the changes it proposes
  price,        when a run does not fit; a lever without a price is refused at planning time
  proposals
  spell, read   its part of a lever set's name (`layer+liger+chunked8+head+offload`): the one spelling the
                benchmark, the planner's calibration and the docs use, read back by `LeverSet.read`

Stages, in the order a run calls them:
  configure(settings, build)           before TRL's DPOConfig exists: its keyword arguments, facts for other levers
  replace_kernels(settings, models, build)   on the policy and the reference: kernels swapped in place (Liger's,
                                       the lean norm), beneath every wrapper
  wrap_recompute(settings, model, build)     on the policy: what backward recomputes (checkpoints, MLP chunks)
  route_attention(settings, models, build)   on both models: how attention runs (masks, sequence parallelism)
  wrap_trainer(settings, trainer, build)     on the built DPOTrainer: its forwards, its offloading context
  during_training(settings, build)     a context manager around `trainer.train()`
A stage returns nothing; what a lever wrapped goes into `build.wrapped`.

The registry is read lazily (`levers()`): importing one lever module, e.g. `longdpo.levers.allocator` before torch is
imported, imports no other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import pkgutil
from dataclasses import dataclass, field

from longdpo.recipe_values import RecipeError, trainer_default

SECTIONS = ("memory", "data", "parallelism", "trainer")  # where lever keys live; `trainer`: a field of TRL's DPOConfig
# TRL's DPOTrainer as a user gets it: transformers' layer checkpoint, TRL's padding mask and torch's own pinning of
# host memory; none of our levers
STOCK, STOCK_MEANS = "stock", "layer+mask+hostalloc"


@dataclass(frozen=True)
class Key:
    """One recipe key of a lever. `default` None for a `trainer` key means TRL's own default (read from DPOConfig)."""

    name: str
    type: object
    default: object
    doc: str
    section: str = "memory"
    priced: bool = False  # the planner fits its coefficients per value of this key (`LeverSet.priced_name`)

    @property
    def dotted(self) -> str:
        return self.name if self.section == "trainer" else f"{self.section}.{self.name}"


class Lever:
    """A lever's declaration. Subclasses set `name`, `keys` and `order`, and override what they do."""

    name: str = ""
    keys: tuple[Key, ...] = ()
    order: int = 0  # stages run, and names are spelled, in this order
    base: bool = False  # its token starts a lever set's name (the checkpointing policy)
    kept_in_fallback: bool = False  # an unmeasured lever set is planned as its nearest relative, which keeps this

    # ---- start-up -------------------------------------------------------------------------------------------------
    def check(self, s: LeverSet, ctx) -> None:
        """Raise RecipeError (one line naming the fix). `ctx`: longdpo.checks.CheckContext."""

    def replica_ranks(self, s: LeverSet) -> int:
        """How many ranks share one replica's pairs (sequence parallelism): they divide the data-parallel size."""
        return 1

    def reshapes_pairs(self, s: LeverSet) -> bool:
        """Whether it runs a pair as other rows than TRL's two (the planner's per-token coefficients are fitted on
        TRL's rows only)."""
        return False

    def patches_decoder(self, s: LeverSet) -> bool:
        """Whether it patches decoder modules by name (and so needs a family longdpo.model.families knows)."""
        return False

    # ---- stages ---------------------------------------------------------------------------------------------------
    def configure(self, s: LeverSet, build: Build) -> None:
        pass

    def replace_kernels(self, s: LeverSet, models: list, build: Build) -> None:
        pass

    def wrap_recompute(self, s: LeverSet, model, build: Build) -> None:
        pass

    def route_attention(self, s: LeverSet, models: list, build: Build) -> None:
        pass

    def wrap_trainer(self, s: LeverSet, trainer, build: Build) -> None:
        pass

    def during_training(self, s: LeverSet, build: Build):
        return contextlib.nullcontext()

    # ---- the planner ----------------------------------------------------------------------------------------------
    def geometry(self, s: LeverSet, setup, terms) -> None:
        """How it changes the tokens a rank holds (terms.pair_tokens, terms.shards, terms.shared_rows)."""

    def price(self, s: LeverSet, setup, terms, cal: dict) -> None:
        """Its terms in the memory model; the default refuses, so that a lever is never priced by a guess."""
        raise RecipeError(f"The planner has no cost for the lever `{self.name}`; it cannot plan this recipe.")

    def fit(self, rows: list, every: list, cal: dict, planner) -> dict:
        """Its own calibration entries, fitted on committed GPU rows (tools/calibrate_planner.py gives them; the
        package reads no results): `rows` the (environment, row, source, Setup) the per-lever-set coefficients are
        fitted on, `every` every benchmark row with figures (other pair shapes too), `cal` the calibration so far,
        `planner` the planner's predict / terms_of / tokens / resident."""
        return {}

    def proposals(self, s: LeverSet, setup, plan_of):
        """(rank, change, settings) it proposes when a run does not fit; rank orders all proposals by their cost
        (0: none, 1: little speed, 2: another lever set, 3: settings of the machine, 4: hardware and the task)."""
        return ()

    def fitting_change(self, s: LeverSet, setup, plan_of):
        """The smallest change of its own settings that makes the run fit, searched: (change, Plan) or None."""
        return None

    def needs_pairs(self, s: LeverSet, recipe) -> bool:
        """Whether the plan depends on the pairs themselves (measured before planning)."""
        return False

    def setup_facts(self, s: LeverSet, recipe, seq: int, pairs, synthetic: bool) -> dict:
        """Facts of the planner's Setup it takes from the pairs' (prompt, chosen, rejected) token counts."""
        return {}

    def report_lines(self, s: LeverSet, report: dict) -> list[str]:
        """Start-up log lines about the data's length report (longdpo.data.lengths.length_report)."""
        return []

    def summary(self, s: LeverSet, build: Build) -> dict:
        """Fields for the run's train_summary.json."""
        return {}

    # ---- naming ---------------------------------------------------------------------------------------------------
    # A lever named by one token that stands for one setting: (key, value, token). `spell` and `read` follow from
    # it; the token is in the planner's coefficient class when its key is `priced`.
    flag: tuple[str, object, str] | None = None

    def spell(self, s: LeverSet, priced: bool = False) -> str | None:
        """Its token in a lever set's name, None when off. `priced`: in the name of the planner's coefficient class,
        which leaves out what the planner prices by its own terms."""
        if self.flag is None:
            return None
        key, value, token = self.flag
        in_class = next(k.priced for k in self.keys if k.name == key)
        return token if getattr(s, key) == value and (in_class or not priced) else None

    def read(self, token: str) -> dict | None:
        """The settings a token of a name stands for, or None when the token is not this lever's."""
        if self.flag is None:
            return None
        key, value, own = self.flag
        return {key: value} if token == own else None

    def read_base(self, name: str) -> tuple[dict, str]:
        """The base lever: (the settings the start of `name` stands for, the rest of the name)."""
        return {}, name


@dataclass
class Build:
    """What the stages of one run share: TRL's keyword arguments, facts levers state for each other, what was
    wrapped, extra per-step telemetry and callbacks."""

    trainer_kwargs: dict = field(default_factory=dict)
    world_size: int = 1
    is_main: bool = True
    mlp_recomputes_itself: bool = False  # an MLP lever recomputes the MLP: no checkpoint around it
    rows_per_pair: int = 2  # rows a pair runs as: TRL's chosen and rejected, or one shared row
    one_row_per_pair: object = None  # (pairs, width) -> whether a batch runs one row per pair (a lever's choice)
    core_attention: str | None = None  # an attention function the models are built with (replaces the recipe's)
    wrapped: dict = field(default_factory=dict)
    step_telemetry: list = field(default_factory=list)  # callables -> dict of fields for each step's record
    callbacks: list = field(default_factory=list)
    messages: list = field(default_factory=list)  # start-up lines for the log
    sequence_parallel: object = None  # the SP group when sequence parallelism is on (its data-parallel size)
    state: dict = field(default_factory=dict)  # a lever's own state between its stages, under its name


@functools.cache
def levers() -> tuple[Lever, ...]:
    """Every lever of this package, in order (each module's `LEVER`)."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "LEVER"):
            found.append(module.LEVER)
    return tuple(sorted(found, key=lambda lever: lever.order))


@functools.cache
def keys() -> dict[str, tuple[Lever, Key]]:
    """Every lever key by name: (its lever, the key)."""
    out = {}
    for lever in levers():
        for key in lever.keys:
            assert key.name not in out, f"two levers declare `{key.name}`"
            out[key.name] = (lever, key)
    return out


def section_keys(section: str) -> dict[str, Key]:
    return {name: key for name, (_, key) in keys().items() if key.section == section}


def replica_ranks(s: LeverSet) -> int:
    """Ranks that hold the same pairs (world_size / this = the data-parallel ranks)."""
    out = 1
    for lever in levers():
        out *= lever.replica_ranks(s)
    return out


def setup_facts(s: LeverSet, recipe, seq: int, pairs, synthetic: bool) -> dict:
    """The planner's Setup facts every lever takes from the pairs' (prompt, chosen, rejected) token counts."""
    facts = {}
    for lever in levers():
        facts.update(lever.setup_facts(s, recipe, seq, pairs, synthetic))
    return facts


def known_tokens() -> list[str]:
    """What a name may hold, for error messages: `stock`, then each lever's tokens as its `tokens` attribute lists
    them."""
    return [STOCK, *(t for lever in levers() for t in getattr(lever, "tokens", ()))]


def default(key: Key):
    if key.section == "trainer" and key.default is None:
        return trainer_default(key.name)
    return key.default


class LeverSet:
    """Every lever's settings for one run (or one benchmark configuration), typed as the keys declare them.

    Read from a recipe (`LeverSet.from_recipe`), a name (`LeverSet.read("layer+liger+chunked8+head+offload")`) or
    given (`LeverSet(mlp_chunks=8)`); unset keys hold their defaults. Immutable and hashable."""

    __slots__ = ("_values",)

    def __init__(self, **values):
        known = keys()
        unknown = set(values) - set(known)
        if unknown:
            raise KeyError(f"no lever has the key(s) {sorted(unknown)}")
        full = {name: default(key) for name, (_, key) in known.items()}
        full.update(values)
        object.__setattr__(self, "_values", full)

    def __getattr__(self, name: str):
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"LeverSet is immutable; use .replace({name}=...)")

    def __eq__(self, other) -> bool:
        return isinstance(other, LeverSet) and self._values == other._values

    def __hash__(self) -> int:
        return hash(repr(self))

    def __repr__(self) -> str:
        return f"LeverSet({self.name})"

    def replace(self, **values) -> LeverSet:
        return LeverSet(**{**self._values, **values})

    @classmethod
    def from_recipe(cls, sections: dict[str, dict]) -> LeverSet:
        """From a recipe's values by section (`memory`, `data`, `parallelism`, `trainer`): what is set there."""
        values = {}
        for name, (_, key) in keys().items():
            given = sections.get(key.section) or {}
            if name in given:
                values[name] = given[name]
        return cls(**values)

    # ---- names ----------------------------------------------------------------------------------------------------
    def spelled(self, priced: bool = False) -> str:
        tokens = [t for lever in levers() for t in (lever.spell(self, priced) or "").split("+") if t]
        if tokens[:1] == ["layer"] and "mask" in tokens and "hostalloc" in tokens:
            tokens = [STOCK, *(t for t in tokens[1:] if t not in ("mask", "hostalloc"))]
        return "+".join(tokens)

    @property
    def name(self) -> str:
        """The one spelling of this lever set, e.g. `layer+liger+chunked8+head+offload`."""
        return self.spelled()

    @property
    def priced_name(self) -> str:
        """The planner's coefficient class: the name without what the planner prices by its own terms."""
        return self.spelled(priced=True)

    @classmethod
    def read(cls, name: str) -> LeverSet:
        """A lever set from its name (tokens in any order; the base, a checkpointing policy, first). An unknown
        token is a ValueError naming it."""
        values: dict = {}
        given = name
        if name == STOCK or name.startswith(STOCK + "+"):
            name = STOCK_MEANS + name[len(STOCK) :]
        rest = name
        for lever in levers():
            if lever.base:
                got, rest = lever.read_base(name)
                values.update(got)
        for token in filter(None, rest.split("+")):
            for lever in levers():
                got = None if lever.base else lever.read(token)
                if got is not None:
                    values.update(got)
                    break
            else:
                raise ValueError(f"unknown lever `{token}` in {given!r}; levers: {', '.join(known_tokens())}")
        return cls(**values)

    def with_priced_from(self, other: LeverSet) -> LeverSet:
        """These settings with `other`'s values of every priced key (a proposed lever set, keeping the rest)."""
        return self.replace(**{name: getattr(other, name) for name, (_, key) in keys().items() if key.priced})

    def changes_to(self, other: LeverSet) -> str:
        """`memory.lean_norm: true and activation_offloading: true`: the keys `other` sets differently, in order."""
        parts = [
            f"{key.dotted}: {as_yaml(getattr(other, name))}"
            for name, (_, key) in keys().items()
            if getattr(other, name) != getattr(self, name)
        ]
        return ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1] if parts else ""

    @property
    def reshapes_pairs(self) -> bool:
        """A lever of this set runs a pair as other rows than TRL's two."""
        return any(lever.reshapes_pairs(self) for lever in levers())

    def overrides(self) -> dict[str, str]:
        """As the entrypoint's command-line overrides (`--memory.mlp_chunks 8`, `--activation_offloading true`)."""
        return {key.dotted: as_yaml(getattr(self, name)) for name, (_, key) in keys().items()}


def as_yaml(value) -> str:
    """A value as a recipe or the command line writes it (`true`, `null`, `8`, `{\"a\": 1}`)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def patch_policy(model, s: LeverSet, build: Build | None = None) -> dict:
    """What changes what the policy keeps for backward, alone, as a run applies it: the kernels swapped in (the lean
    norm) and the recompute wrappers (checkpoints, MLP chunks and tiles). Returns what was wrapped."""
    build = build or Build()
    for lever in levers():
        lever.configure(s, build)
    for lever in levers():
        lever.replace_kernels(s, [model], build)
    for lever in levers():
        lever.wrap_recompute(s, model, build)
    return build.wrapped
