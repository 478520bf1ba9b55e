"""swapkit with Hugging Face transformers: a ``Trainer`` callback and meta-device models for planning.

``attach(trainer, config)`` applies the config to ``trainer.model`` (its family's preset is picked
from ``config.model_type``) and adds a :class:`SwapkitCallback`, which activates the session for
every optimizer step's forwards and backwards and adds swapkit's stats to the Trainer's logs.

Note [Where the Trainer's step begins and ends]
``Trainer`` calls ``on_step_begin`` before the first micro-batch of an optimizer step and
``on_pre_optimizer_step`` after the last micro-batch's backward, before gradient clipping is
applied to the optimizer. Between the two run only ``training_step`` calls (forward + backward of
each micro-batch; each micro-batch is its own swapkit step, DESIGN §8), so the session is active
exactly around them: evaluation, logging and checkpointing run after ``on_step_end``, outside it.
If a training step raises, the Trainer calls no further callback: :func:`attach` wraps
``trainer.train`` so that the session is closed (its step marked aborted) before the error
propagates, and saved-tensor hooks never outlive the run.
"""
from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, TrainerCallback

import swapkit
from swapkit.config.types import Config
from swapkit.runtime.session import SwapSession

logger = logging.getLogger(__name__)
MIB = 1 << 20


class SwapkitCallback(TrainerCallback):
    """Activates a :class:`SwapSession` around each training step and logs its stats.

    See Note [Where the Trainer's step begins and ends]. The logged keys are
    ``swapkit/offloaded_MiB``, ``swapkit/peak_saved_MiB``, ``swapkit/saved_MiB``,
    ``swapkit/late_fetches`` and ``swapkit/wait_s`` of the last finished micro-batch.
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
    }


def attach(trainer: Any, config: Config | Mapping[str, Any] | str | Path, layers: str | None = None) -> SwapkitCallback:
    """Apply ``config`` to ``trainer.model`` and register the callback: one call before ``trainer.train()``.

    Args:
        trainer: a ``transformers.Trainer``.
        config: a swapkit config (``Config``, dict in the YAML layout, or YAML path);
            ``model.model_config.num_layers`` may be left out (counted from the model).
        layers: dotted path of the layer container (``"model.layers"``); ``None`` auto-detects.

    Returns:
        The callback; ``callback.session`` is the :class:`SwapSession` (call ``remove()`` to undo).

    Example:
        >>> callback = attach(trainer, {"swap_config": {"swap": True}})  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
    """
    session = swapkit.apply(trainer.model, config, layers=layers)
    callback = SwapkitCallback(session)
    trainer.add_callback(callback)
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


def meta_model(spec: str) -> nn.Module:
    """A transformers model built on the meta device from a ``model_type`` or a ``config.json`` path.

    Raises:
        ValueError: unknown model type, or a file that is not a transformers config.
    """
    path = Path(spec)
    if path.is_dir() or path.suffix == ".json":
        model_config = _config_from_file(path / "config.json" if path.is_dir() else path)
    else:
        try:
            model_config = AutoConfig.for_model(spec)
        except ValueError as err:
            raise ValueError(f"--model hf:{spec}: not a transformers model_type or config.json path ({err})") from None
    with torch.device("meta"):
        return AutoModel.from_config(model_config)


def random_model(spec: str, seed: int = 0) -> nn.Module:
    """The model ``spec`` names (as :func:`meta_model`) with seeded random weights on the CPU: the
    family's causal-LM head when it has one, else the base model (``swapkit plan --budget --model``).

    Raises:
        ValueError: as :func:`meta_model`.
    """
    model_config = meta_model(spec).config
    torch.manual_seed(seed)
    try:
        return AutoModelForCausalLM.from_config(model_config)
    except ValueError:  # a family without a causal-LM head
        return AutoModel.from_config(model_config)


def _config_from_file(path: Path) -> Any:
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--model hf:{path}: cannot read a config.json ({err})") from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise ValueError(f"--model hf:{path}: a transformers config.json needs a model_type key")
    return AutoConfig.for_model(values.pop("model_type"), **values)
