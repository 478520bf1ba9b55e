"""``pickle`` / ``torch.save`` of a model swapkit was applied to gives the plain model, and leaves the original alone.

swapkit.runtime.detach Note [Copies and pickles of a model swapkit was applied to].
"""
from __future__ import annotations

import copy
import functools
import io
import pickle

import pytest
import torch

import swapkit
from swapkit.distributed.pipeline import build_stage_chunks
from swapkit.runtime.detach import DETACHED, AttachedForward, AttachedHook
from tests.pipeline_utils import pipeline_config
from tests.toys import (ToyNet, assert_grads_equal, grads, layer_swap, llama, llama_batch, llama_step, lm_loss,
                         toy_config)

# layer swap, op swap, full recompute and select recompute on the built-in model
MINDFORMERS = toy_config(4, recompute_config={"recompute": [0], "select_recompute": {r"feed_forward\.mul": [1]}},
                         swap_config={"swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": [2, 3]}],
                                      "op_swap": [{"op_name": "attention", "backward_prefetch": 1, "layers": [1]}]},
                         runtime={"min_offload_bytes": 0})
# uniform units: the first layer's wrapper runs the unit, the others are pass-throughs (nothing left to swap)
MEGATRON = toy_config(4, recompute_config={"recompute_granularity": "full", "recompute_method": "uniform",
                                           "recompute_num_layers": 2})


@pytest.fixture(autouse=True, scope="module")
def _one_thread_here(one_thread):
    """Tiny matrices in this file (conftest's ``one_thread``)."""


def pickled(model):
    return pickle.loads(pickle.dumps(model))


def saved(model, tmp_path):
    path = tmp_path / "model.pt"
    torch.save(model, path)
    return torch.load(path, weights_only=False)


def swapkit_left(model) -> list[str]:
    """Everything of swapkit a model carries: hook entries, instance forwards, swapkit objects in ``__dict__``."""
    left = []
    for name, module in model.named_modules():
        left += [f"{name or 'model'}.{key}" for key, value in module.__dict__.items()
                 if ("hook" in key and isinstance(value, dict) and value) or key == "forward"
                 or isinstance(value, (AttachedHook, AttachedForward))
                 or (key == "_swapkit_applied" and value is not None)]
    return left


def attachments(model) -> dict:
    """What swapkit installed on ``model``, by object identity: to check that pickling changed nothing."""
    return {name: {key: list(value.items()) if isinstance(value, dict) else value for key, value in m.__dict__.items()
                   if "hook" in key or key in ("forward", "_swapkit_applied")}
            for name, m in model.named_modules()}


def assert_plain_twin(loaded, original_state: dict) -> None:
    """``loaded`` has the original's weights and computes exactly what a model that never had swapkit does."""
    assert swapkit_left(loaded) == []
    assert loaded._swapkit_applied is None
    state = loaded.state_dict()
    assert state.keys() == original_state.keys()
    assert all(torch.equal(state[k], original_state[k]) for k in state)
    plain = llama()
    plain.load_state_dict(state)
    for (name, buffer), (_, expected) in zip(loaded.named_buffers(), plain.named_buffers()):
        assert torch.equal(buffer, expected), name  # non-persistent buffers (rope tables) too
    batch = llama_batch()
    torch.manual_seed(0)
    loss = llama_step(loaded, batch)
    torch.manual_seed(0)
    assert torch.equal(loss, llama_step(plain, batch))
    assert_grads_equal(grads(loaded), grads(plain))


@pytest.mark.parametrize("config", [MINDFORMERS, MEGATRON], ids=["mindformers", "megatron_uniform"])
@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_saved_model_is_the_plain_model_and_the_original_still_swaps(config, how, tmp_path):
    model = llama()
    session = swapkit.apply(model, config, layers="layers")
    batch = llama_batch()
    with session:
        llama_step(model, batch)
    offloaded, recomputed = session.stats.offloaded_bytes, session.stats.recomputed_by_scope
    assert (offloaded > 0) == (config is MINDFORMERS) and recomputed
    before, state = attachments(model), copy.deepcopy(model.state_dict())
    loaded = pickled(model) if how == "pickle" else saved(model, tmp_path)
    assert attachments(model) == before  # pickling mutated nothing of the original
    assert_plain_twin(loaded, state)
    assert swapkit_left(pickled(loaded)) == []  # and it pickles again
    model.zero_grad()
    with session:  # the original keeps swapping and recomputing as before
        llama_step(model, batch)
    assert session.stats.offloaded_bytes == offloaded and session.stats.recomputed_by_scope == recomputed
    again = swapkit.apply(loaded, config, layers="layers")  # swapkit can be applied to the loaded model
    with again:
        llama_step(loaded, batch)
    assert again.stats.offloaded_bytes == offloaded and again.stats.recomputed_by_scope == recomputed
    session.remove()
    assert swapkit_left(model) == []


