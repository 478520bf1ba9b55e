"""User-facing configuration errors.

Every problem found in a config is collected into one :class:`ConfigError` so a user fixes a
file in one pass. A problem names the key path (``swap_config.op_swap[1].layers``), the bad
value and what is expected.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config: where, and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ConfigError(ValueError):
    """A config file or dict is invalid; ``problems`` lists everything that is wrong."""

    def __init__(self, problems: Iterable[Problem], source: str | None = None):
        self.problems = tuple(problems)
        self.source = source
        where = f" in {source}" if source else ""
        count = len(self.problems)
        what = "command line" if all(p.path.startswith("--") for p in self.problems) else f"config{where}"
        lines = [f"invalid swapkit {what} ({count} problem{'s' if count != 1 else ''}):"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


class BindError(ValueError):
    """The model does not fit the plan (no layer container, wrong layer count, an op scope it lacks, ...).

    Raised by :mod:`swapkit.runtime.binding`; defined here, with no torch import, so the CLI can catch it.
    """


def show(value: Any) -> str:
    """Render a user value the way they wrote it (YAML-ish), short enough for one line."""
    if value is True:
        return "true"
    if value is False:
        return "false"
    if value is None:
        return "null"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class Problems:
    """Collects :class:`Problem` s while a config is read; raises them together."""

    def __init__(self) -> None:
        self.items: list[Problem] = []

    def __len__(self) -> int:
        return len(self.items)

    def add(self, path: str, message: str) -> None:
        self.items.append(Problem(path, message))

    def bad(self, path: str, value: Any, expected: str, fix: str | None = None) -> None:
        """Record that ``value`` at ``path`` is not ``expected``; ``fix`` says what to do."""
        message = f"got {show(value)}; expected {expected}"
        self.add(path, f"{message}. {fix[0].upper()}{fix[1:]}" if fix else message)

    def unknown_key(self, path: str, key: str, known: Iterable[str]) -> None:
        known = sorted(known)
        close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
        self.add(join(path, key), f"unknown key; {hint}")

    def raise_if_any(self, source: str | None = None) -> None:
        if self.items:
            raise ConfigError(self.items, source)


def join(path: str, key: Any) -> str:
    """``join('swap_config', 'op_swap')`` -> ``'swap_config.op_swap'``; ints become ``[i]``."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)
