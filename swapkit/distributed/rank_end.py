"""How the rank processes of ``swapkit train`` end: the parent waits for each; orphans clean up after the run.

Note [An orphaned rank removes the run's files]
A parent killed with SIGKILL removes nothing: its rank folder (``swapkit-ranks-*``, with the ranks'
failure files) and ``multiprocessing``'s ``pymp-*`` folder with the fork server's socket stayed in
TMPDIR, and a rank that failed before it noticed (its collective saw the peer that had already stopped
close the connection) left a ``pytorch-errorfile-*.pickle`` there too: ``torch.multiprocessing``
writes a rank's ``Exception`` to a file the parent named and would have read and removed. The ranks
are then the run's last processes (the fork server ends with them), so each rank whose parent is gone
removes, as it ends, the rank folder and the server's socket, and the socket's folder if nothing else
is in it (the parent's ``multiprocessing`` may keep more there); the last to end leaves nothing. A
rank that fails then leaves with ``SystemExit`` instead of its ``Exception``, so torch writes no error
file, and a peer that writes into the folder after another rank removed it fails the same way. Each
rank asks whether the parent is gone when it ends, not only once the watch thread noticed it.

Note [A rank has ended when its process has]
``multiprocessing`` learns that a forked rank ended from the fork server, which reaps it
(swapkit.distributed.rank_start Note [Ranks forked from a preloaded server]). A server that dies
(killed, or SIGTERM to the whole process group, which reaches the server with the others) closes its
pipes, and every rank it forked reads as ended with code 255 while it still runs, stopping on its own
(its death signal, the parent's SIGTERM or its watch). The parent then reported the run stopped,
removed the rank folder and exited while its ranks ran on: they printed after its last line, and
each wrote its failure into the removed folder, failed there too, and left torch's error file in
TMPDIR. So the parent also holds each rank as a process (``psutil``, which tells a reused pid apart
by its start time), and before it removes anything waits for every rank to have ended, with the same
SIGTERM, grace and SIGKILL as a stop (swapkit.distributed.signals Note [Stopping the ranks]); when
the server is alive they have all ended already and this costs one look at each.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from multiprocessing import forkserver
from typing import Any, Sequence

import psutil

from swapkit.distributed.signals import POLL_S


def rank_processes(processes: Sequence[Any], started_after: float) -> list[psutil.Process]:
    """The started ranks as the system sees them, not as the fork server reports them (Note [A rank has ended
    when its process has]); one that has already ended is left out."""
    found = []
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            rank = psutil.Process(process.pid)
            if rank.create_time() >= started_after:
                found.append(rank)
    return found


def end_processes(processes: Sequence[psutil.Process], grace_s: float) -> int:
    """SIGTERM to those of ``processes`` still running, SIGKILL to any left after ``grace_s``; return once each
    has ended (Note [A rank has ended when its process has]).

    Returns:
        How many had to be killed.
    """
    for process in _running(processes):
        _signal(process, signal.SIGTERM)
    _wait_while_running(processes, grace_s)
    killed = _running(processes)
    for process in killed:
        _signal(process, signal.SIGKILL)
    _wait_while_running(processes, grace_s)  # bounded: a process in uninterruptible sleep is not waited for
    return len(killed)


def _running(processes: Sequence[psutil.Process]) -> list[psutil.Process]:
    """Those of ``processes`` still running: ``is_running`` tells a reused pid apart; a zombie has ended."""
    alive = []
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
    return alive


def _wait_while_running(processes: Sequence[psutil.Process], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _running(processes) and time.monotonic() < deadline:
        time.sleep(POLL_S / 10)


def _signal(process: psutil.Process, signum: int) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):  # it ended since _running()
        process.send_signal(signum)


def leave_no_files(folder: str) -> None:
    """A rank whose parent is gone: remove the run's rank folder and the fork server's socket (Note [An orphaned
    rank removes the run's files])."""
    shutil.rmtree(folder, ignore_errors=True)
    listener = forkserver._forkserver._forkserver_address  # inherited from the server this rank was forked from
    if isinstance(listener, str):
        with contextlib.suppress(OSError):
            os.unlink(listener)
            os.rmdir(os.path.dirname(listener))  # only if empty: the parent's multiprocessing may keep more there
