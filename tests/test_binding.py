"""Binding plans to models: the layer container, op scopes, apply-time logging."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import swapkit
from swapkit.runtime.binding import BindError, bind, find_layers
from swapkit.runtime.scope import ScopeTracker
from tests.toys import SMALL, Block, ToyNet, layer_swap, llama, toy_config


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
    assert find_layers(model, "transformer.h")[0] == "transformer.h"
    # several candidates are an error listing them
    with pytest.raises(BindError, match=r"several layer containers.*transformer\.h \(3 x Block\).*heads \(2 x Linear\)"):
        find_layers(model, None)
    with pytest.raises(BindError) as info:
        find_layers(model, None)
    assert str(info.value).endswith(  # what to write, in the API and in YAML; no internal values
        "say which hold the layers, in order. In Python: pass layers=['transformer.h', 'heads'] (or "
        "layers='transformer.h' for one) to swapkit.apply. In a YAML config: set model.model_config.layers_path: "
        "[transformer.h, heads] (swapkit plan also takes --layers transformer.h for one container)")
    assert "None" not in str(info.value)
    del model.heads
    assert find_layers(model, None)[0] == "transformer.h"
    with pytest.raises(BindError, match=r"'transformer\.x': transformer has no child 'x'; children: h"):
        find_layers(model, "transformer.x")
    with pytest.raises(BindError, match="is a Module; expected an nn.ModuleList"):
        find_layers(model, "transformer")


def test_an_empty_layers_path_names_the_model_itself_never_an_auto_detected_container():
    """layers='' silently auto-detected whatever container the model had."""
    with pytest.raises(BindError, match=r"layers path '' \(the model itself\) is a ToyNet; expected an nn.ModuleList"):
        swapkit.apply(ToyNet(3, dim=8), toy_config(3, **layer_swap(1)), layers="")
    blocks = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])  # a model that is its own layer container
    session = swapkit.apply(blocks, toy_config(3, **layer_swap(1)), layers="")
    assert [layer.module for layer in session.binding.layers] == list(blocks)
    session.remove()


class EmptyLayers(nn.Module):
    """A model whose layer container holds no blocks (a factory that built none)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.layers = nn.ModuleList()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(x)


@pytest.mark.parametrize("sections", [{}, {"swap_config": {"swap": True}}, {"recompute_config": {"recompute": True}}])
def test_an_empty_layer_container_is_an_error_not_a_plan_of_zero_layers(sections):
    """Counted from the model, 0 layers gave a session that swapped and recomputed nothing, silently
    (Note [An empty layer container])."""
    with pytest.raises(BindError, match=r"EmptyLayers\.layers holds no layers, so nothing could be swapped or "
                                        r"recomputed; name the container that holds the model's layers"):
        swapkit.apply(EmptyLayers(), sections, layers="layers")


def test_auto_detection_that_finds_only_an_empty_container_says_so():
    """It said only 'found no ... of repeated layers; pass layers=...', and layers='layers' then gave 0 layers."""
    with pytest.raises(BindError, match=r"repeated layers in EmptyLayers \(layers is empty: a model built with no "
                                        r"layers has nothing to swap or recompute\); pass layers="):
        swapkit.apply(EmptyLayers(), {})


class TitanStyle(nn.Module):
    """torchtitan's models keep their layers in an ``nn.ModuleDict`` keyed by layer id, so that a
    pipeline split (which deletes keys) keeps every parameter's name."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block(16) for i in range(3)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


@pytest.mark.parametrize("layers", [None, "layers"])
def test_a_module_dict_of_layers_binds_in_its_order(layers, caplog):
    caplog.set_level(logging.INFO, logger="swapkit")
    torch.manual_seed(0)
    model, reference = TitanStyle(), TitanStyle()
    reference.load_state_dict(model.state_dict())
    config = {"swap_config": {"swap": True, "layer_swap": {"backward_prefetch": 1, "layers": [0, 1]}},
              "runtime": {"min_offload_bytes": 0}}
    session = swapkit.apply(model, config, layers=layers)
    assert [b.module for b in session.binding.layers] == list(model.layers.values())
    assert "Bound layers: layers (layers 0-2: 3 x Block)" in caplog.messages
    x = torch.randn(4, 16)
    with session:
        model(x).sum().backward()
    reference(x).sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
    scopes = set(session.stats.offloaded_by_scope)
    assert "layer 0" in scopes and scopes <= {"layer 0", "layer 1"}
    session.remove()
    assert list(model.state_dict()) == list(reference.state_dict())
    model.heads = nn.ModuleList(Block(16) for _ in range(2))
    with pytest.raises(BindError, match=r"several layer containers in TitanStyle: layers \(3 x Block\), "
                                        r"heads \(2 x Block\)"):
        find_layers(model, None)


class Mixer(nn.Module):
    """A hybrid model's other block type (a state-space block beside attention ones)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x))


