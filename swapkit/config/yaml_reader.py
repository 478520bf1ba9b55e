"""Reading YAML text safely: a regular file of bounded size, a bounded node graph, scalars as written.

Every way reading can fail ends in a :class:`~swapkit.config.errors.ConfigError` with one line that
says what is wrong and how to fix it; nothing else escapes (Note [Hostile YAML]).
"""
from __future__ import annotations

import difflib
import itertools
import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from swapkit.config.errors import ConfigError, Problem, clip

#: A config file larger than this is refused (real configs are a few KiB; PyYAML reads ~1 MiB/s).
MAX_FILE_BYTES = 1 << 20
#: Values (scalars, lists, mappings) written in the document (a real config has a few hundred).
MAX_WRITTEN_NODES = 50_000
#: Values of the document with every alias expanded.
MAX_NODES = 200_000
#: Nesting depth of mappings and lists (a real config nests fewer than ten levels).
MAX_DEPTH = 64

# Note [Hostile YAML]
# A config file is user input and may be hostile or broken in ways that used to hang or crash:
# - a FIFO or /dev/zero blocks or exhausts memory: only regular files are opened, and at most
#   MAX_FILE_BYTES are read;
# - "billion laughs": a few aliases expand to 10**9 nodes. PyYAML shares aliased objects, so
#   loading is cheap, but anything that walks the value (copying, validating, repr in an error) does
#   the full expansion. The composed node graph is measured with every alias expanded (memoised per
#   node, so the check itself is linear) and refused beyond MAX_NODES or MAX_DEPTH before anything
#   is constructed; a recursive alias (`&a [*a]`) is refused too;
# - deep nesting makes PyYAML's recursive composer raise RecursionError; huge integers make int()
#   raise ValueError: both become a ConfigError.


def read_yaml_file(path: Path) -> Any:
    """Read and parse one config file; every failure is a :class:`ConfigError`."""
    return parse_yaml(_read_text(path), str(path))


def parse_yaml(text: str, source: str | None = None) -> Any:
    """Parse YAML text with :class:`StrictLoader` under the node and depth budget."""
    try:
        return _parse(text)
    except yaml.YAMLError as err:
        raise ConfigError([Problem("", yaml_message(err))], source) from None
    except RecursionError:
        raise ConfigError([Problem("", f"YAML nested too deeply; expected at most {MAX_DEPTH} levels of "
                                       "mappings and lists")], source) from None
    except (ValueError, OverflowError, MemoryError) as err:  # int('9' * 10**6), exponent overflow, ...
        raise ConfigError([Problem("", f"YAML value cannot be read: {clip(str(err), 200)}")], source) from None


