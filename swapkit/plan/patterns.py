r"""Op patterns: MindFormers' ``\.``-separated regular expressions over sub-module names.

A pattern is split on the literal two characters ``\.``; each component must *fullmatch* one
child name while walking down a layer's module tree, and the last component names the op scope.
An unescaped ``.`` stays a regex wildcard inside one component. Pure: no torch needed.
"""
from __future__ import annotations

from functools import lru_cache

# `regex` rather than `re`: its matcher takes a time limit (Note [Regex against regex]).
import regex

from swapkit.config.errors import ConfigError, Problem, show

SEPARATOR = r"\."
#: Longest a single component match may run before the pattern is refused.
MATCH_TIMEOUT_S = 0.25

# Note [Regex against regex]
# Excludes and the recompute-overrides-swap check read one user pattern as a regular expression and
# match it against another pattern's *text*; binding matches patterns against module names. Such
# text is short, but a pattern with nested quantifiers (`(a|aa)+$`) backtracks exponentially: `re`
# ran for minutes. Every match goes through `regex` with MATCH_TIMEOUT_S; a match that runs out of
# time is a ConfigError naming the pattern, never a hang. At load, patterns are capped in length
# (swapkit.config.fields.MAX_PATTERN_CHARS) and in counted repetition (MAX_REPEAT: `regex` unrolls
# `a{n}` when it compiles, which has no time limit) and compiled by the same engine.


class PatternTooSlow(ConfigError):
    """A pattern took longer than ``MATCH_TIMEOUT_S`` to match a name (catastrophic backtracking)."""

    def __init__(self, pattern: str, text: str, path: str = "") -> None:
        self.pattern, self.text = pattern, text
        super().__init__([Problem(path, (
            f"got op pattern component {show(pattern)}; it ran over {MATCH_TIMEOUT_S} s matching "
            f"{show(text)} (catastrophic backtracking); expected a simple pattern. Remove nested "
            "repetition such as (a|aa)+ or (x+)+"))])

    def at(self, path: str) -> "PatternTooSlow":
        """The same error, located at a config key path."""
        return PatternTooSlow(self.pattern, self.text, path)


@lru_cache(maxsize=None)
def split(pattern: str) -> tuple[str, ...]:
    return tuple(pattern.split(SEPARATOR))


def display(pattern: str) -> str:
    r"""How a pattern reads as a path: ``feed_forward\.mul`` -> ``feed_forward.mul``."""
    return ".".join(split(pattern))


@lru_cache(maxsize=4096)
def _fullmatch(component: str, name: str) -> bool:
    """``component`` fullmatches ``name``; Note [Regex against regex]."""
    try:
        return regex.fullmatch(component, name, timeout=MATCH_TIMEOUT_S) is not None
    except TimeoutError:
        raise PatternTooSlow(component, name) from None


def components_match(a: str, b: str) -> bool:
    """Either component, read as a regex, fullmatches the other (MindFormers' exclude rule)."""
    return _fullmatch(a, b) or _fullmatch(b, a)


def same_scope(a: str, b: str) -> bool:
    """Two patterns name the same scope: equal length and every component pair matches."""
    pa, pb = split(a), split(b)
    return len(pa) == len(pb) and all(components_match(x, y) for x, y in zip(pa, pb))


def covers(outer: str, inner: str) -> bool:
    r"""Every scope ``inner`` can name lies in (or is) a scope ``outer`` names, as far as can be
    told without a model: each component of ``outer`` fullmatches ``inner``'s component read as a
    literal name. ``feed_forward`` covers ``feed_forward\.mul``; ``feed_forward`` does not cover
    ``.*\.wq`` (which may name ``attention.wq``)."""
    po, pi = split(outer), split(inner)
    return len(po) <= len(pi) and all(_fullmatch(x, y) for x, y in zip(po, pi))


def resolve(tree: dict, pattern: str) -> list[str]:
    """Dotted paths of the scopes ``pattern`` names in ``tree`` (child name -> subtree), in tree order."""
    found: list[str] = []
    _walk(tree, split(pattern), "", found)
    return found


def _walk(tree: dict, parts: tuple[str, ...], prefix: str, found: list[str]) -> None:
    head, rest = parts[0], parts[1:]
    for name, subtree in tree.items():
        if not _fullmatch(head, name):
            continue
        path = f"{prefix}.{name}" if prefix else name
        if rest:
            _walk(subtree, rest, path, found)
        else:
            found.append(path)
