"""One rank of a multi-process ``swapkit train``: its pipeline stage, FSDP2 over its data-parallel peers.

Small ordered transforms, as torchtitan's ``parallelize``: build the stage's chunks with the
single-process weights (``swapkit.distributed.pipeline``), shard them with FSDP2 ``fully_shard`` over
the data-parallel mesh dimension, apply swapkit to the chunks (``stage=``), wrap them in
``PipelineStage``s and a torch schedule.

Note [Same micro-batches as gradient accumulation]
Step ``s`` on data-parallel rank ``d`` feeds the schedule micro-batches ``d*M .. d*M + M-1`` of
:class:`~swapkit.train.data.SyntheticTokens`, each ``train.batch_size`` rows. The schedule scales
gradients by ``1/M`` and FSDP2 averages them over the ``D`` replicas, so one step equals a
single-process step with ``gradient_accumulation_steps = D*M`` over the same micro-batches. The
reported loss is the mean over all ``D*M`` micro-batches, as the single-process loop reports it.

Note [A uniform unit is one FSDP2 group]
A Megatron ``uniform`` unit runs the forwards of all its layers inside the first layer's call (one
checkpoint region; swapkit.runtime.recompute Note [Uniform units]); its other layers are called
afterwards as pass-throughs. FSDP2 per layer gathers a layer's weights in that layer's own
pre-forward hook, which for the later layers of a unit comes too late: the unit computed with their
sharded DTensor weights and failed ("got mixed torch.Tensor and DTensor"). So the layers of a unit
are sharded as one FSDP2 group (``fully_shard([layer_a, layer_b])``): the group's weights are
gathered before the first of them runs, and the group's hooks fire once, so the pass-throughs get
the unit's output unchanged. Layers outside units are sharded one by one, as before.

Note [bf16 in the schedule]
``train.dtype: bf16`` is autocast, as in one process (swapkit.train.loop), where the forward runs
under ``torch.autocast`` and the loss and backward after it. A schedule runs the forwards, the loss
and the backwards of all its micro-batches inside ``schedule.step()``, so the whole call runs under
autocast: the loss casts the logits to float itself (``lm_loss``) and autograd runs each backward
op in the dtype its forward chose, so this is the single-process math. (Before, the pipeline path
had no autocast at all and trained in fp32 while its metrics said bf16.)

Note [Clipping across stages]
Each pipeline stage holds different parameters, so the gradient norm is the square root of the sum
over stages of each stage's sum of squares (an all-reduce over the pipeline group); FSDP2's sharded
gradients are gathered per parameter first (the model is small: clarity over speed).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from tqdm import tqdm

import swapkit
from swapkit.config.errors import Problem
from swapkit.config.types import Config
from swapkit.distributed.pipeline import (
    build_stage_chunks, make_schedule, micro_batches, pipeline_stages, schedule_name,
)
from swapkit.distributed.resume import resume_every_rank
from swapkit.plan.plan import Plan
from swapkit.train.checkpoint import ran_since_resume, save_checkpoint
from swapkit.train.data import SyntheticTokens
from swapkit.train.files import prepare_output_dir, raise_problems
from swapkit.train.loop import check_finite, drive, environment
from swapkit.train.model import lm_loss
from swapkit.train.state import RunState, TrainResult
from swapkit.train.summary import human_bytes, stage_rows, step_record, summarize, write_metrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Topology:
    """Where this rank sits: rank ``= dp_rank * P + pp_rank``."""

    rank: int
    pp: int
    dp: int
    mesh: DeviceMesh

    @property
    def pp_rank(self) -> int:
        return self.rank % self.pp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.pp


@dataclass
class RankRun:
    run: RunState
    topology: Topology
    chunks: list[nn.Module]
    schedule: Any
    first: bool
    last: bool


def train_rank(config: Config, device: torch.device, rank: int, world: int, steps: int,
               metrics_out: str | Path | None = None, progress: bool = True) -> TrainResult | None:
    """Train this rank's part; rank 0 returns the run's :class:`TrainResult`, the others ``None``."""
    parallel = config.parallel
    mesh = init_device_mesh(device.type, (parallel.data_parallel, parallel.pipeline_stage), mesh_dim_names=("dp", "pp"))
    part = _start(config, device, Topology(rank, parallel.pipeline_stage, parallel.data_parallel, mesh), steps,
                  metrics_out if rank == 0 else None)
    try:
        _loop(part, progress and rank == 0)
    except BaseException as err:
        _close(part, "interrupted" if isinstance(err, KeyboardInterrupt) else "failed")
        raise
    _close(part, "completed")
    run = part.run
    return TrainResult([r["loss"] for r in run.records], run.records, summarize(run)) if rank == 0 else None


# ---------------------------------------------------------------------- setup

def _start(config: Config, device: torch.device, topo: Topology, steps: int, metrics_out: Any) -> RankRun:
    cfg, plan = config.train, swapkit.build_plan(config)
    torch.manual_seed(cfg.seed)
    chunks = build_stage_chunks(config.model, plan, topo.pp_rank, cfg.seed, device)
    if topo.dp > 1:
        _shard(chunks, topo.mesh["dp"], plan.stage_layers(topo.pp_rank), plan)
    model = nn.ModuleList(chunks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    data = SyntheticTokens(cfg.seed, cfg.batch_size, config.model.seq_length, config.model.vocab_size)
    per_rank = replace(config, train=replace(cfg, save_dir=_rank_dir(cfg.save_dir, topo.rank)))
    if per_rank.train.save_dir:  # its own folder, as one process prepares save_dir: stale temporaries go
        problems: list[Problem] = []
        prepare_output_dir(Path(per_rank.train.save_dir), "train.save_dir", "step_*.pt", problems)
        raise_problems(problems, config.source)
    run = RunState(per_rank, device, steps, model, optimizer, data,
                   metrics_out=Path(metrics_out) if metrics_out else None, env=_environment(config, device, topo))
    if cfg.resume:
        resume_every_rank(run, cfg.save_dir)  # Note [One resume step for every rank]
    run.session = swapkit.apply(chunks, config, layers="layers", stage=topo.pp_rank)
    stages = pipeline_stages(chunks, topo.pp_rank, topo.pp, device, group=topo.mesh.get_group("pp"))
    schedule = make_schedule(schedule_name(config), stages, micro_batches(config), lm_loss)
    last_rank = (plan.layout.pipeline_stage * plan.layout.pp_interleave_num - 1) % topo.pp
    return RankRun(run, topo, chunks, schedule, first=topo.pp_rank == 0, last=topo.pp_rank == last_rank)


def _shard(chunks: list[nn.Module], mesh: DeviceMesh, chunk_layers: list[list[int]], plan: Plan) -> None:
    """FSDP2 per layer (per Megatron uniform unit: Note [A uniform unit is one FSDP2 group]), then per chunk
    (embedding and head with it); kept unsharded between micro-batches."""
    for chunk, layer_ids in zip(chunks, chunk_layers):
        for group in _shard_groups(chunk.layers, layer_ids, plan):
            fully_shard(group if len(group) > 1 else group[0], mesh=mesh, reshard_after_forward=False)
        fully_shard(chunk, mesh=mesh, reshard_after_forward=False)


def _shard_groups(layers: nn.ModuleList, layer_ids: list[int], plan: Plan) -> list[list[nn.Module]]:
    """The chunk's layers grouped by the Megatron ``uniform`` unit each belongs to (one layer otherwise)."""
    groups: dict[tuple[int, int], list[nn.Module]] = {}
    for module, index in zip(layers, layer_ids):
        groups.setdefault(plan.layers[index].unit or (index, index), []).append(module)
    return list(groups.values())


