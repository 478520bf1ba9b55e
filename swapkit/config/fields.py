"""Small typed checks for config values, and a reader for one YAML mapping.

A check takes ``(value, path, problems)`` and returns the converted value, or :data:`INVALID`
after recording a problem. Checks never raise: the loader collects every problem of a file.
"""
from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Mapping, Sequence

import regex

from swapkit.config.errors import Problems, clip, join, show

INVALID: Any = type("Invalid", (), {"__repr__": lambda self: "INVALID"})()
Check = Callable[[Any, str, Problems], Any]


def is_int(value: Any) -> bool:
    """True for ints that are not bools (YAML ``true`` must never pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def boolean(value: Any, path: str, problems: Problems) -> Any:
    """``true``/``false``; YAML's ``yes``/``no``/``on``/``off`` arrive here as booleans (Note [YAML 1.1 booleans])."""
    if isinstance(value, bool):
        return value
    fix = None
    if isinstance(value, str):
        fix = ("write true or false, unquoted (y, n and quoted words are text; unquoted yes/no/on/off are booleans, "
               "as PyYAML and MindFormers read them)")
    problems.bad(path, value, "true or false", fix)
    return INVALID


#: The fix for a text key that got a boolean: the user may have written a bare ``off`` or ``no``
#: (Note [YAML 1.1 booleans]).
BOOLEAN_AS_TEXT = "an unquoted true/false, yes/no or on/off is a boolean in YAML; quote it ('off') if you mean the text"


def integer(minimum: int | None = None, maximum: int | None = None) -> Check:
    def check(value: Any, path: str, problems: Problems) -> Any:
        if not is_int(value) or (minimum is not None and value < minimum) or (
            maximum is not None and value > maximum
        ):
            above = is_int(value) and maximum is not None and value > maximum
            problems.bad(path, value, _int_range(minimum, maximum, above), yaml11_hint(value))
            return INVALID
        return value

    return check


#: Units of a memory size as users write them (``64MiB``); ``swapkit.plan.size`` parses ``--budget`` with them.
SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
#: at most 30 digits a side: the bytes are written out in the message, and Python refuses to write an int of
#: more than 4300 digits (a longer number is refused as any non-integer is)
_SIZE_WITH_UNIT = re.compile(r"\s*([0-9]{1,30}(?:\.[0-9]{0,30})?|\.[0-9]{1,30})\s*([kmgt]i?b|b)\s*", re.IGNORECASE)


def byte_count(minimum: int) -> Check:
    """A whole number of bytes; ``4GiB`` (a size as ``--budget`` takes it) is refused naming its bytes."""
    whole = integer(minimum)

    def check(value: Any, path: str, problems: Problems) -> Any:
        match = _SIZE_WITH_UNIT.fullmatch(value) if isinstance(value, str) else None
        if match:
            size = Fraction(match.group(1)) * SIZE_UNITS[match.group(2).lower()]
            problems.bad(path, value, f"a whole byte count >= {minimum}",
                         f"this key takes plain bytes, not a size with a unit: {_bytes_to_write(size, minimum)}")
            return INVALID
        return whole(value, path, problems)

    return check


def _bytes_to_write(size: Fraction, minimum: int) -> str:
    """What to write for a size with a unit that is ``size`` bytes."""
    if size.denominator == 1 and size >= minimum:
        return f"write {size}"
    return f"that is {float(size):.6g} bytes; write a whole number of bytes >= {minimum}"


