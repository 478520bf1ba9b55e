"""``swapkit plan --budget --model hf:...``: a tiny-step recipe for a transformers model.

The planner has to run training steps, so it needs real weights (random, seeded), a batch and a
loss. For ``hf:<model_type>`` or ``hf:<config.json>`` the causal-LM head of that family is built
when it has one (loss: next-token cross entropy on random tokens); otherwise the base model, with
the mean square of its last hidden state as a stand-in loss. Other ``--model`` forms name a factory
whose inputs swapkit cannot know: plan those from Python with
:class:`~swapkit.planner.steps.ModelSource`.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from swapkit.config.errors import ConfigError, Problem
from swapkit.config.types import Config
from swapkit.integrations.models import build_meta_model
from swapkit.planner.steps import ModelSource


def source_from_spec(spec: str, config: Config, layers: str | None) -> ModelSource:
    """A :class:`ModelSource` for ``--model hf:...`` (seeded random weights on the CPU).

    Raises:
        ConfigError: not an ``hf:`` spec, or the spec cannot be built.
    """
    if not spec.startswith("hf:"):
        raise ConfigError([Problem("--model", f"got {spec!r} with --budget; the planner builds hf:<model_type> or "
                                              "hf:<config.json> models itself; for your own factory call "
                                              "swapkit.planner.measure(config, model=ModelSource(...)) from Python")])
    try:
        from swapkit.integrations.transformers import random_model

        model_config = build_meta_model(spec).config
    except (ImportError, ValueError) as err:
        raise ConfigError([Problem("--model", str(err))]) from None
    vocab = int(getattr(model_config, "vocab_size", 0) or 0)
    if vocab < 2:
        raise ConfigError([Problem("--model", f"{spec}: the planner feeds random token ids and needs a vocab_size")])
    seed, shape = config.train.seed, (config.train.batch_size, config.model.seq_length)
    return ModelSource(lambda: random_model(spec[len("hf:"):], seed), lambda step: _tokens(vocab, shape, seed + step),
                       _loss, layers)


def _tokens(vocab: int, shape: tuple[int, int], seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids}


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The step's loss, without a key/value cache: training needs none, and a cache in a recomputed
    layer would only bring swapkit's warning (``swapkit.runtime.kv_cache``), which a CLI user could
    not act on."""
    if "use_cache" in inspect.signature(model.forward).parameters:
        batch = {**batch, "use_cache": False}
    out = model(**batch, labels=batch["input_ids"]) if _has_lm_head(model) else model(**batch)
    return out.loss if _has_lm_head(model) else out[0].float().pow(2).mean()


def _has_lm_head(model: nn.Module) -> bool:
    return type(model).__name__.endswith("ForCausalLM")