def _rank_dir(save_dir: str | None, rank: int) -> str | None:
    """Checkpoints per rank: each holds only its stage's (and shard's) state."""
    return str(Path(save_dir) / f"rank{rank:03d}") if save_dir else None


def _environment(config: Config, device: torch.device, topo: Topology) -> dict[str, Any]:
    env = environment(config, device)
    env.update(world_size=topo.pp * topo.dp, pipeline_stage=topo.pp, data_parallel=topo.dp,
               micro_batch_num=micro_batches(config), pipeline_schedule=schedule_name(config),
               backend=dist.get_backend())
    return env


# ---------------------------------------------------------------------- the loop

def _loop(part: RankRun, progress: bool) -> None:
    drive(part.run, progress, lambda step: _train_step(part, step), _report)


def _train_step(part: RankRun, step: int) -> dict[str, Any] | None:
    run, topo = part.run, part.topology
    start = time.perf_counter()
    run.optimizer.zero_grad(set_to_none=True)
    x, y = _batch(run, topo.dp_rank, step)
    losses: list[torch.Tensor] = []
    bf16 = run.config.train.dtype == "bf16"  # Note [bf16 in the schedule]
    with run.session, torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=bf16):  # one optimizer step
        part.schedule.step(*([x] if part.first else []),
                           **({"target": y, "losses": losses} if part.last else {}))
    loss = _mean_loss(losses, run)  # every rank has it: each stops on a NaN before its optimizer step
    check_finite(run, step, loss)
    if run.config.train.grad_clip is not None:
        _clip(part.chunks, run.config.train.grad_clip, topo)
    run.optimizer.step()
    return _gather_record(part, step, loss, time.perf_counter() - start)


