"""Pipeline benchmark: GPipe and 1F1B on 2 gloo ranks, keep vs swap vs recompute, peak per stage.

Each rank builds its stage of the built-in model (``swapkit.distributed.pipeline``) three times, one
per variant, each with a swapkit session on its chunk: ``keep`` (no swap, no recompute: the session
only accounts), ``swap`` (layer swap of every layer) and ``recompute`` (every layer fully
recomputed). The variants' optimizer-free steps are interleaved, in a rotating order, on each
schedule, so load drifts hit all of them alike; medians are reported, and a time ratio is the median
over repetitions of (variant step / keep's step of the same repetition), as in swap_vs_recompute.py
(Note [Pairwise ratios] in measure.py; it was a ratio of two medians). Gradients are
compared with ``keep``'s: ``torch.equal`` for swap, ``assert_close`` for recompute. Memory is the
session's accounting of device-resident saved bytes per stage (on CPU not the RSS).

Note [Benchmark ranks end without finalization]
The two ranks are forked from a preloaded fork server, as ``swapkit train`` forks its CPU ranks
(``swapkit.distributed.rank_start``), not spawned. Besides sparing each rank the imports, a forked
rank ends with ``os._exit`` once its work returned, while a spawned one ends through the
interpreter's finalization. In one of nine runs of the ``--quick`` smoke test on a loaded machine a
spawned rank died with ``terminate called without an active exception`` (SIGABRT); its cause was
not captured, but gloo is known to abort like that during finalization (pytorch/pytorch#179291:
work objects of gloo's threads that hold tensors, freed while the interpreter is torn down), which
a forked rank never runs.

    python benchmarks/pipeline.py [--quick] [--reps N] [--out benchmarks/results]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import swapkit
from swapkit.distributed.pipeline import build_stage_chunks, make_schedule, pipeline_stages
from swapkit.distributed.rank_start import RankStart, start_method
from swapkit.train.model import lm_loss

from common import load_warning, output_dir, positive_int, warning_lines

DEFAULT_OUT = Path("bench-out/pipeline")  # git-ignored; benchmarks/results only with an explicit --out
MODEL = {"num_layers": 8, "hidden_size": 128, "num_heads": 4, "intermediate_size": 352, "vocab_size": 256,
         "seq_length": 128}
QUICK_MODEL = {**MODEL, "num_layers": 4, "hidden_size": 64, "intermediate_size": 176, "seq_length": 64}
MICRO_BATCHES, MICRO_BATCH_SIZE, PREFETCH = 4, 2, 4
VARIANTS = {
    "keep": {},
    "swap": {"swap_config": {"swap": True, "layer_swap": [{"backward_prefetch": PREFETCH, "layers": True}]}},
    "recompute": {"recompute_config": {"recompute": True}},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=output_dir, default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="smaller model, 2 repetitions")
    parser.add_argument("--reps", type=positive_int, help="interleaved repetitions (default 10, --quick 2)")
    return parser.parse_args(argv)


def config(model: dict, variant: str) -> dict:
    return {"model": {"model_config": model}, "parallel_config": {"pipeline_stage": 2},
            "runtime": {"min_offload_bytes": 1024}, **VARIANTS[variant]}


class Variant:
    """One variant's stage on this rank: chunk, session, schedule."""

    def __init__(self, rank: int, schedule: str, model: dict, name: str) -> None:
        cfg = swapkit.load_config(config(model, name))
        plan = swapkit.build_plan(cfg)
        self.rank, self.name = rank, name
        self.chunks = build_stage_chunks(cfg.model, plan, rank, seed=0)
        self.session = swapkit.apply(self.chunks, cfg, layers="layers", stage=rank)
        self.schedule = make_schedule(schedule, pipeline_stages(self.chunks, rank, 2, torch.device("cpu")),
                                      MICRO_BATCHES, lm_loss)
        self.times: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        for chunk in self.chunks:
            chunk.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        with self.session:
            self.schedule.step(x) if self.rank == 0 else self.schedule.step(target=y, losses=[])
        dist.barrier()
        self.times.append(time.perf_counter() - start)

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for chunk in self.chunks for p in chunk.parameters()]


