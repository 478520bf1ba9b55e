"""A user's own model: layer count inferred, presets by name, defaults that cannot bind are errors."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import swapkit
from tests.toys import ToyNet
from tests.user_models import TinyGPT


def test_default_swap_on_a_model_without_flash_attention_names_its_attention_scopes():
    with pytest.raises(swapkit.BindError) as info:
        swapkit.apply(TinyGPT(), {"swap_config": {"swap": True}})
    message = str(info.value)
    assert r"op_swap pattern '.*\.flash_attention' matches no sub-module in any layer of TinyGPT.blocks" in message
    assert "attention-like scopes found: attn" in message
    assert "Set model.model_config.preset to the model family, or write swap_config.op_swap: [{op_name: attn, " \
           "backward_prefetch: 1, layers: true}]" in message


class _NormNamedAfterAttention(nn.Module):
    """A Llama-style layer without a preset: its norm's name contains 'attention' (as HF Gemma's, OLMo2's)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.post_attention_layernorm = nn.LayerNorm(dim)
        self.self_attn = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_attention_layernorm(x + self.self_attn(x))


def test_the_default_swap_error_does_not_offer_a_norm_named_after_attention_as_the_attention_scope():
    model = nn.Sequential(nn.ModuleList(_NormNamedAfterAttention() for _ in range(2)))
    with pytest.raises(swapkit.BindError) as info:
        swapkit.apply(model, {"swap_config": {"swap": True}})
    message = str(info.value)
    assert "attention-like scopes found: self_attn." in message
    assert "write swap_config.op_swap: [{op_name: self_attn, backward_prefetch: 1, layers: true}]" in message


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


@pytest.mark.parametrize("swap, recompute, warned", [
    ({"layer_swap": [], "op_swap": []}, {}, "swap_config.layer_swap and op_swap are empty"),
    ({"op_swap": []}, {}, "swap_config.op_swap is empty"),
    ({"layer_swap": [], "op_swap": []}, {"recompute": [0, 1]}, None),  # the planner's recompute-only form
    ({"layer_swap": []}, {"recompute_granularity": "full", "recompute_method": "uniform",
                          "recompute_num_layers": 1}, None),
    ({}, {}, None),  # MindFormers' default op swap
    ({"layer_swap": [{"backward_prefetch": 1, "layers": True}], "op_swap": []}, {}, None),
])
def test_swap_on_with_nothing_to_swap_or_recompute_is_warned_at_load(swap, recompute, warned, caplog):
    """A config that changes nothing: swap on, every list written empty, no recompute (quality bar: never silence)."""
    caplog.set_level(logging.WARNING, logger="swapkit")
    config = swapkit.load_config({"model": {"model_config": {"num_layers": 2}}, "swap_config": {"swap": True, **swap},
                                  **({"recompute_config": recompute} if recompute else {})})
    messages = [r.getMessage() for r in caplog.records if "changes nothing" in r.getMessage()]
    if warned is None:
        assert messages == []
        return
    assert messages == [f"swap_config.swap is true but {warned} and nothing is recomputed: the config changes "
                        "nothing, every saved tensor stays on the device; list the layers or ops to swap (or leave "
                        "the lists out for MindFormers' default op swap)"]
    assert not any(layer.swaps or layer.recomputes for layer in swapkit.build_plan(config).layers)  # it is so


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


# ---------------------------------------------------------------- Note [Where a pattern was written]

def bind_error(config) -> list[str]:
    with pytest.raises(swapkit.BindError) as info:
        swapkit.apply(TinyGPT(), config)
    head, *problems = str(info.value).split("\n  - ")
    assert head == "the config names op scopes this model does not have:"
    return problems


CHILDREN = "its layers' children are: attn, ln_1, ln_2, mlp"


def test_default_select_recompute_on_an_own_model_says_what_to_write():
    assert bind_error({"recompute_config": {"select_recompute": True}}) == [
        "recompute_config.select_recompute: got true, which selects the default op patterns 'feed_forward\\.mul', "
        "'feed_forward\\.w1\\.activation\\.silu' (MindFormers' Llama names, which swapkit's built-in model has), and "
        f"they match no sub-module in any layer of TinyGPT.blocks; {CHILDREN}. Write an explicit op list instead, "
        "e.g. select_recompute: {mlp: true}, or set model.model_config.preset to the model family"]
    swapkit.apply(TinyGPT(), {"recompute_config": {"select_recompute": {"mlp": True}}}).remove()  # the fix binds


