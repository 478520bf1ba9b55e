"""Copy engines: CUDA (side stream, events, pinned pool) and a CPU thread engine."""
from __future__ import annotations

import logging

import torch

from swapkit.config.types import EngineOptions, RuntimeConfig
from swapkit.engine.base import CopyEngine
from swapkit.engine.pool import HostPool
from swapkit.engine.thread import ThreadCopyEngine

logger = logging.getLogger(__name__)


def make_pool(engine: CopyEngine, max_bytes: int | None) -> HostPool:
    """The session's host pool: slabs from ``engine.host_buffer`` (pinned on CUDA), ranges reused once
    the engine's fence passed (``swapkit.engine.pool`` Note [Slab lifetimes]), at most ``max_bytes``
    (``runtime.max_host_bytes``) held."""
    return HostPool(engine.host_buffer, max_bytes, fence=engine.fence, granule=engine.host_granule)


def make_engine(runtime: RuntimeConfig, device: torch.device) -> CopyEngine:
    """``runtime.engine``: ``auto`` picks cuda for a model on a CUDA device, thread otherwise.

    Raises:
        ValueError: ``engine: cuda`` for a model that is not on a CUDA device.
    """
    kind = runtime.engine
    if kind == "auto":
        kind = "cuda" if device.type == "cuda" else "thread"
    if kind == "cuda":
        if device.type != "cuda":
            raise ValueError(f"runtime.engine is 'cuda' but the model is on {device}; move the model to a CUDA "
                             "device or set runtime.engine: thread (or auto)")
        from swapkit.engine.cuda import CudaCopyEngine

        for message in unused_engine_options(runtime.engine_options, kind):
            logger.warning("%s", message)
        return CudaCopyEngine(device)
    options = runtime.engine_options
    return ThreadCopyEngine(device, options.latency_s, options.bandwidth_gbps, options.inline_bytes)


def unused_engine_options(options: EngineOptions, kind: str) -> list[str]:
    """``runtime.engine_options`` emulate a slower link for the thread engine; the CUDA engine's copies
    run on the real link, so there a set option does nothing (a config tuned on CPU, moved to a GPU)."""
    if kind != "cuda":
        return []
    unused = [f"runtime.engine_options.{name}: {value} has no effect with the CUDA engine (it emulates a slower "
              "link for the thread engine on CPU); remove it, or set runtime.engine: thread to emulate that link"
              for name, value in (("latency_s", options.latency_s), ("bandwidth_gbps", options.bandwidth_gbps))
              if value]
    if options.inline_bytes != EngineOptions.inline_bytes:
        unused.append(f"runtime.engine_options.inline_bytes: {options.inline_bytes} has no effect with the CUDA "
                      "engine (every copy is queued on its side stream); remove it")
    return unused


__all__ = ["CopyEngine", "HostPool", "ThreadCopyEngine", "make_engine", "make_pool", "unused_engine_options"]
