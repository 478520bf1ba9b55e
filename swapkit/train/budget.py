"""Before building anything: will the model and one step fit in memory?

Note [Memory estimate]
Sizes pass the schema's limits one by one but not together: ``vocab_size: 1048576`` with
``hidden_size: 65536`` asks for a 256 GiB embedding, and ``batch_size: 65536`` for terabytes of
activations. Allocating them fails deep in torch (or gets the process killed). The estimate below
counts parameters, gradients and AdamW's two moments (4 x fp32 per parameter) and a generous bound
of one step's activations (the logits three times; per layer the projections, the feed-forward
and the attention scores); when it exceeds the memory available now it is a ConfigError naming
the sizes. It is an upper-bound sanity check, not a planner: a run that passes may still run out
of memory, which the CLI reports as a runtime failure. The same check guards ``swapkit plan
--budget``, which trains real weights too (the built-in model, its pipeline stage chunks, or a
``--model hf:...`` model, whose sizes come from its transformers config: :class:`StepSizes`).
"""
from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from swapkit.config.errors import ConfigError, Problem
from swapkit.config.types import Config
from swapkit.train.summary import human_bytes

FP32 = 4
BUILTIN_FIX = "Reduce these sizes"


@dataclass(frozen=True)
class StepSizes:
    """What the estimate reads: a model's parameter count and shapes, and one micro-batch's."""

    parameters: int
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    vocab_size: int
    seq_length: int
    batch_size: int

    def describe(self) -> str:
        """``'1,234 parameters: vocab_size 256, hidden_size 64, ...'`` for an error message."""
        return (f"{self.parameters:,} parameters: vocab_size {self.vocab_size}, hidden_size {self.hidden_size}, "
                f"intermediate_size {self.intermediate_size}, num_layers {self.num_layers}")


def parameter_count(config: Config) -> int:
    m = config.model
    per_layer = 4 * m.hidden_size ** 2 + 3 * m.hidden_size * m.intermediate_size + 2 * m.hidden_size
    return 2 * m.vocab_size * m.hidden_size + m.num_layers * per_layer + m.hidden_size


def builtin_sizes(config: Config) -> StepSizes:
    """The built-in model's sizes as ``config`` gives them (``num_layers`` must be set)."""
    m = config.model
    return StepSizes(parameter_count(config), m.num_layers, m.hidden_size, m.intermediate_size, m.num_heads,
                     m.vocab_size, m.seq_length, config.train.batch_size)


def activation_bytes(sizes: StepSizes) -> int:
    s, tokens = sizes, sizes.batch_size * sizes.seq_length
    per_layer = tokens * (12 * s.hidden_size + 4 * s.intermediate_size + 2 * s.num_heads * s.seq_length)
    return FP32 * (s.num_layers * per_layer + 3 * tokens * s.vocab_size)


def step_bytes(sizes: StepSizes) -> int:
    """Upper-bound bytes of one training step of a model of these sizes; Note [Memory estimate]."""
    return FP32 * 4 * sizes.parameters + activation_bytes(sizes)


def estimate_bytes(config: Config) -> int:
    """Upper-bound bytes of one training step of the built-in model; Note [Memory estimate]."""
    return step_bytes(builtin_sizes(config))


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


def check_memory(config: Config, device: torch.device) -> None:
    """Raise a ConfigError when the built-in model's run cannot fit (Note [Memory estimate])."""
    check_step_memory(builtin_sizes(config), device, "the built-in model", BUILTIN_FIX, config.source)


def check_step_memory(sizes: StepSizes, device: torch.device, model: str, fix: str, source: str | None = None,
                      copies: int = 1) -> None:
    """Raise a ConfigError when ``copies`` runs of a model of ``sizes`` cannot fit on ``device``.

    Args:
        sizes: the model's and the micro-batch's sizes.
        device: where the runs allocate.
        model: what the message calls the model (``"the built-in model"``, ``"--model hf:llama"``).
        fix: the message's last sentence: what to change.
        source: the config's source, for the error's heading.
        copies: runs held in memory at once (the planner's side-by-side measurement runs).

    Raises:
        ConfigError: at ``model.model_config``, naming the sizes, the estimate, the memory available and ``fix``.
    """
    need, have = copies * step_bytes(sizes), available_bytes(device)
    if need <= have:
        return
    held = f" ({copies} runs held at once)" if copies > 1 else ""
    raise ConfigError([Problem("model.model_config", (
        f"{model} ({sizes.describe()}) with train.batch_size {sizes.batch_size} x seq_length {sizes.seq_length} "
        f"needs about {human_bytes(need)}{held}; {device} has {human_bytes(have)} available. {fix}"))], source)