def test_default_select_comm_recompute_suggests_a_norm_child():
    (problem,) = bind_error({"recompute_config": {"select_comm_recompute": [1]}})
    assert problem.startswith("recompute_config.select_comm_recompute: got [1], which selects the default op "
                              "pattern '.*\\.norm' (")
    assert problem.endswith("e.g. select_comm_recompute: {ln_1: [1]}, or set model.model_config.preset to the "
                            "model family")
    swapkit.apply(TinyGPT(), {"recompute_config": {"select_comm_recompute": {"ln_1": [1]}}}).remove()


@pytest.mark.parametrize("written, key, value", [
    ({"recompute_granularity": "selective"}, "recompute_granularity", "'selective'"),
    ({"recompute_activations": True}, "recompute_activations", "true"),
    ({"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}, "recompute_modules", "['core_attn']"),
])
def test_megatron_selective_on_an_own_model_names_the_megatron_key(written, key, value):
    """The built-in scope of core_attn came from no key the user wrote: name theirs, not module_scopes."""
    assert bind_error({"recompute_config": written}) == [
        f"recompute_config.{key}: got {value}, so module 'core_attn' is recomputed at swapkit's built-in scope "
        "'attention\\.flash_attention' (the built-in model's name), and it matches no sub-module in any layer of "
        f"TinyGPT.blocks; {CHILDREN}. Map the module to this model's scope: recompute_config.module_scopes: "
        "{core_attn: attn}, or set model.model_config.preset to the model family"]
    fixed = {**written, "module_scopes": {"core_attn": "attn"}}
    swapkit.apply(TinyGPT(), {"recompute_config": fixed}).remove()


def test_a_written_module_scope_is_blamed_where_it_was_written():
    (problem,) = bind_error({"recompute_config": {"recompute_granularity": "selective", "recompute_modules": ["mlp"],
                                                  "module_scopes": {"mlp": "ffn"}}})
    assert problem.startswith("recompute_config.module_scopes.mlp: recompute_config.module_scopes pattern 'ffn' "
                              f"matches no sub-module in any layer of TinyGPT.blocks; {CHILDREN}. Write one of these "
                              "names, or a path below one with \\. between the names (e.g. 'attn\\.out_proj')")


def test_an_op_name_in_a_list_is_blamed_at_its_position():
    config = {"swap_config": {"swap": True, "op_swap": [
        {"op_name": "mlp", "backward_prefetch": 1, "layers": [0]},
        {"op_name": ["mlp", "atn"], "backward_prefetch": 1, "layers": True}]}}
    assert bind_error(config) == [
        "swap_config.op_swap[1].op_name[1]: op_swap pattern 'atn' matches no sub-module in any layer of "
        "TinyGPT.blocks; did you mean 'attn'? Replace 'atn' with 'attn'"]


def test_two_models_in_one_step_take_one_session_over_both_containers():
    """A second session cannot be entered inside the first (its hooks would replace the first's); the error
    now says how to swap both models: one session over a module holding them, layers naming each container."""
    torch.manual_seed(0)
    first, second = TinyGPT(), TinyGPT()
    plain = [copy.deepcopy(first), copy.deepcopy(second)]
    config = {"runtime": {"min_offload_bytes": 0}, "swap_config": {"swap": True, "op_swap": [
        {"op_name": "mlp", "backward_prefetch": 1, "layers": True}]}}
    one, two = swapkit.apply(first, config), swapkit.apply(second, config)
    with pytest.raises(RuntimeError, match=r"To swap several models in one step, apply swapkit once to a module "
                                           r"holding them all, with layers=\[\.\.\.\]"):
        with one, two:
            pass
    one.remove()
    two.remove()
    both = torch.nn.ModuleDict({"first": first, "second": second})
    session = swapkit.apply(both, config, layers=["first.blocks", "second.blocks"])
    tokens = torch.randint(0, 64, (2, 8))
    with session:
        (first(tokens).square().mean() + second(tokens).square().mean()).backward()
    (plain[0](tokens).square().mean() + plain[1](tokens).square().mean()).backward()
    for model, reference in zip((first, second), plain):
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            assert torch.equal(p.grad, q.grad), name
    assert set(session.stats.offloaded_by_scope) == {f"layer {i}: mlp" for i in range(6)}
    session.remove()


def test_apply_without_a_config_says_what_to_pass():
    """``apply(model, None)`` was "the config is empty; expected ... num_layers", which apply counts itself."""
    model = ToyNet(layers=2)
    with pytest.raises(TypeError, match=r"config is None; pass a config dict .*\{\} applies nothing and only accounts"):
        swapkit.apply(model, None)
    swapkit.apply(model, {}).remove()  # what the message offers works