def test_pickling_while_a_graph_is_pending_leaves_its_backward_exact():
    model, reference = llama(), llama()
    reference.load_state_dict(model.state_dict())
    session = swapkit.apply(model, MINDFORMERS, layers="layers")
    tokens, targets = llama_batch()
    with session:
        loss = lm_loss(model(tokens), targets)
        state = copy.deepcopy(model.state_dict())
        data = pickle.dumps(model)  # forward done, backward not yet: inside the block
    buffer = io.BytesIO()
    torch.save(model, buffer)  # and after it
    loss.backward()
    assert session.stats.offloaded_bytes > 0
    reference_loss = lm_loss(reference(tokens), targets)
    reference_loss.backward()
    assert torch.equal(loss, reference_loss)
    assert_grads_equal(grads(model), grads(reference))
    assert_plain_twin(pickle.loads(data), state)
    buffer.seek(0)
    assert_plain_twin(torch.load(buffer, weights_only=False), state)


def doubled(module, x):
    return 2 * type(module).forward(module, x)


def test_a_forward_of_the_models_own_comes_back_as_it_was():
    """A module whose instance ``forward`` swapkit wrapped loads with that forward, not swapkit's."""
    model, plain = ToyNet(layers=2), ToyNet(layers=2)
    plain.load_state_dict(model.state_dict())
    for m in (model, plain):
        m.layers[0].forward = functools.partial(doubled, m.layers[0])  # picklable, as accelerate's hooks
    session = swapkit.apply(model, toy_config(2, recompute_config={"recompute": True}), layers="layers")
    assert isinstance(model.layers[0].forward, AttachedForward)
    for loaded in (pickled(model), copy.deepcopy(model)):
        forward = loaded.layers[0].__dict__["forward"]
        assert isinstance(forward, functools.partial) and forward.func is doubled
        assert forward.args == (loaded.layers[0],)  # the loaded layer, not the original
        assert "forward" not in loaded.layers[1].__dict__
        x = torch.randn(2, 16)
        assert torch.equal(loaded(x), plain(x))
    session.remove()
    assert model.layers[0].forward.func is doubled


def test_only_a_pickle_of_the_model_itself_names_swapkit():
    """Loading a pickle of the model runs swapkit's strip (so imports swapkit); a deep copy pickles without it."""
    model = ToyNet(layers=2)
    session = swapkit.apply(model, toy_config(2, recompute_config={"recompute": [0]}, **layer_swap(1)),
                            layers="layers")
    assert b"swapkit.runtime.detach" in pickle.dumps(model)
    assert b"swapkit.runtime" not in pickle.dumps(copy.deepcopy(model))
    session.remove()
    assert b"swapkit.runtime" not in pickle.dumps(model)


def test_a_layer_copied_or_pickled_alone_computes_as_the_plain_layer():
    """Without the model's marker nothing strips the stand-ins: they stay as no-op hooks, the forward is the class's."""
    model, plain = ToyNet(layers=2), ToyNet(layers=2)
    plain.load_state_dict(model.state_dict())
    config = toy_config(2, recompute_config={"recompute": [0]},
                        swap_config={"swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": True}]},
                        runtime={"min_offload_bytes": 0})
    session = swapkit.apply(model, config, layers="layers")
    x = torch.randn(2, 16)
    for layer in (copy.deepcopy(model.layers[0]), pickled(model.layers[0])):
        assert layer._forward_pre_hooks and all(h is DETACHED for h in layer._forward_pre_hooks.values())
        assert not isinstance(layer.forward, AttachedForward)
        with session:  # the original's session is active: a copy is no part of it
            assert torch.equal(layer(x), plain.layers[0](x))
        assert session.tracker.stack == []
    shallow = copy.copy(model.layers[0])  # shares the original's hook dicts
    with pytest.raises(RuntimeError, match="copy of layer 0 of a model swapkit was applied to.*shallow copy"):
        shallow(x)


def test_a_pipeline_chunk_pickles_without_its_micro_step_hooks():
    config = pipeline_config("1f1b", swap_config={"swap": True, "layer_swap": [{"backward_prefetch": 1,
                                                                                "layers": True}]})
    plan = swapkit.build_plan(swapkit.load_config(config))
    (chunk,) = build_stage_chunks(swapkit.load_config(config).model, plan, 1, seed=1)
    session = swapkit.apply(chunk, config, layers="layers", stage=1)
    assert chunk._forward_pre_hooks  # the chunk's micro-step hook sits on the chunk (the marker's owner) itself
    loaded = pickled(chunk)
    assert swapkit_left(loaded) == [] and loaded._swapkit_applied is None
    x = torch.randn(2, 16, 32)
    assert torch.equal(loaded(x), chunk(x))
    session.remove()


