"""Strict config reading: YAML file or dict -> :class:`swapkit.config.Config`.

Every problem of a file is collected into one :class:`~swapkit.config.errors.Problems` list: unknown
keys (with a "did you mean"), wrong types, out-of-range values. The semantic problems that need the
layout (list lengths, negative counts, layer indices out of range, ...) are added to the same list by
:func:`swapkit.plan.plan.check_plan`; :func:`swapkit.load.load_config` runs both and raises one
:class:`~swapkit.config.errors.ConfigError`.
"""
from __future__ import annotations

import logging
import re
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Mapping, Sequence

from swapkit.config import fields as F
from swapkit.config import schema
from swapkit.config.errors import ConfigError, Problem, Problems, clip, from_overrides, join, show
from swapkit.config.megatron import megatron_warnings, read_megatron
from swapkit.config.swap_entries import read_swap_entries, swap_warnings
from swapkit.config.yaml_reader import MAX_DEPTH, parse_yaml, read_yaml_file
from swapkit.config.types import (
    Config,
    EngineOptions,
    MegatronRecompute,
    MindFormersRecompute,
    ModelConfig,
    ParallelConfig,
    RecomputeConfig,
    RuntimeConfig,
    SwapConfig,
    TrainConfig,
)

logger = logging.getLogger(__name__)
_read_section = partial(F.read_section, homes=schema.key_homes)  # schema Note [Keys written in the wrong section]


def source_name(source: str | Path | Mapping[str, Any]) -> str | None:
    """The file name a config came from, or ``None`` for a dict."""
    return str(source) if isinstance(source, (str, Path)) else None


def read_config(source: str | Path | Mapping[str, Any], overrides: Sequence[str], problems: Problems) -> Config:
    """Read a YAML file or dict into a :class:`Config`, recording every problem in ``problems``.

    Raises:
        ConfigError: only when the file itself cannot be read or parsed.
    """
    name = source_name(source)
    raw = read_yaml_file(Path(source)) if name is not None else _copy(source)
    raw = apply_overrides(raw, overrides, problems)
    return _read_config(raw, problems, name)


def warn_no_effect(config: Config) -> None:
    """Report, once per load, the MindSpore-only keys that were accepted and ignored (naming swapkit's own key
    where it has one: :data:`schema.SWAPKIT_KEYS`)."""
    for path in config.no_effect:
        instead = schema.SWAPKIT_KEYS.get(path)
        logger.warning("%s has no effect in PyTorch eager; accepted and ignored%s", path,
                       f": swapkit train reads {instead} instead" if instead else "")


def warn_written(config: Config) -> None:
    """Report, once per load, settings that load but do less than written (swap lists, ...)."""
    for message in config.warnings:
        logger.warning(message)


def warn_inactive_swap(config: Config) -> None:
    """Swap entries written while ``swap_config.swap`` is false are checked but do nothing: say so. So does
    ``swap: true`` whose written lists are all empty, where nothing recomputes either: the config changes
    nothing (with recompute configured it is the form that reads recompute lists as layer indices, which
    the budget planner writes)."""
    written = [key for key in ("layer_swap", "op_swap") if getattr(config.swap, key) is not None]
    if written and config.swap.swap is False:
        logger.warning("swap_config.%s %s validated but inactive because swap_config.swap is false; set "
                       "swap_config.swap: true to use %s", " and ".join(written), "are" if len(written) > 1 else "is",
                       "them" if len(written) > 1 else "it")
    elif written and config.swap.swap and not any(getattr(config.swap, key) for key in written) \
            and not _recomputes(config.recompute):
        logger.warning("swap_config.swap is true but swap_config.%s %s empty and nothing is recomputed: the config "
                       "changes nothing, every saved tensor stays on the device; list the layers or ops to swap "
                       "(or leave the lists out for MindFormers' default op swap)", " and ".join(written),
                       "are" if len(written) > 1 else "is")


