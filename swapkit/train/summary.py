"""Per-step records, the metrics JSON and the end-of-run summary of ``swapkit train``.

Note [Memory figures]
``peak_device_bytes`` and friends are the swap session's accounting of device-resident saved
activations. On CPU the "device" and the host share RAM: they are not the process's RSS. On CUDA
the summary adds ``torch.cuda.max_memory_allocated``, ``max_memory_reserved`` and the allocator's
retries (``num_alloc_retries``: mallocs that found no free block, freed the cache, which
synchronizes the device, and tried again). Reserved is what a memory cap limits: a swapped storage
freed while its copy to host is queued is no longer allocated, but its block stays reserved until
the side stream ran the copy (``swapkit.engine.cuda`` Note [Copy sources are released in stream
order]); on an H100 under a cap the layer swap's reserved bytes ran about 560 MiB above its
allocated bytes, with about one retry per step (benchmarks/results/cuda/memory_cap).

Note [Figures after a resume]
A resumed run continues the checkpoint's records: ``run.records`` holds every step since step 1,
and the metrics file keeps them all. The steps up to the checkpoint ran in another process, maybe
with another swap, recompute or runtime config (``resume_changes``) and on another machine's load,
so medians over all records would mix two runs. The step time, bytes, peaks and late fetches of the
summary (and its per-stage rows) are over the steps run since the resume, and ``figures_steps``
says which (``first``, ``last``, ``count``, ``since_resume``); the loss row still spans the whole
run, whose math a resume does not change. When no step ran since the resume, the figures are the
checkpoint's steps', and ``since_resume`` is false.
"""
from __future__ import annotations

import json
import statistics
import time
from typing import Any, Mapping

import psutil
import torch

from swapkit.runtime.stats import SwapStats
from swapkit.train.files import atomic_write
from swapkit.train.state import RunState

SUMMED_STATS = ("saved_bytes", "offloaded_bytes", "prefetched_bytes", "late_fetches", "wait_seconds")
PEAK_STATS = ("peak_device_bytes", "host_pool_bytes")


def step_record(step: int, loss: float, seconds: float, stats: list[SwapStats]) -> dict[str, Any]:
    """One entry of ``metrics["steps"]``: the micro-batches' stats summed (bytes, waits) or maxed (peaks)."""
    record: dict[str, Any] = {"step": step, "loss": loss, "step_time_s": seconds}
    record.update({key: sum(getattr(s, key) for s in stats) for key in SUMMED_STATS})
    record.update({key: max(getattr(s, key) for s in stats) for key in PEAK_STATS})
    return record


STAGE_STATS = ("peak_device_bytes", "saved_bytes", "offloaded_bytes", "prefetched_bytes", "late_fetches",
               "wait_seconds", "micro_steps", "host_pool_bytes")


def stage_rows(per_stage: list[tuple[int, SwapStats]]) -> list[dict[str, Any]]:
    """One entry per pipeline stage for ``metrics["steps"][i]["stages"]``."""
    return [{"stage": stage, **{key: getattr(stats, key) for key in STAGE_STATS}} for stage, stats in per_stage]


# Note [Metrics writes]
# The metrics file is one JSON document, rewritten whole (atomically: a reader never sees half of it).
# Rewritten after every step, a write grows with the steps so far, so a run of n steps wrote O(n^2)
# bytes and spent most of a long run's time writing (2000 steps of a 1-layer model: 11 s; with
# --metrics-out 82 s; the step times it records did not show it, as the write is outside the step).
# After a step the file is therefore rewritten only when the time since the last write is at least
# 1 / METRICS_SHARE times that write's duration: writing takes at most that share of the run. The
# end of a run (completed, failed, interrupted: the loops' close) always writes, so the file ends
# with every finished step; only a kill -9 can leave it some seconds of steps behind.
METRICS_SHARE = 0.05


def write_metrics_due(run: RunState) -> None:
    """After a step: rewrite ``--metrics-out`` when the time since the last write allows (Note [Metrics writes])."""
    if run.metrics_out is not None and \
            time.perf_counter() - run.metrics_written_at >= run.metrics_write_seconds / METRICS_SHARE:
        write_metrics(run)