def batch(model: dict) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(model["vocab_size"], (MICRO_BATCHES * MICRO_BATCH_SIZE, model["seq_length"] + 1),
                           generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # torch 2.11's stages check strides


def measure(rank: int, schedule: str, model: dict, reps: int) -> list[dict]:
    variants = [Variant(rank, schedule, model, name) for name in VARIANTS]
    x, y = batch(model)
    for variant in variants:  # warm-up: shape inference, host pool, allocator
        variant.step(x, y)
    for variant in variants:
        variant.times.clear()
    for rep in range(reps):  # rotate the order too: no variant always runs first after the others
        for variant in variants[rep % 3:] + variants[:rep % 3]:
            variant.step(x, y)
    keep = variants[0]
    return [row(rank, schedule, v, keep) for v in variants]


def row(rank: int, schedule: str, variant: Variant, keep: Variant) -> dict:
    stats, base = variant.session.stats, keep.session.stats
    pairs = list(zip(keep.grads(), variant.grads()))
    close = all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in pairs)  # recompute may reorder math
    return {"schedule": schedule, "variant": variant.name, "stage": rank,
            "peak_device_bytes": stats.peak_device_bytes,
            "memory_ratio": stats.peak_device_bytes / base.peak_device_bytes,
            "moved_bytes": stats.offloaded_bytes + stats.prefetched_bytes, "late_fetches": stats.late_fetches,
            "micro_steps": stats.micro_steps, "step_time_median_s": statistics.median(variant.times),
            "time_ratio": statistics.median(v / k for v, k in zip(variant.times, keep.times)),
            "grads_equal": all(torch.equal(a, b) for a, b in pairs), "grads_close": close}


def worker(rank: int, store: str, model: dict, reps: int, out: str, start: RankStart) -> None:
    start.take()  # Note [Benchmark ranks end without finalization]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        rows = [r for schedule in ("gpipe", "1f1b") for r in measure(rank, schedule, model, reps)]
        gathered: list | None = [None, None] if rank == 0 else None
        dist.gather_object(rows, gathered, dst=0)
        if rank == 0:
            Path(out).write_text(json.dumps([r for part in gathered for r in part]))
    finally:
        dist.destroy_process_group()


def markdown(rows: list[dict], env: dict) -> str:
    warnings = load_warning(env["cpu_count"], env.get("load_average_at_start"), env.get("load_average_at_end"))
    lines = [*warning_lines(warnings),
             f"# Pipeline benchmark ({env['world_size']} gloo ranks, {MICRO_BATCHES} micro-batches, "
             f"torch {env['torch']}, {env['platform']}, {env['cpu_count']} CPUs)", "",
             "| schedule | variant | stage | peak saved bytes | vs keep | moved | late | step ms | time vs keep "
             "| grads |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["schedule"], r["stage"], list(VARIANTS).index(r["variant"]))):
        grads = "equal" if r["grads_equal"] else "close" if r["grads_close"] else "DIFFER"
        lines.append(f"| {r['schedule']} | {r['variant']} | {r['stage']} | {r['peak_device_bytes']:,} | "
                     f"{r['memory_ratio']:.2f} | {r['moved_bytes']:,} | {r['late_fetches']} | "
                     f"{r['step_time_median_s'] * 1e3:.1f} | {r['time_ratio']:.2f} | {grads} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model, reps = (QUICK_MODEL, args.reps or 2) if args.quick else (MODEL, args.reps or 10)
    load_at_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rows.json"
        mp.start_processes(worker, args=(str(Path(folder) / "store"), model, reps, str(out), RankStart()), nprocs=2,
                           join=True, start_method=start_method("cpu"))  # Note [Benchmark ranks end without ...]
        rows = json.loads(out.read_text())
    env = {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
           "cpu_count": os.cpu_count(), "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg(),
           "world_size": 2, "model_config": model, "reps": reps,
           "micro_batches": MICRO_BATCHES, "micro_batch_size": MICRO_BATCH_SIZE, "backward_prefetch": PREFETCH,
           "memory": "swap session accounting of device-resident saved bytes (CPU: not RSS)"}
    warnings = load_warning(env["cpu_count"], load_at_start, env["load_average_at_end"])  # Note [Loaded machines]
    for warning in warnings:
        print(f"WARNING: {warning}", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pipeline.json").write_text(json.dumps({"env": env, "rows": rows, "warnings": warnings}, indent=2)
                                            + "\n")
    (args.out / "pipeline.md").write_text(markdown(rows, env))
    print(markdown(rows, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
