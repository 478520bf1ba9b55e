"""The config a checkpoint was written with, and what a resume may change.

Note [Resume differences]
A checkpoint stores the config of its run (:func:`config_record`). On resume the two are compared
field by field:
- fields that change the model or the data (every built-in model size, ``train.seed``,
  ``batch_size``, ``gradient_accumulation_steps``, ``dtype``) would make the resumed run a different
  run with the old weights: each difference is listed (old -> new) in one ConfigError;
- optimizer hyper-parameters (``lr``, ``weight_decay``, ``grad_clip``) take the config's values —
  the optimizer state's own copies are overwritten — and the summary says so;
- the parallel layout of a run on several ranks (``parallel_config.pipeline_stage``,
  ``data_parallel``, ``micro_batch_num``; Note [Per-rank layout on resume]) is refused the same way;
- everything else (swap, recompute, runtime, the pipeline schedule, device) does not change the math:
  allowed, logged and listed in the summary. A flipped ``swap_config.swap`` also changes what the recompute
  lists select: a warning shows both readings (Note [Two readings of a recompute list]).
Run control (``steps``, ``save_dir``, ``save_interval``, ``resume``, ``gc_interval``) is not compared.

Note [Per-rank layout on resume]
With several ranks each rank saves only its own part (its stage's chunks, its FSDP2 shard, its
optimizer state) in ``save_dir/rankNNN``, and step ``s`` of data-parallel rank ``d`` reads
micro-batches ``d*M .. d*M+M-1`` (swapkit.distributed.train Note [Same micro-batches as gradient
accumulation]). Another ``pipeline_stage`` or ``data_parallel`` gives a rank another part than its
file holds (at best an unreadable shape error from ``load_state_dict``, at worst a stage that loads
and trains other layers' weights), and another ``micro_batch_num`` trains the same step on other data,
as another ``gradient_accumulation_steps`` does in one process. So the three are compared as
the run uses them: ``micro_batch_num`` not written is ``pipeline_stage``, and in one process,
where it is not used, it is not compared.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Mapping

from swapkit.config.errors import ConfigError, Problem, show
from swapkit.config.types import Config
from swapkit.plan.readings import flip_warnings

logger = logging.getLogger(__name__)

SECTIONS = {"model": "model.model_config", "parallel": "parallel_config", "recompute": "recompute_config",
            "swap": "swap_config", "runtime": "runtime", "train": "train"}
MODEL_OR_DATA = ("train.seed", "train.batch_size", "train.gradient_accumulation_steps", "train.dtype")
#: Note [Per-rank layout on resume]
PER_RANK = ("parallel_config.pipeline_stage", "parallel_config.data_parallel", "parallel_config.micro_batch_num")
OPTIMIZER = ("train.lr", "train.weight_decay", "train.grad_clip")
#: Fields that record how a setting was written, not a setting (Note [Where a pattern was written]).
NOT_SETTINGS = ("given",)
NOT_COMPARED = ("train.steps", "train.save_dir", "train.save_interval", "train.resume", "train.gc_interval")
ABSENT = "(absent)"


def config_record(config: Config) -> dict[str, dict[str, Any]]:
    """The config as plain data (``torch.load(weights_only=True)`` reads it back), keyed by YAML section."""
    return {name: _plain({key: value for key, value in dataclasses.asdict(getattr(config, field)).items()
                          if key not in NOT_SETTINGS}) for field, name in SECTIONS.items()}


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def apply_resume_config(config: Config, stored: Any, path: Path) -> list[str]:
    """Compare the stored config with ``config`` (Note [Resume differences]); returns the notes to report.

    Raises:
        ConfigError: the model or the data changed; every difference is listed.
    """
    if not isinstance(stored, Mapping):
        logger.warning("train.resume: %s holds no config (written by an older swapkit); differences in the "
                       "model or data cannot be checked", path)
        return [f"{path.name} holds no config: differences were not checked"]
    changes = _changes(config, stored)
    _raise_if_math_changed(config, changes, path)
    notes = [_note(key, old, new) for key, old, new in changes]
    for note in notes:
        logger.info("train.resume: %s", note)
    _warn_flipped_swap(config, _flat(stored).get("swap_config.swap"), path)
    return notes


def check_resume_fits(config: Config, stored: Any, path: Path) -> None:
    """The refusal of :func:`apply_resume_config` alone, logging nothing: ``swapkit train --budget``
    checks it before measuring (a checkpoint with no config is left to the resume's warning).

    Raises:
        ConfigError: the model or the data changed; every difference is listed.
    """
    if isinstance(stored, Mapping):
        _raise_if_math_changed(config, _changes(config, stored), path)


def _changes(config: Config, stored: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    return differences(_as_run(_flat(stored)), _as_run(_flat(config_record(config))))


def _raise_if_math_changed(config: Config, changes: list[tuple[str, Any, Any]], path: Path) -> None:
    fatal = [Problem(key, f"{show(old)} -> {show(new)} (changed since {path.name} was saved)")
             for key, old, new in changes if _changes_math(key)]
    if fatal:
        parts = ("model.model_config, parallel_config and train", "the model, the data or the parallel layout") \
            if any(p.path in PER_RANK for p in fatal) else ("model.model_config and train", "the model or the data")
        head = Problem("train.resume", f"{path} does not fit {parts[0]}: {parts[1]} changed since it was saved. "
                                       "Restore the old values, or start a new run in another train.save_dir")
        raise ConfigError([head, *fatal], config.source)


def _warn_flipped_swap(config: Config, stored_swap: Any, path: Path) -> None:
    """The recompute lists changed meaning since the checkpoint (Note [Two readings of a recompute list])."""
    if isinstance(stored_swap, bool):
        for message in flip_warnings(config, stored_swap, origin=f"{path.name} was written with it {{before}}"):
            logger.warning("train.resume: %s", message)


def differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    keys = [k for k in {**old, **new} if k not in NOT_COMPARED]
    return [(k, old.get(k, ABSENT), new.get(k, ABSENT)) for k in keys if old.get(k, ABSENT) != new.get(k, ABSENT)]


def _flat(record: Mapping[str, Any]) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, fields in record.items() if isinstance(fields, Mapping)
            for key, value in fields.items()}


def _as_run(flat: dict[str, Any]) -> dict[str, Any]:
    """``micro_batch_num`` as the run uses it (Note [Per-rank layout on resume])."""
    key = "parallel_config.micro_batch_num"
    stages = flat.get("parallel_config.pipeline_stage", 1)
    one_process = stages * flat.get("parallel_config.data_parallel", 1) == 1
    return {**flat, key: None if one_process else flat.get(key) if flat.get(key) is not None else stages}


def _changes_math(key: str) -> bool:
    model = key.startswith("model.model_config.") and not key.endswith(".layers_path")
    return key in MODEL_OR_DATA or key in PER_RANK or model


def _note(key: str, old: Any, new: Any) -> str:
    why = "the config's value is used" if key in OPTIMIZER else "allowed: it does not change the math"
    return f"{key}: {show(old)} -> {show(new)} ({why})"
