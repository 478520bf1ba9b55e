"""Models for ``swapkit plan --model``: built on the meta device (no memory, no download).

``pkg.module:factory`` imports ``pkg.module`` and calls ``factory()`` with the meta device as the
default device; ``hf:<model_type>`` or ``hf:<path to config.json>`` builds a transformers model
from its config, in the form it is trained in: the masked-LM model of an encoder-only config (BERT,
RoBERTa, ...), else the causal-LM model where the family has one, else the base model
(:func:`swapkit.integrations.transformers.meta_random_model`).
"""
from __future__ import annotations

import importlib
import os
import sys
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
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: {attribute} is a {type(factory).__name__}, not callable; name a "
                         f"function or class that builds the model with no arguments")
    model = _call(factory, spec, attribute)
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {spec!r}: {attribute}() returned a {type(model).__name__}, not an nn.Module")
    return model


def _call(factory, spec: str, attribute: str) -> object:
    try:
        with torch.device("meta"):
            return factory()
    except Exception as err:  # the user's factory: report it as a --model problem, not a crash
        raise ValueError(f"--model {spec!r}: {attribute}() raised {type(err).__name__}: {err}; --model needs a "
                         f"function or class that builds the model with no arguments") from None


def _import(module_name: str, attribute: str, spec: str):
    if os.getcwd() not in sys.path:  # as `python -m` does; console scripts leave the current folder out
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--model {spec!r}: cannot import {module_name} ({err}); is it on PYTHONPATH?") from None
    try:
        return reduce(getattr, attribute.split("."), module)
    except AttributeError:
        raise ValueError(f"--model {spec!r}: {module_name} has no attribute {attribute!r}") from None


def _hf_model(spec: str) -> nn.Module:
    """The family's training form (masked LM for an encoder-only config, else its causal-LM model when it
    has one, as ``--budget`` trains and as users train): layer paths such as ``model.layers`` mean the
    same with and without ``--budget``."""
    try:
        from swapkit.integrations.transformers import meta_random_model
    except ImportError as err:
        raise ValueError(f"--model hf:{spec} needs transformers ({err}); pip install transformers") from None
    return meta_random_model(spec)
