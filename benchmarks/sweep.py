"""Prefetch-distance sweep of the layer swap over a throttled thread engine.

Note [Emulated link]
Unthrottled, the thread engine's "link" is a memcpy within one RAM: far faster, relative to
compute, than PCIe is to a GPU, so every prefetch distance would look free. The sweep therefore
throttles it: the bandwidth is chosen from this machine's own measured forward time so that
copying one layer's swapped activations takes ``fraction`` of that layer's forward compute time
(default 0.5), plus a fixed per-copy latency (default 20 us, the order of a CUDA copy launch plus
PCIe round trip). On a GPU a whole-layer swap of a large model sits near or above 1 (a Llama-7B
layer at 4k tokens saves ~0.5 GB, ~10 ms over PCIe 5, for ~10 ms of forward compute on an H100),
so 0.5 is a favourable but not a free link: in forward the copies keep up; in backward
(about twice the forward's compute) whether they arrive in time depends on how far ahead they are
issued: the prefetch distance.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from swapkit.train.model import lm_loss

from common import Setup, synchronize
from measure import pairwise_ratio, run_interleaved, stats_fields
from variants import BASELINE, Runner, Variant, sweep_variants


def forward_seconds(runner: Runner, batch: tuple[torch.Tensor, torch.Tensor], reps: int = 7) -> float:
    """Median time of the plain model's forward (with grad, as in training), after 2 warm-up calls."""
    times = []
    for _ in range(reps + 2):
        synchronize(runner.setup.device)
        start = time.perf_counter()
        lm_loss(runner.model(batch[0]), batch[1])
        synchronize(runner.setup.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def choose_link(baseline: Runner, batch: tuple[torch.Tensor, torch.Tensor], layer_bytes: float, fraction: float,
                latency_s: float) -> dict[str, Any]:
    """Note [Emulated link]: bandwidth so one layer's copy takes ``fraction`` of its forward.

    On CUDA the real link is measured instead: the CUDA engine, no throttling.
    """
    if baseline.setup.device.type == "cuda":
        return {"runtime": {}, "why": "CUDA engine over this machine's real host link (no emulation)"}
    model_forward = forward_seconds(baseline, batch)
    layer_forward = model_forward / baseline.setup.model.num_layers
    bandwidth = layer_bytes / (fraction * layer_forward) / 1e9
    options = {"latency_s": latency_s, "bandwidth_gbps": round(bandwidth, 3)}
    return {"runtime": {"engine": "thread", "engine_options": options}, **options, "layer_bytes": int(layer_bytes),
            "model_forward_s": model_forward, "layer_forward_s": layer_forward, "copy_over_compute": fraction,
            "why": f"one layer's swapped activations ({layer_bytes / 2**20:.1f} MiB) take {fraction:.2f} x that "
                   f"layer's measured forward time ({layer_forward * 1e3:.1f} ms) at {bandwidth:.2f} GB/s, plus "
                   f"{latency_s * 1e6:.0f} us per copy; a whole-layer swap of a large model on a GPU over PCIe "
                   f"sits near 1, so {link_verdict(fraction)}"}


def link_verdict(fraction: float) -> str:
    """How ``--link-fraction`` compares with a GPU over PCIe (near 1): the text followed it only at 0.5."""
    if fraction < 0.9:
        return "this is a favourable but not free link"
    return "this link is about as slow as that" if fraction <= 1.1 else "this link is slower than that"


def run_sweep(setup: Setup, batch: tuple[torch.Tensor, torch.Tensor], prefetches: list[int], link: dict[str, Any],
              warmup: int, reps: int, baseline_peak: int) -> list[dict[str, Any]]:
    """Interleave the baseline and the layer swap at each distance; one row per distance."""
    baseline = Runner(Variant(BASELINE), setup)
    runners = [Runner(v, setup) for v in sweep_variants(prefetches, link["runtime"])]
    try:
        run_interleaved([baseline, *runners], batch, warmup, reps, "prefetch sweep")
        return [_row(k, runner, baseline, baseline_peak) for k, runner in zip(prefetches, runners)]
    finally:
        for runner in runners:
            runner.close()


def _row(prefetch: int, runner: Runner, baseline: Runner, baseline_peak: int) -> dict[str, Any]:
    stats = stats_fields(runner)
    return {"backward_prefetch": prefetch, "step_time_median_s": statistics.median(s.seconds for s in runner.samples),
            "time_ratio": pairwise_ratio(runner, baseline), "wait_seconds": stats["wait_seconds"],
            "late_fetches": stats["late_fetches"], "mean_prefetch_lead": stats["mean_prefetch_lead"],
            "peak_device_bytes": stats["peak_device_bytes"],
            "memory_ratio": stats["peak_device_bytes"] / baseline_peak if baseline_peak else None,
            "moved_bytes": stats["moved_bytes"], "tail_bytes": stats["tail_bytes"],
            "skipped": stats["skipped"], "reps": len(runner.samples)}