def _recomputes(recompute: RecomputeConfig) -> bool:
    """Whether ``recompute_config`` asks for any recompute as written (a written value may still select no
    layer: this only rules out the config that plainly asks for none)."""
    if isinstance(recompute, MegatronRecompute):
        return recompute.recompute_granularity is not None
    return any(bool(getattr(recompute, key)) for key in ("recompute", "select_recompute", "select_comm_recompute"))


#: Values a dict config may hold, aliases (shared sub-lists) counted each time they appear.
MAX_DICT_NODES = 1_000_000


def _copy(value: Any, depth: int = 0, budget: list[int] | None = None) -> Any:
    """A plain copy of a dict config; a recursive, absurdly deep or huge one is a ConfigError (Note [Hostile YAML])."""
    budget = [MAX_DICT_NODES] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0 or (depth > MAX_DEPTH and isinstance(value, (Mapping, list, tuple))):
        raise ConfigError([Problem("", f"config nested deeper than {MAX_DEPTH} levels, recursive, or holding more "
                                       f"than {MAX_DICT_NODES:,} values; expected a dict in the YAML layout")])
    if isinstance(value, Mapping):
        return {k: _copy(v, depth + 1, budget) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_copy(v, depth + 1, budget) for v in value]
    return value


class CommandLineOverrides(tuple):
    """Override strings the user wrote as ``--set KEY=VALUE``: problems with them name ``--set``
    (Note [Naming an override]); the CLI passes its ``--set`` items in this."""


# Note [Naming an override]
# The same override strings reach the loader from `swapkit train tiny.yaml --set a.b=1` and from
# `load_config("tiny.yaml", overrides=["a.b=1"])`. A problem must name what the user wrote: a Python
# caller who was told "invalid swapkit command line ... (from --set a.b=1)" looks for a command line
# it never used. The CLI wraps its items in CommandLineOverrides; any other sequence is the Python
# argument, and its items are named by index: `overrides[0] 'a.b=1'`.
def override_name(overrides: Sequence[str], index: int, item: str | None = None) -> str:
    """``--set ITEM`` (or ``--set``) for the CLI's overrides, ``overrides[i] 'ITEM'`` (or ``overrides[i]``)
    for the Python argument."""
    if isinstance(overrides, CommandLineOverrides):
        return "--set" if item is None else f"--set {clip(item, 120)}"
    return f"overrides[{index}]" if item is None else f"overrides[{index}] {show(item)}"


def override_word(overrides: Sequence[str]) -> str:
    """What the user calls one of ``overrides``: ``--set`` on the command line, else an override."""
    return "--set" if isinstance(overrides, CommandLineOverrides) else "override"


# Note [An op pattern in an override key]
# `--set recompute_config.select_recompute.feed_forward\.mul=[1]` names a select pattern, whose
# components are separated by the two characters `\.`. Splitting the key at every dot made the keys
# `feed_forward\` and `mul`, and the error blamed the file for a pattern that does not compile. A dot
# after a backslash belongs to the pattern; only the other dots separate the key path.
_KEY_DOT = re.compile(r"(?<!\\)\.")


def key_parts(key: str) -> list[str]:
    """The keys of an override's dotted path (Note [An op pattern in an override key])."""
    return [part.strip() for part in _KEY_DOT.split(key.strip())]  # ' swap_config . swap' is swap_config.swap


def apply_overrides(raw: Any, overrides: Sequence[str], problems: Problems) -> Any:
    """Apply ``--set a.b=value`` strings to the raw dict (the value is parsed as YAML)."""
    for index, item in enumerate(overrides):
        key, sep, text = item.partition("=")
        parts = key_parts(key)
        name = override_name(overrides, index)
        if not sep or not all(parts):
            problems.bad(name, item, "dotted.key=value, for example train.steps=5")
            continue
        try:
            value = parse_yaml(text) if text.strip() else None
        except ConfigError as err:
            problems.bad(f"{name} {key}", text, "a YAML value", err.problems[0].message)
            continue
        raw = _set_path(raw if isinstance(raw, dict) else {}, parts, value, problems,
                        (overrides, index, item))
    return raw


