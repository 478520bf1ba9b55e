"""User-facing configuration errors.

Every problem found in a config is collected into one :class:`ConfigError` so a user fixes a
file in one pass. A problem names the key path (``swap_config.op_swap[1].layers``), the bad
value and what is expected.
"""
from __future__ import annotations

import difflib
import reprlib
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

#: At most this many problems are listed; the rest are counted ("... and 199,990 more unknown keys").
MAX_LISTED_PROBLEMS = 20
#: A problem's message is cut to this many characters (a value is summarised before, by :func:`show`).
MAX_MESSAGE_CHARS = 400
#: A rendered value is cut to this many characters.
MAX_VALUE_CHARS = 80
#: How an unknown-key problem's message begins (the ones not listed are counted by this).
UNKNOWN_KEY = "unknown key"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config: where, and what."""

    path: str
    message: str
    origin: str | None = None  # the override that wrote the value at ``path`` (loader Note [Naming an override])

    def __str__(self) -> str:
        where = f"{self.path} (from {self.origin})" if self.origin else self.path
        return f"{where}: {self.message}" if where else self.message


class ConfigError(ValueError):
    """A config file or dict is invalid; ``problems`` lists everything that is wrong."""

    def __init__(self, problems: Iterable[Problem], source: str | None = None):
        self.problems = tuple(problems)
        self.source = source
        where = f" in {clip(source, 200)}" if source else ""
        count = len(self.problems)
        what = _overrides_only(self.problems) or f"config{where}"
        lines = [f"invalid swapkit {what} ({count:,} problem{'s' if count != 1 else ''}):"]
        lines += [f"  - {p}" for p in self.problems[:MAX_LISTED_PROBLEMS]]
        if count > MAX_LISTED_PROBLEMS:
            lines.append(f"  ... and {_more(self.problems[MAX_LISTED_PROBLEMS:])}")
        super().__init__("\n".join(lines))


def from_overrides(path: str) -> bool:
    """Whether a problem's path names a command-line flag or a ``load_config`` override, not a config key."""
    return path.startswith(("--", "overrides["))


def _overrides_only(problems: Sequence[Problem]) -> str | None:
    """``'command line'`` or ``'overrides'`` when every problem came from one of them, else ``None``."""
    origins = {p.origin or p.path for p in problems}
    if not origins or not all(from_overrides(origin) for origin in origins):
        return None
    return "overrides" if all(origin.startswith("overrides[") for origin in origins) else "command line"


def _more(rest: tuple[Problem, ...]) -> str:
    """``'199,990 more unknown keys'`` when the unlisted problems are all unknown keys, else ``'N more problems'``."""
    kind = "unknown keys" if all(p.message.startswith(UNKNOWN_KEY) for p in rest) else "problems"
    return f"{len(rest):,} more {kind} (fix the ones listed and run again)"


def _short_repr() -> reprlib.Repr:
    """A ``repr`` that never walks more than a few items of a container, however large or deep.

    Note [Bounded rendering]
    A value in an error may be a huge list, a deep nest or an aliased YAML structure whose full
    ``repr`` is gigabytes. Values are rendered by this bounded repr (a few items per level, three
    levels) before anything else sees them, and messages are cut to ``MAX_MESSAGE_CHARS``, so
    formatting an error costs the same for any input.
    """
    limits = reprlib.Repr()
    limits.maxlevel, limits.maxlist, limits.maxtuple, limits.maxdict = 3, 8, 8, 6
    limits.maxstring, limits.maxother, limits.maxlong = 60, 60, 40
    return limits


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
    try:
        text = _short_repr().repr(value)
    except ValueError:  # an int beyond Python's 4300-digit str limit
        text = f"<an integer of {value.bit_length():,} bits>" if isinstance(value, int) else "<unprintable value>"
    return text if len(text) <= MAX_VALUE_CHARS else text[:MAX_VALUE_CHARS - 3] + "..."


def clip(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how much was left out."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit:,} more characters)"


class Problems:
    """Collects :class:`Problem` s while a config is read; raises them together."""

    def __init__(self) -> None:
        self.items: list[Problem] = []

    def __len__(self) -> int:
        return len(self.items)

    def add(self, path: str, message: str) -> None:
        self.items.append(Problem(clip(path, 200), clip(message)))

    def bad(self, path: str, value: Any, expected: str, fix: str | None = None) -> None:
        """Record that ``value`` at ``path`` is not ``expected``; ``fix`` says what to do."""
        message = f"got {show(value)}; expected {expected}"
        self.add(path, f"{message}. {fix[0].upper()}{fix[1:]}" if fix else message)

    def unknown_key(self, path: str, key: str, known: Iterable[str], homes: Sequence[str] = (),
                    ignored: Iterable[str] = ()) -> str | None:
        """``key`` is not one of ``known`` at ``path``; ``homes``: the sections it belongs to instead;
        ``ignored``: the MindFormers keys accepted there with no effect (suggested, not listed).

        Returns the key its "did you mean" names, if it has one."""
        key = clip(key, 100) if isinstance(key, str) else show(key)  # a YAML key may be any scalar
        if len(self.items) >= MAX_LISTED_PROBLEMS:  # not listed: only counted, so no did-you-mean search
            self.add(join(path, key), UNKNOWN_KEY)
            return None
        if homes:  # schema Note [Keys written in the wrong section]
            where = " or ".join(home or "the top level" for home in homes)
            self.add(join(path, key), f"{UNKNOWN_KEY} here; {key!r} is a key of {where}: move it to "
                     f"{join(homes[0], key)}")
            return None
        known, ignored = sorted(known), sorted(ignored)
        if not known:  # a MindSpore-only section (context): its keys are all there is to list
            known, ignored = ignored, []
        close = difflib.get_close_matches(key, known + ignored, n=1, cutoff=0.6)
        more = f" (and {len(ignored)} MindFormers keys accepted with no effect)" if ignored else ""
        hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}{more}"
        self.add(join(path, key), f"{UNKNOWN_KEY}; {hint}")
        return close[0] if close else None

    def raise_if_any(self, source: str | None = None) -> None:
        if self.items:
            raise ConfigError(self.items, source)


def join_key(path: str, key: Any) -> str:
    """``join`` for a mapping key written by the user: one that is not non-empty text is shown as YAML shows it
    (``select_recompute.1``, ``select_recompute.''``), never as a list index (``[1]``)."""
    return join(path, key if isinstance(key, str) and key else show(key))


def join(path: str, key: Any) -> str:
    """``join('swap_config', 'op_swap')`` -> ``'swap_config.op_swap'``; ints become ``[i]``."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)
