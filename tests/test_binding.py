"""Binding plans to models: the layer container, op scopes, apply-time logging."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import swapkit
from swapkit.runtime.binding import BindError, bind, find_layers
from swapkit.runtime.scope import ScopeTracker
from tests.toys import SMALL, Block, ToyNet, llama, toy_config


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.h = nn.ModuleList(Block(8) for _ in range(3))
        self.heads = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for layer in self.transformer.h:
            x = layer(x)
        return x


def plan_for(layers, **sections):
    return swapkit.build_plan(swapkit.load_config(toy_config(layers, **sections)))


def test_dotted_path_and_auto_detection():
    model = Nested()
    assert find_layers(model, "transformer.h", 3)[0] == "transformer.h"
    assert find_layers(model, None, 3)[0] == "transformer.h"  # the only list of 3 repeated blocks
    with pytest.raises(BindError, match=r"several layer containers.*transformer\.h \(3 x Block\).*heads \(2 x Linear\)"):
        find_layers(model, None, 5)
    with pytest.raises(BindError, match=r"'transformer\.x': transformer has no child 'x'; children: h"):
        find_layers(model, "transformer.x", 3)
    with pytest.raises(BindError, match="is a Module; expected an nn.ModuleList"):
        find_layers(model, "transformer", 3)


def test_layer_count_must_match_num_layers():
    with pytest.raises(BindError, match=r"holds 3 layers but the config says model.model_config.num_layers: 4"):
        bind(ToyNet(layers=3), plan_for(4), "layers")


def test_layers_path_from_config():
    plan = swapkit.build_plan(swapkit.load_config(
        {"model": {"model_config": {"num_layers": 3, "layers_path": "transformer.h"}}}))
    assert bind(Nested(), plan).layers_path == "transformer.h"


def test_apply_logs_with_real_op_paths(caplog):
    caplog.set_level(logging.INFO, logger="swapkit")
    swapkit.apply(llama(), "configs/seed001_swap_op.yaml", layers="layers")
    messages = [r.getMessage() for r in caplog.records]
    assert "Set op_swap at layer 0: .attention, value=20" in messages
    assert "Set op_swap at layer 1: .attention, value=20, .feed_forward, value=15" in messages
    assert "Set op_swap at layer 3: .attention, value=10" in messages
    caplog.clear()
    swapkit.apply(llama(), "configs/seed001_swap_default.yaml", layers="layers")
    assert "Set op_swap at layer 2: attention.flash_attention, value=10" in [r.getMessage() for r in caplog.records]


def test_pattern_matching_nothing_in_any_layer_is_an_error():
    config = toy_config(4, swap_config={"swap": True, "op_swap": [
        {"op_name": "no_such_op", "backward_prefetch": 2, "layers": True}]})
    model = llama()
    with pytest.raises(swapkit.BindError) as info:
        swapkit.apply(model, config, layers="layers")
    assert str(info.value) == (
        "the config names op scopes this model does not have:\n  - op_swap pattern 'no_such_op' matches no "
        "sub-module in any layer of LlamaModel.layers; its layers' children are: attention, attention_norm, "
        "feed_forward, ffn_norm, hidden_dropout")
    assert not hasattr(model, "_swapkit_applied")  # nothing was installed: apply again works
    swapkit.apply(model, toy_config(4), layers="layers").remove()


@pytest.mark.parametrize("written, hint", [
    ("atention", "did you mean 'attention',"),
    ("attention.wq", r"Components of a pattern are separated by the two characters \. (a bare '.' is a regex "
                     r"wildcard inside one name): write 'attention\.wq'"),
])
def test_unmatched_pattern_error_suggests_real_names(written, hint):
    config = toy_config(4, recompute_config={"select_recompute": [written]})
    with pytest.raises(swapkit.BindError) as info:
        swapkit.apply(llama(), config, layers="layers")
    assert f"select_recompute pattern '{written}' matches no sub-module in any layer of LlamaModel.layers" \
        in str(info.value)
    assert hint in str(info.value)


def test_pattern_matching_some_layers_is_warned_once(caplog):
    caplog.set_level(logging.INFO, logger="swapkit")
    model = llama()
    del model.layers[2].feed_forward.w1  # layer 2 lacks the scope, the others have it
    config = toy_config(4, swap_config={"swap": True, "op_swap": [
        {"op_name": r"feed_forward\.w1", "backward_prefetch": 2, "layers": True}]})
    swapkit.apply(model, config, layers="layers")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["op_swap pattern " + repr(r"feed_forward\.w1") + " matches no sub-module in layer(s) [2]; "
                        "it has no effect there"]


def test_scope_tracker_innermost_swap_scope_wins_and_ops_inherit_layer_swap():
    config = toy_config(4, swap_config={"swap": True,
                                        "layer_swap": [{"backward_prefetch": 9, "layers": [1]}],
                                        "op_swap": [{"op_name": r"attention\.flash_attention",
                                                     "backward_prefetch": 2, "layers": [1, 2]}]})
    model = llama()
    binding = bind(model, swapkit.build_plan(swapkit.load_config(config)), "layers")
    tracker = ScopeTracker()
    tracker.install(binding)
    seen = []
    for layer in (1, 2):
        model.layers[layer].attention.flash_attention.register_forward_pre_hook(
            lambda *_: seen.append(tracker.top))
        model.layers[layer].feed_forward.register_forward_pre_hook(lambda *_: seen.append(tracker.top))
    with torch.no_grad():
        model(torch.zeros(1, SMALL.seq_length, dtype=torch.long))
    assert [(f.layer, f.path, f.prefetch) for f in seen] == [
        (1, "attention.flash_attention", 2), (1, "", 9),  # feed_forward inherits the layer swap
        (2, "attention.flash_attention", 2), (2, "", None)]
    assert tracker.stack == []
    tracker.remove()
