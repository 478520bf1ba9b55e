"""Resuming a multi-process ``swapkit train``: every rank continues from the same step.

Note [One resume step for every rank]
Each rank saves its own checkpoint (its stage's chunks, its shard, its optimizer state) in
``save_dir/rankNNN``, one rank after another. A run killed between two ranks' saves leaves some
ranks with a newer step than the others, and a broken file is skipped on one rank only. If each
rank resumed its own newest valid checkpoint, the ranks would continue different steps: a stage
would train on another step's micro-batches (the schedule's sends and receives still pair up, so
nothing notices), the rank with fewer steps left would finish, save a checkpoint that mixes steps
and leave, and its peers would fail in their next collective. So the ranks agree on one step:
1. each rank lists its checkpoint steps by name (nothing loaded) and the lists are all-gathered;
2. the newest step that every rank lists is tried: each rank loads and checks its file and the
   outcomes are all-gathered; if any rank's file is broken, the next older common step is tried;
3. a rank's checkpoints newer than the agreed step are passed over with a warning.
Every rank takes the same decision from the same gathered lists, so when there is no step to
agree on, every rank raises the same ConfigError after the same collective: no rank is left
waiting. Ranks without any checkpoint beside ranks with some mean the run was saved with another
parallel layout (or files went missing): that is an error too, not a silent start from step 0 on
some ranks; so are checkpoints of a single-process run in ``save_dir`` itself (swapkit.train.checkpoint
Note [Checkpoints of another process layout]).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist

from swapkit.config.errors import ConfigError, Problem, clip
from swapkit.train.checkpoint import checkpoint_steps, load_valid, no_checkpoint, restore
from swapkit.train.state import RunState

logger = logging.getLogger(__name__)


def resume_every_rank(run: RunState, save_dir: str) -> None:
    """Restore every rank from the same checkpoint step (Note [One resume step for every rank]).

    Args:
        run: this rank's run; ``run.config.train.save_dir`` is this rank's folder.
        save_dir: the configured ``train.save_dir`` that holds the ``rankNNN`` folders (for messages).

    Raises:
        ConfigError: some ranks have checkpoints and no step is saved and valid on all of them, or only a
            single-process run's checkpoints are in ``save_dir``.
    """
    mine = dict(checkpoint_steps(run.config.train.save_dir))
    listed = _gather(sorted(mine))
    if not any(listed):
        no_checkpoint(run.config.train.save_dir, [path for _, path in checkpoint_steps(save_dir)], "in one process")
        return
    broken: list[str] = []
    for step in sorted(set.intersection(*(set(steps) for steps in listed)), reverse=True):
        state, reason = load_valid(mine[step], run.device)
        reasons = _gather(reason and f"{mine[step].parent.name}/{mine[step].name} ({reason})")
        if not any(reasons):
            _warn_passed_over(mine, step)
            restore(run, mine[step], state)
            return
        broken += [r for r in reasons if r]
    raise ConfigError([Problem("train.resume", _no_common_step(save_dir, listed, broken))], run.config.source)


def _gather(value: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _warn_passed_over(mine: dict[int, Path], step: int) -> None:
    for newer in sorted(s for s in mine if s > step):
        logger.warning("train.resume: %s is newer than the newest step every rank saved (%d); every rank "
                       "resumes step %d", mine[newer], step, step)


def _no_common_step(save_dir: str, listed: list[list[int]], broken: list[str]) -> str:
    ranks = "; ".join(f"rank {rank}: {', '.join(map(str, steps)) or 'none'}" for rank, steps in enumerate(listed))
    invalid = f"; not valid: {clip('; '.join(broken), 300)}" if broken else ""
    return (f"no checkpoint step that every rank saved and can load in {clip(str(save_dir), 200)}/rankNNN; "
            f"steps per rank: {clip(ranks, 300)}{invalid}. Each rank resumes its own checkpoint, so a run "
            "resumes with the parallel_config it was saved with and needs one step saved by every rank: "
            "restore the missing files, or set train.resume: false or another train.save_dir to start anew")
