"""Before building anything: will the built-in model and one step fit in memory?

Note [Memory estimate]
Sizes pass the schema's limits one by one but not together: ``vocab_size: 1048576`` with
``hidden_size: 65536`` asks for a 256 GiB embedding, and ``batch_size: 65536`` for terabytes of
activations. Allocating them fails deep in torch (or gets the process killed). The estimate below
counts parameters, gradients and AdamW's two moments (4 x fp32 per parameter) and a generous bound
of one step's activations (the logits three times; per layer the projections, the feed-forward
and the attention scores); when it exceeds the memory available now it is a ConfigError naming
the sizes. It is an upper-bound sanity check, not a planner: a run that passes may still run out
of memory, which the CLI reports as a runtime failure.
"""
from __future__ import annotations

import psutil
import torch

from swapkit.config.errors import ConfigError, Problem
from swapkit.config.types import Config
from swapkit.train.summary import human_bytes

FP32 = 4


def parameter_count(config: Config) -> int:
    m = config.model
    per_layer = 4 * m.hidden_size ** 2 + 3 * m.hidden_size * m.intermediate_size + 2 * m.hidden_size
    return 2 * m.vocab_size * m.hidden_size + m.num_layers * per_layer + m.hidden_size


def activation_bytes(config: Config) -> int:
    m, tokens = config.model, config.train.batch_size * config.model.seq_length
    per_layer = tokens * (12 * m.hidden_size + 4 * m.intermediate_size + 2 * m.num_heads * m.seq_length)
    return FP32 * (m.num_layers * per_layer + 3 * tokens * m.vocab_size)


def estimate_bytes(config: Config) -> int:
    """Upper-bound bytes of one training step; Note [Memory estimate]."""
    return FP32 * 4 * parameter_count(config) + activation_bytes(config)


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


def check_memory(config: Config, device: torch.device) -> None:
    """Raise a ConfigError when the run cannot fit (Note [Memory estimate])."""
    need, have = estimate_bytes(config), available_bytes(device)
    if need <= have:
        return
    m = config.model
    raise ConfigError([Problem("model.model_config", (
        f"the built-in model ({parameter_count(config):,} parameters: vocab_size {m.vocab_size}, hidden_size "
        f"{m.hidden_size}, intermediate_size {m.intermediate_size}, num_layers {m.num_layers}) with "
        f"train.batch_size {config.train.batch_size} x seq_length {m.seq_length} needs about {human_bytes(need)}; "
        f"{device} has {human_bytes(have)} available. Reduce these sizes"))], config.source)
