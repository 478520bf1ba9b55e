"""Models for ``swapkit plan --model``: built on the meta device (no memory, no download).

``pkg.module:factory`` imports ``pkg.module`` and calls ``factory()`` with the meta device as the
default device; ``hf:<model_type>`` or ``hf:<path to config.json>`` builds a transformers model
from its config (:func:`swapkit.integrations.transformers.meta_model`).
"""
from __future__ import annotations

import importlib
from functools import reduce

import torch
from torch import nn

MODEL_FORMS = "pkg.module:factory, hf:<model_type> or hf:<path to config.json>"


def build_meta_model(spec: str) -> nn.Module:
    """The model ``spec`` names, on the meta device.

    Raises:
        ValueError: the spec is malformed, cannot be imported, or does not give an ``nn.Module``.
    """
    if spec.startswith("hf:"):
        return _hf_model(spec[len("hf:"):])
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"--model {spec!r}: expected {MODEL_FORMS}")
    factory = _import(module_name, attribute, spec)
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {spec!r}: {attribute}() returned a {type(model).__name__}, not an nn.Module")
    return model


def _import(module_name: str, attribute: str, spec: str):
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--model {spec!r}: cannot import {module_name} ({err}); is it on PYTHONPATH?") from None
    try:
        return reduce(getattr, attribute.split("."), module)
    except AttributeError:
        raise ValueError(f"--model {spec!r}: {module_name} has no attribute {attribute!r}") from None


def _hf_model(spec: str) -> nn.Module:
    try:
        from swapkit.integrations.transformers import meta_model
    except ImportError as err:
        raise ValueError(f"--model hf:{spec} needs transformers ({err}); pip install transformers") from None
    return meta_model(spec)
