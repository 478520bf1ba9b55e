"""Memory sizes as users write them: ``64MiB``, ``1.5GiB``, ``500MB``, or a byte count. Pure."""
from __future__ import annotations

import re
from fractions import Fraction

from swapkit.config.errors import ConfigError, Problem, clip
from swapkit.config.fields import SIZE_UNITS

UNITS = SIZE_UNITS
#: 1 EiB: far beyond any device, and small enough for the planner's float arithmetic.
MAX_SIZE = 2**60
#: Digits a size may have: 1 EiB has 19, and Python refuses int() of more than 4300 (Fraction raised it).
MAX_DIGITS = 40
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_size(text: str, key: str = "--budget") -> int:
    """Bytes in ``text``, exactly: a fraction of a unit is rounded down to whole bytes.

    Raises:
        ConfigError: not a positive size with a known unit, a byte count with a fraction (``1.5``)
            more than 1 EiB, or more than :data:`MAX_DIGITS` digits (the message names ``key`` and the fix).

    Example:
        >>> parse_size("1.5GiB"), parse_size("64MiB"), parse_size("1000")
        (1610612736, 67108864, 1000)
    """
    match = _SIZE.fullmatch(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in UNITS:
        raise ConfigError([Problem(key, f"got {_shown(text)}; expected a size such as 64MiB, 1.5GiB, 500MB or a "
                                        "byte count (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")])
    if len(match.group(1)) > MAX_DIGITS:
        raise ConfigError([Problem(key, f"got {_shown(text)}; expected at most 1 EiB ({MAX_SIZE} bytes), "
                                        f"written in at most {MAX_DIGITS} digits such as 64MiB")])
    exact = Fraction(match.group(1)) * UNITS[unit]
    _check_range(text, key, exact, unit)
    return int(exact)


def _shown(text: str) -> str:
    """``text`` quoted for a message, cut short (a pasted number may have thousands of digits)."""
    return clip(repr(str(text)), 60)


def _check_range(text: str, key: str, exact: Fraction, unit: str) -> None:
    """A whole byte count, at least 1 byte and at most :data:`MAX_SIZE`."""
    if exact < 1:
        raise ConfigError([Problem(key, f"got {_shown(text)}; expected at least 1 byte")])
    if UNITS[unit] == 1 and exact.denominator != 1:  # int() would read '1.5' as 1 byte without a word
        whole = int(exact)
        raise ConfigError([Problem(key, f"got {_shown(text)}; a byte count must be a whole number: write {whole} or "
                                        f"{whole + 1}, or a size with a unit such as 1.5MiB")])
    if exact > MAX_SIZE:
        raise ConfigError([Problem(key, f"got {_shown(text)}; expected at most 1 EiB ({MAX_SIZE} bytes)")])
