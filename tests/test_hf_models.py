"""swapkit on Hugging Face transformers models (tiny random configs, nothing downloaded).

Swap must give bit-identical gradients; recompute must work with HF's default ``use_cache=True``
(``swapkit.runtime.kv_cache.Note [Caches in recomputed regions]``); encoder-decoder models bind
both stacks in one session (``swapkit.runtime.binding.Note [Several layer containers]``).
"""
from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch

pytest.importorskip("transformers")

import swapkit  # noqa: E402
from swapkit.runtime.binding import BindError  # noqa: E402
from tests.hf_zoo import FAMILIES, SEQ, Family  # noqa: E402
from tests.toys import ReadyWhenDone, assert_grads_equal, grads, install_engine  # noqa: E402

CACHE_WARNING = "a key/value cache cannot be updated inside a recomputed region"


@pytest.fixture(autouse=True, scope="module")
def _one_thread_here(one_thread):
    """Tiny matrices in this file (conftest's ``one_thread``)."""


def config(family: Family, **sections) -> dict:
    return {"model": {"model_config": {"num_layers": family.num_layers}}, "runtime": {"min_offload_bytes": 0},
            **sections}


def train(model, family: Family, session=None, steps: int = 2, **call) -> tuple[list[torch.Tensor], list]:
    """``steps`` forward/backward passes (gradients accumulate); the losses and the outputs. ``call``: extra
    keyword arguments of the model's call (``use_cache=False``)."""
    torch.manual_seed(1234)  # the same dropout masks in every variant
    losses, outputs = [], []
    for _ in range(steps):
        if session is None:
            out = family.forward(functools.partial(model, **call))
            out.loss.backward()
        else:
            with session:
                out = family.forward(model)
                out.loss.backward()
        losses.append(out.loss.detach())
        outputs.append(out)
    return losses, outputs


def reference_and_applied(name: str, cfg: dict, steps: int = 2, uncached: str | None = None):
    """The family, the model, its unwrapped reference trained ``steps`` times, the reference's losses and a
    session applied to the model. ``uncached``: the reference runs with the cache off where swapkit recomputes
    (Note [Caches in recomputed regions]): ``"model"`` for every layer, or the op pattern of the recomputed
    scope in each layer."""
    family = FAMILIES[name]
    model = family.build()
    reference = copy.deepcopy(model)
    reference.calls = count_calls(reference, family)  # module calls inside the attention scopes
    if uncached is not None and uncached != "model":
        for scope in scopes(reference, family, uncached):
            scope.register_forward_pre_hook(_cache_off, with_kwargs=True)
    call = {"use_cache": False} if uncached == "model" else {}
    ref_losses, _ = train(reference, family, steps=steps, **call)
    session = swapkit.apply(model, cfg(family) if callable(cfg) else cfg, layers=family.layers)
    return family, model, reference, ref_losses, session


def scopes(model, family: Family, pattern: str) -> list:
    """The sub-module named by a one-component op ``pattern`` (``\\.`` for dots) in every bound layer."""
    paths = [family.layers] if isinstance(family.layers, str) else family.layers
    name = pattern.replace("\\.", ".")
    return [layer.get_submodule(name) for path in paths for layer in model.get_submodule(path)]