class Hybrid(nn.Module):
    """Jamba-style: the layers are of two classes in one list; two identical heads beside them."""

    def __init__(self, mixed_width: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(mixed_width), Mixer(mixed_width), Block(mixed_width), Mixer(mixed_width)])
        self.heads = nn.ModuleList([nn.Linear(mixed_width, 2), nn.Linear(mixed_width, 2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return sum(head(x) for head in self.heads).sum()


def test_a_hybrid_models_layers_are_not_silently_replaced_by_a_smaller_identical_list():
    # Note [Hybrid models]: the two heads are the only list of identical blocks, but the mixed list holds more
    with pytest.raises(BindError) as info:
        find_layers(Hybrid(), None)
    message = str(info.value)
    assert "heads (2 x Linear, 68 parameters)" in message
    assert "layers (4 blocks of mixed types: Block, Mixer" in message
    assert "layers='layers' (or layers='heads' to keep the guess)" in message
    assert "model.model_config.layers_path" in message
    # an explicit path binds either, and swap on the mixed layers is exact
    assert find_layers(Hybrid(), "heads")[0] == "heads"
    torch.manual_seed(0)
    model, reference = Hybrid(), Hybrid()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 16)
    reference(x).backward()
    config = {"model": {"model_config": {"num_layers": 4}}, "runtime": {"min_offload_bytes": 0},
              "swap_config": {"swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": True}]}}
    session = swapkit.apply(model, config, layers="layers")
    with session:
        model(x).backward()
    assert session.stats.offloaded_bytes > 0
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_a_small_mixed_list_beside_the_layers_does_not_stop_auto_detection():
    model = Hybrid()
    model.layers = nn.ModuleList([Block(16) for _ in range(3)])
    model.extras = nn.ModuleList([nn.Linear(16, 2), nn.Tanh()])  # fewer parameters than the layers
    del model.heads
    assert find_layers(model, None)[0] == "layers"


def test_layer_count_must_match_num_layers():
    with pytest.raises(BindError, match=r"holds 3 layers but the config says model.model_config.num_layers: 4"):
        bind(ToyNet(layers=3), plan_for(4), "layers")


def test_layers_path_from_config():
    plan = swapkit.build_plan(swapkit.load_config(
        {"model": {"model_config": {"num_layers": 3, "layers_path": "transformer.h"}}}))
    assert bind(Nested(), plan).layers_path == "transformer.h"


def test_several_containers_number_layers_in_the_order_given(caplog):
    model = Nested()
    model.heads = nn.ModuleList(Block(8) for _ in range(2))
    caplog.set_level(logging.INFO, logger="swapkit")
    plan = swapkit.build_plan(swapkit.load_config(
        {"model": {"model_config": {"num_layers": 5, "layers_path": ["heads", "transformer.h"]}}}))
    binding = bind(model, plan)
    assert binding.layers_paths == ("heads", "transformer.h")
    assert [b.module for b in binding.layers] == [*model.heads, *model.transformer.h]
    assert "Bound layers: heads (layers 0-1: 2 x Block), transformer.h (layers 2-4: 3 x Block)" in caplog.messages
    with pytest.raises(BindError, match=r"Nested\.heads \+ transformer\.h holds 5 layers but the config says "
                                        r"model\.model_config\.num_layers: 4"):
        bind(model, plan_for(4), ["heads", "transformer.h"])
    with pytest.raises(BindError, match=r"expected distinct container paths"):
        bind(model, plan, ["heads", "heads"])
    with pytest.raises(BindError, match=r"layers=\[\]: expected distinct container paths"):
        bind(model, plan, [])


