"""The swap session's own cost per saved tensor (pack + unpack), against bare hooks and no hooks.

One "layer" runs a chain of many tiny ops (``sin`` on a few floats), so each step saves thousands
of tiny tensors and the time per step is dominated by per-tensor overhead, not by math or memcpy.
Four ways of running the same step, interleaved:

(a) no hooks; (b) identity ``saved_tensors_hooks(lambda t: t, lambda t: t)``; (c) a swapkit
session that keeps everything (accounting only); (d) a swapkit session that swaps everything
(layer swap, ``min_offload_bytes: 0``) through the unthrottled thread engine, with coalesced copies
(the default ``runtime.offload_batch_bytes``); (e) the same with ``offload_batch_bytes: 0``, one copy job per
storage as before coalescing, so the before/after ratio comes from one run.

Cost per saved tensor = (median step time of the way - median of (a)) / saved tensors per step.

It also times the thread engine's own copies of one typical swapped tensor: into a reused host
buffer (what forward's device-to-host copy into the pool does) and into a freshly allocated buffer
(what backward's prefetch does), to explain where a CPU layer swap's time goes.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, ContextManager

import torch
from torch import nn

import swapkit
from swapkit.engine import ThreadCopyEngine
from swapkit.runtime.records import checksum

from common import synchronize


class TinyChain(nn.Module):
    """``length`` tiny ops in a row; each ``sin`` saves its input for backward."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.length):
            x = torch.sin(x)
        return x


class TinyModel(nn.Module):
    def __init__(self, length: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.layers = nn.ModuleList([TinyChain(length)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x * self.weight).sum()


def _session(model: nn.Module, swap: bool, coalesce: bool = True) -> swapkit.SwapSession:
    runtime = {"min_offload_bytes": 0, **({} if coalesce else {"offload_batch_bytes": 0})}
    config: dict[str, Any] = {"model": {"model_config": {"num_layers": 1}}, "runtime": runtime}
    if swap:
        config["swap_config"] = {"swap": True, "layer_swap": [{"backward_prefetch": 8, "layers": True}]}
    return swapkit.apply(model, config, layers="layers")


def _identity_hooks() -> ContextManager:
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


def count_saved(model: nn.Module, x: torch.Tensor) -> int:
    """Tensors autograd saves in one forward, counted with a pack hook."""
    count = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return count


def _step(model: nn.Module, x: torch.Tensor, context: Callable[[], ContextManager]) -> float:
    model.zero_grad(set_to_none=True)
    synchronize(x.device)
    start = time.perf_counter()
    with context():
        model(x).backward()
    synchronize(x.device)
    return time.perf_counter() - start


def run(device: torch.device, length: int, reps: int, width: int = 16) -> dict[str, Any]:
    """Interleaved reps of (a)-(e); returns microseconds per saved tensor for (b)-(e)."""
    x = torch.randn(width, device=device)
    names = ("none", "identity", "keep", "swap", "swap_per_tensor")
    models = {name: TinyModel(length, width).to(device) for name in names}
    sessions = {"keep": _session(models["keep"], False), "swap": _session(models["swap"], True),
                "swap_per_tensor": _session(models["swap_per_tensor"], True, coalesce=False)}
    contexts = {"none": contextlib.nullcontext, "identity": _identity_hooks,
                **{name: (lambda s=session: s) for name, session in sessions.items()}}
    saved = count_saved(models["none"], x)
    times: dict[str, list[float]] = {name: [] for name in models}
    for rep in range(reps + 2):  # two warm-up rounds
        for name, model in models.items():
            seconds = _step(model, x, contexts[name])
            if rep >= 2:
                times[name].append(seconds)
    swap_stats = sessions["swap"].stats
    for session in sessions.values():
        session.remove()
    summary = _summary(times, saved, length, width, swap_stats)
    summary["swap_copy_jobs"] = swap_stats.offload_copies + swap_stats.prefetch_copies
    return summary


def _summary(times: dict[str, list[float]], saved: int, length: int, width: int, swap_stats: Any) -> dict[str, Any]:
    medians = {name: statistics.median(values) for name, values in times.items()}
    per_tensor = {name: (medians[name] - medians["none"]) / saved * 1e6 for name in medians if name != "none"}
    return {"ops_in_chain": length, "tensor_bytes": width * 4, "saved_tensors_per_step": saved,
            "reps": len(times["none"]), "step_time_median_s": medians, "us_per_saved_tensor": per_tensor,
            "session_keep_over_identity_us": per_tensor["keep"] - per_tensor["identity"],
            "over_identity": {name: per_tensor[name] / per_tensor["identity"] for name in per_tensor},
            "swap_offloaded_tensors": swap_stats.offloaded_tensors, "swap_late_fetches": swap_stats.late_fetches}


def engine_copy_gbps(nbytes: int, reps: int = 10) -> dict[str, float]:
    """GB/s of the CPU thread engine copying ``nbytes`` (into a reused buffer and into a new one), and
    of verify mode's checksum of as many bytes (``runtime.verify``: two per round trip)."""
    engine = ThreadCopyEngine("cpu")
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    reused, fresh, summed = [], [], []
    for _ in range(reps + 1):
        reused.append(_timed(lambda: engine.wait(engine.offload(src, dst))))
        fresh.append(_timed(lambda: engine.wait(engine.prefetch(src)[1])))
        summed.append(_timed(lambda: checksum(src)))
    engine.close()
    return {"bytes": nbytes, "reused_buffer_gbps": nbytes / statistics.median(reused[1:]) / 1e9,
            "fresh_buffer_gbps": nbytes / statistics.median(fresh[1:]) / 1e9,
            "verify_checksum_gbps": nbytes / statistics.median(summed[1:]) / 1e9}


def _timed(work: Callable[[], Any]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start
