"""What one ``swapkit train`` run holds and what it returns."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from swapkit.config.types import Config
from swapkit.runtime.session import SwapSession
from swapkit.train.data import SyntheticTokens
from swapkit.train.model import LlamaModel


@dataclass
class TrainResult:
    """What a run produced: ``losses[i]`` is the loss of step ``i + 1`` (resumed steps included)."""

    losses: list[float]
    steps: list[dict[str, Any]]
    summary: dict[str, Any]


@dataclass
class RunState:
    """Everything one training run holds; built by :func:`_start`, closed by :func:`train`."""

    config: Config
    device: torch.device
    total_steps: int
    model: LlamaModel
    optimizer: torch.optim.Optimizer
    data: SyntheticTokens
    session: SwapSession | None = None
    step: int = 0  # completed steps
    records: list[dict[str, Any]] = field(default_factory=list)
    env: dict[str, Any] = field(default_factory=dict)
    metrics_out: Path | None = None
    status: str = "running"
    resumed_from: str | None = None  # the checkpoint this run continued from
    resumed_step: int = 0  # its step: records up to it ran before the resume (summary Note [Figures after a resume])
    resume_notes: list[str] = field(default_factory=list)  # what changed since it (Note [Resume differences])
    metrics_written_at: float = float("-inf")  # perf_counter() after the last metrics write (Note [Metrics writes])
    metrics_write_seconds: float = 0.0  # how long that write took
