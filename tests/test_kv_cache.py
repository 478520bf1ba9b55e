"""Caches in recomputed regions (swapkit.runtime.kv_cache Note [Caches in recomputed regions]),
without transformers: a toy layer that appends to a list cache, by keyword or positionally."""
from __future__ import annotations

import logging

import torch
from torch import nn

import swapkit
from swapkit.runtime.kv_cache import CacheArguments
from tests.toys import Block, toy_config


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