def test_auto_detection_ignores_lists_inside_a_layer():
    model = ToyNet(layers=3)
    for layer in model.layers:
        layer.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
    assert find_layers(model, None)[0] == "layers"


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
        "the config names op scopes this model does not have:\n  - swap_config.op_swap[0].op_name: op_swap pattern "
        "'no_such_op' matches no sub-module in any layer of LlamaModel.layers; its layers' children are: attention, "
        "attention_norm, feed_forward, ffn_norm, hidden_dropout. Write one of these names, or a path below one with "
        "\\. between the names (e.g. 'attention\\.flash_attention')")
    assert not hasattr(model, "_swapkit_applied")  # nothing was installed: apply again works
    swapkit.apply(model, toy_config(4), layers="layers").remove()


@pytest.mark.parametrize("written, hint", [
    ("atention", "did you mean 'attention'?"),  # only the close one: not attention_norm as well
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


@pytest.mark.parametrize("sections, path, written", [
    # full recompute wins on every layer: the select pattern applies to none, and its typo was never checked
    ({"recompute_config": {"recompute": True, "select_recompute": {r"feed_forward\.w9": True}}},
     r"recompute_config.select_recompute.feed_forward\.w9", r"feed_forward\.w9"),
    ({"recompute_config": {"select_comm_recompute": {"atention_norm": [0]}}},  # a count of 0: no layer
     "recompute_config.select_comm_recompute.atention_norm", "atention_norm"),
    ({"swap_config": {"swap": False, "op_swap": [{"op_name": "atention", "backward_prefetch": 2, "layers": [0]}]}},
     "swap_config.op_swap[0].op_name", "atention"),  # the swap section is validated even when swap is false
])
def test_a_written_pattern_is_checked_even_where_it_applies_to_no_layer(sections, path, written):
    """DESIGN §3: a pattern that matches nothing in any bound layer is an error, whatever layers it applies to."""
    with pytest.raises(swapkit.BindError) as info:
        swapkit.apply(llama(), toy_config(4, **sections), layers="layers")
    assert f"{path}: " in str(info.value)
    assert f"pattern '{written}' matches no sub-module in any layer of LlamaModel.layers" in str(info.value)


def test_a_default_pattern_that_applies_to_no_layer_is_not_an_error():
    """Counts that select no layer turn the default patterns off (``select_recompute: [0]``): nothing was written
    that a model must have."""
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(2)])
    config = {"model": {"model_config": {"num_layers": 2}},
              "recompute_config": {"select_recompute": [0], "select_comm_recompute": False}}
    swapkit.apply(model, config, layers="").remove()


def test_preset_on_the_builtin_model_names_the_written_pattern():
    """The llama preset turns the default swap op into HF Llama's self_attn, which the built-in model
    (MindFormers' names) does not have: the error says where 'self_attn' came from and what to do."""
    config = toy_config(4, model={"model_config": {"num_layers": 4, "preset": "llama"}},
                        swap_config={"swap": True})
    with pytest.raises(swapkit.BindError) as info:
        swapkit.apply(llama(), config, layers="layers")
    assert ("op_swap pattern 'self_attn' matches no sub-module in any layer of LlamaModel.layers. The llama model preset "
            "translated '.*\\.flash_attention' (swapkit's default swap op for "
            "swap_config.swap: true) to 'self_attn', but '.*\\.flash_attention' matches this model's layers as "
            "written: the model already uses MindFormers' scope names (as swapkit's built-in model does) and needs "
            "no preset: remove model.model_config.preset") in str(info.value)