def _parse(text: str) -> Any:
    loader = StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        check_node_budget(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _read_text(path: Path) -> str:
    shown = clip(str(path), 200)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ConfigError([Problem("", f"config file not found: {shown}{_missing_hint(path)}")]) from None
    except (OSError, ValueError) as err:  # ENAMETOOLONG, ELOOP, EACCES, an embedded NUL byte
        raise ConfigError([Problem("", f"cannot read {shown}: {_reason(err)}")]) from None
    _check_file_kind(info, shown)
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except OSError as err:
        raise ConfigError([Problem("", f"cannot read {shown}: {_reason(err)}")]) from None
    _check_size(len(data), shown)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError([Problem("", f"cannot read {shown}: not UTF-8 text ({err.reason} at byte "
                                       f"{err.start}); save it as UTF-8")]) from None


def _missing_hint(path: Path) -> str:
    """Where a relative path was looked for, and the YAML files beside it with a close name (``tiny.yml``
    for ``tiny.yaml``); empty when there is nothing to add."""
    hint = "" if path.is_absolute() else f" (relative to the current directory, {clip(os.getcwd(), 120)})"
    try:
        siblings = [p.name for p in itertools.islice(path.parent.iterdir(), 10_000) if p.suffix in (".yaml", ".yml")]
    except OSError:  # the folder is missing or unreadable too
        return hint
    close = difflib.get_close_matches(path.name, sorted(siblings), n=3, cutoff=0.7)
    return hint + (f"; did you mean {', '.join(close)}?" if close else "")


def _check_file_kind(info: os.stat_result, shown: str) -> None:
    if stat.S_ISDIR(info.st_mode):
        raise ConfigError([Problem("", f"{shown} is a directory; expected a YAML file")])
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError([Problem("", f"{shown} is not a regular file (a FIFO, device or socket); "
                                       "expected a YAML file: save the config to a file first")])
    _check_size(info.st_size, shown)


def _check_size(size: int, shown: str) -> None:
    if size > MAX_FILE_BYTES:
        raise ConfigError([Problem("", f"config file {shown} is larger than {MAX_FILE_BYTES // 1024} KiB; "
                                       "expected a swapkit/MindFormers YAML config of a few KiB")])


def _reason(err: BaseException) -> str:
    return clip(err.strerror if isinstance(err, OSError) and err.strerror else str(err), 200)


def check_node_budget(root: yaml.Node) -> None:
    """Refuse a node graph larger than ``MAX_NODES`` or deeper than ``MAX_DEPTH`` once aliases are expanded.

    Raises:
        yaml.YAMLError: naming the line where the budget ran out.
    """
    sizes: dict[int, int] = {}
    _expanded(root, sizes, set(), 0)


def _expanded(node: yaml.Node, sizes: dict[int, int], active: set[int], depth: int) -> int:
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in active:
        raise _budget_error(node, "an alias refers to a node that contains it (a recursive structure)")
    if depth > MAX_DEPTH:
        raise _budget_error(node, f"nested deeper than {MAX_DEPTH} levels")
    total = 1
    if isinstance(node, (yaml.SequenceNode, yaml.MappingNode)):
        active.add(key)
        for child in _children(node):
            total += _expanded(child, sizes, active, depth + 1)
            if total > MAX_NODES:
                raise _budget_error(node, f"more than {MAX_NODES:,} values once aliases are expanded "
                                          "(an alias bomb?); write the values out or use fewer aliases")
        active.discard(key)
    sizes[key] = total
    return total


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return list(node.value)


def _budget_error(node: yaml.Node, what: str) -> yaml.YAMLError:
    return yaml.constructor.ConstructorError(None, None, what, node.start_mark)


#: Fixes for PyYAML problems whose text says what is wrong but not what to write (problem text -> fix).
_SYNTAX_FIXES = {
    "found character '\\t' that cannot start any token": "YAML indents with spaces: replace the tab with spaces",
    "but found another document": "A config is one YAML document: remove the '---' line and merge the documents",
    "found unknown escape character": ("In double quotes a backslash starts an escape: write an op pattern in "
                                       "single quotes ('feed_forward\\.mul') or unquoted"),
}


def yaml_message(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(err, "problem", None) or str(err)
    context = getattr(err, "context", None)
    if context and problem.startswith("but "):  # "but found another document" says nothing without its context
        problem = f"{context} {problem}"
    fix = next((f". {fix}" for text, fix in _SYNTAX_FIXES.items() if text in problem), "")
    kind = "YAML error" if isinstance(err, yaml.constructor.ConstructorError) else "YAML syntax error"
    return clip(f"{kind}{where}: {problem}{fix}", 300)


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys and reads numbers as YAML 1.2 does (Note [YAML 1.1 scalars]);
    booleans as PyYAML and MindFormers do (Note [YAML 1.1 booleans])."""

    _depth = 0
    _written = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        """Refuse nesting beyond MAX_DEPTH and more than MAX_WRITTEN_NODES values while composing, before
        PyYAML's recursion gets deep or its (pure Python, ~100k values/s) parsing gets long."""
        self._depth += 1
        self._written += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels",
                                                  self.peek_event().start_mark)
            if self._written > MAX_WRITTEN_NODES:
                raise yaml.composer.ComposerError(None, None, f"more than {MAX_WRITTEN_NODES:,} values; a swapkit "
                                                  "config has a few hundred", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        merged: int | None = None  # the line of the mapping's `<<` key
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` merges; keys beside it override
                if merged is not None:  # PyYAML would let the second one's values win, silently
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key '<<' (first given at line {merged}); merge several mappings "
                        "with one key: <<: [*a, *b]", key_node.start_mark)
                merged = key_node.start_mark.line + 1
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                hash(key)
            except TypeError:
                continue  # SafeLoader reports the unhashable key itself
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {clip(repr(key), 80)} (first given at line {seen[key]})",
                    key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


# Note [YAML 1.1 scalars]
# PyYAML follows YAML 1.1, which surprises in both directions:
# - `steps: 1:30` is 90 (base 60) and `seed: 010` is 8 (octal); `2024-01-01` is a date;
# - `lr: 1e-3` is the *string* '1e-3' (a 1.1 float needs a dot and a signed exponent).
# The loader reads numbers as YAML 1.2's core schema does: decimal integers (no leading zero, `_`
# allowed), 0x hex, floats with a dot and/or an exponent, .inf/.nan (which the number checks then
# refuse). Anything else, `1:30` and `010` included, stays a string, and the integer and number
# checks say what YAML 1.1 would have made of it (:func:`swapkit.config.fields.yaml11_hint`).
#
# Note [YAML 1.1 booleans]
# Booleans are deliberately *not* read as YAML 1.2: they stay PyYAML's set, true/false, yes/no and
# on/off (each as lower, Title or UPPER case), which is what MindFormers reads its files with. A
# MindFormers file with `swap: yes` or `use_reentrant: on` means true there and must load unchanged
# here (DESIGN §2); reading `yes` as the string 'yes' would turn files that work in MindFormers into
# errors, and nothing is read differently from MindFormers. PyYAML never read `y`/`n` as booleans,
# so they are text, and a boolean key given text says to write true or false; a text key given a
# boolean (a bare `off`) says to quote it (:func:`swapkit.config.fields.boolean`, ``BOOLEAN_AS_TEXT``).
_RESOLVED_ELSEWHERE = {"tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp"}
StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _RESOLVED_ELSEWHERE]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^[-+]?(?:0|[1-9][0-9_]*|0x[0-9a-fA-F_]+)$"), list("-+0123456789"))
StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?[0-9][0-9_]*(?:\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[eE][-+]?[0-9]+)
                   |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
                   |[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))
