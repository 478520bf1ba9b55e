"""Memory sizes as users write them: ``64MiB``, ``1.5GiB``, ``500MB``, or a byte count. Pure."""
from __future__ import annotations

import re

from swapkit.config.errors import ConfigError, Problem

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_size(text: str, key: str = "--budget") -> int:
    """Bytes in ``text``.

    Raises:
        ConfigError: not a positive size with a known unit (the message names ``key`` and the fix).

    Example:
        >>> parse_size("1.5GiB"), parse_size("64MiB"), parse_size("1000")
        (1610612736, 67108864, 1000)
    """
    match = _SIZE.fullmatch(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in UNITS:
        raise ConfigError([Problem(key, f"got {text!r}; expected a size such as 64MiB, 1.5GiB, 500MB or a byte "
                                        "count (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")])
    nbytes = int(float(match.group(1)) * UNITS[unit])
    if nbytes < 1:
        raise ConfigError([Problem(key, f"got {text!r}; expected at least 1 byte")])
    return nbytes
