"""Presets on tiny random Hugging Face models of every family: defaults and MindFormers names just work."""
from __future__ import annotations

import copy
import logging

import pytest
import torch

import swapkit
from swapkit.plan.presets import preset_named
from tests.hf_models import FAMILIES, inputs, loss_of, tiny_model

SWAP_DEFAULT = {"swap_config": {"swap": True}, "runtime": {"min_offload_bytes": 0}}
MINDFORMERS = {
    "swap_config": {"swap": True, "op_swap": [{"op_name": "attention", "backward_prefetch": 1, "layers": True},
                                              {"op_name": "feed_forward", "backward_prefetch": 1, "layers": [0]}]},
    "recompute_config": {"select_recompute": True, "select_comm_recompute": [1]},
    "runtime": {"min_offload_bytes": 0},
}


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def reference(model_type: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    model = tiny_model(model_type)
    plain = copy.deepcopy(model)
    loss_of(plain, inputs(model_type)).backward()
    return model, grads(plain)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_default_swap_resolves_to_the_family_attention(model_type, caplog):
    caplog.set_level(logging.INFO, logger="swapkit")
    model, expected = reference(model_type)
    layers, preset = FAMILIES[model_type][1], preset_named(FAMILIES[model_type][2])
    session = swapkit.apply(model, SWAP_DEFAULT, layers=layers)  # no num_layers, no module names
    with session:
        loss_of(model, inputs(model_type)).backward()
    got = grads(model)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    (attention,) = [p.replace("\\.", ".") for p in preset.scopes["attention"]]
    assert set(session.stats.offloaded_by_scope) == {f"layer 0: {attention}", f"layer 1: {attention}"}
    assert session.stats.offloaded_bytes == sum(session.stats.offloaded_by_scope.values()) > 0
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"model preset {preset.name}, auto-detected from ") for m in messages)
    assert "model.model_config.num_layers not given: " in "\n".join(messages)
    session.remove()


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_mindformers_names_map_onto_the_family(model_type, caplog):
    caplog.set_level(logging.INFO, logger="swapkit")
    model, expected = reference(model_type)
    preset = preset_named(FAMILIES[model_type][2])
    session = swapkit.apply(model, MINDFORMERS, layers=FAMILIES[model_type][1])
    first = session.plan.layers[0]
    assert first.op_swap == tuple((p, 1) for p in preset.scopes["attention"] + preset.scopes["mlp"])
    assert session.plan.layers[1].op_swap == tuple((p, 1) for p in preset.scopes["attention"])
    assert first.select == preset.scopes.get("activation", ())  # the gated multiply has no module: dropped
    assert session.plan.layers[1].comm == preset.scopes["norms"]
    with session:
        loss_of(model, inputs(model_type)).backward()
    got = grads(model)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)
    assert any(key.startswith("layer 0: ") and key != f"layer 0: {preset.scopes['attention'][0]}"
               for key in session.stats.offloaded_by_scope)  # the MLP of layer 0 moved too
    warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert rf"'feed_forward\.mul' has no module in {preset.name} models" in warnings  # that setting does nothing
    session.remove()


def test_megatron_modules_map_onto_mixtral():
    model = tiny_model("mixtral")
    session = swapkit.apply(model, {"recompute_config": {"recompute_granularity": "selective",
                                                         "recompute_modules": ["core_attn", "moe_act"]}})
    assert session.plan.layers[0].select == ("self_attn", r"mlp\.experts\.act_fn")
    session.remove()


def test_config_preset_wins_over_detection_and_unknown_names_are_errors():
    model = tiny_model("llama")
    with pytest.raises(swapkit.ConfigError) as info:
        swapkit.apply(model, {"model": {"model_config": {"preset": "lama"}}})
    assert "model.model_config.preset: unknown model preset 'lama'; did you mean 'llama'?" in str(info.value)
    with pytest.raises(swapkit.BindError) as info:  # gpt2 names (attn) are not in a Llama layer
        swapkit.apply(model, {"model": {"model_config": {"preset": "gpt2"}}, "swap_config": {"swap": True}})
    assert "op_swap pattern 'attn' matches no sub-module in any layer of LlamaModel.layers" in str(info.value)


def test_num_layers_when_given_must_match_the_model():
    with pytest.raises(swapkit.BindError) as info:
        swapkit.apply(tiny_model("gpt2"), {"model": {"model_config": {"num_layers": 3}}})
    assert "GPT2Model.h holds 2 layers but the config says model.model_config.num_layers: 3" in str(info.value)


def test_swap_layers_are_checked_against_the_counted_layers():
    config = {"swap_config": {"swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": [0, 5]}]}}
    with pytest.raises(swapkit.ConfigError) as info:
        swapkit.apply(tiny_model("gpt2"), config)
    assert "swap_config.layer_swap[0].layers: got [0, 5]; expected layer indices >= 0 < num_layers (2)" \
        in str(info.value)
