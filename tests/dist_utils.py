"""Multi-process test helpers: run a function on N ranks (gloo on CPU by default), collect what each rank returns.

Ranks rendezvous through a ``FileStore`` in a temporary directory, so concurrent test runs on one
machine never compete for a port. Each rank's return value is saved with ``torch.save`` and handed
back to the parent in rank order; an exception on any rank fails the parent with that rank's
traceback. The function must be importable (a module-level function of a test module or of this
file): it is pickled by name, as with ``spawn``.

Note [Ranks forked from a preloaded server]
A rank started with ``spawn`` is a new interpreter that imports torch, Dynamo, DTensor and the
pipelining package again: 5-6 s of CPU each on a 2-core VM, so a 2-rank test paid 5 s before its first
collective, and those starts were most of the suite's multi-process time. The gloo ranks here are
forked instead from multiprocessing's fork server (``start_method="forkserver"``), which imports
:data:`PRELOAD` once per test session: a 2-rank start then takes 40 ms. Forking that server is
safe: it is a fresh interpreter with one thread, that has imported modules and run nothing else
(no OpenMP pool, no CUDA, no process group), whereas forking the pytest process itself would copy
its copy threads' locks and its OpenMP pool. What a fork server changes, and how it is kept as
``spawn`` had it:
- a rank's environment is the server's, from when it started: :func:`rank_environment` hands each
  rank the parent's ``os.environ`` as it is at the call, and the rank takes it before anything else;
- its standard streams are the server's (the capture of the test that started it); results come
  back through files and errors through files or torch.multiprocessing's error queue, never
  through output;
- the nccl ranks are still spawned: CUDA is not initialised in the server, but a CUDA test is worth
  a fresh process.
``swapkit train``'s own launcher keeps ``spawn`` (swapkit.distributed.launch): its ranks watch their
parent's pid and start with the parent's signal mask (swapkit.distributed.signals Note [Ranks start
deaf]), which a fork server would replace with its own; the tests that launch it pay the start.

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
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 120.0

#: imported once by the fork server that starts gloo ranks (Note [Ranks forked from a preloaded server])
PRELOAD = ["pytest", "torch", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.pipelining", "swapkit",
           "swapkit.distributed.train"]


def start_method(backend: str = "gloo") -> str:
    """``forkserver`` preloading :data:`PRELOAD` for gloo ranks, ``spawn`` for nccl ones (Note [Ranks forked
    from a preloaded server])."""
    if backend == "nccl":
        return "spawn"
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)  # read when the server starts, once per session
    return "forkserver"


def rank_environment() -> dict[str, str]:
    """The parent's environment now, for a rank to take first (Note [Ranks forked from a preloaded server])."""
    return dict(os.environ)


def take_environment(environment: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environment)


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
        context = mp.start_processes(_rank_main, args=(world_size, str(root), fn, args, backend, rank_environment()),
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
               environment: dict[str, str]) -> None:
    take_environment(environment)
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