def blame_overrides(problems: Problems, overrides: Sequence[str]) -> None:
    """A problem under a key that ``--set`` wrote names that ``--set`` (Note [Blame the command line])."""
    written = _override_keys(overrides)
    problems.items[:] = [_blamed(problem, written) for problem in problems.items]


# Note [Blame the command line]
# `swapkit train tiny.yaml --set swap_config.swp=true` used to report "invalid swapkit config in
# tiny.yaml": the file was blamed for a key it does not have. An override replaces the whole value at
# its dotted key, so every problem at that key path or below it came from the command line (or from
# `load_config`'s `overrides`: Note [Naming an override]). The last override whose key is a prefix of
# the problem's path wrote it (overrides apply in order).
def _override_keys(overrides: Sequence[str]) -> list[tuple[str, str]]:
    """(dotted key, the override's name) for each well-formed override, in the order they apply."""
    keys = []
    for index, item in enumerate(overrides):
        key, sep, _ = item.partition("=")
        if sep and all(key_parts(key)):
            keys.append((".".join(key_parts(key)), override_name(overrides, index, item)))
    return keys


def _blamed(problem: Problem, written: list[tuple[str, str]]) -> Problem:
    if problem.origin is not None or from_overrides(problem.path):
        return problem
    path = problem.path
    names = [name for key, name in written if path == key or path.startswith((f"{key}.", f"{key}["))]
    return replace(problem, origin=names[-1]) if names else problem


# Note [A list item on the command line]
# `--set swap_config.layer_swap[0].backward_prefetch=3` reads like a path into a list, but a key part is
# a mapping key, so it wrote a new key named ``layer_swap[0]`` and the error blamed the file: "invalid
# swapkit config in tiny.yaml: swap_config.layer_swap[0]: unknown key; did you mean 'layer_swap'?",
# which reads as if ``layer_swap`` were missing. A part ``name[i]`` whose ``name`` holds a list is refused
# naming the command line and how to set the whole list. Only then: a pattern key such as ``w[13]`` under
# ``select_recompute`` (a mapping) is an ordinary key. So is a dotted index, ``layer_swap.0.backward_prefetch``:
# any part below a key that holds a list.
def _list_item_problem(node: dict, parts: list[str], depth: int, where: tuple, problems: Problems) -> bool:
    name, bracket, _ = parts[depth].partition("[")
    below_a_list = depth < len(parts) - 1 and isinstance(node.get(parts[depth]), list)
    if not below_a_list and (not bracket or parts[depth] in node or not isinstance(node.get(name), list)):
        return False
    name = parts[depth] if below_a_list else name
    overrides, index, item = where
    dotted = ".".join(parts[:depth] + [name])
    cli = override_word(overrides) == "--set"
    problems.bad(override_name(overrides, index), item,
                 f"mapping keys only; {dotted} is a list, and {'--set' if cli else 'an override'} cannot set one of "
                 f"its items", f"set the whole list: {'--set ' if cli else ''}'{dotted}=[...]' (it is now "
                 f"{show(node[name])})")
    return True


def _set_path(raw: dict, parts: list[str], value: Any, problems: Problems, where: tuple) -> dict:
    """``where``: (overrides, index, item) of the override that writes ``value``, for its problems."""
    node = raw
    for depth, part in enumerate(parts):  # Note [A list item on the command line]
        if _list_item_problem(node, parts, depth, where, problems):
            return raw
        if depth == len(parts) - 1:
            break
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            problems.bad(override_name(*where), child, f"{'.'.join(parts[:depth + 1])} to be a mapping")
            return raw
        node = child
    node[parts[-1]] = value
    return raw


