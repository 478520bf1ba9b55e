"""How a rank process that ``swapkit train`` starts on this machine comes to life.

Note [Ranks forked from a preloaded server]
A rank started with ``spawn`` is a new interpreter that imports torch, Dynamo, FSDP and the
pipelining package before its first collective: seconds of CPU on a 2-core VM, paid by every rank,
so 4 CPU ranks on 2 cores waited twice that (``swapkit train configs/pp2_dp2.yaml --steps 2`` took
16.0-17.5 s with spawned ranks, 9.0-9.8 s with forked ones). CPU ranks are therefore forked from
``multiprocessing``'s fork server (``start_method="forkserver"``), which imports
:data:`RANK_PRELOAD` once per process that starts ranks; each rank is then a ``fork`` of it. Forking
that server is safe where forking the parent is not: it is a fresh interpreter with one thread that
has imported modules and run nothing (no OpenMP pool, no CUDA context, no process group, none of the
parent's copy threads and their locks). CUDA ranks are still spawned: one GPU per rank pays its own
CUDA start anyway, and nothing here is worth a CUDA process that shares a parent's pages.

A forked rank would take from the server what a spawned one takes from the parent at its start, so
the parent hands those over explicitly (:class:`RankStart`), and they hold for every launch from one
process, not only the first (the server outlives a launch: Python API users may train twice):
- the environment: the parent's ``os.environ`` as it is at the launch (the server's is the one of
  its own start). What torch reads only at import (``OMP_NUM_THREADS`` for its default thread count,
  say) is read once, by the server, from the environment of the first launch;
- standard output and error: the parent's descriptors 1 and 2 at the launch are passed with the
  process (``multiprocessing.reduction.DupFd``) and become the rank's, so its log lines go where the
  parent's go now (a terminal, a pipe, a file, a test's capture); one closed when the parent
  started becomes ``os.devnull`` in the rank, never the server's (which may be any file by then);
- the signal mask: the parent starts the server with SIGINT blocked (only SIGINT: see below), so a
  Ctrl-C while it imports is held pending there and discarded when it ignores SIGINT (as
  ``multiprocessing``'s server does), and the ranks it forks start with SIGINT blocked, as spawned
  ones start with both stop signals blocked (swapkit.distributed.signals Note [Ranks start deaf]). A
  SIGTERM before a forked rank installed its handlers ends it at once and quietly (its default
  action; the parent counts it as stopped, Note [Stopping the ranks]). SIGTERM stays deliverable
  because the server is process-wide and outlives the launch: whatever else this process later forks
  from it (a ``multiprocessing`` pool under Python 3.14's default start method, a DataLoader's
  workers) starts with the server's mask, and a pool stops its workers with SIGTERM. Those start
  with SIGINT blocked: a Ctrl-C raises ``KeyboardInterrupt`` in the process that started them, not
  in them, and that process stops them. A server something
  else started first keeps its own mask; ranks forked from it install their handlers after they
  unpickle their work, tens of milliseconds in which a Ctrl-C reaches them as a
  ``KeyboardInterrupt``;
- the parent: a forked rank's parent process is the server, so it watches the ``swapkit train``
  process itself (swapkit.distributed.signals Note [No rank outlives its parent]).
The server ends once the parent and every process it forked have ended (each holds its pipe open).
If it dies first (killed), ``multiprocessing`` reads every rank it forked as ended with code 255,
and torch's ``PR_SET_PDEATHSIG`` sends each of them SIGINT, which stops them; the parent waits for
them by pid (swapkit.distributed.rank_end Note [A rank has ended when its process has]). The server, not the
parent, reaps a rank, so a rank's pid is free as soon as it ended; the parent signals only ranks it
has not seen end, and a pid reused within that moment would take a whole cycle of the pid space. A
module of :data:`RANK_PRELOAD` that fails to import in the server is skipped by ``multiprocessing``
without a word: the ranks then import it themselves, as spawned ones do.

Note [The server starts first]
``swapkit train`` starts the server as soon as its config says the run has CPU ranks, before the
parent imports torch (``swapkit.cli._start_rank_server``): the server's imports then run beside the
parent's own and its checks (the op patterns on a meta model, the memory estimate), on the other
core, instead of after them. ``launch`` finds it running. A run that then fails a check (exit 2)
leaves nothing behind: the server ends with its parent.

Note [A fork server needs a short TMPDIR]
The server listens on a Unix socket that ``multiprocessing`` makes in a ``pymp-*`` folder of TMPDIR,
and the kernel caps a socket's path (108 bytes on Linux with the terminating NUL, 104 on macOS). With
a longer TMPDIR the server cannot start, and every CPU run on several ranks failed with ``swapkit:
failed: OSError: AF_UNIX path too long``, while one process trained. Before it starts the server,
:func:`start_method` measures the path the socket would have; when it does not fit, the ranks are
spawned as CUDA ranks are (each imports torch itself: slower, the same run) and a WARNING says so and
how to get the fast start back.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import tempfile
from multiprocessing import forkserver, reduction, util
from typing import TYPE_CHECKING, Any, Sequence

from swapkit.distributed.signals import stop_signals_blocked

if TYPE_CHECKING:
    from swapkit.config.types import Config

logger = logging.getLogger(__name__)

#: Note [A fork server needs a short TMPDIR]: the longest path a Unix socket binds to (the NUL takes a byte)
SOCKET_PATH_MAX = 107 if sys.platform.startswith("linux") else 103

#: what the fork server imports once, before it forks any rank: all a rank of swapkit train needs
RANK_PRELOAD = ("torch", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.pipelining",
                "swapkit.distributed.train")


def world_size(config: Config) -> int:
    """How many processes the config's ``parallel_config`` asks ``swapkit train`` for (no torch: the CLI
    asks before it imports torch, Note [The server starts first])."""
    return config.parallel.pipeline_stage * config.parallel.data_parallel


def start_method(device_type: str, preload: Sequence[str] = RANK_PRELOAD, warn: bool = True) -> str:
    """``forkserver`` for CPU ranks, with the server started now (SIGINT blocked) if it is not running;
    ``spawn`` for CUDA ranks (Note [Ranks forked from a preloaded server]), and for CPU ranks when TMPDIR is
    too long for the server's socket (Note [A fork server needs a short TMPDIR]).

    Args:
        device_type: the ranks' device type.
        preload: the modules a server started now imports.
        warn: log the WARNING of Note [A fork server needs a short TMPDIR] (the CLI's early start leaves it
            to the launch, which asks again).
    """
    if device_type == "cuda" or not _server_socket_fits(warn):
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(preload))
    with stop_signals_blocked((signal.SIGINT,)):
        forkserver.ensure_running()  # a no-op once it runs: the preload and the mask are its first start's
    return "forkserver"


def _server_socket_fits(warn: bool) -> bool:
    """Note [A fork server needs a short TMPDIR]: whether a server started now can bind its socket."""
    if forkserver._forkserver._forkserver_pid is not None:  # started once: a restart binds in the same folder
        return True
    listener = os.path.join(util.get_temp_dir(), "listener-" + "x" * 8)  # as multiprocessing names it
    if len(os.fsencode(listener)) <= SOCKET_PATH_MAX:
        return True
    if warn:
        logger.warning("swapkit: TMPDIR (%s) is too long for the Unix socket of the fork server that CPU ranks are "
                       "forked from (%d bytes of at most %d with its file name); the ranks are spawned instead, "
                       "each importing torch itself (seconds per rank). Set TMPDIR to a shorter folder for the fast "
                       "start", tempfile.gettempdir(), len(os.fsencode(listener)), SOCKET_PATH_MAX)
    return False


class RankStart:
    """What a rank takes from the parent at its start (Note [Ranks forked from a preloaded server]).

    Built in the parent; pickled once per rank, when that rank is started.
    """

    def __init__(self) -> None:
        self.parent = os.getpid()
        self.environment = dict(os.environ)
        self.streams: tuple[Any, ...] = ()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # DupFd must run while the process is being started: it registers the descriptor with that start.
        # A stream closed when this interpreter started (``>&-``) is None here, and its number may name
        # another file by now: the rank gets os.devnull for it instead.
        streams = tuple(None if stream is None else reduction.DupFd(fd)
                        for fd, stream in ((1, sys.__stdout__), (2, sys.__stderr__)))
        return _received, (self.parent, self.environment, streams)

    def take(self) -> None:
        """In the rank, first: the parent's environment and standard streams become this process's."""
        os.environ.clear()
        os.environ.update(self.environment)
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        for target, passed in zip((1, 2), self.streams):
            fd = os.open(os.devnull, os.O_WRONLY) if passed is None else passed.detach()
            if fd != target:  # a spawned rank inherits the parent's descriptors under their own numbers
                os.dup2(fd, target)
                os.close(fd)


def _received(parent: int, environment: dict[str, str], streams: tuple[Any, ...]) -> RankStart:
    start = RankStart.__new__(RankStart)
    start.parent, start.environment, start.streams = parent, environment, streams
    return start