def test_pattern_matching_some_layers_is_warned_once(caplog):
    caplog.set_level(logging.INFO, logger="swapkit")
    model = llama()
    del model.layers[2].feed_forward.w1  # layer 2 lacks the scope, the others have it
    config = toy_config(4, swap_config={"swap": True, "op_swap": [
        {"op_name": r"feed_forward\.w1", "backward_prefetch": 2, "layers": True}]})
    swapkit.apply(model, config, layers="layers")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [r"op_swap pattern 'feed_forward\.w1' matches no sub-module in layer(s) [2]; "  # as written
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


def test_one_module_at_several_layer_positions_is_warned(caplog):
    """Note [One module at several layer positions]: before, the merged settings were silent (here the
    layer swap of layer 1 and the recompute of layer 0 covered every call of the shared block)."""
    model = ToyNet(layers=1)
    shared, other = model.layers[0], Block(16)
    model.layers = nn.ModuleList([shared, other, shared])
    caplog.set_level(logging.WARNING, logger="swapkit")
    swapkit.apply(model, toy_config(3, swap_config={"swap": True, "layer_swap": [
        {"backward_prefetch": 1, "layers": [0]}]}))
    (message,) = [m for m in caplog.messages if "several positions" in m]
    assert message.startswith("swapkit: layers 0, 2 of ToyNet are one Block object (a module at several positions)")
    assert ("gets the layer swap configured for layer 2 (none: the layer swap configured for layer 0 has no effect), "
            "and the op swaps and the recompute configured for any of these layers") in message


def test_a_swap_at_an_earlier_position_of_a_shared_module_names_the_shared_module(caplog):
    """ALBERT with a swap at a middle position only: every call saves under the last position's frame, which
    swaps nothing. Before, the binding warning said every call got "the swap configured for layer 2" (which
    has none) and the step's report blamed something else: "the tensors are saved elsewhere, or something else
    checkpoints the region ... stop the other checkpointing"."""
    model = ToyNet(layers=1)
    model.layers = nn.ModuleList([model.layers[0]] * 3)
    caplog.set_level(logging.WARNING, logger="swapkit")
    session = swapkit.apply(model, toy_config(3, **layer_swap(1, layers=[1])))
    with session:
        model(torch.randn(4, 16)).sum().backward()
    assert session.stats.offloaded_bytes == 0
    (bound,) = [m for m in caplog.messages if "several positions" in m and "Block object" in m]
    assert "the layer swap configured for layer 2 (none: the layer swap configured for layer 1 has no effect)" in bound
    (unused,) = [m for m in caplog.messages if "saw no saved tensor" in m]
    assert unused.startswith("swapkit: layer swap at layer 1 saw no saved tensor in step 1: its layer is one module "
                             "object with layers 0, 1, 2 (a module at several positions), so every call of it saves "
                             "under the swap settings of layer 2")
    assert "Configure the same swap for every position of the shared module" in unused
    assert "checkpoint" not in unused


def op_swap_at_a_middle_position(op_name: str, block: type = Block) -> swapkit.SwapSession:
    """One ``block`` at layer positions 0-2, an op swap of ``op_name`` at layer 1 only: its session after one step."""
    model = ToyNet(layers=1, block=block)
    model.layers = nn.ModuleList([model.layers[0]] * 3)
    config = toy_config(3, swap_config={"swap": True, "op_swap": [{"layers": [1], "op_name": op_name,
                                                                   "backward_prefetch": 1}]},
                        runtime={"min_offload_bytes": 0})
    session = swapkit.apply(model, config)
    with session:
        model(torch.randn(4, 16)).sum().backward()
    return session


def test_an_op_swap_at_an_earlier_position_of_a_shared_module_is_not_called_idle(caplog):
    """Note [One module at several layer positions]: an op swap at an earlier position of a shared module pushes
    its op frame inside every call (no later position configures that op), so it swaps on every call. Only an
    earlier position's layer swap is shadowed by the last position's layer frame; the binding warning said the
    op swap "has no effect" while it offloaded under 'layer 1: act'."""
    caplog.set_level(logging.WARNING, logger="swapkit")
    session = op_swap_at_a_middle_position("act")
    assert session.stats.offloaded_by_scope.get("layer 1: act", 0) > 0
    (bound,) = [m for m in caplog.messages if "several positions" in m and "Block object" in m]
    assert "no effect" not in bound
    assert not [m for m in caplog.messages if "saw no saved tensor" in m]
    session.remove()


class _BlockWithIdentity(Block):
    """A Block with an op scope that saves nothing (``skip``)."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.skip = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.skip(super().forward(x))


def test_an_unused_op_swap_at_a_shared_modules_earlier_position_keeps_its_own_cause(caplog):
    """swapkit.runtime.overrides Note [Swaps nobody reports]: an op swap at an earlier position of a shared module
    is not shadowed by the last position (its op frame is pushed inside every call), so when it sees no tensor the
    cause is its own (nothing inside saved one), not the shared module, whose fix (the same swap everywhere)
    would change nothing."""
    caplog.set_level(logging.WARNING, logger="swapkit")
    session = op_swap_at_a_middle_position("skip", _BlockWithIdentity)
    (unused,) = [m for m in caplog.messages if "saw no saved tensor" in m]
    assert unused.startswith("swapkit: op swap at layer 1: skip saw no saved tensor in step 1: nothing inside it")
    assert "several positions" not in unused and "Configure the same swap" not in unused
    session.remove()


def test_a_swap_on_every_position_of_a_shared_module_is_not_reported_unused(caplog):
    """Note [One module at several layer positions]: with the same swap at every position (the advice of
    the warning above), every call's saves land in the last position's frame and are swapped; the earlier
    positions' swaps were reported as moving nothing ("the swap has no effect")."""
    model = ToyNet(layers=1)
    model.layers = nn.ModuleList([model.layers[0]] * 3)
    reference = copy.deepcopy(model)
    session = swapkit.apply(model, toy_config(3, **layer_swap(1)))
    caplog.set_level(logging.WARNING, logger="swapkit")
    x = torch.randn(4, 16)
    with session:
        model(x).sum().backward()
    reference(x).sum().backward()
    assert torch.equal(model.layers[0].lin.weight.grad, reference.layers[0].lin.weight.grad)
    assert session.stats.offloaded_bytes > 0 and session.stats.unused_swaps == []
    assert not [m for m in caplog.messages if "saw no saved tensor" in m]



def shared_at_0_and_2() -> ToyNet:
    torch.manual_seed(0)
    model = ToyNet(layers=1)
    model.layers = nn.ModuleList([model.layers[0], Block(16), model.layers[0]])
    return model


@pytest.mark.parametrize("num_layers", [2, 3])
def test_a_uniform_unit_holding_a_shared_module_is_refused_at_apply(num_layers):
    """Note [One module at several layer positions]: a unit replaces its members' forwards with the unit's
    head and pass-throughs, which the other positions of a shared module then ran: [a, b, a] in units of 2
    gave another loss and other gradients, silently, and [a, a, a] in one unit recomputed nothing."""
    model = shared_at_0_and_2()
    recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": num_layers}
    with pytest.raises(BindError, match=r"uniform unit of layers 0-\d: layer 0 is the Block object of "
                                        r"layers 0, 2 .*recompute_method: block"):
        swapkit.apply(model, toy_config(3, recompute_config=recompute))
    assert "forward" not in model.layers[0].__dict__  # nothing was left wrapped


@pytest.mark.parametrize("recompute, counted", [
    ({"recompute": True}, {"layer 0": 2, "layer 1": 1}),
    ({"select_recompute": ["lin"]}, {"layer 0: lin": 2, "layer 1: lin": 1}),
    ({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 3},
     {"layer 0": 2, "layer 1": 1})])
def test_a_shared_module_is_wrapped_once_and_its_recomputes_counted_once(recompute, counted):
    """Before, the shared block's forward was wrapped once per position (checkpoints nested three deep on
    ALBERT) and every call was counted at each position: {'layer 0': 2, 'layer 2': 2, 'layer 1': 1}."""
    model = shared_at_0_and_2()
    reference = copy.deepcopy(model)
    session = swapkit.apply(model, toy_config(3, recompute_config=recompute))
    x = torch.randn(4, 16, requires_grad=True)
    with session:
        model(x).sum().backward()
    reference(x.detach().requires_grad_()).sum().backward()
    assert session.stats.recomputed_by_scope == counted
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert len(session.recompute.wrapped_modules()) == 2  # the shared block (or its lin) and layer 1's
    session.remove()
    assert all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("config, scope", [
    ({"swap_config": {"swap": True, "op_swap": [{"op_name": "lin", "backward_prefetch": 1, "layers": [1]}]},
      "runtime": {"min_offload_bytes": 0}}, "lin of layer 1"),
    ({"recompute_config": {"select_recompute": {"lin": [1]}}}, "lin of layer 0")])
def test_an_op_scope_shared_by_distinct_layers_is_warned(config, scope, caplog):
    """Note [One module at several layer positions]: a sub-module shared between distinct layers (Zamba's
    shared attention block) carries the hooks of the layer that configures it, so its calls from the other
    layers were swapped (here all three, counted under layer 1) or recomputed too, and nothing said so."""
    model = ToyNet(layers=3)
    for layer in model.layers[1:]:
        layer.lin = model.layers[0].lin
    caplog.set_level(logging.WARNING, logger="swapkit")
    session = swapkit.apply(model, toy_config(3, **config))
    (message,) = [m for m in caplog.messages if "shared between layers" in m]
    assert message.startswith(f"swapkit: op scope {scope} is one Linear object with layers 0, 1, 2's ")
    if "swap_config" in config:
        with session:
            model(torch.randn(4, 16)).sum().backward()
        # the model's input, saved by layer 0's call of the shared lin (the other layers' inputs were saved
        # first, and kept, by the sigmoid before them): layer 0 got layer 1's swap
        assert session.stats.offloaded_by_scope == {"layer 1: lin": 4 * 16 * 4}

def stage_config(**sections) -> dict:
    """Two stages of two layers each (layers 0-1 on stage 0)."""
    config = toy_config(4, **sections)
    config.setdefault("parallel_config", {})["pipeline_stage"] = 2
    return config


def test_a_pipeline_stage_with_one_module_at_two_positions_is_warned(caplog):
    """Note [One module at several layer positions] holds for a stage's chunk as for a whole model; a stage
    bound without the check said nothing (bind_stage skipped it)."""
    chunk = ToyNet(layers=1)
    chunk.layers = nn.ModuleList([chunk.layers[0]] * 2)
    caplog.set_level(logging.WARNING, logger="swapkit")
    swapkit.apply(chunk, stage_config(swap_config={"swap": True, "layer_swap": [{"backward_prefetch": 1,
                                                                                 "layers": [0]}]}),
                  layers="layers", stage=0)
    (message,) = [m for m in caplog.messages if "several positions" in m]
    assert message.startswith("swapkit: layers 0, 1 of pipeline stage 0 are one Block object")


def test_a_pipeline_stage_with_a_uniform_unit_over_a_shared_module_is_refused():
    """Note [One module at several layer positions]: stage 1 holds global layers 2-3, one module."""
    chunk = ToyNet(layers=1)
    chunk.layers = nn.ModuleList([chunk.layers[0]] * 2)
    recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2}
    with pytest.raises(BindError, match=r"uniform unit of layers 2-3: layer 2 is the Block object of layers 2, 3 "):
        swapkit.apply(chunk, stage_config(recompute_config=recompute), layers="layers", stage=1)
    assert "forward" not in chunk.layers[0].__dict__


