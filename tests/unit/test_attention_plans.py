"""`memory.reuse_attention_plans` reaches torch as the variable it reads, before the models run, and only when asked."""

import pytest

from longdpo.levers import Build, LeverSet, attention_plans


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv(attention_plans.ENV_VAR, raising=False)
    return monkeypatch


def configured(**values) -> Build:
    build = Build()
    s = LeverSet(**values)
    attention_plans.LEVER.configure(s, build)
    return build


def test_on_sets_the_variable_torch_reads(env):
    import os

    build = configured(reuse_attention_plans=True)
    assert os.environ[attention_plans.ENV_VAR] == "1"
    assert attention_plans.LEVER.summary(None, build) == {"attention_plans_per_length_class": True}


def test_off_leaves_the_environment_as_it_was(env):
    import os

    build = configured()
    assert attention_plans.ENV_VAR not in os.environ
    assert attention_plans.LEVER.summary(None, build) == {"attention_plans_per_length_class": False}
    # a user who set it themselves gets it, and the summary says so
    env.setenv(attention_plans.ENV_VAR, "1")
    assert attention_plans.LEVER.summary(None, configured()) == {"attention_plans_per_length_class": True}
    env.setenv(attention_plans.ENV_VAR, "0")
    assert attention_plans.LEVER.summary(None, configured()) == {"attention_plans_per_length_class": False}


def test_named_plans_and_priced_as_the_same_lever_set():
    ours = LeverSet.read("layer+liger+chunked8+head+offload+shared+plans+expandable")
    assert ours.reuse_attention_plans is True
    assert ours.name == "layer+liger+chunked8+head+offload+shared+plans+expandable"
    # no activation changes: the planner's coefficient class is the one without it
    assert ours.priced_name == ours.replace(reuse_attention_plans=False).priced_name
    assert LeverSet.read("stock").reuse_attention_plans is False
