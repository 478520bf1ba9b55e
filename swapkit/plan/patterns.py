r"""Op patterns: MindFormers' ``\.``-separated regular expressions over sub-module names.

A pattern is split on the literal two characters ``\.``; each component must *fullmatch* one
child name while walking down a layer's module tree, and the last component names the op scope.
An unescaped ``.`` stays a regex wildcard inside one component. Pure: no torch needed.
"""
from __future__ import annotations

import re
from functools import lru_cache

SEPARATOR = r"\."


@lru_cache(maxsize=None)
def split(pattern: str) -> tuple[str, ...]:
    return tuple(pattern.split(SEPARATOR))


def display(pattern: str) -> str:
    r"""How a pattern reads as a path: ``feed_forward\.mul`` -> ``feed_forward.mul``."""
    return ".".join(split(pattern))


@lru_cache(maxsize=None)
def _fullmatch(regex: str, name: str) -> bool:
    return re.fullmatch(regex, name) is not None


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
