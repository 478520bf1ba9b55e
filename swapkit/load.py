"""``load_config``: where the two pure packages meet.

:mod:`swapkit.config` reads what the file says; :mod:`swapkit.plan` finds the problems that need the
layout. Both add to one problem list, so a file with five mistakes gets one error listing five.
Neither package imports torch.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

from swapkit.config.errors import Problem, Problems
from swapkit.config.loader import (blame_overrides, override_name, override_word, read_config, source_name,
                                   warn_inactive_swap, warn_no_effect, warn_written)
from swapkit.config.types import Config
from swapkit.plan.plan import check_plan
from swapkit.plan.readings import count_shaped_warnings, flip_warnings

logger = logging.getLogger(__name__)
SWAP_KEY = "swap_config.swap"


def load_config(source: str | Path | Mapping[str, Any], overrides: Sequence[str] = ()) -> Config:
    """Load and validate a swapkit config.

    Args:
        source: a YAML file path, or a dict in the YAML layout.
        overrides: ``"dotted.key=value"`` strings applied before validation (values are YAML).

    Returns:
        The validated :class:`Config`.

    Raises:
        ConfigError: listing every problem, each with its key path, the bad value and the fix.
        TypeError: ``overrides`` is one string instead of a list of them.

    Example:
        >>> cfg = load_config({"model": {"model_config": {"num_layers": 4}}})
        >>> cfg.model.num_layers
        4
    """
    config = validated_config(source, overrides)
    warn_no_effect(config)
    warn_inactive_swap(config)
    warn_written(config)
    for message in _flipped(source, overrides, config) or count_shaped_warnings(config):
        logger.warning(message)  # Note [Two readings of a recompute list]
    return config


def validated_config(source: str | Path | Mapping[str, Any], overrides: Sequence[str] = ()) -> Config:
    """:func:`load_config` without its warnings: for a config derived from one already loaded (the
    budget planner's output), whose warnings the user has seen once.

    Raises:
        ConfigError: as :func:`load_config`.
        TypeError: as :func:`load_config`.
    """
    if isinstance(overrides, (str, bytes)):  # a str is a sequence too: one problem per character
        raise TypeError(f"overrides: got the string {overrides!r}; expected a list of 'dotted.key=value' strings: "
                        f"overrides=[{overrides!r}]")
    problems = Problems()
    config = read_config(source, overrides, problems)
    if config is not None and config.model.num_layers is not None:  # else the model counts them (apply)
        check_plan(config, problems, for_model=False)
    blame_overrides(problems, overrides)  # Note [Blame the command line]
    if problems and config is not None:
        _blame_the_flip(source, overrides, config, problems)
    problems.raise_if_any(source_name(source))
    return config


def _file_swap(source: str | Path | Mapping[str, Any], overrides: Sequence[str]) -> bool | None:
    """``swap_config.swap`` as the file (with the other overrides) says, if an override changes it."""
    if not any(item.partition("=")[0].strip() == SWAP_KEY for item in overrides):
        return None
    rest = [item for item in overrides if item.partition("=")[0].strip() != SWAP_KEY]
    file_config = read_config(source, rest, Problems())
    return None if file_config is None else file_config.swap.swap


def _blame_the_flip(source: str | Path | Mapping[str, Any], overrides: Sequence[str], config: Config,
                    problems: Problems) -> None:
    """A config that fails after an override of ``swap_config.swap`` flipped the file: say the flip changed the
    lists' reading."""
    file_swap = _file_swap(source, overrides)
    if not isinstance(config.swap.swap, bool):  # the override's value is itself wrong (reported): no flip
        return
    if file_swap is not None and file_swap != config.swap.swap and flip_warnings(config, file_swap):
        now, before = ("true", "false") if config.swap.swap else ("false", "true")
        index = max(i for i, item in enumerate(overrides) if item.partition("=")[0].strip() == SWAP_KEY)
        problems.items.append(Problem(SWAP_KEY, origin=override_name(overrides, index, overrides[index]), message=(
            f"the override flips the file's {before} to {now}, and with it what the recompute lists mean (per-stage "
            f"counts with swap off, global layer indices with swap on); the problems above may come from that: "
            f"drop the {override_word(overrides)} or rewrite the lists")))


def _flipped(source: str | Path | Mapping[str, Any], overrides: Sequence[str], config: Config) -> list[str]:
    """An override of ``swap_config.swap`` changed what the recompute lists mean: both readings."""
    file_swap = _file_swap(source, overrides)
    return [] if file_swap is None else flip_warnings(config, file_swap)
