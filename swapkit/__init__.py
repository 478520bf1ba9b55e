"""swapkit: operator-granularity activation memory management for PyTorch training.

Per layer and per operator, every tensor autograd saves is kept on the device, swapped to host
memory and prefetched back ahead of need, or recomputed — driven by MindFormers-style YAML.
"""
from swapkit.api import apply
from swapkit.binding import BindError
from swapkit.config import Config
from swapkit.errors import ConfigError
from swapkit.loader import load_config
from swapkit.plan import LayerPlan, Plan, build_plan
from swapkit.session import SwapSession
from swapkit.stats import SwapStats

__all__ = ["BindError", "Config", "ConfigError", "LayerPlan", "Plan", "SwapSession", "SwapStats", "apply",
           "build_plan", "load_config"]
__version__ = "0.1.0"
