"""swapkit with Hugging Face transformers: a ``Trainer`` callback and meta-device models for planning.

``attach(trainer, config)`` applies the config to ``trainer.model`` (its family's preset is picked
from ``config.model_type``) and adds a :class:`SwapkitCallback`, which activates the session for
every optimizer step's forwards and backwards and adds swapkit's stats to the Trainer's logs.

Note [Where the Trainer's step begins and ends]
``Trainer`` calls ``on_step_begin`` before the first micro-batch of an optimizer step and
``on_pre_optimizer_step`` after the last micro-batch's backward and the gradient clipping, right
before ``optimizer.step()``. Between the two run the ``training_step`` calls (forward + backward of
each micro-batch; each micro-batch is its own swapkit step, DESIGN §8) and the clipping, which saves
nothing for backward, so the session is active around the step's forwards and backwards only:
evaluation (checked per batch by a test), logging and checkpointing run after ``on_step_end``, outside it.
If a training step raises, the Trainer calls no further callback: :func:`attach` wraps
``trainer.train`` so that the session is closed (its step marked aborted) before the error
propagates, and saved-tensor hooks never outlive the run.
"""
from __future__ import annotations

import difflib
import functools
import json
import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn
from transformers import (CONFIG_MAPPING, AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM,
                          TrainerCallback)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

import swapkit
from swapkit.config.errors import clip
from swapkit.config.types import Config
from swapkit.runtime.session import SwapSession

logger = logging.getLogger(__name__)
MIB = 1 << 20


class SwapkitCallback(TrainerCallback):
    """Activates a :class:`SwapSession` around each training step and logs its stats.

    See Note [Where the Trainer's step begins and ends]. The logged keys are
    ``swapkit/offloaded_MiB``, ``swapkit/peak_saved_MiB``, ``swapkit/saved_MiB``,
    ``swapkit/late_fetches``, ``swapkit/wait_s`` and ``swapkit/recomputed_regions`` (checkpointed
    regions run: layers, op scopes, Megatron units) of the last finished micro-batch.
    """

    def __init__(self, session: SwapSession) -> None:
        self.session = session

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()
        self.session.__enter__()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if logs is None or "loss" not in logs:  # training logs only, not eval or the final summary
            return
        values = stats_for_logs(self.session)
        logs.update(values)
        if state.log_history:
            state.log_history[-1].update(values)  # the Trainer stored its copy before calling us

    def _close(self, error: BaseException | None = None) -> None:
        if self.session.active:
            self.session.__exit__(type(error) if error else None, error, None)


def stats_for_logs(session: SwapSession) -> dict[str, float]:
    """The session's last-step stats as flat numbers for the Trainer's logs."""
    stats = session.stats
    return {
        "swapkit/offloaded_MiB": round(stats.offloaded_bytes / MIB, 3),
        "swapkit/peak_saved_MiB": round(stats.peak_device_bytes / MIB, 3),
        "swapkit/saved_MiB": round(stats.saved_bytes / MIB, 3),
        "swapkit/late_fetches": stats.late_fetches,
        "swapkit/wait_s": round(stats.wait_seconds, 6),
        "swapkit/recomputed_regions": sum(stats.recomputed_by_scope.values()),
    }


def attach(trainer: Any, config: Config | Mapping[str, Any] | str | Path,
           layers: str | Sequence[str] | None = None) -> SwapkitCallback:
    """Apply ``config`` to ``trainer.model`` and register the callback: one call before ``trainer.train()``.

    Args:
        trainer: a ``transformers.Trainer``.
        config: a swapkit config (``Config``, dict in the YAML layout, or YAML path);
            ``model.model_config.num_layers`` may be left out (counted from the model).
        layers: dotted path of the layer container (``"model.layers"``), or a list of them numbered in the
            order given (``["encoder.block", "decoder.block"]`` for T5), as :func:`swapkit.apply` takes;
            ``None`` auto-detects.

    Returns:
        The callback; ``callback.session`` is the :class:`SwapSession` (call ``remove()`` to undo). With
        ``Trainer(model_init=...)`` each model the Trainer builds gets a session of its own and
        ``callback.session`` is the latest one (Note [A Trainer that builds its model]).

    Example:
        >>> callback = attach(trainer, {"swap_config": {"swap": True}})  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
    """
    session = swapkit.apply(trainer.model, config, layers=layers)
    callback = SwapkitCallback(session)
    trainer.add_callback(callback)
    _run_first(trainer, callback)
    _follow_model_init(trainer, callback, config, layers)
    train = trainer.train

    @functools.wraps(train)
    def train_closing_on_error(*args: Any, **kwargs: Any) -> Any:
        try:
            return train(*args, **kwargs)
        except BaseException as error:  # see Note [Where the Trainer's step begins and ends]
            callback._close(error)
            raise

    trainer.train = train_closing_on_error
    return callback