def _cache_off(module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward pre-hook: the cache keyword arguments off (HF passes them by keyword to attention)."""
    off = {"use_cache": False, "cache": None, "past_key_values": None, "past_key_value": None, "layer_past": None}
    return args, {k: off.get(k, v) for k, v in kwargs.items()}


def swap_config(family: Family) -> dict:
    return config(family, swap_config={"swap": True, "layer_swap": [{"backward_prefetch": 2, "layers": [0]}],
                                       "op_swap": [{"op_name": family.attention, "backward_prefetch": 1,
                                                    "layers": True}]})


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_swap_is_bit_identical(name):
    family, model, reference, ref_losses, session = reference_and_applied(name, swap_config)
    install_engine(session, ReadyWhenDone())  # releases exactly at their horizon: the stats do not depend on timing
    losses, _ = train(model, family, session)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert_grads_equal(grads(model), grads(reference))
    stats = session.stats
    assert stats.offloaded_bytes > 0 and stats.prefetched_bytes > 0
    assert stats.prefetched_bytes + stats.tail_bytes == stats.offloaded_bytes  # every byte came back or stayed
    last = family.num_layers - 1
    attention = family.attention.replace("\\.", ".")
    assert {"layer 0", f"layer 0: {attention}", f"layer {last}: {attention}"} <= set(stats.offloaded_by_scope)
    session.remove()


def recompute_config(family: Family) -> dict:
    return config(family, recompute_config={"recompute": True})


def count_calls(model, family: Family) -> list[int]:
    """A counter of module calls inside the attention scopes of every bound layer (the scope's own
    call is not counted: a wrapped scope replays its ``forward``, not its ``__call__``)."""
    calls = [0]
    for scope in scopes(model, family, family.attention):
        for module in list(scope.modules())[1:]:
            module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def assert_close_to_cached(name: str, recomputed: dict) -> None:
    """Gradients with recompute are close to the unwrapped model's with its cache on. Not equal in general:
    with the cache off, attention multiplies other tensor layouts (keys and values not copied into the cache),
    and some CPU kernels round differently for them (seen for GPT-2 and T5 on an AMD EPYC)."""
    family = FAMILIES[name]
    reference = family.build()
    train(reference, family, steps=1)
    cached = grads(reference)
    assert recomputed.keys() == cached.keys()
    for key in recomputed:
        torch.testing.assert_close(recomputed[key], cached[key], msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_full_recompute_with_default_use_cache(name, caplog):
    # one step: the single warning below is still one per session, not one per recomputed layer
    family, model, reference, ref_losses, session = reference_and_applied(name, recompute_config, steps=1,
                                                                          uncached="model")
    calls = count_calls(model, family)
    caplog.set_level(logging.WARNING, logger="swapkit")
    losses, outputs = train(model, family, session, steps=1)
    assert calls[0] == 2 * reference.calls[0]  # forward + replay of every layer
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=0)
    assert_grads_equal(grads(model), grads(reference))
    assert_close_to_cached(name, grads(model))
    warnings = [r.getMessage() for r in caplog.records if CACHE_WARNING in r.getMessage()]
    if family.cache:
        assert len(warnings) == 1 and "use_cache=False" in warnings[0]
        assert outputs[-1].past_key_values.get_seq_length() == 0  # never filled, never filled twice
    else:
        assert warnings == []
    session.remove()


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2", "falcon", "t5"])
def test_select_recompute_of_attention_with_default_use_cache(name, caplog):
    cfg = lambda family: config(family, recompute_config={"select_recompute": {family.attention: True}})  # noqa: E731
    family, model, reference, ref_losses, session = reference_and_applied(name, cfg, steps=1,
                                                                          uncached=FAMILIES[name].attention)
    calls = count_calls(model, family)
    caplog.set_level(logging.WARNING, logger="swapkit")
    losses, _ = train(model, family, session, steps=1)
    # the forward and the checkpoint's replay (which stops early once it has recomputed what it needs)
    assert calls[0] > reference.calls[0]
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=0)
    assert_grads_equal(grads(model), grads(reference))
    assert_close_to_cached(name, grads(model))
    assert sum(CACHE_WARNING in r.getMessage() for r in caplog.records) == 1
    session.remove()


def uniform(family: Family, n: int = 2) -> dict:
    return config(family, recompute_config={"recompute_granularity": "full", "recompute_method": "uniform",
                                            "recompute_num_layers": n})


def test_uniform_units_on_a_tensor_returning_layer():
    family, model, reference, ref_losses, session = reference_and_applied("llama", uniform)
    losses, _ = train(model, family, session)
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=0)
    assert_grads_equal(grads(model), grads(reference))
    assert session.recompute.wrapped[0] == "layers 0-1"


@pytest.mark.parametrize("name", ["falcon", "t5"])
def test_uniform_units_on_tuple_returning_layers_raise_swapkits_error(name):
    family = FAMILIES[name]
    model = family.build()
    session = swapkit.apply(model, uniform(family), layers=family.layers)
    with pytest.raises(RuntimeError, match=r"uniform recompute unit layers 0-1: layer 0 returned a tuple, not the "
                                           r"hidden-states tensor; use recompute_method: block"):
        train(model, family, session, steps=1)


def test_uniform_unit_may_not_span_two_containers():
    family = FAMILIES["t5"]
    with pytest.raises(BindError, match=r"uniform unit of layers 0-2 spans two layer containers \(encoder\.block "
                                        r"holds layers 0-1\)"):
        swapkit.apply(family.build(), uniform(family, n=3), layers=family.layers)


def test_encoder_decoder_numbering_and_auto_detection(caplog):
    family = FAMILIES["t5"]
    model = family.build()
    with pytest.raises(BindError, match=r"several layer containers in T5ForConditionalGeneration: encoder\.block "
                                        r"\(2 x T5Block\), decoder\.block \(2 x T5Block\); say which hold the "
                                        r"layers, in order\. In Python: pass layers=\['encoder\.block', "
                                        r"'decoder\.block'\] \(or layers='encoder\.block' for one\) to "
                                        r"swapkit\.apply\. In a YAML config: set model\.model_config\.layers_path: "
                                        r"\[encoder\.block, decoder\.block\]") as info:
        swapkit.apply(model, config(family))
    assert "num_layers" not in str(info.value) and "None" not in str(info.value)  # no internal values
    caplog.set_level(logging.INFO, logger="swapkit")
    cfg = config(family, swap_config={"swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": [1, 2]}]})
    cfg["model"]["model_config"]["layers_path"] = ["encoder.block", "decoder.block"]
    session = swapkit.apply(model, cfg)
    assert ("Bound layers: encoder.block (layers 0-1: 2 x T5Block), decoder.block (layers 2-3: 2 x T5Block)"
            in caplog.messages)
    assert [layer.module for layer in session.binding.layers] == [*model.encoder.block, *model.decoder.block]
    train(model, family, session, steps=1)
    assert set(session.stats.offloaded_by_scope) == {"layer 1", "layer 2"}  # last encoder, first decoder layer


@pytest.mark.parametrize("name,path", [("llama", "model.layers"), ("gpt2", "transformer.h"), ("vit", "vit.layers"),
                                       ("bert", "bert.encoder.layer"), ("qwen3_moe", "model.layers")])
def test_auto_detection_binds_and_logs_the_container(name, path, caplog):
    family = FAMILIES[name]
    caplog.set_level(logging.INFO, logger="swapkit")
    session = swapkit.apply(family.build(), config(family))
    assert session.binding.layers_path == path
    assert any(m.startswith(f"Bound layers: {path} (layers 0-1: 2 x ") for m in caplog.messages)


def test_op_swap_inside_hf_gradient_checkpointing_is_reported(caplog):
    family = FAMILIES["llama"]
    model = family.build()
    # gradient_checkpointing_enable() under its newer name (the old one warns that it is deprecated)
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    reference = copy.deepcopy(model)
    train(reference, family)
    cfg = config(family, swap_config={"swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": [0]}],
                                      "op_swap": [{"op_name": "self_attn", "backward_prefetch": 1, "layers": True}]})
    session = swapkit.apply(model, cfg, layers=family.layers)
    caplog.set_level(logging.WARNING, logger="swapkit")
    train(model, family, session)
    assert_grads_equal(grads(model), grads(reference))
    # The op swaps run inside the checkpoint region: always reported. Whether the layer swap sees a saved
    # tensor depends on transformers: 5.23 saves the checkpointed layer's inputs outside the region (the
    # layer swap offloads them), 5.17 checkpoints the whole layer call (seen on an H100 host), and then
    # the layer swap is reported too. Either way, a swap is reported exactly when it offloaded nothing.
    layer_swap_used = "layer 0" in session.stats.offloaded_by_scope
    assert set(session.stats.offloaded_by_scope) == ({"layer 0"} if layer_swap_used else set())
    assert session.stats.unused_swaps == ([] if layer_swap_used else ["layer 0"]) + ["layer 0: self_attn",
                                                                                    "layer 1: self_attn"]
    reported = [m for m in caplog.messages if "saw no saved tensor" in m]
    assert [m.split(" saw ")[0] for m in reported] == (
        ([] if layer_swap_used else ["swapkit: layer swap at layer 0"])
        + ["swapkit: op swap at layers 0-1: self_attn"])
    assert all("another saved_tensors_hooks context" in m for m in reported)
