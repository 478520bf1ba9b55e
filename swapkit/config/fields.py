"""Small typed checks for config values, and a reader for one YAML mapping.

A check takes ``(value, path, problems)`` and returns the converted value, or :data:`INVALID`
after recording a problem. Checks never raise: the loader collects every problem of a file.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from swapkit.config.errors import Problems, join

INVALID: Any = type("Invalid", (), {"__repr__": lambda self: "INVALID"})()
Check = Callable[[Any, str, Problems], Any]


def is_int(value: Any) -> bool:
    """True for ints that are not bools (YAML ``true`` must never pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def boolean(value: Any, path: str, problems: Problems) -> Any:
    if isinstance(value, bool):
        return value
    problems.bad(path, value, "true or false")
    return INVALID


def integer(minimum: int | None = None, maximum: int | None = None) -> Check:
    def check(value: Any, path: str, problems: Problems) -> Any:
        if not is_int(value) or (minimum is not None and value < minimum) or (
            maximum is not None and value > maximum
        ):
            problems.bad(path, value, _int_range(minimum, maximum))
            return INVALID
        return value

    return check


def _int_range(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f"an integer from {minimum} to {maximum}"
    if minimum is not None:
        return f"an integer >= {minimum}"
    return "an integer"


def number(minimum: float | None = None, positive: bool = False, below: float | None = None) -> Check:
    """A real number; ``positive`` excludes 0, ``below`` is an exclusive upper bound."""

    def check(value: Any, path: str, problems: Problems) -> Any:
        ok = (is_int(value) or isinstance(value, float)) and value == value  # NaN fails
        ok = ok and (minimum is None or value >= minimum) and (not positive or value > 0)
        ok = ok and (below is None or value < below)
        if not ok:
            bound = "> 0" if positive else f">= {minimum}" if minimum is not None else ""
            upper = f" and < {below}" if below is not None else ""
            problems.bad(path, value, f"a number {bound}{upper}".strip())
            return INVALID
        return float(value)

    return check


def choice(*options: str, aliases: Mapping[str, str] | None = None) -> Check:
    aliases = dict(aliases or {})

    def check(value: Any, path: str, problems: Problems) -> Any:
        if isinstance(value, str) and value in options:
            return value
        if isinstance(value, str) and value in aliases:
            return aliases[value]
        problems.bad(path, value, "one of " + ", ".join(repr(o) for o in options))
        return INVALID

    return check


def string(value: Any, path: str, problems: Problems) -> Any:
    if isinstance(value, str) and value:
        return value
    problems.bad(path, value, "a non-empty string")
    return INVALID


def optional(check: Check) -> Check:
    """``null`` is allowed and kept as ``None``."""

    def wrapped(value: Any, path: str, problems: Problems) -> Any:
        return None if value is None else check(value, path, problems)

    return wrapped


def anything(value: Any, path: str, problems: Problems) -> Any:
    """Accept as is; a later stage (normalization) validates it with more context."""
    return value


def mapping(value: Any, path: str, problems: Problems) -> Any:
    if isinstance(value, dict):
        return value
    problems.bad(path, value, "a mapping")
    return INVALID


def string_list(value: Any, path: str, problems: Problems) -> Any:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    problems.bad(path, value, "a non-empty string or a non-empty list of strings")
    return INVALID


def layer_paths(value: Any, path: str, problems: Problems) -> Any:
    """One dotted path (kept as a string) or a list of distinct paths (a tuple, in the order given)."""
    if isinstance(value, str):
        return string(value, path, problems)
    if (isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value)
            and len(set(value)) == len(value)):
        return tuple(value)
    problems.bad(path, value, "a non-empty string or a list of distinct non-empty strings "
                 "(e.g. [encoder.block, decoder.block])")
    return INVALID


def pattern(value: Any, path: str, problems: Problems) -> Any:
    """An op pattern: components split on the two characters ``\\.``, each a valid regex."""
    if not isinstance(value, str) or not value:
        problems.bad(path, value, r"an op pattern such as 'feed_forward\.mul'")
        return INVALID
    for component in value.split(r"\."):
        try:
            re.compile(component)
        except re.error as err:
            problems.bad(path, value, "a valid regular expression in every \\.-separated component",
                         f"component {component!r} does not compile: {err}")
            return INVALID
        if not component:
            problems.bad(path, value, r"no empty component between '\.' separators")
            return INVALID
    return value


@dataclass(frozen=True)
class Key:
    """One key of a section: its check, its default, and whether it must be given."""

    check: Check
    default: Any = None
    required: bool = False


def read_section(
    raw: Any,
    path: str,
    keys: Mapping[str, Key],
    problems: Problems,
    no_effect: Mapping[str, Check] | None = None,
    notices: list[str] | None = None,
) -> dict[str, Any]:
    """Validate one mapping: unknown keys are errors, ``no_effect`` keys are checked and noted.

    Returns the values for ``keys`` with defaults filled in (``INVALID`` where a check failed).
    """
    no_effect = no_effect or {}
    values = {name: key.default for name, key in keys.items()}
    if raw is INVALID:  # the parent already reported it
        return {name: INVALID for name in keys}
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.bad(path, raw, "a mapping of keys to values")
        return {name: INVALID for name in keys}
    for name, value in raw.items():
        if name in keys:
            values[name] = keys[name].check(value, join(path, name), problems)
        elif name in no_effect:
            if no_effect[name](value, join(path, name), problems) is not INVALID and notices is not None:
                notices.append(join(path, name))
        else:
            problems.unknown_key(path, name, [*keys, *no_effect])
    for name, key in keys.items():
        if key.required and name not in raw:
            problems.add(join(path, name), "is required")
            values[name] = INVALID
    return values


def any_invalid(values: Mapping[str, Any]) -> bool:
    return any(v is INVALID for v in values.values())
