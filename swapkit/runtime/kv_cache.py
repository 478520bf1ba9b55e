"""Key/value caches and recompute: a recomputed region must not update a cache twice.

Note [Caches in recomputed regions]
Decoder layers of Hugging Face transformers (and models written like them) take a key/value cache as
a keyword argument (``cache`` since transformers 5.24, ``past_key_values``, ``past_key_value`` or
``layer_past`` before, and in models written like those) and a ``use_cache`` flag, and *append* this
step's keys and values to the cache inside ``forward``. A checkpoint region replays ``forward`` in
backward, so the replay appends a second time: the returned cache silently doubles, and with a
padding mask, a sliding window or an encoder-decoder cache the replay sees keys of the wrong length
and fails. HF's own ``GradientCheckpointingLayer`` therefore disables caching inside checkpointed
layers, and so does swapkit: when a region is about to be recomputed (training, grad enabled) a
truthy ``use_cache`` becomes ``False`` and a cache argument that is not ``None`` becomes ``None``,
for the forward and its replay alike, with one warning per session naming the region and the
arguments. Training needs no cache; the model's returned cache then lacks the recomputed layers, as
with HF's gradient checkpointing. Arguments are found by name, positional ones through the forward's
signature (GPT-2 passes its cache positionally); nothing is imported from transformers.

Note [Caches hold swapped storages]
A cache is a problem for swap too, a quieter one. HF decoder models create a cache in training
whenever ``config.use_cache`` is true (the default), hand it to every layer, and return it in the
output. The cache holds the keys and values it stores until the output is dropped, and attention
saves some of them (or views of their storages) for backward: the session offloads those storages
and drops its reference, yet their device memory stays, while the stats count them as released
(measured on a tiny random Llama: a quarter of the attention swap's offloaded bytes with grouped
query attention, two fifths without). Training needs no cache, so the scope tracker watches the
layers that swap: one whose training forward (grad enabled, session active, not a replay in
backward) receives a cache that will be written (a cache argument that is not ``None``, unless
``use_cache`` is given and false) logs one WARNING per session saying to pass ``use_cache=False``.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

logger = logging.getLogger(__name__)

CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")  # "cache": transformers >= 5.24


class CacheArguments:
    """Where a forward takes its cache arguments: by keyword, and at which positions."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.positions = _positions(forward)

    def disable(self, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any], list[str]]:
        """``args`` and ``kwargs`` with caching disabled, and the names that were changed."""
        changed = [name for name in self.positions if name in kwargs and _enabled(name, kwargs[name])]
        changed += [name for name, at in self.positions.items() if at < len(args) and _enabled(name, args[at])]
        if not changed:
            return args, kwargs, changed
        kwargs = {k: _off(k) if k in changed else v for k, v in kwargs.items()}
        names = {at: name for name, at in self.positions.items()}
        args = tuple(_off(names[i]) if names.get(i) in changed else a for i, a in enumerate(args))
        return args, kwargs, changed

    def in_use(self, args: tuple, kwargs: dict[str, Any]) -> list[str]:
        """The cache arguments given a cache that this call writes (Note [Caches hold swapped storages])."""
        if not _enabled("use_cache", self._value("use_cache", args, kwargs, True)):
            return []
        return [name for name in CACHE_ARGUMENTS if self._value(name, args, kwargs, None) is not None]

    def _value(self, name: str, args: tuple, kwargs: dict[str, Any], default: Any) -> Any:
        if name in kwargs:
            return kwargs[name]
        at = self.positions[name]
        return args[at] if at < len(args) else default


def _positions(forward: Callable[..., Any]) -> dict[str, int]:
    """Cache argument name -> its positional index (a large number when keyword-only or absent)."""
    names = (*CACHE_ARGUMENTS, "use_cache")
    found = dict.fromkeys(names, 1 << 30)
    try:
        parameters = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):  # no signature: keywords only
        return found
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for index, parameter in enumerate(parameters):
        if parameter.kind not in positional:
            break
        if parameter.name in found:
            found[parameter.name] = index
    return found


def _enabled(name: str, value: Any) -> bool:
    return bool(value) if name == "use_cache" else value is not None


def _off(name: str) -> Any:
    return False if name == "use_cache" else None


def cache_warning(label: str, changed: list[str]) -> str:
    settings = ", ".join(f"{name}={'False' if name == 'use_cache' else 'None'}" for name in changed)
    return (f"swapkit: recompute of {label}: a key/value cache cannot be updated inside a recomputed region (the "
            f"replay in backward would update it again); setting {settings} inside recomputed regions. Pass "
            "use_cache=False when training to silence this (Note [Caches in recomputed regions])")


def swap_cache_warning(layer: int, names: list[str]) -> str:
    """Note [Caches hold swapped storages]"""
    return (f"swapkit: layer {layer} got a key/value cache ({', '.join(names)}) in a training forward while it "
            "swaps: the cache keeps the keys and values it stores on the device until the model's output is "
            "dropped, and attention saves some of them for backward, so those swapped storages free no device "
            "memory although the stats count them as released. Pass use_cache=False when training (or set "
            "model.config.use_cache = False) (Note [Caches hold swapped storages])")