# Note [The planner's JSON report is not a config]
# ``swapkit plan --budget --json`` prints a report (``plan``, ``layers``, ``predicted``, ``baseline``),
# and a user feeds it to ``swapkit train`` as the planned config. Read as a config, each of its keys
# was an unknown key (``layers: ... did you mean 'layer_scale'?``), which says nothing about the
# mistake. The report is recognised by its keys and answered with where the planned config is.
_PLANNER_REPORT = ("got the JSON report of `swapkit plan --budget --json` (keys plan, predicted, baseline), not a "
                   "config; write the planned config with `swapkit plan CONFIG --budget SIZE --out planned.yaml`, "
                   "or copy the report's plan sections (recompute_config, swap_config) into your config")


def _read_config(raw: Any, problems: Problems, name: str | None) -> Config:
    if raw is None:
        problems.add("", "the config is empty; expected a mapping with at least model.model_config.num_layers")
        return None  # type: ignore[return-value]
    if isinstance(raw, dict) and {"plan", "predicted", "baseline"} <= raw.keys():
        problems.add("", _PLANNER_REPORT)  # Note [The planner's JSON report is not a config]
        return None  # type: ignore[return-value]
    notices: list[str] = []
    top = _read_section(raw, "", schema.TOP_KEYS, problems, schema.TOP_NO_EFFECT, notices)
    if F.any_invalid(top) and not isinstance(raw, dict):
        return None  # type: ignore[return-value]
    model = _read_model(top["model"], problems, notices)
    parallel = ParallelConfig(**_read_section(
        top["parallel_config"], "parallel_config", schema.PARALLEL_KEYS, problems, schema.PARALLEL_NO_EFFECT, notices))
    recompute = _read_recompute(top["recompute_config"], problems, notices)
    swap = _read_swap(top["swap_config"], problems, model)
    warnings = (swap_warnings(top["swap_config"], swap) + megatron_warnings(recompute) + select_warnings(recompute)
                + one_process_warnings(parallel) + ignored_offset_warnings(model, parallel))
    _read_context(top["context"], problems, notices)  # before no_effect is frozen into the Config
    config = Config(
        model=model,
        parallel=parallel,
        recompute=recompute,
        swap=swap,
        runtime=_read_runtime(top["runtime"], problems),
        train=TrainConfig(**_read_section(top["train"], "train", schema.TRAIN_KEYS, problems)),
        no_effect=tuple(notices),
        source=name,
        warnings=tuple(warnings),
    )
    return config


def one_process_warnings(parallel: ParallelConfig) -> list[str]:
    """Pipeline keys that do nothing where there is no pipeline: one process (``pipeline_stage`` and
    ``data_parallel`` 1) runs ``train.gradient_accumulation_steps`` micro-batches per step, as MindFormers
    does without pipeline parallelism; ``micro_batch_num`` 1 is that default and says nothing."""
    stages, replicas = parallel.pipeline_stage, parallel.data_parallel
    if not (F.is_int(stages) and F.is_int(replicas) and stages == replicas == 1):
        return []
    out = []
    if F.is_int(parallel.micro_batch_num) and parallel.micro_batch_num > 1:
        out.append(f"parallel_config.micro_batch_num: {parallel.micro_batch_num} has no effect with pipeline_stage 1 "
                   "and data_parallel 1 (one process, no pipeline); to split a step into micro-batches there, set "
                   "train.gradient_accumulation_steps instead")
    if isinstance(parallel.pipeline_schedule, str):
        out.append(f"parallel_config.pipeline_schedule: {parallel.pipeline_schedule} has no effect with "
                   "pipeline_stage 1 (no pipeline); drop it, or set pipeline_stage above 1")
    return out


def select_warnings(recompute: RecomputeConfig) -> list[str]:
    """A pattern listed twice in a ``select_*`` list of names: the repeat does nothing."""
    if not isinstance(recompute, MindFormersRecompute):
        return []
    out = []
    for key in ("select_recompute", "select_comm_recompute"):
        value = getattr(recompute, key)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            out += F.repeated_patterns(f"recompute_config.{key}", value, "recomputed")
    return out