# Note [A Trainer that builds its model]
# `Trainer(model_init=...)` builds a model in `__init__` and builds a new one at every `train()` (and
# every hyperparameter-search trial), replacing `trainer.model`. Applied once to the first model, swapkit
# would train the new one with nothing swapped (and its unused-swap warning would guess at a compiled
# graph). `attach` therefore wraps `model_init`: each model it builds gets its own session with the
# same config and layers, the previous session is removed first (its model comes back plain), and
# `callback.session` is the session of the model being trained (tests/test_trainer_hf_user.py).
def _follow_model_init(trainer: Any, callback: SwapkitCallback, config: Any, layers: Any) -> None:
    """Apply ``config`` to every model ``trainer.model_init`` builds (Note [A Trainer that builds its model])."""
    model_init = getattr(trainer, "model_init", None)
    if model_init is None:
        return

    @functools.wraps(model_init)  # keeps its signature: the Trainer passes the trial only if it takes one
    def model_init_with_swapkit(*args: Any) -> Any:
        model = model_init(*args)
        callback.session.remove()
        callback.session = swapkit.apply(model, config, layers=layers)
        return model

    trainer.model_init = model_init_with_swapkit


def _run_first(trainer: Any, callback: SwapkitCallback) -> None:
    """Call ``callback`` before the Trainer's other callbacks, so that the printer and every reporting
    integration (TensorBoard, W&B, ...) see swapkit's keys in the logs it adds (``on_log`` edits them in place)."""
    callbacks = trainer.callback_handler.callbacks
    callbacks.remove(callback)
    callbacks.insert(0, callback)


def meta_model(spec: str) -> nn.Module:
    """A transformers model built on the meta device from a ``model_type`` or a ``config.json`` path.

    Raises:
        ValueError: unknown model type, or a file that is not a transformers config.
    """
    path = Path(spec)
    if path.is_dir() or path.suffix == ".json":
        model_config = _config_from_file(path / "config.json" if path.is_dir() else path)
    else:
        model_config = _config_for_type(spec)
    try:
        with torch.device("meta"):
            return AutoModel.from_config(model_config)
    except Exception as err:  # noqa: BLE001 - transformers checks sizes (heads dividing hidden) as it builds
        raise _refused(spec, "cannot build a model from this config", err) from None


def random_model(spec: str, seed: int = 0) -> nn.Module:
    """The model ``spec`` names (as :func:`meta_model`) with seeded random weights on the CPU, in the
    form it is trained in (``swapkit plan --budget --model``): the masked-LM model of an encoder-only
    config (BERT, RoBERTa, ...), else the family's causal-LM model when it has one, else the base model.

    Raises:
        ValueError: as :func:`meta_model`.
    """
    model_config = meta_model(spec).config
    torch.manual_seed(seed)
    return _training_form(model_config)


def meta_random_model(spec: str) -> nn.Module:
    """:func:`random_model`'s model on the meta device: its parameters counted with no memory used.

    Raises:
        ValueError: as :func:`meta_model`.
    """
    model_config = meta_model(spec).config
    with torch.device("meta"):
        return _training_form(model_config)


def _training_form(model_config: Any) -> nn.Module:
    if is_encoder_only(model_config):
        return AutoModelForMaskedLM.from_config(model_config)
    try:
        return AutoModelForCausalLM.from_config(model_config)
    except ValueError:  # a family without a causal-LM head
        return AutoModel.from_config(model_config)


def has_lm_loss(model: nn.Module) -> bool:
    """Whether ``model`` is one of transformers' causal- or masked-LM models, whose ``labels`` give its training
    loss: ``LlamaForCausalLM``, ``BertForMaskedLM``, and those not named so, ``GPT2LMHeadModel`` among them."""
    names: set[str] = set()
    for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES):
        for value in mapping.values():
            names.update((value,) if isinstance(value, str) else value)
    return type(model).__name__ in names


def is_encoder_only(model_config: Any) -> bool:
    """Whether a config is an encoder trained as a masked LM (BERT, RoBERTa, ELECTRA, ...): a family with
    a masked-LM model, configured neither as a decoder nor as an encoder-decoder. Such families' causal-LM
    models (``BertLMHeadModel``) are decoders only with ``is_decoder=True``; built from the encoder's config
    they warn and train a head and an attention mask that BERT users do not."""
    return (model_config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES
            and not getattr(model_config, "is_decoder", False)
            and not getattr(model_config, "is_encoder_decoder", False))


def _config_for_type(model_type: str) -> Any:
    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=3, cutoff=0.8)
        hint = f"did you mean {', '.join(close)}?" if close else "e.g. llama, qwen2, gpt2 or a path to a config.json"
        raise ValueError(f"--model hf:{model_type}: not a transformers model_type nor a config.json path; {hint}")
    return AutoConfig.for_model(model_type)


def _config_from_file(path: Path) -> Any:
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--model hf:{path}: cannot read a config.json ({err})") from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise ValueError(f"--model hf:{path}: a transformers config.json needs a model_type key")
    try:
        return AutoConfig.for_model(values.pop("model_type"), **values)
    except Exception as err:  # noqa: BLE001 - transformers validates the file's values with several error types
        raise _refused(str(path), "refuses this config.json", err) from None


def _refused(spec: str, what: str, err: Exception) -> ValueError:
    """A transformers error about the user's config as a ``--model`` problem (exit 2, not a failed run)."""
    return ValueError(f"--model hf:{spec}: transformers {what}: {type(err).__name__}: "
                      f"{clip(' '.join(str(err).split()), 300)}; correct that value in the config")
