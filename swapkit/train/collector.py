"""Python's cyclic garbage collector during ``swapkit train`` (``train.gc_interval``).

Note [The collector in a training step]
Every tensor a forward saves leaves Python objects alive until its backward: the handle autograd
holds, a keeper, and per new storage a record (``swapkit.runtime.step`` Note [The cost of a save]).
The cyclic collector runs after a fixed number of such allocations, so a step of many saves
triggers collections in the middle of forward and backward, and now and then a full one, which
scans every object of the process (about 170 000 with torch imported: ~50 ms on a 2-core machine).
That cost falls on the thread that runs the step, at moments nobody chose; with several ranks it
makes stragglers. torchtitan (``training.gc_freq``) and Megatron-LM (``--manual-gc``) therefore turn
the automatic collector off for the run and collect at step boundaries. ``train.gc_interval: N``
does the same: the automatic collector is off from the first step to the end of the run, a full
collection runs once before the first step and after every N-th step, and the collector's previous
state comes back when the run ends (normally or not). Reference cycles still get collected, only
later: memory held by a cycle lives until the next collection. Left unset, Python's automatic
collector runs as usual. ``benchmarks/microbench.py`` measures what it costs per saved tensor (its
collector clock): about 5 us per swapped save, 10-15% of a swap session's cost on the benchmark's
process, where a full collection (~90 ms) came about once in ten steps.
"""
from __future__ import annotations

import contextlib
import gc
import logging
from typing import Callable, Iterator

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def collector_schedule(interval: int | None) -> Iterator[Callable[[int], None]]:
    """The collector during a run: automatic (``interval`` ``None``), or off with a full collection every
    ``interval`` steps (Note [The collector in a training step]). Yields ``after_step(step)``."""
    if interval is None:
        yield lambda step: None
        return
    was_enabled = gc.isenabled()
    gc.disable()
    gc.collect()
    logger.info("train.gc_interval: %d: automatic garbage collection off, a full collection every %d steps",
                interval, interval)
    try:
        yield lambda step: gc.collect() if step % interval == 0 else None
    finally:
        if was_enabled:
            gc.enable()