def write_metrics(run: RunState) -> None:
    """Rewrite ``--metrics-out`` atomically with every finished step (Note [Metrics writes])."""
    if run.metrics_out is None:
        return
    start = time.perf_counter()
    document = {"steps": run.records, "summary": summarize(run), "env": run.env}
    text = (json.dumps(document, indent=2) + "\n").encode("utf-8")
    atomic_write(run.metrics_out, lambda file: file.write(text))
    run.metrics_written_at = time.perf_counter()
    run.metrics_write_seconds = run.metrics_written_at - start


def summarize(run: RunState) -> dict[str, Any]:
    """Medians, totals and peaks over the steps so far; Note [Memory figures]."""
    summary: dict[str, Any] = {"status": run.status, "steps": len(run.records), "device": str(run.device),
                               "memory_accounting": "swap session (device-resident saved activations)"}
    if run.resumed_from:
        summary["resumed_from"], summary["resume_changes"] = run.resumed_from, list(run.resume_notes)
    if not run.records:
        return summary
    covered = _figure_records(run)
    column = {key: [r[key] for r in covered] for key in covered[0]}
    summary.update(first_loss=run.records[0]["loss"], final_loss=run.records[-1]["loss"],
                   median_step_time_s=statistics.median(column["step_time_s"]),
                   late_fetches=sum(column["late_fetches"]), wait_seconds=sum(column["wait_seconds"]))
    summary.update({key: max(column[key]) for key in PEAK_STATS})
    summary.update({f"{key}_per_step": statistics.median(column[key])
                    for key in ("saved_bytes", "offloaded_bytes", "prefetched_bytes")})
    summary["process_rss_bytes"] = psutil.Process().memory_info().rss  # the whole process, for scale
    if run.resumed_from:
        summary["figures_steps"] = {"first": covered[0]["step"], "last": covered[-1]["step"], "count": len(covered),
                                    "since_resume": covered[0]["step"] > run.resumed_step}
    if "stages" in covered[0]:
        summary["stages"] = _stage_summary([r["stages"] for r in covered])
    if run.env.get("data_parallel", 1) > 1:  # the figures are replica 0's (swapkit.distributed.train._gather_record)
        summary["data_parallel"] = run.env["data_parallel"]
    if run.device.type == "cuda":  # Note [Memory figures]
        summary["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated(run.device)
        summary["cuda_max_memory_reserved"] = torch.cuda.max_memory_reserved(run.device)
        summary["cuda_alloc_retries"] = torch.cuda.memory_stats(run.device).get("num_alloc_retries", 0)
    return summary


def _figure_records(run: RunState) -> list[dict[str, Any]]:
    """The records the figures are over: those run since the resume, if any (Note [Figures after a resume])."""
    since = [r for r in run.records if r["step"] > run.resumed_step]
    return since or run.records


def _stage_summary(steps: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per pipeline stage over the steps: peak of peaks, median bytes, total late fetches, the host pool's
    largest size (a record written before stages reported their pool has none: 0)."""
    rows = []
    for stage_steps in zip(*steps):
        rows.append({"stage": stage_steps[0]["stage"], "micro_steps": stage_steps[-1]["micro_steps"],
                     "peak_device_bytes": max(s["peak_device_bytes"] for s in stage_steps),
                     "offloaded_bytes_per_step": statistics.median(s["offloaded_bytes"] for s in stage_steps),
                     "late_fetches": sum(s["late_fetches"] for s in stage_steps),
                     "host_pool_bytes": max(s.get("host_pool_bytes", 0) for s in stage_steps)})
    return rows


def format_summary(summary: Mapping[str, Any]) -> str:
    """The end-of-run table printed to stdout."""
    if not summary.get("steps"):
        return "swapkit train summary: no steps were run"
    where = "session accounting, not RSS" if summary["device"] == "cpu" else "session accounting"
    rows = [("steps", str(summary["steps"])),
            ("loss (first -> final)", f"{summary['first_loss']:.4f} -> {summary['final_loss']:.4f}"),
            *_figures_row(summary),
            ("median step time", f"{summary['median_step_time_s'] * 1e3:.1f} ms"),
            (f"peak device-resident saved bytes ({where})", human_bytes(summary["peak_device_bytes"])),
            ("saved activation bytes per step", human_bytes(summary["saved_bytes_per_step"])),
            ("bytes swapped per step (device -> host)", human_bytes(summary["offloaded_bytes_per_step"])),
            ("bytes prefetched per step (host -> device)", human_bytes(summary["prefetched_bytes_per_step"])),
            ("late fetches (total)", f"{summary['late_fetches']} ({summary['wait_seconds'] * 1e3:.1f} ms waited)"),
            ("host pool bytes", human_bytes(summary["host_pool_bytes"])),
            ("process RSS (psutil, whole process)", human_bytes(summary["process_rss_bytes"]))]
    if "cuda_max_memory_allocated" in summary:
        rows.append(("torch.cuda.max_memory_allocated", human_bytes(summary["cuda_max_memory_allocated"])))
    if "cuda_max_memory_reserved" in summary:  # Note [Memory figures]
        rows.append(("torch.cuda.max_memory_reserved (allocator retries)",
                     f"{human_bytes(summary['cuda_max_memory_reserved'])} ({summary['cuda_alloc_retries']})"))
    if "resumed_from" in summary:
        rows.append(("resumed from", summary["resumed_from"]))
        rows += [("  changed since", note) for note in summary["resume_changes"]]
    for stage in summary.get("stages", ()):
        rows.append((f"stage {stage['stage']}: peak / swapped per step / late",
                     f"{human_bytes(stage['peak_device_bytes'])} / {human_bytes(stage['offloaded_bytes_per_step'])} / "
                     f"{stage['late_fetches']} ({stage['micro_steps']} micro-steps per step)"))
    if "data_parallel" in summary:
        rows.append(("data-parallel replicas", f"{summary['data_parallel']}; the bytes, peaks and late fetches above "
                                               "are replica 0's (every replica runs the same shapes)"))
    rows += [line for row in summary.get("budget_check", ()) for line in _budget_rows(row)]
    if "budget_unmeasured_after" in summary:  # swapkit.planner.command Note [No step under the plan]
        rows.append(("--budget", f"no step ran under the plan (the run resumed at step "
                                 f"{summary['budget_unmeasured_after']}): its peak was not measured"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(["swapkit train summary"] + [f"  {name.ljust(width)}  {value}" for name, value in rows])


def _figures_row(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Which steps the figures below cover after a resume (Note [Figures after a resume])."""
    cover = summary.get("figures_steps")
    if cover is None:
        return []
    span = f"step {cover['first']}" if cover["count"] == 1 else f"steps {cover['first']}-{cover['last']}"
    if cover["since_resume"]:
        what = (f"{span}: the {cover['count']} run since the resume (the earlier ones ran before it, maybe with "
                "another config; the metrics file keeps every step)")
    else:
        what = f"{span}, from the checkpoint: no step ran since the resume"
    return [("figures below (time, bytes, late fetches) over", what)]


def _budget_rows(row: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``swapkit train --budget``: a stage's measured peak against its budget
    (``swapkit.planner.command`` Note [Measured peak over budget]), and where the plan predicted it,
    the host pool's bytes measured against the prediction."""
    where = "" if row["stage"] is None else f" stage {row['stage']}"
    verdict = "OVER BUDGET (see the WARNING)" if row["over_budget"] else "within budget"
    rows = [(f"--budget{where}: measured peak / budget / predicted",
             f"{human_bytes(row['measured_peak_bytes'])} / {human_bytes(row['budget_bytes'])} / "
             f"{human_bytes(row['predicted_peak_bytes'])}: {verdict}")]
    if "predicted_host_pool_bytes" in row:
        rows.append((f"--budget{where}: host pool bytes measured / predicted",
                     f"{human_bytes(row['measured_host_pool_bytes'])} / "
                     f"{human_bytes(row['predicted_host_pool_bytes'])}"))
    return rows


def human_bytes(nbytes: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")
