"""Checkpoints of ``swapkit train``: save atomically, find the latest, resume exactly.

Note [Exact resume]
A checkpoint holds the model and optimizer state dicts, the step, the RNG states and the metrics
so far. swapkit's wrappers replace ``forward`` on instances and insert no module (see
:mod:`swapkit.runtime.recompute`), so the state dict keys are those of a plain model. Data is a pure
function of the step (Note [Synthetic data]), so continuing from step k gives the same losses, bit
for bit, as never stopping.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from swapkit.config.errors import ConfigError, Problem
from swapkit.train.state import RunState

logger = logging.getLogger(__name__)

CHECKPOINT_GLOB = "step_*.pt"


def checkpoint_due(run: RunState) -> bool:
    interval = run.config.train.save_interval
    return bool(run.config.train.save_dir and interval and run.step % interval == 0 and run.step < run.total_steps)


def save_checkpoint(run: RunState) -> Path:
    """Write ``save_dir/step_NNNNNNN.pt`` atomically; returns its path."""
    folder = Path(run.config.train.save_dir)
    folder.mkdir(parents=True, exist_ok=True)
    rng = {"torch": torch.get_rng_state()}
    if run.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(run.device)
    state = {"step": run.step, "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
             "rng": rng, "records": run.records}
    path = folder / f"step_{run.step:07d}.pt"
    torch.save(state, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)
    logger.info("saved checkpoint %s", path)
    return path


def latest_checkpoint(save_dir: str | Path) -> Path | None:
    """The checkpoint with the highest step in ``save_dir``, or ``None``."""
    paths = sorted(Path(save_dir).glob(CHECKPOINT_GLOB))
    return paths[-1] if paths else None


def resume(run: RunState) -> None:
    path = latest_checkpoint(run.config.train.save_dir)
    if path is None:
        logger.warning("train.resume: no checkpoint in %s; starting from step 0", run.config.train.save_dir)
        return
    try:
        state = torch.load(path, map_location=run.device, weights_only=True)
    except Exception as err:  # a truncated or foreign file: say which one, not how unpickling failed
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError([Problem("train.resume", f"cannot read checkpoint {path} ({first_line}); delete it to "
                                   "resume from the previous one")]) from None
    try:
        run.model.load_state_dict(state["model"])
    except RuntimeError as err:
        raise ConfigError([Problem("train.resume", f"{path} does not fit model.model_config: {err}")]) from None
    run.optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"].cpu())
    if "cuda" in state["rng"] and run.device.type == "cuda":
        torch.cuda.set_rng_state(state["rng"]["cuda"].cpu(), run.device)
    run.step, run.records = state["step"], list(state["records"])
    logger.info("resumed from %s at step %d", path, run.step)
