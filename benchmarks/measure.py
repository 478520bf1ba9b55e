"""Interleaved timing of several runners and the per-variant summary rows.

Note [Pairwise ratios]
Each repetition runs every variant once, in a fixed order (A B C ... A B C ...), after warm-up.
Background load on a shared machine drifts on the scale of seconds, so a variant's step is
compared with the baseline's step *of the same repetition*; the reported ratio is the median of
those per-repetition ratios, which cancels the drift that a ratio of two medians would keep.
"""
from __future__ import annotations

import statistics
import sys
from typing import Any

import torch
from tqdm import tqdm

from probe import Probe, compare, live_bytes_probe, move_check
from variants import Runner


def run_interleaved(runners: list[Runner], batch: tuple[torch.Tensor, torch.Tensor], warmup: int, reps: int,
                    label: str) -> None:
    """Warm up every runner, then ``reps`` interleaved rounds (Note [Pairwise ratios])."""
    for _ in range(warmup):
        for runner in runners:
            runner.step(batch, record=False)
    for _ in tqdm(range(reps), desc=label, unit="rep", file=sys.stderr, disable=not sys.stderr.isatty()):
        for runner in runners:
            runner.step(batch)


def pairwise_ratio(runner: Runner, baseline: Runner) -> float:
    ratios = [s.seconds / b.seconds for s, b in zip(runner.samples, baseline.samples)]
    return statistics.median(ratios)


def timing_row(runner: Runner, baseline: Runner) -> dict[str, Any]:
    seconds = sorted(s.seconds for s in runner.samples)
    row = {"name": runner.variant.name, "note": runner.variant.note, "reps": len(seconds),
           "step_time_median_s": statistics.median(seconds), "step_time_p25_s": _quantile(seconds, 0.25),
           "step_time_p75_s": _quantile(seconds, 0.75), "time_ratio": pairwise_ratio(runner, baseline),
           "main_thread_cpu_median_s": statistics.median(s.cpu_seconds for s in runner.samples)}
    peaks = [s.cuda_peak_bytes for s in runner.samples if s.cuda_peak_bytes is not None]
    row["cuda_step_peak_bytes"] = int(statistics.median(peaks)) if peaks else None  # Note [A step's CUDA peak]
    return row


def stats_fields(runner: Runner) -> dict[str, Any]:
    """The session's counters: last step for the planned ones (bytes chosen at pack time), medians
    for those that depend on copy timing (peak, tail, late fetches, wait)."""
    stats = [s.stats for s in runner.samples if s.stats is not None]
    if not stats:
        return {"peak_device_bytes": None, "moved_bytes": None, "late_fetches": None, "wait_seconds": None,
                "host_pool_bytes": None}
    last = stats[-1]
    return {"peak_device_bytes": int(statistics.median(s.peak_device_bytes for s in stats)),
            "peak_device_bytes_max": max(s.peak_device_bytes for s in stats),
            "saved_bytes": last.saved_bytes, "ticks": last.ticks,
            "moved_bytes": last.offloaded_bytes, "offloaded_tensors": last.offloaded_tensors,
            "prefetched_bytes": last.prefetched_bytes,
            "tail_bytes": int(statistics.median(s.tail_bytes for s in stats)),
            "late_fetches": statistics.median(s.late_fetches for s in stats),
            "late_fetches_max": max(s.late_fetches for s in stats),
            "wait_seconds": statistics.median(s.wait_seconds for s in stats),
            "mean_prefetch_lead": statistics.median(s.mean_prefetch_lead for s in stats),
            "host_pool_bytes": last.host_pool_bytes, "host_allocations_last_step": last.host_allocations,
            "skipped": dict(last.skipped)}


def probe_fields(runner: Runner, batch: tuple[torch.Tensor, torch.Tensor],
                 reference: Probe | None) -> tuple[dict[str, Any], Probe]:
    """Live-bytes probe, comparison with the baseline probe and, for swapping sessions, the move check."""
    probe = live_bytes_probe(runner, batch)
    fields: dict[str, Any] = {"probe_peak_live_bytes": probe.peak_live_bytes,
                              "probe_forward_end_bytes": probe.forward_end_live_bytes}
    checks = compare(probe, reference) if reference is not None else {}
    if runner.session is not None:
        checks.update(move_check(runner, batch))
    fields["checks"] = checks
    return fields, probe


def add_ratios(rows: list[dict[str, Any]], baseline: dict[str, Any]) -> None:
    """Memory ratios to the baseline row, for each memory figure both rows have."""
    pairs = [("peak_device_bytes", "memory_ratio"), ("probe_forward_end_bytes", "probe_forward_end_ratio"),
             ("probe_peak_live_bytes", "probe_peak_ratio"), ("cuda_step_peak_bytes", "cuda_memory_ratio")]
    for row in rows:
        for key, ratio in pairs:
            ok = row.get(key) is not None and baseline.get(key)
            row[ratio] = row[key] / baseline[key] if ok else None


def _quantile(values: list[float], q: float) -> float:
    return values[min(int(q * len(values)), len(values) - 1)]


def overhead_estimate(layer: dict[str, Any], baseline: dict[str, Any], micro: dict[str, Any],
                      copy: dict[str, float]) -> dict[str, Any]:
    """Where the CPU layer swap's extra time goes, from the microbenchmark's per-unit costs.

    Worker thread: every swapped byte is copied twice (into a reused pool buffer in forward, into
    a freshly allocated buffer in backward). Main thread: the session's pack + unpack per saved
    tensor, plus the swap path's extra per offloaded tensor; and how much of the extra wall time
    the main thread spent on the CPU at all (the rest it waited: for the GIL or for a core).
    """
    per = micro["us_per_saved_tensor"]
    moved = layer["moved_bytes"]
    copy_s = moved / (copy["reused_buffer_gbps"] * 1e9) + moved / (copy["fresh_buffer_gbps"] * 1e9)
    hooks_s = (layer["ticks"] * per["keep"] + layer["offloaded_tensors"] * (per["swap"] - per["keep"])) * 1e-6
    measured = (layer["time_ratio"] - 1) * baseline["step_time_median_s"]
    cpu_extra = layer["main_thread_cpu_median_s"] - baseline["main_thread_cpu_median_s"]
    return {"worker_copy_s": copy_s, "main_thread_hooks_s": hooks_s, "measured_extra_s": measured,
            "main_thread_cpu_extra_s": cpu_extra, "main_thread_off_cpu_extra_s": measured - cpu_extra, "copy": copy}