def test_an_op_scope_shared_across_a_stages_chunks_is_warned(caplog):
    """Two interleaved chunks of one stage sharing a sub-module: the scope check runs over the stage's
    layers with their global indices (stage 0 of 2 with 2 chunks holds global layers 0 and 2)."""
    chunks = [ToyNet(layers=1), ToyNet(layers=1)]
    chunks[1].layers[0].lin = chunks[0].layers[0].lin
    config = stage_config(swap_config={"swap": True, "op_swap": [{"op_name": "lin", "backward_prefetch": 1,
                                                                  "layers": [2]}]})
    config["model"]["model_config"]["pp_interleave_num"] = 2
    caplog.set_level(logging.WARNING, logger="swapkit")
    swapkit.apply(chunks, config, layers="layers", stage=0)
    (message,) = [m for m in caplog.messages if "shared between layers" in m]
    assert message.startswith("swapkit: op scope lin of layer 2 is one Linear object with layers 0, 2's ")


def test_distinct_layers_are_not_warned(caplog):
    caplog.set_level(logging.WARNING, logger="swapkit")
    swapkit.apply(ToyNet(layers=3), toy_config(3))
    assert not [m for m in caplog.messages if "several positions" in m]


@pytest.mark.parametrize("layers, shown", [(3, "3"), (nn.ModuleList(), "<ModuleList>"), (["layers", 1], "['layers', 1]")])
def test_a_layers_argument_that_is_no_path_is_a_clear_bind_error(layers, shown):
    """Before: TypeError "'int' object is not iterable", or a module's whole repr."""
    with pytest.raises(BindError) as info:
        swapkit.apply(ToyNet(layers=3), toy_config(3), layers=layers)
    assert str(info.value).startswith(f"layers={shown}: expected the dotted path of the layer container")


