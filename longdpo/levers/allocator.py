"""CUDA caching-allocator settings that really take effect (a bug NeMo-RL PR #926 found, fixed).

NeMo-RL PR #926 found that setting PYTORCH_CUDA_ALLOC_CONF after CUDA is initialised silently does nothing: the
allocator reads the variable once, when it starts. So the entrypoint applies `memory.allocator_conf` before it
imports torch (it reads the recipe YAML with plain Python first), and if CUDA is already up (e.g. a notebook) it goes
through torch's runtime call `torch.cuda.memory._set_allocator_settings`; if neither can work it fails loudly.

torch accepts unknown keys silently, so keys and values are checked here. Pure Python: importing this module does
not import torch (nor does `longdpo.levers`, whose registry is read lazily), so the entrypoint applies the setting
first of all (`apply_from_recipe`).

Planner: the allocator's setting scales what is not resident by a factor fitted per setting, mode and lever set
(`allocator_factors`): max_split_size_mb:64 scaled it 2.5x under ZeRO-3 with norm_attn_mlp at 4 layers, 1.5x with the
layer checkpoint at 1 layer, and 0.93x in one process at 40 layers; expandable_segments:True 0.79x under ZeRO-3 and
0.70x in one process (40 layers at 64k); an unmeasured lever set takes the mean of the setting's measurements in that
mode. On pairs of many lengths the default allocator grows past a fixed shape's figure (`mixed_lengths_factors`:
1.44x in one process, measured on a 32k mix with 40 layers, where `expandable_segments:True` held the fixed-shape
plan within 1%; real-path mixes with 8 layers measured no growth).
"""

from __future__ import annotations

import difflib
import logging
import os
import sys
from dataclasses import replace

from longdpo.levers import Key, Lever
from longdpo.recipe_values import RecipeError

logger = logging.getLogger(__name__)
ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch >= 2.9 reads the second, older the first


def _positive_int(v: str) -> bool:
    return v.isdigit() and int(v) > 0


def _fraction(v: str) -> bool:
    try:
        return 0.0 < float(v) < 1.0
    except ValueError:
        return False


def _bool(v: str) -> bool:
    return v in ("True", "False", "true", "false")


def _power_of_two(v: str) -> bool:
    return _positive_int(v) and (int(v) & (int(v) - 1)) == 0


def _threads(v) -> int:
    """torch's pinned_num_register_threads (a power of two up to 128) as an int, or 0 when v is not one."""
    text = str(v) if isinstance(v, (int, str)) and not isinstance(v, bool) else ""
    return int(text) if _power_of_two(text) and int(text) <= 128 else 0


def _pow2_divisions(v: str) -> bool:
    if v.startswith("[") and v.endswith("]"):  # per-size form: [256:1,512:2,>:4]
        return all(":" in part for part in v[1:-1].split(","))
    return _power_of_two(v)


# key -> (validator, what a valid value looks like)
KEYS = {
    "max_split_size_mb": (lambda v: _positive_int(v) and int(v) > 20, "an integer > 20 (MB)"),
    "garbage_collection_threshold": (_fraction, "a fraction strictly between 0 and 1"),
    "expandable_segments": (_bool, "True or False"),
    "roundup_power2_divisions": (_pow2_divisions, "a power of two, or [size:div,...,>:div]"),
    "release_lock_on_cudamalloc": (_bool, "True or False"),
    "pinned_use_cuda_host_register": (_bool, "True or False"),
    "pinned_num_register_threads": (lambda v: _threads(v) > 0, "a power of two up to 128"),
    "pinned_use_background_threads": (_bool, "True or False"),
    "backend": (lambda v: v in ("native", "cudaMallocAsync"), "native or cudaMallocAsync"),
}


def parse(conf: str) -> dict[str, str]:
    """`"max_split_size_mb:64,expandable_segments:True"` -> dict, or RecipeError naming the bad part."""
    out: dict[str, str] = {}
    # split on commas outside [...] (roundup_power2_divisions takes a list)
    parts, depth, cur = [], 0, ""
    for ch in conf.replace(" ", ""):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    for part in filter(None, parts):
        key, sep, value = part.partition(":")
        if not sep or not value:
            raise RecipeError(
                f"`memory.allocator_conf` entry {part!r} is malformed; write `key:value`, e.g. `max_split_size_mb:64`."
            )
        if key not in KEYS:
            close = difflib.get_close_matches(key, KEYS, n=1)
            hint = f" Did you mean `{close[0]}`?" if close else ""
            raise RecipeError(
                f"`memory.allocator_conf` key `{key}` is not a CUDA allocator setting.{hint} "
                f"Known keys: {', '.join(KEYS)}."
            )
        ok, expected = KEYS[key]
        if not ok(value):
            raise RecipeError(f"`memory.allocator_conf` {key} must be {expected}, got {value!r}.")
        out[key] = value
    return out


