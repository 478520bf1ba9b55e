"""Checkpoints of ``swapkit train``: save atomically, find the newest valid one, resume exactly.

Note [Exact resume]
A checkpoint holds the model and optimizer state dicts, the step, the RNG states, the metrics so
far and the config it was written with. swapkit's wrappers replace ``forward`` on instances and
insert no module (see :mod:`swapkit.runtime.recompute`), so the state dict keys are those of a plain
model. Data is a pure function of the step (Note [Synthetic data]), so continuing from step k gives
the same losses, bit for bit, as never stopping — as long as the model and the data did not change,
which :mod:`swapkit.train.resume_check` verifies against the stored config.

Note [Choosing a checkpoint]
Checkpoints are named ``step_<step>.pt`` and chosen by the step *number* (``step_10000000`` is newer
than ``step_9999999``; a stray ``step_best.pt`` is not a step). The newest one that loads and has
the expected structure wins; a truncated, empty or garbage file is skipped with a warning naming
it, and only when no checkpoint is valid does resume fail (a ConfigError, exit 2).
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch

from swapkit.config.errors import ConfigError, Problem, clip
from swapkit.config.types import Config
from swapkit.train.files import atomic_write
from swapkit.train.resume_check import apply_resume_config, check_resume_fits, config_record
from swapkit.train.state import RunState

logger = logging.getLogger(__name__)

CHECKPOINT_NAME = re.compile(r"step_(\d+)\.pt")
REQUIRED = {"step": int, "model": dict, "optimizer": dict, "rng": dict, "records": list}


def checkpoint_due(run: RunState) -> bool:
    interval = run.config.train.save_interval
    return bool(run.config.train.save_dir and interval and run.step % interval == 0 and run.step < run.total_steps)


def save_checkpoint(run: RunState) -> Path:
    """Write ``save_dir/step_NNNNNNN.pt`` atomically (Note [Atomic writes]); returns its path."""
    folder = Path(run.config.train.save_dir)
    folder.mkdir(parents=True, exist_ok=True)  # checked before the first step (swapkit.train.files)
    rng = {"torch": torch.get_rng_state()}
    if run.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(run.device)
    state = {"step": run.step, "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
             "rng": rng, "records": run.records, "config": config_record(run.config)}
    path = folder / f"step_{run.step:07d}.pt"
    atomic_write(path, lambda file: torch.save(state, file))
    logger.info("saved checkpoint %s", path)
    return path


def checkpoints(save_dir: str | Path) -> list[Path]:
    """``step_<n>.pt`` files in ``save_dir``, newest step first (Note [Choosing a checkpoint])."""
    return [path for _, path in checkpoint_steps(save_dir)]


def checkpoint_steps(save_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of each ``step_<n>.pt`` file in ``save_dir``, newest step first; nothing is loaded."""
    found = []
    for path in Path(save_dir).glob("step_*.pt"):
        match = CHECKPOINT_NAME.fullmatch(path.name)
        if match and path.is_file():
            found.append((int(match.group(1)), path))
    return sorted(found, reverse=True)


def earlier_run_problems(save_dir: str | Path | None, resume: bool) -> list[Problem]:
    """A run that starts anew (``resume: false``) in a ``save_dir`` holding checkpoints: a problem
    (Note [A fresh run in a used save_dir]); empty otherwise.

    Note [A fresh run in a used save_dir]
    Checkpoints are named by step alone. A run that starts from step 0 in a folder holding another
    run's checkpoints wrote over those of its own steps (that run's step_1 was lost without a word)
    and left the newer ones beside its own, so a later ``resume: true`` continued the other run from
    its newest step and dropped this one's work, also without a word. As with Hugging Face's
    ``overwrite_output_dir``, starting anew over checkpoints is refused before the first step; either
    layout counts (``step_<n>.pt`` of one process, ``rankNNN/step_<n>.pt`` of several ranks).
    """
    if resume or not save_dir or not Path(save_dir).is_dir():
        return []
    found = [path for _, path in checkpoint_steps(save_dir)] + sorted(Path(save_dir).glob("rank[0-9]*/step_*.pt"))
    found = [path for path in found if CHECKPOINT_NAME.fullmatch(path.name) and path.is_file()]
    if not found:
        return []
    newest = max(found, key=lambda path: int(CHECKPOINT_NAME.fullmatch(path.name).group(1)))
    return [Problem("train.save_dir", f"got {clip(str(save_dir), 200)}, which holds {len(found)} checkpoint(s) of an "
                    f"earlier run (the newest: {clip(str(newest), 200)}); with train.resume: false this run starts "
                    "from step 0, would write over those of its own steps and leave the newer ones for a later "
                    "resume to continue. Set train.resume: true to continue that run, or choose another "
                    "train.save_dir (or remove those checkpoints to start anew there)")]


def latest_checkpoint(save_dir: str | Path) -> Path | None:
    """The checkpoint with the highest step number in ``save_dir``, or ``None``."""
    paths = checkpoints(save_dir)
    return paths[0] if paths else None


