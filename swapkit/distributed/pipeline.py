"""A pipeline stage of the built-in model on ``torch.distributed.pipelining``.

Each rank materializes only its own chunks: the full model is built on the ``meta`` device, the
stage's chunks take their modules from it and are then allocated on the real device, and the
weights are drawn from the same seeded stream as :meth:`LlamaModel.reset_parameters` (the other
stages' draws are generated and dropped), so a pipeline starts from exactly the weights of the
single-process model.

Note [Micro-batch counts per schedule]
``parallel_config.micro_batch_num`` is the schedule's ``n_microbatches``, which torch's schedules
check in their constructors (torch 2.13, ``torch/distributed/pipelining/schedules.py``; ``P`` is
``pipeline_stage``, the ranks of the pipeline group, and ``n`` the count):
- ``ScheduleGPipe``: any ``n >= 1`` (every forward, then every backward).
- ``Schedule1F1B``: ``n >= P`` ("Number of microbatches (1) must be greater than or equal to the
  number of stages (2)"): its first stage runs ``P`` forwards before its first backward.
- ``ScheduleInterleaved1F1B``: it runs ``rounds = max(1, n // P)`` rounds of ``n // rounds``
  micro-batches and refuses an ``n`` that is not a multiple of ``rounds``: every ``n`` below ``2P``,
  then even ones up to ``3P``, multiples of 3 up to ``4P``, ... (``P = 2``: 1, 2, 3 and every even count).
The steps then run the counts their constructor takes (tests/test_pipeline_micro_batches.py
compares this rule with torch's constructors and trains counts that are not multiples of ``P`` on
2 gloo ranks; by hand, gradients bit-identical to the pipeline without swapkit, 1F1B with 4 and
GPipe with 2 on 3 stages, Interleaved1F1B with 4 and 8 on 3 stages and 2, 5 and 10 on 4). swapkit itself needs nothing more: a step's batch is ``n`` micro-batches of
``train.batch_size`` rows, which torch's ``tensor_split`` gives back exactly for any ``n``
(swapkit.distributed.train Note [Same micro-batches as gradient accumulation]); a stage session
opens one micro-step per chunk forward, keyed by chunk and ordinal, however many run
(swapkit.runtime.microsteps); the budget planner replays torch's GPipe and 1F1B order for any count
(swapkit.plan.stages.schedule_actions). ``swapkit train`` used to ask for a multiple of ``P`` on
every schedule: stricter than torch, it refused 3 micro-batches on 2 stages, and GPipe's 1.

Note [Pipelining loads where a stage runs]
``import torch.distributed.pipelining`` loads Dynamo, sympy and DTensor: 2-2.5 s of CPU on a 2-core
VM, on top of ``import torch``'s 2.5 s. The config checks here (micro-batch counts, schedule names)
run in the ``swapkit train`` process that starts the ranks, before it starts them
(``swapkit.distributed.launch.check``), and that process builds no stage. So this module imports
pipelining only where a stage or a schedule is built, in a rank: a pipeline run's ranks start about
2 s sooner (tests/test_package_layout.py checks that the launcher's checks leave it unloaded).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from swapkit.config.errors import Problem
from swapkit.config.schema import LIMITS
from swapkit.config.types import Config, ModelConfig
from swapkit.plan.plan import Plan
from swapkit.train.model import LlamaModel, build_model, rotary_tables

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

#: torch's schedule class of each name (Note [Pipelining loads where a stage runs])
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}


class PipelineChunk(nn.Module):
    """Consecutive layers of the built-in model; the first chunk embeds, the last one projects.

    The layer container is ``layers`` and holds exactly the chunk's layers, in global order.
    """

    layers_path = "layers"

    def __init__(self, model: LlamaModel, layer_ids: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.layer_ids = list(layer_ids)
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleList(model.layers[i] for i in layer_ids)
        self.norm_out = model.norm_out if last else None
        self.lm_head = model.lm_head if last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        seq = h.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.lm_head(self.norm_out(h)) if self.lm_head is not None else h

    def global_names(self) -> dict[str, str]:
        """Parameter name in this chunk -> name in the single-process :class:`LlamaModel`."""
        names = {}
        for name, _ in self.named_parameters():
            head, _, rest = name.partition(".")
            if head == "layers":
                index, _, tail = rest.partition(".")
                names[name] = f"layers.{self.layer_ids[int(index)]}.{tail}"
            else:
                names[name] = name
        return names


def build_stage_chunks(cfg: ModelConfig, plan: Plan, stage: int, seed: int,
                       device: torch.device | str = "cpu") -> list[PipelineChunk]:
    """The ``pp_interleave_num`` chunks of pipeline stage ``stage``, with the single-process weights."""
    meta = build_model(cfg, device="meta")
    last_chunk = plan.layout.pp_interleave_num - 1
    last_stage = plan.layout.pipeline_stage - 1
    chunks = [PipelineChunk(meta, ids, first=(v, stage) == (0, 0), last=(v, stage) == (last_chunk, last_stage))
              for v, ids in enumerate(plan.stage_layers(stage))]
    for chunk in chunks:
        chunk.to_empty(device=device)
    _init_like_single_process(meta, chunks, seed, cfg.num_layers)
    return chunks


def _init_like_single_process(meta: LlamaModel, chunks: list[PipelineChunk], seed: int, num_layers: int) -> None:
    """Same draws, in the same order, as :meth:`LlamaModel.reset_parameters` (other stages' are dropped)."""
    by_name = {chunk.global_names()[n]: p for chunk in chunks for n, p in chunk.named_parameters()}
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in meta.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_out.weight"):
                if name in by_name:
                    nn.init.ones_(by_name[name])
                continue
            std = 0.02 / math.sqrt(2 * num_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
            values = torch.randn(param.shape, generator=gen) * std
            if name in by_name:
                by_name[name].copy_(values)
        cos, sin = rotary_tables(meta.config)
        for chunk in chunks:
            chunk.rope_cos.copy_(cos)
            chunk.rope_sin.copy_(sin)


def micro_batches(config: Config) -> int:
    """``parallel_config.micro_batch_num``, by default one per pipeline stage."""
    return config.parallel.micro_batch_num or config.parallel.pipeline_stage


def takes_micro_batches(schedule: str, stages: int, count: int) -> bool:
    """Does torch's ``schedule`` on ``stages`` pipeline ranks run ``count`` micro-batches
    (Note [Micro-batch counts per schedule])?

    Example:
        >>> [n for n in range(1, 9) if takes_micro_batches("interleaved_1f1b", 2, n)]
        [1, 2, 3, 4, 6, 8]

    Raises:
        ValueError: an unknown schedule name.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not one of {sorted(SCHEDULES)}")
    if schedule == "1f1b":
        return count >= stages
    if schedule == "interleaved_1f1b":
        return count % max(1, count // stages) == 0
    return count >= 1


def nearest_micro_batches(schedule: str, stages: int, count: int) -> list[int]:
    """The counts ``schedule`` takes closest to ``count``: the one below it (if any) and the one above."""
    below = next((n for n in range(count - 1, 0, -1) if takes_micro_batches(schedule, stages, n)), None)
    above = next((n for n in range(count + 1, LIMITS["micro_batch_num"] + 1)
                  if takes_micro_batches(schedule, stages, n)), None)
    return [n for n in (below, above) if n is not None]


def micro_batch_problems(config: Config) -> list[Problem]:
    """``parallel_config.micro_batch_num`` against the schedule's rule (Note [Micro-batch counts per schedule])."""
    name, stages, count = schedule_name(config), config.parallel.pipeline_stage, micro_batches(config)
    if takes_micro_batches(name, stages, count):
        return []
    default = "" if config.parallel.pipeline_schedule else " (the default)"
    if name == "1f1b":
        rule = f"needs at least pipeline_stage ({stages}) micro-batches (torch's Schedule1F1B refuses fewer)"
    else:
        rounds = max(1, count // stages)
        rule = (f"runs max(1, {count} // pipeline_stage {stages}) = {rounds} rounds and needs a multiple of them "
                "(torch's ScheduleInterleaved1F1B)")
    fix = " or ".join(map(str, nearest_micro_batches(name, stages, count)))
    other = ", or use pipeline_schedule gpipe" if name == "1f1b" else ""
    return [Problem("parallel_config.micro_batch_num", f"got {count}; pipeline_schedule {name}{default} {rule}; "
                                                       f"set it to {fix}{other}")]


def schedule_name(config: Config) -> str:
    """``parallel_config.pipeline_schedule``; by default ``1f1b`` (``interleaved_1f1b`` with several chunks)."""
    default = "interleaved_1f1b" if config.model.pp_interleave_num > 1 else "1f1b"
    return config.parallel.pipeline_schedule or default


def pipeline_stages(chunks: list[nn.Module], stage: int, pipeline_stage: int, device: torch.device,
                    group: torch.distributed.ProcessGroup | None = None) -> list["PipelineStage"]:
    """One ``PipelineStage`` per chunk; chunk ``v`` of stage ``s`` is torch stage ``v * P + s``."""
    from torch.distributed.pipelining import PipelineStage  # Note [Pipelining loads where a stage runs]

    total = pipeline_stage * len(chunks)
    return [PipelineStage(chunk, v * pipeline_stage + stage, total, device, group=group)
            for v, chunk in enumerate(chunks)]


def make_schedule(name: str, stages: list["PipelineStage"], micro_batches: int,
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> object:
    """The torch schedule ``name`` (``gpipe``, ``1f1b``, ``interleaved_1f1b``) over the stage's chunks.

    Raises:
        ValueError: an unknown name, or a single-chunk schedule with several chunks.
    """
    if name not in SCHEDULES:
        raise ValueError(f"schedule {name!r} is not one of {sorted(SCHEDULES)}")
    from torch.distributed import pipelining  # Note [Pipelining loads where a stage runs]

    schedule = getattr(pipelining, SCHEDULES[name])
    if name != "interleaved_1f1b":
        if len(stages) != 1:
            raise ValueError(f"schedule {name!r} runs one chunk per stage but this stage has {len(stages)} "
                             "(pp_interleave_num > 1); use interleaved_1f1b")
        return schedule(stages[0], micro_batches, loss_fn=loss_fn)
    return schedule(stages, micro_batches, loss_fn=loss_fn)
