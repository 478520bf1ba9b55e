"""What the config file says, read strictly into frozen dataclasses. Pure: imports no torch.

``types`` holds the dataclasses, ``schema`` and ``fields`` the key tables and field checks,
``loader`` reads YAML (or a dict) and ``megatron`` / ``swap_entries`` the sections whose keys
depend on each other. Every problem goes to one :class:`~swapkit.config.errors.Problems` list.
"""
from swapkit.config.errors import ConfigError, Problem, Problems
from swapkit.config.loader import read_config
from swapkit.config.types import (
    Config,
    EngineOptions,
    MegatronRecompute,
    MindFormersRecompute,
    ModelConfig,
    ParallelConfig,
    RuntimeConfig,
    SwapConfig,
    SwapEntry,
    TrainConfig,
)

__all__ = ["Config", "ConfigError", "EngineOptions", "MegatronRecompute", "MindFormersRecompute", "ModelConfig",
           "ParallelConfig", "Problem", "Problems", "RuntimeConfig", "SwapConfig", "SwapEntry", "TrainConfig",
           "read_config"]
