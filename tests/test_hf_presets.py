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
    assert ("op_swap pattern 'attn' matches no sub-module in any layer of LlamaModel.layers. The gpt2 model preset "
            "translated '.*\\.flash_attention' (swapkit's default swap op for "
            "swap_config.swap: true) to 'attn'; the gpt2 preset does not fit this model: its attention scope 'attn' "
            "is not in its layers. Set model.model_config.preset to the model's family or remove it") \
        in str(info.value)


def test_written_mindformers_name_is_named_when_its_translation_binds_nowhere():
    config = {"swap_config": {"swap": True, "op_swap": [{"op_name": "feed_forward", "backward_prefetch": 1,
                                                          "layers": True}]}}
    model = tiny_model("llama")
    for layer in model.layers:  # a Llama whose MLP is called ffn: the preset's 'mlp' is not there
        layer.ffn = layer._modules.pop("mlp")
    with pytest.raises(swapkit.BindError) as info:
        swapkit.apply(model, config)
    assert ("op_swap pattern 'mlp' matches no sub-module in any layer of LlamaModel.layers. The llama model preset "
            "translated 'feed_forward' to 'mlp'; this model's layers have no such scope. "
            "Write the scope's real name (children: ffn, input_layernorm, post_attention_layernorm, self_attn)") in str(info.value)


@pytest.mark.parametrize("written, hint", [
    ("atention", "; did you mean 'attention' (the llama preset maps it to self_attn)?"),
    ("feed_forwrd", "; did you mean 'feed_forward' (the llama preset maps it to mlp)?"),
    ("attention_nrom", "; did you mean 'attention_norm' (the llama preset maps it to input_layernorm)?"),
    ("attention.wq", r". Components of a pattern are separated by the two characters \. (a bare '.' is a regex "
                     r"wildcard inside one name): write 'attention\.wq' (the llama preset maps it to "
                     r"self_attn\.q_proj)"),
    ("feed_forward.mul", r". Components of a pattern are separated by the two characters \. (a bare '.' is a "
                         r"regex wildcard inside one name): write 'feed_forward\.mul' (the llama preset has no module for it: the elementwise "
                         "product in llama's gated MLP is computed inside its forward, not by a module)"),
    (r"attention\.wq|attention\.wk", r". The llama preset translates a pattern only when it is written exactly as "
                                     r"one of its names, not inside a larger regex: write 'attention\.wq' and "
                                     r"'attention\.wk' as separate entries"),
    ("xyzzy", "; its layers' children are: input_layernorm, mlp, post_attention_layernorm, self_attn; names the "
              "llama preset translates: attention, flash_attention, feed_forward, attention_norm, ffn_norm"),
])
def test_unmatched_pattern_hints_know_the_preset_names(written, hint):
    config = {"swap_config": {"swap": True, "op_swap": [{"op_name": written, "backward_prefetch": 1,
                                                          "layers": True}]}}
    with pytest.raises(swapkit.BindError) as info:
        swapkit.apply(tiny_model("llama"), config)
    assert f"op_swap pattern '{written}' matches no sub-module in any layer of LlamaModel.layers{hint}" \
        in str(info.value)
    assert "post_attention_layernorm'" not in str(info.value)  # attention_norm is the pre-attention norm


def test_num_layers_when_given_must_match_the_model():
    with pytest.raises(swapkit.BindError) as info:
        swapkit.apply(tiny_model("gpt2"), {"model": {"model_config": {"num_layers": 3}}})
    assert "GPT2Model.h holds 2 layers but the config says model.model_config.num_layers: 3" in str(info.value)


def test_swap_layers_are_checked_against_the_counted_layers():
    config = {"swap_config": {"swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": [0, 5]}]}}
    with pytest.raises(swapkit.ConfigError) as info:
        swapkit.apply(tiny_model("gpt2"), config)
    assert ("swap_config.layer_swap[0].layers: got [0, 5]; expected global layer indices 0 to 1 (num_layers is 2). "
            "Out of range: [5]; remove them, or list layers below 2") in str(info.value)


def test_a_plan_built_without_the_model_preset_says_to_pass_the_config():
    """api Note [A Plan is applied as built]: the dict binds, the Plan of the same config cannot, and says why."""
    config = swapkit.load_config({"model": {"model_config": {"num_layers": 2}}, **MINDFORMERS})
    swapkit.apply(tiny_model("llama"), config).remove()
    with pytest.raises(swapkit.BindError) as info:
        swapkit.apply(tiny_model("llama"), swapkit.build_plan(config))
    assert ("This Plan was built without a model preset, so its MindFormers / Megatron names were not translated to "
            "LlamaModel's modules: pass the Config (or its dict or YAML path) to swapkit.apply, which detects "
            "the llama preset from config.model_type, or set model.model_config.preset: llama before build_plan"
            ) in str(info.value)