@pytest.mark.parametrize("num_layers", [None, 3])
def test_a_wrong_layers_path_in_the_config_names_its_key(num_layers):
    config = {"model": {"model_config": {"num_layers": num_layers, "layers_path": "blocks"}}}
    with pytest.raises(BindError) as info:
        swapkit.apply(ToyNet(layers=3), config)
    assert str(info.value) == ("model.model_config.layers_path: layers path 'blocks': ToyNet has no child 'blocks'; "
                               "children: layers")


@pytest.mark.parametrize("model, config, shown", [
    (toy_config(3), ToyNet(layers=3), "dict"),  # the arguments swapped
    ("llama", toy_config(3), "str"),
])
def test_a_model_that_is_no_module_is_a_clear_bind_error(model, config, shown):
    """Before: 'got dict of chunk modules without stage=', as if a pipeline stage's chunks were meant."""
    with pytest.raises(BindError) as info:
        swapkit.apply(model, config)
    assert str(info.value) == (f"model: got {shown}; expected the nn.Module to apply swapkit to, as "
                               "swapkit.apply(model, config)")


def test_chunk_modules_without_a_stage_still_name_stage():
    with pytest.raises(BindError, match="got list of chunk modules without stage="):
        swapkit.apply([ToyNet(layers=3)], toy_config(3))


