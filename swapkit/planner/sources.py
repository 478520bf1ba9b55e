"""``swapkit plan --budget --model hf:...``: a tiny-step recipe for a transformers model.

The planner has to run training steps, so it needs real weights (random, seeded), a batch and a
loss. For ``hf:<model_type>`` or ``hf:<config.json>`` the model is built in its training form
(:func:`swapkit.integrations.transformers.random_model`): the masked-LM model of an encoder-only
config (BERT, RoBERTa, ...; loss: cross entropy predicting every random token), else the family's
causal-LM model (loss: next-token cross entropy on random tokens), else the base model, with the mean
square of its last hidden state as a stand-in loss. Other ``--model`` forms name a factory
whose inputs swapkit cannot know: plan those from Python with
:class:`~swapkit.planner.steps.ModelSource`.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch
from torch import nn

from swapkit.config.errors import ConfigError, Problem
from swapkit.config.types import Config
from swapkit.planner.steps import ModelSource
from swapkit.train.budget import StepSizes, check_step_memory


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
        from swapkit.integrations.transformers import has_lm_loss, meta_random_model, random_model

        meta = meta_random_model(spec[len("hf:"):])
    except (ImportError, ValueError) as err:
        raise ConfigError([Problem("--model", str(err).removeprefix("--model "))]) from None
    vocab = int(getattr(meta.config, "vocab_size", 0) or 0)
    if vocab < 2:
        raise ConfigError([Problem("--model", f"{spec}: the planner feeds random token ids and needs a vocab_size")])
    seed, shape = config.train.seed, (config.train.batch_size, config.model.seq_length)
    return ModelSource(lambda: random_model(spec[len("hf:"):], seed), lambda step: _tokens(vocab, shape, seed + step),
                       functools.partial(_loss, lm=has_lm_loss(meta)), layers,
                       _memory_check(spec, hf_sizes(meta, config), config.source))


def hf_sizes(meta: nn.Module, config: Config) -> StepSizes:
    """A transformers model's sizes (its config's, through the family's attribute map: ``n_embd`` is
    ``hidden_size`` for gpt2) and the config's micro-batch, for the memory estimate."""
    model_config = meta.config

    def size(name: str, default: int = 0) -> int:
        return int(getattr(model_config, name, None) or default)

    hidden = size("hidden_size")
    return StepSizes(sum(p.numel() for p in meta.parameters()), size("num_hidden_layers"), hidden,
                     size("intermediate_size", 4 * hidden), size("num_attention_heads"), size("vocab_size"),
                     config.model.seq_length, config.train.batch_size)


def _memory_check(spec: str, sizes: StepSizes, source: str | None) -> Callable[[torch.device, int], None]:
    """``swapkit.train.budget`` Note [Memory estimate] for ``--model hf:...``, run before its weights are built."""
    fix = ("Plan a smaller model: --model hf:<config.json> with fewer num_hidden_layers or a smaller hidden_size "
           "(model.model_config.num_layers only counts the model's layers), or lower train.batch_size or "
           "model.model_config.seq_length")
    return lambda device, copies: check_step_memory(sizes, device, f"--model {spec}", fix, source, copies)


def _tokens(vocab: int, shape: tuple[int, int], seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids}


def _loss(model: nn.Module, batch: dict[str, torch.Tensor], lm: bool | None = None) -> torch.Tensor:
    """The step's loss, without a key/value cache: training needs none, and a cache in a recomputed
    layer would only bring swapkit's warning (``swapkit.runtime.kv_cache``), which a CLI user could
    not act on. ``lm``: a causal- or masked-LM model (``has_lm_loss``), whose ``labels`` give its loss (a
    masked LM's logits cover every position whichever tokens are labelled, so labelling all of them
    measures the memory of masking some; ``None``: looked up); else the mean square of the base model's last
    hidden state."""
    if lm is None:
        from swapkit.integrations.transformers import has_lm_loss

        lm = has_lm_loss(model)
    if "use_cache" in inspect.signature(model.forward).parameters:
        batch = {**batch, "use_cache": False}
    if lm:
        return model(**batch, labels=batch["input_ids"]).loss
    return model(**batch)[0].float().pow(2).mean()