def test_a_hugging_face_model_pickles_as_the_plain_model():
    pytest.importorskip("transformers")
    from tests.hf_zoo import FAMILIES

    family = FAMILIES["llama"]
    model = family.build()
    reference = copy.deepcopy(model)
    config = {"model": {"model_config": {"num_layers": family.num_layers}}, "runtime": {"min_offload_bytes": 0},
              "recompute_config": {"recompute": [0]},
              "swap_config": {"swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": [1]}]}}
    session = swapkit.apply(model, config, layers=family.layers)
    with session:
        family.forward(model).loss.backward()
    assert session.stats.offloaded_bytes > 0
    model.zero_grad()
    loaded = pickled(model)
    assert swapkit_left(loaded) == []  # the cache watch (a pre-hook with kwargs) included
    losses = []
    for m in (loaded, reference):
        torch.manual_seed(0)
        loss = family.forward(m).loss
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(*losses)
    assert_grads_equal(grads(loaded), grads(reference))
    session.remove()


def test_a_model_compiled_before_apply_pickles_as_the_plain_model():
    """swapkit applied to ``torch.compile(model)`` (layers under ``_orig_mod``): the wrapper copies and pickles
    only the module it wraps, so the marker sits there (detach Note [Copies and pickles of a model ...])."""
    model, plain = ToyNet(layers=2), ToyNet(layers=2)
    plain.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="eager")
    config = toy_config(2, recompute_config={"recompute": [0]}, **layer_swap(1))
    session = swapkit.apply(compiled, config)
    assert session.binding.layers_path == "_orig_mod.layers"
    x = torch.randn(2, 16)
    for loaded in (pickled(compiled), copy.deepcopy(compiled)):
        assert swapkit_left(loaded._orig_mod) == [] and loaded._swapkit_applied is None
        assert torch.equal(loaded._orig_mod(x), plain(x))
    with pytest.raises(swapkit.BindError, match="already applied"):  # the compiled module is that model
        swapkit.apply(model, config, layers="layers")
    session.remove()
    assert swapkit_left(model) == [] and getattr(compiled, "_swapkit_applied", None) is None
    swapkit.apply(model, config, layers="layers").remove()


def test_a_shallow_copy_of_the_model_takes_swapkit_once_the_session_is_removed():
    """``copy.copy`` shares the model's layers and its marker object: refused while the session lives (it
    would hook the same layers twice), applied as the original once ``remove()`` made the marker stale."""
    model, reference = llama(), llama()
    config = toy_config(4, **layer_swap(1))
    session = swapkit.apply(model, config, layers="layers")
    shallow = copy.copy(model)
    with pytest.raises(swapkit.BindError, match=r"shallow copy \(copy.copy\) of a model swapkit is applied to.*"
                                                r"call remove\(\) on that model's SwapSession first"):
        swapkit.apply(shallow, config, layers="layers")
    with pytest.raises(swapkit.BindError, match="already applied to this"):
        swapkit.apply(model, config, layers="layers")
    session.remove()
    assert swapkit_left(copy.deepcopy(shallow)) == []  # the stale marker copies as None, strips nothing
    again = swapkit.apply(shallow, config, layers="layers")
    batch = llama_batch()
    with again:
        loss = llama_step(shallow, batch)
    assert again.stats.offloaded_bytes > 0
    assert torch.equal(loss, llama_step(reference, batch))
    assert_grads_equal(grads(shallow), grads(reference))
    with pytest.raises(swapkit.BindError, match=r"layer 0 of this .* already carries the hooks of another swapkit "
                                                r"session: another model shares it"):
        swapkit.apply(model, config, layers="layers")  # the original shares the layers the copy hooked
    again.remove()
    assert swapkit_left(shallow) == []
    swapkit.apply(model, config, layers="layers").remove()  # free again once the copy's session is removed


def test_a_layer_another_session_hooked_is_refused_not_hooked_twice():
    """swapkit applied to a module holding the layers (here a wrapper around the model) after it was applied to
    the model itself: both would swap and recompute the same layers."""
    model = llama()
    config = toy_config(4, **layer_swap(1))
    inner = swapkit.apply(model, config, layers="layers")
    outer = torch.nn.Sequential(model)
    with pytest.raises(swapkit.BindError, match="layer 0 of this Sequential already carries the hooks of another"):
        swapkit.apply(outer, config, layers="0.layers")
    inner.remove()
    swapkit.apply(outer, config, layers="0.layers").remove()
