"""Measure the copy engine's link: per-copy latency and bandwidth, each direction separately.

The same code measures both engines through the :class:`~swapkit.engine.base.CopyEngine` protocol:
on CUDA pinned device-to-host and host-to-device copies on the side stream (they differ: PCIe
reads and writes are not symmetric), on CPU the thread engine's worker including the latency and
bandwidth it is configured to emulate and its thread hand-off.

Note [The fastest copy is the link]
Noise only adds time: another process taking the core, the worker waiting for the interpreter
lock, torch's intra-op threads waking up. So the link is the fastest of a few copies per size,
not their median (on a busy two-core machine a median 64 KiB copy was seen at 5 ms, 1000 times its
cost). How late copies are in a real step, compute running beside them, is measured separately
(``swapkit.planner.measure`` Note [Release lag]) and added on top.
"""
from __future__ import annotations

import time

import torch

from swapkit.engine import CopyEngine
from swapkit.plan.simulate import Link, Links

SMALL_BYTES = 4096
REPEATS = 7  # copies per size and direction (Note [The fastest copy is the link])


def measure_link(engine: CopyEngine, large_bytes: int = 1 << 20, repeats: int = REPEATS) -> Links:
    """Time copies of two sizes in each direction and fit ``latency + bytes / bandwidth``.

    Args:
        engine: the engine the session will use (same device, same options).
        large_bytes: the larger copy size (about the size of the storages that will move).
        repeats: copies per size and direction; the fastest is used (Note [The fastest copy is the link]).

    Returns:
        :class:`Links` with the fitted device-to-host and host-to-device links.
    """
    large_bytes = max(large_bytes, 16 * SMALL_BYTES)
    d2h = _fit({n: _fastest(_offload_seconds, engine, n, repeats) for n in (SMALL_BYTES, large_bytes)})
    h2d = _fit({n: _fastest(_prefetch_seconds, engine, n, repeats) for n in (SMALL_BYTES, large_bytes)})
    return Links(d2h, h2d)


def copies_per_measurement(repeats: int = REPEATS) -> int:
    """How many copies :func:`measure_link` makes: two sizes, two directions, a warm-up and ``repeats`` each."""
    return 2 * 2 * (repeats + 1)


def _fastest(measure, engine: CopyEngine, nbytes: int, repeats: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8, device=engine.device)
    host = engine.host_buffer(nbytes)[:nbytes]  # a slab may be longer (whole pages on CUDA): copies need equal sizes
    measure(engine, src, host)  # warm-up: worker start, allocator
    return min(measure(engine, src, host) for _ in range(repeats))


def _offload_seconds(engine: CopyEngine, src: torch.Tensor, host: torch.Tensor) -> float:
    engine.synchronize()
    start = time.perf_counter()
    engine.wait(engine.offload(src, host))
    _sync(engine)
    return time.perf_counter() - start


def _prefetch_seconds(engine: CopyEngine, src: torch.Tensor, host: torch.Tensor) -> float:
    engine.synchronize()
    start = time.perf_counter()
    _, copy = engine.prefetch(host)
    engine.wait(copy)
    _sync(engine)
    return time.perf_counter() - start


def _sync(engine: CopyEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)  # wait() only orders the compute stream after the copy


def _fit(seconds: dict[int, float]) -> Link:
    (small, t_small), (large, t_large) = sorted(seconds.items())
    per_byte = max((t_large - t_small) / (large - small), 1e-13)  # at most 10 TB/s: never divide by zero
    return Link(max(t_small - small * per_byte, 0.0), 1.0 / per_byte)
