"""The measurement runs' own warnings: held back, and what in them concerns the user's config said as such.

Note [Warnings about the measurement runs]
The planner measures configs it writes itself (``swapkit.planner.measure.mode_config``: every layer
kept, recomputed, select-recomputed, or swapped with distance 1), each under a real session that
warns as it would for a user's config: the swap probe runs under the user's ``runtime`` settings
(but for ``runtime.max_host_bytes``, which the replay models instead:
``swapkit.planner.measure.mode_config``), so with a ``runtime.min_offload_bytes`` above every saved
tensor its session said "swap moved nothing off the device in step 1", a step and a swap the user
never configured. While the runs are measured, WARNING records of the loggers that speak for a
session or a plan (:data:`RUN_LOGGERS`) are therefore held back (a filter on each logger: a filter
on a parent logger does not see its children's records). Afterwards the planner says, about the
user's config, what the held-back warnings stood for (:func:`setting_warnings`: the swap settings
that leave the planner nothing to swap, from the measured sizes; for a pipeline config once, not
once per stage measured, unless a setting leaves only some stages nothing:
:func:`stage_setting_warnings`); the others are logged at DEBUG (``-v``), naming the run they came
from. The input config's own warnings were logged when it was loaded.
INFO lines (the runs' ``Formative`` / ``Set`` lines, shown with ``--log``) pass unchanged.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

from swapkit.config.types import RuntimeConfig

RUN_LOGGERS = ("swapkit.api", "swapkit.runtime.session", "swapkit.runtime.stage_session", "swapkit.runtime.reports",
               "swapkit.runtime.binding", "swapkit.runtime.recompute", "swapkit.runtime.kv_cache", "swapkit.train.loop")


class HeldWarnings(logging.Filter):
    """Holds back WARNING (and higher) records; lets the rest through."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        message = record.getMessage()
        if message not in self.messages:
            self.messages.append(message)
        return False


@contextmanager
def held_warnings(logger: logging.Logger) -> Iterator[HeldWarnings]:
    """Hold back the measurement runs' warnings inside the block; afterwards log each at DEBUG on ``logger``.

    Note [Warnings about the measurement runs].
    """
    held = HeldWarnings()
    loggers = [logging.getLogger(name) for name in RUN_LOGGERS]
    for one in loggers:
        one.addFilter(held)
    try:
        yield held
    finally:
        for one in loggers:
            one.removeFilter(held)
        for message in held.messages:
            logger.debug("a measurement run (a config the planner wrote, not yours) warned: %s", message)


def setting_warnings(runtime: RuntimeConfig, sizes: list[int], what: str = "this model") -> list[str]:
    """What the user's swap settings leave the planner, given every saved storage's size: nothing to
    swap when ``runtime.min_offload_bytes`` is above all of them or ``runtime.max_host_bytes`` below
    every one it could swap (a cap that holds some of them is planned with: ``swapkit.plan.hostpool``
    Note [The host pool in the replay]). ``what`` names whose storages they are."""
    if not sizes:
        return []
    largest, floor = max(sizes), runtime.min_offload_bytes
    if floor > largest:
        return [f"runtime.min_offload_bytes: {floor} is larger than every saved tensor of {what} (the largest "
                f"is {largest} bytes): the planner found nothing to swap (it plans keep and recompute only); lower it "
                f"to {largest} or less to let it swap"]
    swappable = [size for size in sizes if size >= floor]
    cap = runtime.max_host_bytes
    if cap is not None and cap < min(swappable):
        return [f"runtime.max_host_bytes: {cap} is smaller than every saved tensor the planner could swap in {what} "
                f"(the smallest is {min(swappable)} bytes): the host pool can hold none of them, so the planner "
                f"found nothing to swap (it plans keep and recompute only); raise it to at least {max(swappable)} "
                "or remove it to let it swap"]
    return []


def stage_setting_warnings(runtime: RuntimeConfig, sizes: list[list[int]]) -> list[str]:
    """:func:`setting_warnings` for a pipeline, given each stage's storage sizes: said once about the
    user's config where a setting leaves no stage anything to swap, else once per stage it leaves
    nothing (a warning that really differs per stage)."""
    whole = setting_warnings(runtime, [size for stage in sizes for size in stage], "any stage")
    if whole:
        return whole
    return [message for stage, one in enumerate(sizes) for message in setting_warnings(runtime, one, f"stage {stage}")]
