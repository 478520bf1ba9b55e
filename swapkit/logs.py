"""Logging helpers shared by the CLI and the rank launcher (no torch import)."""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator


@contextlib.contextmanager
def quieter(name: str, level: int) -> Iterator[None]:
    """The logger ``name`` logs only records at ``level`` and above inside the block; its own level after."""
    logger = logging.getLogger(name)
    previous = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(previous)
