"""swapkit: operator-granularity activation memory management for PyTorch training.

Per layer and per operator, every tensor autograd saves is kept on the device, swapped to host
memory and prefetched back ahead of need, or recomputed — driven by MindFormers-style YAML.

The package follows the data flow, one folder per stage: ``config`` (strict reading) and
``plan`` (layout, normalization, per-layer decisions) are pure and import no torch;
``runtime`` (binding, saved-tensor hooks, recompute), ``engine`` (copy engines, host pool) and
``train`` (``swapkit train``) need torch. The torch-side names below are imported on first use,
so ``import swapkit.config`` works where torch is not installed.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

from swapkit.config import Config, ConfigError
from swapkit.load import load_config
from swapkit.plan import LayerPlan, Plan, build_plan

if TYPE_CHECKING:
    from swapkit.api import apply
    from swapkit.runtime.binding import BindError
    from swapkit.runtime.session import SwapSession
    from swapkit.runtime.stats import SwapStats

_TORCH_SIDE = {"apply": "swapkit.api", "BindError": "swapkit.runtime.binding",
               "SwapSession": "swapkit.runtime.session", "SwapStats": "swapkit.runtime.stats"}

__all__ = ["BindError", "Config", "ConfigError", "LayerPlan", "Plan", "SwapSession", "SwapStats", "apply",
           "build_plan", "load_config"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """Import the torch-side public names lazily (PEP 562)."""
    if name not in _TORCH_SIDE:
        raise AttributeError(f"module 'swapkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(_TORCH_SIDE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names, the lazy ones included, and the subpackages imported so far (tab completion,
    ``dir(swapkit)``), without the helpers this module imports (``importlib``, ``Any``)."""
    loaded = (name for name, value in globals().items()
              if isinstance(value, ModuleType) and value.__name__ == f"{__name__}.{name}")
    return sorted({*__all__, *loaded, *(name for name in globals() if name.startswith("__"))})
