"""Multi-process test helpers: run a function on N ranks (gloo on CPU by default), collect what each rank returns.

Ranks rendezvous through a ``FileStore`` in a temporary directory, so concurrent test runs on one
machine never compete for a port. Each rank's return value is saved with ``torch.save`` and handed
back to the parent in rank order; an exception on any rank fails the parent with that rank's
traceback. The function must be importable (a module-level function of a test module or of this
file): it is pickled by name, as with ``spawn``.

The gloo ranks are forked from a fork server, as ``swapkit train``'s CPU ranks are
(swapkit.distributed.rank_start Note [Ranks forked from a preloaded server]), and take the parent's
environment and standard streams the same way (:class:`~swapkit.distributed.rank_start.RankStart`).
The server also imports pytest (:data:`PRELOAD`): whichever starts it first in a test session, the
launcher or these helpers, its ranks unpickle test functions without importing anything. A spawned
rank paid 5-6 s of CPU importing torch, Dynamo, FSDP and pipelining on a 2-core VM, most of the
suite's multi-process time; a forked 2-rank start takes 40 ms. Errors come back through files or
torch.multiprocessing's error queue, never through output. The nccl ranks are still spawned.

Example:
    >>> def work(rank, world_size, scale):
    ...     t = torch.full((1,), float(rank + 1)) * scale
    ...     dist.all_reduce(t)
    ...     return t.item()
    >>> run_ranks(work, 2, 10.0)  # doctest: +SKIP
    [30.0, 30.0]
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from swapkit.distributed import rank_start
from swapkit.distributed.rank_start import RANK_PRELOAD, RankStart

DEFAULT_TIMEOUT_S = 120.0

#: imported once by the fork server, whoever starts it first: the launcher's ranks' modules and pytest
PRELOAD = (*RANK_PRELOAD, "pytest")


def run_script(path: Path, source: str, *args: str, close_stderr: bool = False,
               timeout_s: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Write ``source`` to ``path`` and run it with this checkout importable; its output comes back as text.

    A file, not ``python -c``: the processes a script starts with ``forkserver`` import its functions by
    name. ``close_stderr`` starts it as ``2>&-`` would; ``env`` adds to this process's environment.
    """
    path.write_text(source)
    root = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, str(path), *args], cwd=root, capture_output=not close_stderr,
                          stdout=subprocess.PIPE if close_stderr else None, text=True, timeout=timeout_s,
                          env={**os.environ, **(env or {}), "PYTHONPATH": str(root)},
                          preexec_fn=(lambda: os.close(2)) if close_stderr else None)


def start_method(backend: str = "gloo") -> str:
    """``forkserver`` preloading :data:`PRELOAD` for gloo ranks, ``spawn`` for nccl ones."""
    return rank_start.start_method("cuda" if backend == "nccl" else "cpu", PRELOAD)


def run_ranks(fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S,
              backend: str = "gloo") -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return their results.

    ``backend="nccl"`` gives rank ``r`` the GPU ``r`` (its current device) before the group starts.

    Raises:
        RuntimeError: a rank raised (its traceback is in the message), died (the signal is named), or the
            run timed out.
    """
    with tempfile.TemporaryDirectory(prefix="swapkit-dist-") as tmp:
        root = Path(tmp)
        context = mp.start_processes(_rank_main, args=(world_size, str(root), fn, args, backend, RankStart()),
                                     nprocs=world_size, join=False, start_method=start_method(backend))
        _join(context, root, timeout_s)
        return [torch.load(root / f"result{rank}.pt", weights_only=False) for rank in range(world_size)]


def _join(context: Any, root: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(deadline - time.monotonic(), 0.01)):
            if time.monotonic() >= deadline:
                raise RuntimeError(f"ranks did not finish within {timeout_s:.0f} s")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:  # a rank raised, or died (a signal)
        errors = sorted(root.glob("error*.txt"))
        raise RuntimeError("\n".join(p.read_text() for p in errors) or str(err)) from None
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def _rank_main(rank: int, world_size: int, root: str, fn: Callable[..., Any], args: tuple, backend: str,
               start: RankStart) -> None:
    start.take()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = dist.FileStore(os.path.join(root, "store"), world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(root, f"result{rank}.pt"))
    except BaseException:
        Path(root, f"error{rank}.txt").write_text(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        if dist.is_initialized():  # fn may have ended the group itself (swapkit.distributed.launch._run does)
            dist.destroy_process_group()