def test_a_stage_without_num_layers_says_the_stage_cannot_count_them():
    """Before: '... or pass the model to swapkit.apply, which counts the layers', to a user who had."""
    with pytest.raises(swapkit.ConfigError) as info:
        swapkit.apply(ToyNet(layers=3), {"swap_config": {"swap": True}}, layers="layers", stage=0)
    assert str(info.value).endswith(
        "model.model_config.num_layers: missing; with stage=, swapkit.apply binds one pipeline stage's chunks and "
        "cannot count the whole model's layers from them: write the whole model's layer count")


class CausalLM(nn.Module):
    """A Hugging Face causal LM's shape: the layers sit at ``model.layers``, not ``layers``."""

    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(Block(8) for _ in range(2))
        self.lm_head = nn.Linear(8, 8)


@pytest.mark.parametrize("path, start", [
    ("layers", "layers path 'layers': CausalLM has no child 'layers'; children: model, lm_head"),
    ("model", "layers path 'model' is a Module; expected an nn.ModuleList"),
    ("model.layers.0", "layers path 'model.layers.0' is a Block; expected an nn.ModuleList"),
    ("lm_head", "layers path 'lm_head' is a Linear; expected an nn.ModuleList"),
])
def test_a_wrong_layers_path_names_the_containers_the_model_has(path, start):
    """A new user wrote layers='layers' for a Hugging Face model; the error listed only the root's children."""
    with pytest.raises(BindError) as info:
        swapkit.apply(CausalLM(), toy_config(2), layers=path)
    assert str(info.value).startswith(start)
    assert str(info.value).endswith("; did you mean 'model.layers' (the model's list of repeated blocks)?")


def test_a_wrong_layers_path_beside_the_container_names_no_container_twice():
    with pytest.raises(BindError) as info:
        swapkit.apply(CausalLM(), toy_config(2), layers="model.layer")
    assert str(info.value) == "layers path 'model.layer': model has no child 'layer'; children: layers"
