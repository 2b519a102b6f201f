"""Each lever has one home: its module of longdpo/levers/ declares its keys, checks, stages, planner terms and name,
and the rest of the project is derived from the declarations. Counted here: per lever, the source files outside its
module (the library, the entrypoints, the tools) whose code names one of its keys. Imports of the lever's module (to
use what it declares, e.g. the shared prompt's row length) do not count; docstrings and comments do not count."""

import glob
import io
import os
import re
import sys
import tokenize

from conftest import ROOT

from longdpo.levers import LeverSet, keys, levers

# The one pair of levers that check each other: the shared prompt's rows bring their own attention, so it refuses
# TRL's padding mask by name
CROSS_CHECKS = {"padding_mask": {"longdpo/levers/shared_prompt.py"}}


def code_names(path: str) -> list[str]:
    """Identifiers and string literals of a Python file, leaving out docstrings, comments and import statements."""
    out, statement_start, in_import = [], True, False
    for token in tokenize.generate_tokens(io.StringIO(open(path).read()).readline):
        if token.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            statement_start, in_import = True, False
            continue
        if token.type in (tokenize.NL, tokenize.COMMENT):
            continue
        if statement_start and token.type == tokenize.NAME and token.string in ("import", "from"):
            in_import = True
        if token.type == tokenize.STRING and statement_start:
            statement_start = False
            continue  # a docstring (or another bare string statement)
        statement_start = False
        if not in_import and token.type in (tokenize.NAME, tokenize.STRING):
            out.append(token.string)
    return out


def test_each_lever_is_named_only_in_its_own_module():
    sources = [
        path
        for pattern in ("longdpo/**/*.py", "launch/**/*.py", "tools/*.py")
        for path in glob.glob(os.path.join(ROOT, pattern), recursive=True)
    ]
    names = {path: code_names(path) for path in sources}
    found = {}
    for lever in levers():
        home = os.path.abspath(sys.modules[type(lever).__module__].__file__)
        pattern = re.compile(r"\b(" + "|".join(k.name for k in lever.keys) + r")\b")
        found[lever.name] = {
            os.path.relpath(path, ROOT)
            for path, tokens in names.items()
            if os.path.abspath(path) != home and any(pattern.search(t) for t in tokens)
        }
    assert len(found) >= 11 and len(names) > 40
    assert found == {lever.name: CROSS_CHECKS.get(lever.name, set()) for lever in levers()}


def test_the_counter_sees_a_lever_named_elsewhere(tmp_path):
    """The count above can fail: code that reads a key outside its lever's module is seen, a docstring is not."""
    path = tmp_path / "elsewhere.py"
    path.write_text('"""memory.mlp_chunks in a docstring"""\nimport os\n\nchunks = recipe.levers.mlp_chunks\n')
    assert "mlp_chunks" in code_names(str(path))
    path.write_text('"""memory.mlp_chunks in a docstring"""\nfrom longdpo.levers import mlp_split  # mlp_chunks\n')
    assert not any("mlp_chunks" in t for t in code_names(str(path)))


def test_a_name_is_one_spelling_read_back_and_an_unknown_lever_is_one_line():
    import pytest

    for name in (
        "stock",
        "stock+liger+offload",
        "layer+liger+chunked8+head+offload",
        "layer+lean+tiled4+offload+pageable",
    ):
        assert LeverSet.read(name).name == name
    # older spellings read the same lever set, and are written in the one spelling
    assert LeverSet.read("stock+offload+liger").name == "stock+liger+offload"
    assert (
        LeverSet.read("layer+lean+chunked8+head+offload_pageable").name == "layer+lean+chunked8+head+offload+pageable"
    )
    with pytest.raises(ValueError, match=r"unknown lever `newlever` in 'stock\+newlever'; levers: "):
        LeverSet.read("stock+newlever")
    assert len(keys()) >= 16