def ignored_offset_warnings(model: ModelConfig, parallel: ParallelConfig) -> list[str]:
    """A non-zero ``offset`` with one stage and one chunk: the layout ignores it, as MindFormers master does
    (DESIGN §3), so it does nothing. A malformed one is the layout's error."""
    if not (parallel.pipeline_stage == 1 and model.pp_interleave_num == 1 and _nonzero(model.offset)):
        return []
    return [f"model.model_config.offset: {show(model.offset)} has no effect with pipeline_stage 1 and "
            "pp_interleave_num 1 (one chunk holds every layer; ignored, as in MindFormers); remove it, or set "
            "pipeline_stage or pp_interleave_num above 1"]


def _nonzero(offset: Any) -> bool:
    """Some integer of an offset (an int, a list or a grid of them) is not 0."""
    if isinstance(offset, (list, tuple)):
        return any(_nonzero(cell) for cell in offset)
    return F.is_int(offset) and offset != 0


def _read_model(raw: Any, problems: Problems, notices: list[str]) -> ModelConfig:
    section = _read_section(raw, "model", schema.MODEL_KEYS, problems, schema.MODEL_NO_EFFECT, notices)
    if section["model_config"] is F.INVALID:
        return ModelConfig(num_layers=F.INVALID)
    values = _read_section(section["model_config"], "model.model_config", schema.MODEL_CONFIG_KEYS, problems,
                            schema.MODEL_CONFIG_NO_EFFECT, notices)
    hidden, heads = values["hidden_size"], values["num_heads"]
    if F.INVALID not in (hidden, heads) and (hidden % heads or (hidden // heads) % 2):
        problems.bad("model.model_config.hidden_size", hidden,
                     f"a multiple of num_heads ({heads}) with an even head size (rotary embeddings)")
    return ModelConfig(**values)


def _read_recompute(raw: Any, problems: Problems, notices: list[str]):
    values = _read_section(raw, "recompute_config", schema.RECOMPUTE_KEYS, problems,
                            schema.RECOMPUTE_NO_EFFECT, notices)
    given = set(raw) if isinstance(raw, dict) else set()
    mindformers = sorted(given & schema.MINDFORMERS_RECOMPUTE_KEYS)
    megatron = sorted(given & schema.MEGATRON_RECOMPUTE_KEYS)
    if mindformers and megatron:
        problems.add("recompute_config", f"mixes the MindFormers keys ({', '.join(mindformers)}) with the "
                     f"Megatron keys ({', '.join(megatron)}); use one dialect per file")
        return MindFormersRecompute()
    if megatron:
        return read_megatron(values, given, "recompute_config", problems, notices)
    return MindFormersRecompute(**{k: values[k] for k in (*schema.MINDFORMERS_RECOMPUTE_KEYS, "use_reentrant")})


def _read_swap(raw: Any, problems: Problems, model: ModelConfig) -> SwapConfig:
    values = _read_section(raw, "swap_config", schema.SWAP_KEYS, problems)
    num_layers = model.num_layers if F.is_int(model.num_layers) else None
    for key, with_op in (("layer_swap", False), ("op_swap", True)):
        values[key] = read_swap_entries(values[key], join("swap_config", key), problems, with_op, num_layers)
    return SwapConfig(**values)


def _read_runtime(raw: Any, problems: Problems) -> RuntimeConfig:
    values = _read_section(raw, "runtime", schema.RUNTIME_KEYS, problems)
    options = values["engine_options"]
    if options is not F.INVALID:
        values["engine_options"] = EngineOptions(
            **_read_section(options, "runtime.engine_options", schema.ENGINE_OPTION_KEYS, problems))
    return RuntimeConfig(**values)


def _read_context(raw: Any, problems: Problems, notices: list[str]) -> None:
    if raw is not None:
        _read_section(raw, "context", {}, problems, schema.CONTEXT_NO_EFFECT, notices)
