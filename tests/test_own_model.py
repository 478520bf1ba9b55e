"""A user's own model: layer count inferred, presets by name, defaults that cannot bind are errors."""
from __future__ import annotations

import copy
import logging

import pytest
import torch

import swapkit
from tests.user_models import TinyGPT


def test_default_swap_on_a_model_without_flash_attention_names_its_attention_scopes():
    with pytest.raises(swapkit.BindError) as info:
        swapkit.apply(TinyGPT(), {"swap_config": {"swap": True}})
    message = str(info.value)
    assert r"op_swap pattern '.*\.flash_attention' matches no sub-module in any layer of TinyGPT.blocks" in message
    assert "attention-like scopes found: attn" in message
    assert "Set model.model_config.preset to the model family, or write swap_config.op_swap: [{op_name: attn, " \
           "backward_prefetch: 1, layers: true}]" in message


def test_a_preset_by_name_makes_the_defaults_and_mindformers_names_work(caplog):
    caplog.set_level(logging.INFO, logger="swapkit")
    torch.manual_seed(0)
    model = TinyGPT()
    plain = copy.deepcopy(model)
    tokens = torch.randint(0, 64, (2, 8))
    plain(tokens).square().mean().backward()
    config = {"model": {"model_config": {"preset": "gpt2"}}, "runtime": {"min_offload_bytes": 0},
              "swap_config": {"swap": True, "op_swap": [
                  {"op_name": ["attention", "feed_forward"], "backward_prefetch": 2, "layers": True}]}}
    session = swapkit.apply(model, config)  # the same names as for the built-in model / MindFormers
    with session:
        model(tokens).square().mean().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert set(session.stats.offloaded_by_scope) == {f"layer {i}: {s}" for i in range(3) for s in ("attn", "mlp")}
    messages = [r.getMessage() for r in caplog.records]
    assert "model.model_config.num_layers not given: TinyGPT.blocks holds 3 layers" in messages
    assert "model preset gpt2 (model.model_config.preset)" in messages
    assert "preset gpt2: 'attention' -> 'attn'" in messages
    session.remove()


def test_swap_entries_while_swap_is_off_are_warned_at_load(caplog):
    caplog.set_level(logging.WARNING, logger="swapkit")
    swapkit.load_config({"swap_config": {"swap": False, "layer_swap": [{"backward_prefetch": 1, "layers": True}],
                                         "op_swap": [{"op_name": "attn", "backward_prefetch": 1, "layers": True}]}})
    assert [r.getMessage() for r in caplog.records] == [
        "swap_config.layer_swap and op_swap are validated but inactive because swap_config.swap is false; "
        "set swap_config.swap: true to use them"]


def test_flipping_swap_on_the_command_line_shows_both_readings(caplog, tmp_path):
    caplog.set_level(logging.WARNING, logger="swapkit")
    path = tmp_path / "c.yaml"
    path.write_text("model: {model_config: {num_layers: 4}}\nparallel_config: {pipeline_stage: 2}\n"
                    "recompute_config: {recompute: [1, 1]}\n")
    config = swapkit.load_config(path, ["swap_config.swap=true"])
    assert [layer.full for layer in swapkit.build_plan(config).layers] == [False, True, False, False]
    assert [r.getMessage() for r in caplog.records] == [
        "swap_config.swap is on (the file says off), which changes what recompute_config.recompute: [1, 1] means: "
        "with swap off, per-stage counts selecting layers [0, 2]; with swap on, global layer indices selecting "
        "layers [1]; now in effect: swap on"]
    caplog.clear()
    swapkit.load_config(path, ["swap_config.swap=false"])  # no flip: no warning
    assert caplog.records == []


def test_swapkit_train_needs_num_layers_for_the_builtin_model(tmp_path, capsys):
    from swapkit.cli import main

    path = tmp_path / "c.yaml"
    path.write_text("swap_config: {swap: true}\n")
    assert main(["train", str(path), "--steps", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "model.model_config.num_layers: missing; give the layer count" in err