_SEXAGESIMAL = re.compile(r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?")
_LEADING_ZERO = re.compile(r"[-+]?0[0-9_]+")
_DECIMAL = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def yaml11_hint(value: Any) -> str | None:
    """What YAML 1.1 would have read ``value`` as, when it is one of its surprises (Note [YAML 1.1 scalars])."""
    if not isinstance(value, str) or len(value) > 40:
        return None
    if _SEXAGESIMAL.fullmatch(value):
        return (f"{value!r} is read as text: YAML 1.1 reads it as a base-60 number (1:30 = 90); "
                "write the plain number you mean")
    if _LEADING_ZERO.fullmatch(value):
        return (f"{value!r} is read as text: YAML 1.1 reads a leading 0 as octal (010 = 8); "
                "write the number without leading zeros")
    if _DECIMAL.fullmatch(value.strip()):
        return f"{value!r} is text because it is quoted; write the number unquoted: {value.strip()}"
    return None


_BOOLEAN_WORDS = {"true": "true", "yes": "true", "on": "true", "false": "false", "no": "false", "off": "false"}


def quoted_hint(value: Any) -> str | None:
    """The fix for a value (or a list item) that is a boolean or an integer in quotes, as text: ``'True'`` is
    not ``true`` (a count or layer value that YAML read as text)."""
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(item, str) and item.strip().lower() in _BOOLEAN_WORDS:
            return f"{item!r} is text because it is quoted; write {_BOOLEAN_WORDS[item.strip().lower()]} unquoted"
        if isinstance(item, str) and re.fullmatch(r"[-+]?[0-9]+", item.strip()):
            return f"{item!r} is text because it is quoted; write the number unquoted: {item.strip()}"
    return None


def _int_range(minimum: int | None, maximum: int | None, above: bool = False) -> str:
    """The range in words; a far-away upper bound (a size limit) is named only when it was exceeded."""
    if minimum is not None and maximum is not None and (above or maximum <= 100_000):
        return f"an integer from {minimum} to {maximum}"
    if minimum is not None:
        return f"an integer >= {minimum}"
    return "an integer"


def number(minimum: float | None = None, positive: bool = False, below: float | None = None,
           maximum: float | None = None) -> Check:
    """A finite real number; ``positive`` excludes 0, ``below`` / ``maximum`` are upper bounds."""

    def check(value: Any, path: str, problems: Problems) -> Any:
        real = _finite(value)
        ok = real is not None and (minimum is None or real >= minimum) and (not positive or real > 0)
        ok = ok and (below is None or real < below) and (maximum is None or real <= maximum)
        if not ok:
            bound = "> 0" if positive else f">= {minimum}" if minimum is not None else ""
            above = real is not None and maximum is not None and real > maximum  # named only when exceeded
            upper = f" and < {below}" if below is not None else f" and <= {maximum:g}" if above else ""
            problems.bad(path, value, f"a number {bound}{upper}".strip(), _number_fix(value))
            return INVALID
        return real

    return check


def _number_fix(value: Any) -> str | None:
    if isinstance(value, float) and not math.isfinite(value) or is_int(value) and _finite(value) is None:
        return "numbers must be finite: .inf, .nan and values beyond 1.8e308 are not allowed"
    return yaml11_hint(value)


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, or ``None`` (bools, strings, .inf, .nan, ints beyond float range)."""
    if not (is_int(value) or isinstance(value, float)):
        return None
    try:
        real = float(value)
    except OverflowError:
        return None
    return real if math.isfinite(real) else None


def choice(*options: str, aliases: Mapping[str, str] | None = None) -> Check:
    aliases = dict(aliases or {})

    def check(value: Any, path: str, problems: Problems) -> Any:
        if isinstance(value, str) and value in options:
            return value
        if isinstance(value, str) and value in aliases:
            return aliases[value]
        problems.bad(path, value, "one of " + ", ".join(repr(o) for o in options),
                     BOOLEAN_AS_TEXT if isinstance(value, bool) else _closest_option(value, options))
        return INVALID

    return check


def _closest_option(value: Any, options: Sequence[str]) -> str | None:
    """``did you mean 'thread'?`` for ``'threads'``: the option a misspelt text value is closest to."""
    if not isinstance(value, str) or len(value) > 2 * max(map(len, options), default=0):
        return None  # no match at 0.8 is possible (ratio 2M / (len a + len b)); a 1 MB value costs no difflib
    close = difflib.get_close_matches(value.lower(), options, n=1, cutoff=0.8)  # not fp16 -> bf16
    return f"did you mean {close[0]!r}?" if close else None


def string(value: Any, path: str, problems: Problems) -> Any:
    if isinstance(value, str) and value:
        return value
    problems.bad(path, value, "a non-empty string", BOOLEAN_AS_TEXT if isinstance(value, bool) else None)
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
        return tuple(value) if few_patterns(len(value), value, path, problems) else INVALID
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


#: Longest op pattern accepted (MindFormers' longest is about 40 characters).
MAX_PATTERN_CHARS = 200
#: Op patterns one key may list (MindFormers configs list a handful). Plan and report work grows with
#: patterns x patterns x layers: 100 x 100 patterns on 1024 layers took a minute before this limit.
MAX_PATTERNS = 64


def few_patterns(count: int, value: Any, path: str, problems: Problems) -> bool:
    """At most ``MAX_PATTERNS`` names or patterns under one key."""
    if count <= MAX_PATTERNS:
        return True
    problems.bad(path, value, f"at most {MAX_PATTERNS} op patterns", f"it lists {count:,}; merge them into "
                 "fewer patterns (a component is a regular expression: 'w1|w2|w3')")
    return False


def repeated_patterns(path: str, names: Sequence[str], done: str) -> list[str]:
    """A warning when ``names`` lists a pattern more than once: the repeat does nothing (``done``: what happens
    to a pattern once, ``"recomputed"`` or ``"swapped"``)."""
    repeated = list(dict.fromkeys(name for name in names if names.count(name) > 1))
    if not repeated:
        return []
    return [f"{path} lists {repeated} more than once ({list(names)}); a pattern is {done} once, the repeats do "
            "nothing: list each pattern once"]


def pattern(value: Any, path: str, problems: Problems) -> Any:
    """An op pattern: components split on the two characters ``\\.``, each a valid regex.

    Compiled with the engine that matches them (``regex``; Note [Regex against regex] in
    :mod:`swapkit.plan.patterns`); a compile that overflows or recurses is a problem, not a crash.
    """
    if not isinstance(value, str) or not value or len(value) > MAX_PATTERN_CHARS:
        problems.bad(path, value, r"an op pattern such as 'feed_forward\.mul'",
                     _length_fix(value))
        return INVALID
    for component in value.split(r"\."):
        if not component:
            problems.bad(path, value, r"no empty component between '\.' separators")
            return INVALID
        error = _compile_error(component)
        if error:
            problems.bad(path, value, "a valid regular expression in every \\.-separated component",
                         f"component {show(component)} does not compile: {error}{_doubled_backslash(value)}")
            return INVALID
    return value


def _doubled_backslash(value: str) -> str:
    """The fix for ``feed_forward\\\\.mul`` copied from a log line, where Python's repr doubles each backslash."""
    if "\\\\." not in value:
        return ""
    return (f"; a backslash doubled as in the log lines (Python's repr doubles it): write one, "
            f"{value.replace(chr(92) * 2, chr(92))}")


def _length_fix(value: Any) -> str | None:
    if isinstance(value, str) and len(value) > MAX_PATTERN_CHARS:
        return f"it has {len(value):,} characters; write a pattern of at most {MAX_PATTERN_CHARS} characters"
    return None


#: Counted repetition (``a{3}``) a pattern may ask for, nested counts multiplied: `regex` unrolls
#: counted repeats when it compiles, so ``((a{99}){99}){99}`` alone takes seconds and three 65535s hang.
MAX_REPEAT = 1000
_COUNTED_REPEAT = re.compile(r"(?<!\\)\{(\d*)(?:,(\d*))?\}")


def _repeat_product(component: str) -> int:
    """An upper bound of how far ``regex`` unrolls the counted repeats of ``component``."""
    product = 1
    for low, high in _COUNTED_REPEAT.findall(component):
        product *= max(1, int(high or low or 1) if len(high or low or "1") < 12 else 10 ** 12)
    return product


def _compile_error(component: str) -> str | None:
    repeats = _repeat_product(component)
    if repeats > MAX_REPEAT:
        return f"counted repetition up to {repeats:,} times; at most {MAX_REPEAT:,} (counts multiply when nested)"
    try:
        regex.compile(component)
    except (regex.error, OverflowError, RecursionError, MemoryError, ValueError) as err:
        return clip(str(err) or type(err).__name__, 120)
    return None


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
    homes: Callable[[Any], Sequence[str]] | None = None,
) -> dict[str, Any]:
    """Validate one mapping: unknown keys are errors, ``no_effect`` keys are checked and noted.

    ``homes`` names the sections an unknown key belongs to, for its error (schema Note [Keys
    written in the wrong section]).

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
    suggested = set()  # the keys a "did you mean" names
    for name, value in raw.items():
        if name in keys:
            values[name] = keys[name].check(value, join(path, name), problems)
        elif name in no_effect:
            if no_effect[name](value, join(path, name), problems) is not INVALID and notices is not None:
                notices.append(join(path, name))
        else:
            elsewhere = [home for home in homes(name) if home != path] if homes is not None else []
            suggested.add(problems.unknown_key(path, name, keys, elsewhere, no_effect))
    for name, key in keys.items():
        if key.required and name not in raw:
            if name not in suggested:  # else the unknown key's "did you mean" already names it
                problems.add(join(path, name), "is required")
            values[name] = INVALID
    return values


def any_invalid(values: Mapping[str, Any]) -> bool:
    return any(v is INVALID for v in values.values())