def load_newest_valid(save_dir: str | Path, device: torch.device) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads and looks right; broken ones are skipped with a warning.

    Raises:
        ConfigError: there are checkpoints but none of them is valid.
    """
    paths, broken = checkpoints(save_dir), []
    for path in paths:
        state, reason = load_valid(path, device)
        if reason is None:
            return path, state
        broken.append(f"{path.name} ({reason})")
    if broken:
        raise ConfigError([Problem("train.resume", f"no valid checkpoint in {clip(str(save_dir), 200)}: "
                                   f"{'; '.join(broken[:5])}. Remove the broken files or set train.resume: false")])
    return None


def load_valid(path: Path, device: torch.device) -> tuple[dict[str, Any] | None, str | None]:
    """``(state, None)`` when ``path`` loads and looks right, else ``(None, reason)`` and a warning naming it."""
    try:
        state = torch.load(path, map_location=device, weights_only=True)
        reason = _structure_problem(state, path)
    except Exception as err:  # noqa: BLE001 - any unreadable file is a broken checkpoint
        reason = f"{type(err).__name__}: {clip(str(err), 200)}"
    if reason is None:
        return state, None
    logger.warning("train.resume: skipping %s, which is not a valid checkpoint (%s)", path, reason)
    return None, reason


def _structure_problem(state: Any, path: Path) -> str | None:
    if not isinstance(state, dict):
        return f"holds a {type(state).__name__}, not a checkpoint"
    for key, kind in REQUIRED.items():
        if not isinstance(state.get(key), kind):
            return f"{key!r} is missing or not a {kind.__name__}"
    if not isinstance(state["rng"].get("torch"), torch.Tensor):
        return "the torch RNG state is missing"
    if int(CHECKPOINT_NAME.fullmatch(path.name).group(1)) != state["step"]:
        return f"it holds step {state['step']}"
    return None


def resume(run: RunState) -> None:
    """Continue from the newest valid checkpoint in ``train.save_dir`` (Note [Exact resume]).

    Raises:
        ConfigError: no valid checkpoint, or only those of a run on several ranks (``rankNNN/``).
    """
    save_dir = run.config.train.save_dir
    found = load_newest_valid(save_dir, run.device)
    if found is None:
        no_checkpoint(save_dir, sorted(Path(save_dir).glob("rank[0-9]*/step_*.pt")), "on several ranks")
        return
    restore(run, *found)


def no_checkpoint(save_dir: str | Path, others: list[Path], layout: str) -> None:
    """Nothing to resume: a warning and step 0, unless ``save_dir`` holds the other process layout's checkpoints.

    Note [Checkpoints of another process layout]
    One process saves ``save_dir/step_<n>.pt``, a run on several ranks ``save_dir/rankNNN/step_<n>.pt``
    (each rank its own part). Each looks only where it writes, so resuming one kind from the other
    found nothing and started from step 0 with a warning, then saved its own checkpoints beside the
    old ones. ``resume: true`` on a folder holding the other kind is a mistake: an error.

    Raises:
        ConfigError: ``others`` is not empty.
    """
    if others:
        raise ConfigError([Problem("train.resume", f"no checkpoint for this run in {clip(str(save_dir), 200)}, "
                                   f"but {clip(str(others[-1]), 200)} ({len(others)} file(s)) was written by a run "
                                   f"{layout}; resume with the parallel_config it was saved with, or set "
                                   "train.resume: false or another train.save_dir to start anew")])
    logger.warning("train.resume: no checkpoint in %s; starting from step 0", save_dir)


def check_resume_early(config: Config) -> None:
    """What the resume of one process would refuse, checked before the first step is near
    (``swapkit train --budget``, before measuring): no valid checkpoint, or the newest valid one
    written for another model or data. It logs what the resume will log again (a broken file
    skipped): the CLI holds this module's logger quieter around it.

    Raises:
        ConfigError: as :func:`resume` and :func:`restore` would.
    """
    save_dir = config.train.save_dir
    if not (config.train.resume and save_dir and Path(save_dir).is_dir()):
        return
    found = load_newest_valid(save_dir, torch.device("cpu"))
    if found is not None:
        check_resume_fits(config, found[1].get("config"), found[0])


def restore(run: RunState, path: Path, state: dict[str, Any]) -> None:
    """Continue from the checkpoint ``state`` loaded from ``path`` (Note [Exact resume]).

    Raises:
        ConfigError: it was written with another model or data config, or does not fit the model.
    """
    run.resume_notes = apply_resume_config(run.config, state.get("config"), path)
    try:
        run.model.load_state_dict(state["model"])
    except RuntimeError as err:
        raise ConfigError([Problem("train.resume", f"{path} does not fit model.model_config: "
                                                   f"{clip(str(err), 300)}")]) from None
    run.optimizer.load_state_dict(state["optimizer"])
    for group in run.optimizer.param_groups:  # the config's hyper-parameters win (Note [Resume differences])
        group["lr"], group["weight_decay"] = run.config.train.lr, run.config.train.weight_decay
    torch.set_rng_state(state["rng"]["torch"].cpu())
    if "cuda" in state["rng"] and run.device.type == "cuda":
        torch.cuda.set_rng_state(state["rng"]["cuda"].cpu(), run.device)
    run.step, run.records = state["step"], list(state["records"])
    run.resumed_from, run.resumed_step = str(path), state["step"]
    logger.info("resumed from %s at step %d", path, run.step)
    _warn_nothing_to_run(run, path)


def _warn_nothing_to_run(run: RunState, path: Path) -> None:
    """A checkpoint at or past the step the run stops at leaves no step to run (Note [Nothing to run])."""
    if run.step >= run.total_steps:
        logger.warning("train.resume: %s is at step %d, and this run is to stop at step %d (--steps or train.steps): "
                       "no step runs; set a higher --steps or train.steps to train further", path, run.step,
                       run.total_steps)


def ran_since_resume(run: RunState) -> bool:
    """A step ran in this process (after the resume, if any), so there is something new to save.

    Note [Nothing to run]
    A resume from step k with ``steps <= k`` runs no step. It used to finish without a word (the summary,
    from the checkpoint's records, looked like a finished run) and then save ``step_k.pt`` again, over
    the checkpoint, with the resuming config as its record: a checkpoint written with one swap config
    then claimed another. Now the resume warns, and the end of the run saves only when a step ran.
    """
    return run.step > run.resumed_step