def resolve(recipe_conf: str | None, environ=os.environ) -> tuple[str | None, str]:
    """Which setting wins: the recipe's (it overrides the environment) or the user's environment. Returns
    (effective setting or None, source: 'recipe' | 'environment' | 'default')."""
    if recipe_conf:
        parse(recipe_conf)
        return recipe_conf, "recipe"
    env_value = next((environ[v] for v in ENV_VARS if environ.get(v)), None)
    if env_value:
        parse(env_value)  # a typo in the user's env is as silent in torch as one in the recipe
        return env_value, "environment"
    return None, "default"


# torch pins host memory with cudaHostAlloc by default: ~1-2 GB/s, so a step whose pair is the first of a larger size
# class (pinned blocks are cached per power-of-two class) stalls while its offloaded activations are pinned. Measured
# on a 32k mix: the largest pair's step took 41 s against 11 s for the next largest; 42 blocks of 620 MB took 24.8 s
# on an H200 against 5.8 s when torch allocates them pageable and registers them with 8 threads
# (tools/pinned_host_probe.py). Copies run at the same speed either way. The user's own `pinned_` keys win;
# `memory.host_pinning_threads: 0` keeps torch's way.
PINNING_THREADS = 8


def host_pinning(threads: int) -> str:
    return f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{threads}"


def with_host_pinning(conf: str | None, threads: int = PINNING_THREADS) -> tuple[str | None, str | None]:
    """(the setting to hand torch, the host-pinning keys added to it, or None when none are)."""
    if not threads or (conf and any(key.startswith("pinned_") for key in parse(conf))):
        return conf, None
    added = host_pinning(threads)
    return (f"{conf},{added}" if conf else added), added


_TOO_LATE = (
    "CUDA was initialised before `memory.allocator_conf` ({conf}) could be applied, and {why}; launch "
    "through launch/train_dpo.py (it applies the setting before importing torch) or export "
    "PYTORCH_CUDA_ALLOC_CONF in the shell before starting Python."
)


def apply(recipe_conf: str | None, environ=os.environ, pinning_threads: int = PINNING_THREADS) -> dict:
    """Make the effective setting reach the allocator. Returns a record for the logs.

    path 'environment': set before CUDA initialises (the allocator reads it at start), host pinning added;
    path 'runtime':     CUDA already initialised, applied via torch.cuda.memory._set_allocator_settings."""
    conf, source = resolve(recipe_conf, environ)
    record = {
        "allocator_conf": conf,
        "source": source,
        "path": None,
        "host_pinning": None,
        "torch_imported_before": "torch" in sys.modules,
        "cuda_initialized_before": False,
    }
    torch = sys.modules.get("torch")
    cuda_up = bool(torch is not None and torch.cuda.is_initialized())
    record["cuda_initialized_before"] = cuda_up
    if not cuda_up:
        handed, record["host_pinning"] = with_host_pinning(conf, pinning_threads)
        if handed is None:
            return record
        for var in ENV_VARS:
            environ[var] = handed
        record["path"] = "environment"
        return record
    if conf is None:
        return record
    # Measured on an H200 (torch 2.11): after CUDA init neither the variable nor this runtime call changes
    # max_split_size (memory_stats reads -1), so the call is made and then read back; a mismatch is an error.
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    try:
        setter(conf)
    except (AttributeError, RuntimeError) as e:
        raise RecipeError(
            _TOO_LATE.format(conf=conf, why=f"torch's runtime allocator-settings call failed ({e})")
        ) from e
    check = verify(conf)
    if check.get("verified") is False:
        raise RecipeError(
            _TOO_LATE.format(
                conf=conf,
                why=(
                    f"torch's runtime call did not take effect (max_split_size reads {check['max_split_size_bytes']})"
                ),
            )
        )
    for var in ENV_VARS:  # child processes (dataloader workers) inherit the same setting
        environ[var] = conf
    record["path"] = "runtime"
    return record


