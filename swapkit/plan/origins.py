r"""Where each op pattern of a plan was written: the key path an error about the pattern names.

Note [Where a pattern was written]
A pattern that matches no sub-module is an error (:mod:`swapkit.plan.unmatched`); the error must name
the key the user wrote, and a pattern does not always come from a key that holds it:
- ``op_swap`` entries and ``select_*`` dicts and lists hold it: ``swap_config.op_swap[0].op_name``
  (``...op_name[1]`` in a list of names), ``recompute_config.select_recompute.<pattern>`` or
  ``recompute_config.select_recompute[0]``;
- a ``select_*`` value that is not a dict or a list of names (``true``, counts) selects default
  patterns (MindFormers' Llama names ``feed_forward\.mul``, ...): the key is the ``select_*`` key, and
  the fix is an explicit op list;
- ``swap_config.swap: true`` with no lists selects the default swap op ``.*\.flash_attention``;
- a Megatron module gets its pattern from ``module_scopes`` only when the user mapped it there;
  otherwise from swapkit's built-in table, chosen by ``recompute_modules`` (or, when that is not
  written, by ``recompute_granularity: selective`` / ``recompute_activations: true``, whose default
  module is ``core_attn``). Blaming ``recompute_config.module_scopes`` there names a key the user never
  wrote; the error names the Megatron key and says how to map the module.
Patterns are recorded as written, before a model preset translates them. Pure: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swapkit.config.errors import join, join_key, show
from swapkit.config.types import Config, MegatronRecompute, SwapConfig
from swapkit.plan.normalize import DEFAULT_COMM, DEFAULT_SELECT, DEFAULT_SWAP_OP

#: How :mod:`swapkit.plan.unmatched` names the setting of a Megatron module's pattern.
MODULE_SCOPES = "recompute_config.module_scopes"


@dataclass(frozen=True)
class Origin:
    """One written (or defaulted) op pattern and the key path that put it in the plan."""

    kind: str  # select_recompute | select_comm_recompute | op_swap | recompute_config.module_scopes
    pattern: str  # as written, before a preset translated it
    path: str  # the key the user wrote
    default: str | None = None  # the value at ``path`` when the pattern is a default it selected
    module: str | None = None  # the Megatron module whose scope it is


def pattern_origins(config: Config) -> tuple[Origin, ...]:
    """Every op pattern of ``config`` with the key path it came from (Note [Where a pattern was written])."""
    rc = config.recompute
    if isinstance(rc, MegatronRecompute):
        found = _megatron(rc)
    else:
        found = (_select(rc.select_recompute, "select_recompute", DEFAULT_SELECT)
                 + _select(rc.select_comm_recompute, "select_comm_recompute", DEFAULT_COMM))
    return tuple(found + _op_swap(config.swap))


def find(origins: tuple[Origin, ...], kind: str, patterns: list[str]) -> Origin | None:
    """The first origin of ``kind`` for the first of ``patterns`` that has one."""
    for pattern in patterns:
        for origin in origins:
            if origin.kind == kind and origin.pattern == pattern:
                return origin
    return None


def _select(value: Any, kind: str, defaults: tuple[str, ...]) -> list[Origin]:
    path = f"recompute_config.{kind}"
    if isinstance(value, dict):
        return [Origin(kind, key, join_key(path, key)) for key in value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return [Origin(kind, key, join(path, index)) for index, key in enumerate(value)]
    if value is False:
        return []
    return [Origin(kind, pattern, path, default=show(value)) for pattern in defaults]


def _op_swap(swap: SwapConfig) -> list[Origin]:
    if swap.layer_swap is None and swap.op_swap is None:
        return [Origin("op_swap", DEFAULT_SWAP_OP, "swap_config.swap", default=show(swap.swap))]
    found = []
    for index, entry in enumerate(swap.op_swap or ()):
        path = join(join("swap_config.op_swap", index), "op_name")
        for position, name in enumerate(entry.op_names):
            found.append(Origin("op_swap", name, join(path, position) if len(entry.op_names) > 1 else path))
    return found


def _megatron(rc: MegatronRecompute) -> list[Origin]:
    if rc.recompute_granularity != "selective":
        return []
    chosen_by = next((key for key in ("recompute_modules", "recompute_granularity", "recompute_activations")
                      if key in rc.given), "recompute_granularity")
    found = []
    for module in rc.recompute_modules or ():
        mapped = f"module_scopes.{module}" in rc.given
        path = join(MODULE_SCOPES, module) if mapped else f"recompute_config.{chosen_by}"
        default = None if mapped else show(list(rc.recompute_modules) if chosen_by == "recompute_modules"
                                           else getattr(rc, chosen_by, True))
        found += [Origin(MODULE_SCOPES, pattern, path, default, module) for pattern in rc.module_scopes.get(module, ())]
    return found
