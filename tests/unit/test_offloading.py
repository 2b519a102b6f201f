"""`memory.offload_keep_layers`: which saved tensors stay on the GPU. TRL's offloader needs a GPU (the GPU acceptance
suite runs it); here the switch that decides is run under a saved-tensor hook that records what it would offload, on a
real model with transformers' non-reentrant layer checkpointing, as in a run."""

import dataclasses

import pytest
import torch
from conftest import TINY_ARGS

from longdpo.levers import offloading
from longdpo.model.build import build_model


def saved_during_forward(model, keep_layers: int):
    """(data pointers of each layer's input, saved while kept, saved while offloaded, the switch after backward)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inputs_of = {}

    def record(i):
        def hook(module, args, kwargs):
            inputs_of.setdefault(i, (args[0] if args else kwargs["hidden_states"]).data_ptr())

        return hook

    for i, layer in enumerate(base.model.layers):
        layer.register_forward_pre_hook(record(i), with_kwargs=True)
    keep = offloading._KeepLast(model, keep_layers)
    kept, offloaded = set(), set()

    def pack(tensor):
        (kept if keep.on else offloaded).add(tensor.data_ptr())
        return tensor

    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the reference's forward saves nothing and must not turn the switch on
        model(input_ids=ids)
    assert not keep.on
    inputs_of.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids)
    assert not keep.on  # off again from the final norm on
    out.logits.float().sum().backward()
    return inputs_of, kept, offloaded, keep.on


@pytest.mark.parametrize("keep_layers", [1, 3])
def test_the_last_layers_inputs_stay_and_the_others_are_offloaded(keep_layers):
    model = build_model(dataclasses.replace(TINY_ARGS, num_hidden_layers=4))
    model.activation_checkpointing_enable({"use_reentrant": False})
    model.train()
    inputs_of, kept, offloaded, on_after_backward = saved_during_forward(model, keep_layers)
    assert len(inputs_of) == 4
    for i, ptr in inputs_of.items():
        if i >= 4 - keep_layers:
            assert ptr in kept and ptr not in offloaded, i
        else:
            assert ptr in offloaded and ptr not in kept, i
    # the checkpoint's recompute in the backward runs layer 4-K-1's hooks again: the switch stays off there
    assert not on_after_backward


def test_lora_models_are_switched_on_their_base_layers():
    from peft import LoraConfig, get_peft_model

    model = build_model(dataclasses.replace(TINY_ARGS, num_hidden_layers=3))
    model.activation_checkpointing_enable({"use_reentrant": False})
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    peft_model.train()
    inputs_of, kept, offloaded, _ = saved_during_forward(peft_model, 1)
    assert inputs_of[2] in kept and inputs_of[1] in offloaded and inputs_of[0] in offloaded
