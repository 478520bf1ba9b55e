"""Multi-process helpers for the pipeline tests: gloo on 127.0.0.1 through a FileStore in tmp_path.

``spawn(fn, world, tmp_path, *args)`` runs ``fn(rank, world, *args)`` on ``world`` processes forked
from a preloaded server (dist_utils Note [Ranks forked from a preloaded server]) and returns each
rank's return value (saved with ``torch.save``). A failing rank fails the call with its traceback;
the process group times out after 60 s, so nothing hangs.
"""
from __future__ import annotations

import datetime
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import swapkit
from dist_utils import start_method
from swapkit.distributed.rank_start import RankStart
from swapkit.engine import ThreadCopyEngine
from swapkit.distributed.pipeline import build_stage_chunks, make_schedule, pipeline_stages
from swapkit.train.model import lm_loss

TINY = {"num_layers": 8, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "vocab_size": 64,
        "seq_length": 16}
MICRO_BATCHES, MICRO_BATCH_SIZE = 4, 2


def spawn(fn, world: int, tmp_path: Path, *args) -> list:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    mp.start_processes(_worker, args=(fn, world, str(tmp_path / "store"), str(out), args, RankStart()),
                       nprocs=world, join=True, start_method=start_method())
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


def _worker(rank: int, fn, world: int, store: str, out: str, args: tuple, start: RankStart) -> None:
    start.take()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        result = fn(rank, world, *args)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()
    torch.save(result, Path(out) / f"rank{rank}.pt")


def pipeline_config(schedule: str, pp: int = 2, sizes: dict | None = None, **sections) -> dict:
    interleave = 2 if schedule == "interleaved_1f1b" else 1
    return {"model": {"model_config": {**(sizes or TINY), "pp_interleave_num": interleave}},
            "parallel_config": {"pipeline_stage": pp}, **sections}


def batch(step: int, sizes: dict, micro_batches: int = MICRO_BATCHES) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(sizes["vocab_size"], (micro_batches * MICRO_BATCH_SIZE, sizes["seq_length"] + 1),
                           generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # torch 2.11's stages check strides


class StageRun:
    """One rank's chunks of the tiny model, its torch schedule and (optionally) a swapkit session.

    ``config`` ``None`` is the same pipeline without swapkit, laid out by ``pipeline_config(schedule,
    world, sizes)``; ``micro_batches`` is the schedule's ``n_microbatches``.
    """

    def __init__(self, rank: int, world: int, schedule: str, config: dict | None, engine=None,
                 micro_batches: int = MICRO_BATCHES, sizes: dict | None = None) -> None:
        layout = swapkit.load_config(config or pipeline_config(schedule, world, sizes))
        model, plan = layout.model, swapkit.build_plan(layout)
        self.rank, self.world, self.plan, self.sizes = rank, world, plan, vars(model)
        self.micro_batches = micro_batches
        self.chunks = build_stage_chunks(model, plan, rank, seed=1)
        self.session = None
        if config is not None:
            self.session = swapkit.apply(self.chunks, config, layers="layers", stage=rank)
            if engine is not None:
                from toys import install_engine
                install_engine(self.session, engine)
        stages = pipeline_stages(self.chunks, rank, world, torch.device("cpu"))
        self.schedule = make_schedule(schedule, stages, micro_batches, lm_loss)

    def step(self, number: int) -> list[torch.Tensor]:
        for chunk in self.chunks:
            chunk.zero_grad(set_to_none=True)
        x, y = batch(number, self.sizes, self.micro_batches)
        losses: list[torch.Tensor] = []
        if self.session is None:
            self._run(x, y, losses)
        else:
            with self.session:
                self._run(x, y, losses)
        return losses

    def _run(self, x, y, losses) -> None:
        if self.rank == 0:
            self.schedule.step(x)
        elif self.rank == self.world - 1:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()

    def grads(self) -> dict[str, torch.Tensor]:
        return {chunk.global_names()[n]: p.grad.clone() for chunk in self.chunks
                for n, p in chunk.named_parameters() if p.grad is not None}


class TickLink(ThreadCopyEngine):
    """An emulated link measured in backward ticks: a prefetch is ready ``delay`` unpacks after it was issued.

    Deterministic where wall-clock latency is not: a copy issued by the unpack that needs it (an on-demand
    fetch) or fewer than ``delay`` unpacks ahead is late; ``ready`` still waits for the real copy.
    Install with :func:`use_tick_link`.
    """

    def __init__(self, delay: int) -> None:
        super().__init__()
        self.delay, self.unpacks = delay, 0
        self._issued: dict[int, int] = {}

    def prefetch(self, host):
        buffer, copy = super().prefetch(host)
        self._issued[id(copy)] = self.unpacks
        return buffer, copy

    def ready(self, copy) -> bool:
        self.wait(copy)  # offloads: released exactly at their horizon, as with toys.ReadyWhenDone
        issued = self._issued.get(id(copy))
        return issued is None or self.unpacks - issued >= self.delay


def use_tick_link(session, delay: int) -> TickLink:
    """Give ``session`` a :class:`TickLink` whose clock is the session's unpack count."""
    from toys import install_engine

    link = TickLink(delay)
    install_engine(session, link)
    unpack = session._unpack

    def counted(saved):
        link.unpacks += 1
        return unpack(saved)

    session._unpack = counted  # read by __enter__ when it installs the hooks
    return link
