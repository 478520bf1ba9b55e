"""Caches in recomputed regions (swapkit.runtime.kv_cache Note [Caches in recomputed regions]),
without transformers: a toy layer that appends to a list cache, by keyword or positionally."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import swapkit
from swapkit.runtime.kv_cache import CacheArguments
from tests.toys import Block, layer_swap, toy_config


class CachingBlock(Block):
    def forward(self, x, past_key_values=None, use_cache=False):
        out = super().forward(x)
        if use_cache and past_key_values is not None:
            past_key_values.append(out.detach())  # what a KV-cache update does: grows every call
        return out


class CachingNet(nn.Module):
    def __init__(self, positional: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CachingBlock(8) for _ in range(2))
        self.positional = positional

    def forward(self, x, cache):
        for layer in self.layers:
            x = layer(x, cache, True) if self.positional else layer(x, past_key_values=cache, use_cache=True)
        return x


def test_recomputed_layers_never_touch_the_cache(caplog):
    for positional in (False, True):
        model = CachingNet(positional)
        session = swapkit.apply(model, toy_config(2, recompute_config={"recompute": [0, 1]},
                                                  swap_config={"swap": True, "layer_swap": []}), layers="layers")
        caplog.clear()
        caplog.set_level(logging.WARNING, logger="swapkit")
        for _ in range(2):
            cache: list = []
            with session:
                model(torch.randn(2, 8, requires_grad=True), cache).sum().backward()
            assert cache == []  # neither in forward nor in the replay
        warnings = [m for m in caplog.messages if "key/value cache cannot be updated" in m]
        assert len(warnings) == 1 and "past_key_values=None, use_cache=False" in warnings[0]
        model.eval()
        with torch.no_grad():
            cache = []
            model(torch.randn(2, 8), cache)
        assert len(cache) == 2  # outside recompute (eval) the cache works as before
        session.remove()


def test_cache_arguments_by_signature():
    layer = CachingBlock(8)
    args, kwargs, changed = CacheArguments(layer.forward).disable((1, [0], True), {})
    assert args == (1, None, False) and kwargs == {} and sorted(changed) == ["past_key_values", "use_cache"]
    args, kwargs, changed = CacheArguments(layer.forward).disable((1,), {"layer_past": [0], "use_cache": False})
    assert kwargs == {"layer_past": None, "use_cache": False} and changed == ["layer_past"]
    # a keyword is found by name, whatever the signature
    assert CacheArguments(len).disable((1, 2), {"use_cache": True})[1] == {"use_cache": False}


def test_the_cache_argument_of_transformers_5_24_is_disabled_too():
    """transformers 5.24 renamed a layer's ``past_key_values`` to ``cache`` (Note [Caches in recomputed regions]):
    without it a recomputed HF layer appended its keys twice and backward failed on the doubled length."""

    def forward(hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False, **kwargs):
        return hidden_states

    arguments = CacheArguments(forward)
    args, kwargs, changed = arguments.disable((1, None, None, [0], True), {})
    assert args == (1, None, None, None, False) and sorted(changed) == ["cache", "use_cache"]
    args, kwargs, changed = arguments.disable((1,), {"cache": [0], "use_cache": True})
    assert kwargs == {"cache": None, "use_cache": False}
    assert arguments.in_use((1,), {"cache": [0], "use_cache": True}) == ["cache"]


def cache_warnings(caplog) -> list[str]:
    return [m for m in caplog.messages if "keeps the keys and values" in m]


@pytest.mark.parametrize("positional", [False, True])
def test_a_cache_beside_swapped_layers_is_warned_once(positional, caplog):
    """Note [Caches hold swapped storages]: HF's default use_cache=True in training hands every decoder layer
    a cache that keeps what it stores, which attention also saves for backward: those swapped storages were
    counted as released but stayed on the device. A training forward of a swapped layer that gets a cache
    warns once per session; one without a cache, or under no_grad (generation), does not."""
    torch.manual_seed(0)
    model = CachingNet(positional)
    session = swapkit.apply(model, toy_config(2, **layer_swap(1)), layers="layers")
    caplog.set_level(logging.WARNING, logger="swapkit")
    x = torch.randn(2, 8, requires_grad=True)
    with session:
        model(x, None).sum().backward()
    with session, torch.no_grad():
        model(x, [])
    assert cache_warnings(caplog) == []
    for _ in range(2):
        with session:
            model(x, []).sum().backward()
    warnings = cache_warnings(caplog)
    assert len(warnings) == 1
    assert warnings[0].startswith("swapkit: layer 0 got a key/value cache (past_key_values) in a training forward")
    assert "use_cache=False" in warnings[0]
    copied = copy.deepcopy(model)  # a plain model: the cache watch is stripped like the other hooks
    assert all(not layer._forward_pre_hooks and not layer._forward_pre_hooks_with_kwargs for layer in copied.layers)
    session.remove()


def test_a_cache_beside_unswapped_layers_is_not_warned(caplog):
    model = CachingNet(False)
    session = swapkit.apply(model, toy_config(2, swap_config={"swap": True, "layer_swap": []}), layers="layers")
    caplog.set_level(logging.WARNING, logger="swapkit")
    with session:
        model(torch.randn(2, 8, requires_grad=True), []).sum().backward()
    assert cache_warnings(caplog) == []
    session.remove()


def test_caches_in_use_by_signature():
    layer = CachingBlock(8)
    arguments = CacheArguments(layer.forward)
    assert arguments.in_use((1, [0], True), {}) == ["past_key_values"]
    assert arguments.in_use((1, [0], False), {}) == []  # a cache that is not written keeps nothing new
    assert arguments.in_use((1,), {"past_key_values": None, "use_cache": True}) == []
    assert arguments.in_use((1,), {"layer_past": [0]}) == ["layer_past"]
