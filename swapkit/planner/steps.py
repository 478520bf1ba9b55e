"""What the planner measures: one training step of a model under a swap session.

:class:`BuiltinSteps` runs ``swapkit train``'s own step on the built-in model; :class:`ModelSteps`
runs a user's model (a factory, a batch, a loss: forward, backward, AdamW) so that a transformers
model or any ``nn.Module`` with a layer container can be planned the same way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from swapkit.api import apply
from swapkit.config.types import Config
from swapkit.runtime.session import SwapSession
from swapkit.train.loop import _start, _train_step


@dataclass(frozen=True)
class ModelSource:
    """A user's model for the planner.

    Args:
        factory: builds a fresh model (same weights every call: seed inside), on the CPU.
        batch: step number -> the batch the loss takes.
        loss: ``(model, batch) -> scalar loss``.
        layers: dotted path of the layer container (``"model.layers"``); ``None`` auto-detects.
        check_memory: ``(device, copies) -> None``, raising a ConfigError when ``copies`` runs of the
            model cannot fit on ``device`` (:func:`swapkit.train.budget.check_step_memory`); the
            planner calls it before the factory. ``None``: not checked.
    """

    factory: Callable[[], nn.Module]
    batch: Callable[[int], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    layers: str | None = None
    check_memory: Callable[[torch.device, int], None] | None = None


class BuiltinSteps:
    """``swapkit train``'s step on the built-in model (:mod:`swapkit.train.loop`)."""

    def __init__(self, config: Config, device: torch.device) -> None:
        self.run = _start(config, device, 1 << 30, None)
        self.session: SwapSession = self.run.session
        self.device = device

    def step(self, number: int) -> None:
        _train_step(self.run, number)

    def close(self) -> None:
        self.session.remove()


class ModelSteps:
    """A user's model: zero grads, forward and loss and backward under the session, AdamW step."""

    def __init__(self, config: Config, source: ModelSource, device: torch.device) -> None:
        self.model = source.factory().to(device).train()
        self.source, self.device = source, device
        self.session: SwapSession = apply(self.model, config, layers=source.layers)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.train.lr)

    def step(self, number: int) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        batch = _to(self.source.batch(number), self.device)
        with self.session:
            self.source.loss(self.model, batch).backward()
        self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.session.remove()


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {key: _to(value, device) for key, value in batch.items()}
    return batch