def _batch(run: RunState, dp_rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Note [Same micro-batches as gradient accumulation]"""
    micro = micro_batches(run.config)
    pairs = [run.data.batch(step, dp_rank * micro + m) for m in range(micro)]
    return torch.cat([p[0] for p in pairs]).to(run.device), torch.cat([p[1] for p in pairs]).to(run.device)


def _clip(chunks: list[nn.Module], max_norm: float, topo: Topology) -> None:
    """Note [Clipping across stages]"""
    grads = [p.grad for chunk in chunks for p in chunk.parameters() if p.grad is not None]
    full = [g.full_tensor() if isinstance(g, DTensor) else g for g in grads]
    total = torch.stack([torch.linalg.vector_norm(g.float()) for g in full]).pow(2).sum() if full else \
        torch.zeros((), device=chunks[0].rope_cos.device)
    dist.all_reduce(total, group=topo.mesh.get_group("pp"))
    scale = torch.clamp(max_norm / (total.sqrt() + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(scale.to(grad.dtype) if not isinstance(grad, DTensor) else scale.item())


def _mean_loss(losses: list[torch.Tensor], run: RunState) -> float:
    total = torch.stack([loss.detach().float() for loss in losses]).sum() if losses else torch.zeros(())
    total = total.to(run.device)
    dist.all_reduce(total)
    return total.item() / (micro_batches(run.config) * run.config.parallel.data_parallel)


def _gather_record(part: RankRun, step: int, loss: float, seconds: float) -> dict[str, Any] | None:
    """Every rank's stats to rank 0, which keeps one row per pipeline stage (data-parallel rank 0's)."""
    topo = part.topology
    mine = (topo.pp_rank, topo.dp_rank, part.run.session.stats)
    gathered: list[Any] | None = [None] * (topo.pp * topo.dp) if topo.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if topo.rank != 0:
        return None
    per_stage = sorted((s, stats) for s, d, stats in gathered if d == 0)
    record = step_record(step, loss, seconds, [stats for _, stats in per_stage])
    record["stages"] = stage_rows(per_stage)
    return record


def _report(run: RunState, record: dict[str, Any], bar: tqdm, bar_off: bool) -> None:
    figures = {"loss": f"{record['loss']:.4f}", "time": f"{record['step_time_s'] * 1e3:.0f}ms",
               "peak/stage": "/".join(human_bytes(s["peak_device_bytes"]) for s in record["stages"])}
    if bar_off:
        logger.info("step %d/%d %s", record["step"], run.total_steps, " ".join(f"{k} {v}" for k, v in figures.items()))
    bar.set_postfix(figures, refresh=False)
    bar.update(1)


def _close(part: RankRun, status: str) -> None:
    run = part.run
    if run.session is not None:
        run.session.remove()
    run.status = status
    if status == "completed" and run.config.train.save_dir and run.step and ran_since_resume(run):
        save_checkpoint(run)  # Note [Nothing to run] in swapkit.train.checkpoint
    write_metrics(run)
