"""Every rank of one ``swapkit train`` run must train the same run: checked once, before anything collective.

Note [Every rank trains the same run]
Spawned ranks all get the parent's :class:`Config`. Under ``torchrun`` each rank reads its own config
file and command line, and on several machines those are several copies of the file: one edited on
one machine only gives ranks that disagree. Most disagreements never fail on their own: ranks with
another ``micro_batch_num`` or ``batch_size`` wait for pipeline messages that never come, a rank with
fewer ``steps`` leaves while its peers wait in the next step's collectives, and both end only at
``train.collective_timeout_s`` (300 s) with gloo's "Timed out waiting ... for send operation"; another
``seed`` or ``lr`` trains different math silently. So right after the process group starts, before
the device mesh (whose shape is ``parallel_config``'s), the ranks all-gather the settings that make
the run (``model.model_config``, ``parallel_config``, ``train`` with the ``--steps`` in effect, and
the device type; defaults resolved, so a ``micro_batch_num`` left out and one written as its default
agree) and every rank compares them with rank 0's. Every rank gathers the same lists and
so takes the same decision: either all go on, or all raise the same :class:`ConfigError` naming each
key, rank 0's value and the other ranks' values, and none is left waiting. ``swap_config``,
``recompute_config`` and ``runtime`` may differ per rank (a stage applies only its own layers'
decisions, README "One layout on every rank").
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch
import torch.distributed as dist

from swapkit.config.errors import ConfigError, Problem, show
from swapkit.config.types import Config
from swapkit.distributed.pipeline import micro_batches, schedule_name

#: Config sections every rank must agree on, as (key path prefix, attribute of Config)
SHARED_SECTIONS = (("model.model_config", "model"), ("parallel_config", "parallel"), ("train", "train"))


def run_settings(config: Config, steps: int, device: torch.device) -> dict[str, Any]:
    """Key path -> value of every setting the ranks must share (Note [Every rank trains the same run])."""
    settings = {f"{prefix}.{f.name}": getattr(getattr(config, attr), f.name)
                for prefix, attr in SHARED_SECTIONS for f in fields(getattr(config, attr))}
    del settings["train.steps"], settings["train.device"]  # the values in effect instead, and defaults resolved:
    settings["parallel_config.micro_batch_num"] = micro_batches(config)
    settings["parallel_config.pipeline_schedule"] = schedule_name(config)
    settings["steps (train.steps or --steps)"] = steps
    settings["device (train.device or --device)"] = device.type
    return settings


def disagreements(per_rank: list[dict[str, Any]]) -> list[Problem]:
    """One problem per key on which some rank's settings differ from rank 0's."""
    reference, problems = per_rank[0], []
    for key, value in reference.items():
        others = [(rank, settings.get(key)) for rank, settings in enumerate(per_rank) if settings.get(key) != value]
        if others:
            listed = ", ".join(f"rank {rank} has {show(other)}" for rank, other in others[:4])
            more = f" (and {len(others) - 4} more ranks)" if len(others) > 4 else ""
            problems.append(Problem(key, f"rank 0 has {show(value)} but {listed}{more}; every rank of one run "
                                         "needs the same model.model_config, parallel_config and train settings "
                                         "(swap_config, recompute_config and runtime may differ per rank): make "
                                         "the ranks' config files and command lines agree"))
    return problems


def check_ranks_agree(config: Config, steps: int, device: torch.device) -> None:
    """All-gather the run's settings and raise on every rank if any rank differs from rank 0.

    Raises:
        ConfigError: on every rank alike, one problem per key that differs.
    """
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, run_settings(config, steps, device))
    problems = disagreements(gathered)
    if problems:
        raise ConfigError(problems, config.source)