def verify(conf: str | None) -> dict:
    """After CUDA is up, read the allocator back: max_split_size from torch.cuda.memory_stats(), expandable segments
    from the allocator's segment list (every segment is expandable once the setting took effect); other keys are
    recorded as applied, not verified."""
    import torch  # waits: this module is imported before torch (module docstring)

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {"verified": None}
    stats = torch.cuda.memory_stats()
    reported = stats.get("max_split_size")
    out = {"max_split_size_bytes": reported}
    wanted = parse(conf).get("max_split_size_mb") if conf else None
    if wanted is not None and reported is not None:
        out["verified"] = int(reported) == int(wanted) * 1024 * 1024
    if conf and str(parse(conf).get("expandable_segments", "")).lower() == "true":
        segments = torch.cuda.memory_snapshot()
        if segments and all("is_expandable" in seg for seg in segments):
            out["expandable_segments"] = all(seg["is_expandable"] for seg in segments)
            out["verified"] = out.get("verified", True) and out["expandable_segments"]
    return out


def apply_from_recipe(raw_recipe: dict) -> dict:
    """The recipe's setting (`memory.allocator_conf`, `memory.host_pinning_threads`, read from the plain YAML before
    torch is imported) applied. A bad value is applied as nothing here; the recipe's check refuses it next."""
    memory = raw_recipe.get("memory") if isinstance(raw_recipe.get("memory"), dict) else {}
    threads = memory.get("host_pinning_threads", PINNING_THREADS)
    return apply(memory.get("allocator_conf"), pinning_threads=_threads(threads))


def _mode(setup) -> str:
    """How a measured factor names the way a run was launched."""
    return "zero3" if setup.zero3 else "one process"


def _measured(factors: dict, mode: str, priced_name: str) -> float:
    """The factor measured for this mode and lever set; an unmeasured lever set takes the mean of the mode's."""
    same = [v for k, v in factors.items() if k.startswith(mode + " / ")]
    return factors.get(f"{mode} / {priced_name}", sum(same) / len(same) if same else 1.0)


# benchmark names of the settings measured most
NAMED = {"alloc64": "max_split_size_mb:64", "expandable": "expandable_segments:True"}


