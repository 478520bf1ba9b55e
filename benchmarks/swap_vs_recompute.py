"""Swap vs recompute on swapkit's built-in model: step time, memory and bytes moved, in one process.

What it measures
  1. Variants, each on its own model copy with identical weights, interleaved (A B C ... A B C ...)
     after warm-up: baseline (plain model), a session with nothing configured (its memory figure is
     the baseline's), swap default (flash_attention), swap op attention+feed_forward, swap every
     layer, recompute full, Megatron selective core_attn and mlp, layer swap + recompute of
     feed_forward; on CUDA also the peers ``save_on_cpu(pin_memory=True)`` and torchtune's
     ``OffloadActivations``. Per variant: median step time and the median of per-repetition ratios
     to the baseline, peak device-resident saved bytes (session accounting; on CUDA also the
     step's ``torch.cuda.max_memory_allocated`` above its start) and an independent live-bytes
     probe, bytes moved, late fetches, exposed wait, host pool bytes, and checks: no parameter bytes
     moved, no storage moved twice, loss and gradients against the baseline.
  2. A prefetch-distance sweep of the layer swap over a throttled thread engine that emulates a
     PCIe-to-compute ratio (see ``sweep.py``, Note [Emulated link]).
  3. A microbenchmark of the session's per-saved-tensor cost against identity hooks and no hooks.

Writes OUT/results.json, OUT/results.md, OUT/tradeoff.png, OUT/prefetch_sweep.png and prints the
markdown. Timings are not tests: they are recorded with hardware, versions and config. OUT defaults
to bench-out/ (git-ignored): the committed benchmarks/results/ changes only with an explicit --out.
A run on a loaded machine (load average above the core count) or with a step-time ratio below 1 for
a variant that adds work prints a warning and marks the report.

Run (from the repository root):
    python benchmarks/swap_vs_recompute.py                        # full run -> bench-out/
    python benchmarks/swap_vs_recompute.py --out benchmarks/results  # refresh the committed results
    python benchmarks/swap_vs_recompute.py --quick                # small model, few repetitions
    python benchmarks/swap_vs_recompute.py --device cuda          # CUDA engine, cuda memory, peers
    python benchmarks/swap_vs_recompute.py --config configs/tiny.yaml --reps 10
    python benchmarks/swap_vs_recompute.py --threads 1 --out bench-out/threads1  # a core for the copy thread
    python benchmarks/swap_vs_recompute.py --device cuda --config benchmarks/configs/gpu.yaml --deterministic

A GPU's default kernels (cuBLAS split reductions, attention backward) may not give the same bits twice,
so a bit-identity check there needs ``--deterministic`` (Note [Deterministic kernels for the checks]).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import microbench
from common import Setup, environment, load_setup, make_batch, output_dir, positive_float, positive_int
from measure import add_ratios, overhead_estimate, probe_fields, run_interleaved, stats_fields, timing_row
from probe import compare, live_bytes_probe
from report import hygiene_warnings, write_all
from sweep import choose_link, run_sweep
from variants import ACCOUNTING, BASELINE, LAYER_SWAP, Runner, Variant, cuda_peers, main_variants, missing_peers

DEFAULT_OUT = Path("bench-out")  # not benchmarks/results/: those are committed (pass --out to refresh them)


@dataclass(frozen=True)
class RunPlan:
    """How much to run: repetitions, warm-up, sweep distances, microbenchmark size."""

    reps: int
    warmup: int
    prefetch: int
    prefetches: list[int]
    link_fraction: float
    link_latency_s: float
    micro_length: int
    micro_reps: int


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--config", help="swapkit YAML: model sizes from model.model_config, batch from train")
    parser.add_argument("--out", type=output_dir, default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="small model, few repetitions (< 1 minute on CPU)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--reps", type=positive_int, help="interleaved repetitions (default 20, --quick 5)")
    parser.add_argument("--prefetch", type=positive_int, default=8, help="backward_prefetch of the swap variants")
    parser.add_argument("--threads", type=positive_int,
                        help="torch intra-op threads (default: torch's choice); 1 on a 2-core machine leaves a core "
                             "to the copy thread, like a GPU's copy engine")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms(True) and a fixed cuBLAS workspace, so the "
                             "loss/gradient checks compare bits on a GPU; timings then are the deterministic kernels'")
    parser.add_argument("--link-fraction", type=positive_float, default=0.5,
                        help="sweep: one layer's copy time / its forward time on the emulated link")
    return parser.parse_args(argv)


def run_plan(args: argparse.Namespace) -> RunPlan:
    if args.quick:
        return RunPlan(args.reps or 5, 1, args.prefetch, [1, 4, 16], args.link_fraction, 20e-6, 300, 3)
    return RunPlan(args.reps or 20, 3, args.prefetch, [1, 2, 4, 8, 16, 32, 64], args.link_fraction, 20e-6,
                   2000, 10)


def compare_variants(setup: Setup, variants: list[Variant], batch: Any, plan: RunPlan) -> list[dict[str, Any]]:
    """Interleaved timing, then the untimed probes; one result row per variant."""
    runners = [Runner(v, setup) for v in variants]
    try:
        run_interleaved(runners, batch, plan.warmup, plan.reps, "variants")
        return _rows(runners, batch)
    finally:
        for runner in runners:
            runner.close()


def _rows(runners: list[Runner], batch: Any) -> list[dict[str, Any]]:
    baseline = runners[0]
    assert baseline.variant.name == BASELINE, "the baseline runs first"
    rows, reference = [], None
    for runner in runners:
        fields, probe = probe_fields(runner, batch, reference)
        reference = reference or probe
        rows.append({**timing_row(runner, baseline), **stats_fields(runner), **fields,
                     "config": runner.variant.sections})
    _reprobe_on_mismatch(baseline, batch, reference, rows)
    accounting = next(r for r in rows if r["name"] == ACCOUNTING)
    rows[0].update({k: accounting[k] for k in ("peak_device_bytes", "saved_bytes")})
    add_ratios(rows, rows[0])
    return rows


def _reprobe_on_mismatch(baseline: Runner, batch: Any, reference: Any, rows: list[dict[str, Any]]) -> None:
    """If a row's loss or gradients differ from the baseline's, probe the baseline once more: a baseline
    that differs from itself means the machine's math was not deterministic at that moment (a benchmark
    artifact), one that matches itself points at the variant."""
    if all(r["checks"].get("grads_equal", True) and r["checks"].get("loss_equal", True) for r in rows):
        return
    again = compare(live_bytes_probe(baseline, batch), reference)
    for row in rows[1:]:
        row["checks"]["baseline_reprobe_equal"] = again["grads_equal"] and again["loss_equal"]


def prefetch_sweep(setup: Setup, batch: Any, rows: list[dict[str, Any]], plan: RunPlan) -> dict[str, Any]:
    """The layer swap at each distance over the emulated link (``sweep.py``)."""
    layer = next(r for r in rows if r["name"] == LAYER_SWAP)
    baseline = Runner(Variant(BASELINE), setup)
    link = choose_link(baseline, batch, layer["moved_bytes"] / setup.model.num_layers, plan.link_fraction,
                       plan.link_latency_s)
    sweep_rows = run_sweep(setup, batch, plan.prefetches, link, plan.warmup, plan.reps, rows[0]["peak_device_bytes"])
    return {"link": link, "rows": sweep_rows}


def layer_swap_overhead(setup: Setup, rows: list[dict[str, Any]], micro: dict[str, Any]) -> dict[str, Any] | None:
    """CPU only: the layer swap's extra time split into worker copies and main-thread hooks."""
    layer = next(r for r in rows if r["name"] == LAYER_SWAP)
    if setup.device.type != "cpu" or not layer["offloaded_tensors"]:
        return None
    copy = microbench.engine_copy_gbps(layer["moved_bytes"] // layer["offloaded_tensors"])
    return overhead_estimate(layer, rows[0], micro, copy)


# Note [Deterministic kernels for the checks]
# The checks compare every variant's loss and gradients with the baseline's bit for bit. On a GPU the
# default kernels may not reproduce their own bits: cuBLAS picks split reductions and the
# memory-efficient attention backward accumulates with atomics, so the baseline differs from itself
# (the report then says so, via the re-probe). ``--deterministic`` asks torch for deterministic
# kernels and sets the cuBLAS workspace that makes its GEMMs reproducible (CUBLAS_WORKSPACE_CONFIG
# must be set before cuBLAS starts, hence before the first CUDA matmul of the process). Not
# ``warn_only``: with it the memory-efficient attention backward only warns and keeps its atomics
# (measured on an H100: the baseline still differed from itself); an op with no deterministic kernel
# stops the run with torch's error naming it.
def deterministic_kernels() -> str:
    """Deterministic kernels; returns the cuBLAS workspace setting in force (a user's own is kept)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    # Deterministic mode also fills every torch.empty by default: an extra kernel per prefetch buffer
    # that changes the timings and no result (every buffer is fully written before it is read).
    torch.utils.deterministic.fill_uninitialized_memory = False
    return os.environ["CUBLAS_WORKSPACE_CONFIG"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"--device cuda: CUDA is not available (torch {torch.__version__}); use --device cpu", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    cublas_workspace = deterministic_kernels() if args.deterministic else None
    logging.getLogger("swapkit").setLevel(logging.ERROR)  # the plan log lines of every apply() are noise here
    started = time.perf_counter()
    setup, plan = load_setup(args.config, args.quick, args.device), run_plan(args)
    batch = make_batch(setup)
    variants = main_variants(setup, plan.prefetch) + (cuda_peers() if setup.device.type == "cuda" else [])
    engine = setup.runtime.get("engine", "auto")
    engine = ("cuda" if setup.device.type == "cuda" else "thread") if engine == "auto" else engine
    env = environment(setup, engine, {v.name: v.sections for v in variants})
    env["deterministic"] = args.deterministic
    env["cublas_workspace_config"] = cublas_workspace
    env["skipped_peers"] = missing_peers() if setup.device.type == "cuda" else []
    for note in env["skipped_peers"]:
        print(f"NOTE: {note}", file=sys.stderr)
    rows = compare_variants(setup, variants, batch, plan)
    sweep = prefetch_sweep(setup, batch, rows, plan)
    micro = microbench.run(setup.device, plan.micro_length, plan.micro_reps)
    env["load_average_at_end"] = os.getloadavg()
    env["wall_seconds"] = round(time.perf_counter() - started, 1)
    results = {"env": env, "run": vars(plan), "variants": rows, "sweep": sweep, "microbench": micro,
               "layer_swap_overhead": layer_swap_overhead(setup, rows, micro)}
    results["warnings"] = hygiene_warnings(env, rows, sweep["link"])
    for warning in results["warnings"]:
        print(f"WARNING: {warning}", file=sys.stderr)
    print(write_all(results, args.out))
    print(f"results written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