class Allocator(Lever):
    name = "allocator"
    order = 100
    tokens = (*NAMED, "alloc(<setting>)", "hostalloc")
    keys = (
        Key(
            "allocator_conf",
            "str | None",
            None,
            'PYTORCH_CUDA_ALLOC_CONF for this run, e.g. "max_split_size_mb:64". Applied before CUDA initialises; '
            "overrides the environment's value (the log says which won).",
        ),
        Key(
            "host_pinning_threads",
            "int",
            PINNING_THREADS,
            "Threads that pin host memory (activation offloading's copies): torch allocates it pageable and "
            "registers it with this many threads, ~4x faster than its default; 0 keeps torch's default "
            "(`hostalloc` in a benchmark name). Pinning keys of your own in allocator_conf win.",
        ),
    )

    def check(self, s, ctx):
        if s.allocator_conf:
            parse(s.allocator_conf)
        if s.host_pinning_threads != 0 and not _threads(s.host_pinning_threads):
            raise RecipeError(
                f"`memory.host_pinning_threads` must be 0 (torch's own pinning) or a power of two up to 128, got "
                f"{s.host_pinning_threads!r}; 8 is the default."
            )

    def configure(self, s, build):
        """`build.state["allocator"]`: what `apply_from_recipe` did, before torch was imported. Each step's telemetry
        records the setting, the run's summary the record, and training's start reads the setting back."""
        # waits: this module is imported, and applies the setting, before torch is (transformers imports it)
        from transformers import TrainerCallback

        record = build.state.setdefault("allocator", apply(None))

        class ReadBack(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                main = state.is_world_process_zero
                if main:
                    how = record["path"] or "nothing to apply"
                    conf = record["allocator_conf"] or "torch default"
                    logger.info("allocator: %s (source: %s, applied via %s)", conf, record["source"], how)
                    if record.get("host_pinning"):
                        logger.info("pinned host memory: registered by threads (%s)", record["host_pinning"])
                record.update(verify(record["allocator_conf"]))
                if main and record.get("verified") is not None:
                    logger.info(
                        "allocator read back: max_split_size=%s bytes, verified=%s",
                        record.get("max_split_size_bytes"),
                        record["verified"],
                    )
                if record.get("verified") is False:
                    logger.warning(
                        "allocator max_split_size does not match memory.allocator_conf: the setting did not reach the "
                        "allocator (was CUDA initialised before the entrypoint ran?)"
                    )

        build.callbacks.append(ReadBack())
        build.step_telemetry.append(lambda: {"allocator_conf": record["allocator_conf"]})

    def summary(self, s, build):
        return {"allocator": build.state.get("allocator")}

    def price(self, s, setup, terms, cal):
        mode = _mode(setup)
        if not s.allocator_conf:
            if setup.lengths_vary:
                # a mix whose run never met a pair as large as the plan's measures below it: the plan stays at the
                # largest pair's (real-path mixes of 30 steps: 0.88-0.92)
                terms.mix_factor = max(1.0, _measured(cal.get("mixed_lengths_factors", {}), mode, terms.priced_name))
            return
        mode = f"{s.allocator_conf} @ {mode}"
        terms.allocator_factor = _measured(cal.get("allocator_factors", {}), mode, terms.priced_name)
        terms.allocator_key = f"{mode} / {terms.priced_name}"

    def fit(self, rows, every, cal, planner):
        """Per setting, mode and lever set: what is not resident, measured with the setting, over what the planner
        predicts without it (rows of lever sets whose coefficients are fitted; the other fits come first)."""
        ratios: dict[str, list] = {}
        for _env, row, _src, s in rows:
            lever_set = s.levers
            if lever_set.allocator_conf and lever_set.priced_name in cal["configs"]:
                without = planner.predict(replace(s, levers=lever_set.replace(allocator_conf=None)), cal)
                fixed = planner.resident(s, cal)
                key = planner.terms_of(s, cal).allocator_key
                ratios.setdefault(key, []).append(
                    (row["peak_reserved_gb"] - fixed) / (without.peak_reserved_gb - fixed)
                )
        # pairs of many lengths on the default allocator (benchmark rows of the `mixed` workload that never hit the
        # GPU's limit: one that did had its cache freed and reserved capped): reserved over a fixed shape's plan for
        # the largest pair
        grown: dict[str, list] = {}
        for _env, row, _src, s in every:
            if row.get("workload") != "mixed" or s.levers.allocator_conf or row.get("alloc_retries"):
                continue
            if s.levers.priced_name not in cal["configs"]:
                continue
            fixed_shape = planner.predict(replace(s, lengths_vary=False), cal).peak_reserved_gb
            resident = planner.resident(s, cal)
            key = f"{_mode(s)} / {s.levers.priced_name}"
            grown.setdefault(key, []).append((row["peak_reserved_gb"] - resident) / (fixed_shape - resident))
        return {
            "allocator_factors": {k: round(sum(v) / len(v), 4) for k, v in sorted(ratios.items())},
            "mixed_lengths_factors": {k: round(sum(v) / len(v), 4) for k, v in sorted(grown.items())},
        }

    def proposals(self, s, setup, plan_of):
        if s.allocator_conf:
            yield (
                3,
                "memory.allocator_conf: null (measured: max_split_size_mb:64 raised reserved 1.4x)",
                s.replace(allocator_conf=None),
            )
            return
        # only where the setting has a measured factor in this mode (a mode without one prices it 1.0)
        grown = s.replace(allocator_conf=NAMED["expandable"])
        factor = plan_of(grown).terms.allocator_factor
        if factor < 1:
            yield (
                0,
                f"memory.allocator_conf: expandable_segments:True (measured: {factor:.2f}x the memory reserved above "
                "the model states)",
                grown,
            )

    def spell(self, s, priced=False):
        if priced:
            return None
        named = {conf: name for name, conf in NAMED.items()}
        conf = named.get(s.allocator_conf, f"alloc({s.allocator_conf})") if s.allocator_conf else ""
        return "+".join(filter(None, [conf, "hostalloc" if s.host_pinning_threads == 0 else ""])) or None

    def read(self, token):
        if token == "hostalloc":
            return {"host_pinning_threads": 0}
        if token in NAMED:
            return {"allocator_conf": NAMED[token]}
        if token.startswith("alloc(") and token.endswith(")"):
            return {"allocator_conf": token[6:-1]}
        return None


LEVER = Allocator()
