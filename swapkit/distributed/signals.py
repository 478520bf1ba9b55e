"""SIGINT, SIGTERM and SIGHUP in the processes ``swapkit train`` owns: one clear stop, no tracebacks, no orphans.

Note [Stopping the ranks]
A scheduler (or ``kill -INT PID``) signals only the process it started: the parent of the
ranks. The parent forwards the stop to every rank, waits for them, kills (SIGKILL) any that is still
alive after ``grace_s`` (one stuck in native code), reaps them all, and only then raises
:class:`Interrupted`; the CLI prints its one line and exits ``128 + signal``. A second signal to the
parent kills the ranks at once. A rank that fails while the others stop (its collective sees a peer
gone) is part of the stop, not a failure to report. The parent forwards SIGTERM whatever it received: a rank still
importing (before it installed :class:`StopOnSignal`) then exits at once and quietly, where SIGINT
would print a ``KeyboardInterrupt`` traceback from the interpreter's start-up; once installed, the
rank treats both alike. A ``SIG_IGN`` inherited for a signal (``nohup``, a background job of a
script) is kept: that signal stays ignored.

Note [A hangup is a stop]
Closing the terminal, or an SSH session that drops, sends SIGHUP to every process of the run, whose
default action ends each at once: no cleanup ran, and the rank folder and the fork server's socket
stayed in TMPDIR. SIGHUP is therefore the third stop signal, handled as SIGTERM is (exit status
``128 + 1``), as torchrun's agent also treats it; ``nohup swapkit train ...`` starts it ignored, and
an inherited ignore is kept. The fork server is not swapkit's and dies of it (it reports every rank
as ended): the parent then waits for each rank process itself (swapkit.distributed.rank_end Note [A
rank has ended when its process has]).

Note [Interrupts and finalizers]
Python runs a signal's handler on the main thread between any two bytecodes, finalizers included.
``KeyboardInterrupt`` raised inside a ``__del__`` (a swap record's, which takes the step's lock and
returns host memory to the pool, swapkit.runtime.records Note [Record lifetime]) cannot propagate:
Python prints ``Exception ignored in ...`` with a traceback, the finalizer stops half-way, and the
interrupt is lost. :class:`StopOnSignal` therefore raises only where no ``__del__`` is on the
interrupted stack; inside one it asks for the signal again a few milliseconds later, by which time
the finalizer has returned (one retry thread, started on install: a finalizer must not start
threads). A finalizer it cannot see (a weak reference's callback) still loses the raise to Python's
"Exception ignored": the unraisable hook installed with the handlers catches that
:class:`Interrupted` and asks for the signal again the same way. A signal still owed when the block
ends without an exception is raised by its ``__exit__``, so none is lost to a block that ended
first. A second signal (Ctrl-C reaches a rank both from the terminal and from the parent) while the
first :class:`Interrupted` propagates (it, or an exception it caused, is being handled: an
``except``, ``finally`` or ``__exit__`` on the stack) is remembered, not raised, so it cannot cut the
cleanup that the first one started; a signal during any other ``except`` raises, and if something
caught the first and went on, the next signal raises again. Nothing is swallowed: each
:class:`Interrupted` propagates like ``KeyboardInterrupt``. A
rank ignores both signals once its work has ended, so nothing interrupts the interpreter's
shutdown (the parent reaps it, or kills it after the grace period).

Note [Ranks start deaf]
A rank starts (a spawned one runs the interpreter's start-up and imports torch; a forked one
unpickles its work) before :class:`StopOnSignal` is installed; a stop signal then (Ctrl-C in the
first seconds reaches every process of the terminal's group, or the parent forwards one) would print
a ``KeyboardInterrupt`` traceback from an import, and torch's own join would then wait 30 s for the
other ranks. So the parent blocks SIGINT and SIGTERM while it starts the ranks, and SIGINT while it
starts the fork server that CPU ranks are forked from (:func:`stop_signals_blocked`; a signal mask is
inherited across fork and exec,
as ``multiprocessing``'s resource tracker also relies on; the tracker is started first, because its
start unblocks both signals in the parent), and each rank unblocks them once its handlers are
installed: a stop that arrived meanwhile was held pending and is raised there, as one
:class:`Interrupted`. The parent's own pending signal reaches :class:`ForwardSignals` when its mask
is restored, right after the start. What the fork server does with a signal it holds:
swapkit.distributed.rank_start Note [Ranks forked from a preloaded server].

Note [No rank outlives its parent]
SIGKILL cannot be caught: a parent killed that way (``kill -9``, the out-of-memory killer, a
scheduler's hard stop) forwards nothing. ``torch.multiprocessing`` asks Linux to send a rank SIGINT
when its parent process dies (``PR_SET_PDEATHSIG``; for a forked CPU rank that is the fork server,
which lives on while its ranks do), but a parent started with SIGINT ignored, as a
background job of a script is (``swapkit train ... &``), passes the ignore on to its ranks, which
keep it (Note [Stopping the ranks]): its ranks, re-parented to init, went on training to the last
step, holding memory and writing checkpoints into ``train.save_dir``, where a resumed run then raced
them. And a CPU rank's parent process is the fork server, which outlives ``swapkit train`` while
any rank it forked runs (swapkit.distributed.rank_start Note [Ranks forked from a preloaded server]).
So each rank started by ``swapkit train`` watches that process itself: a daemon thread looks it up
by the pid the parent passed (so a parent gone before the rank started is noticed too, and a pid
that now names a process started after the rank is not taken for it) every ``POLL_S``, and once it
has ended (a zombie has: its parent has not reaped it yet) logs it and sends the rank SIGTERM, which
stops it as a forwarded stop does (a peer may end first, on the connection that rank closed). Once
the rank's work has ended it ignores the signal (:func:`ignore_stop_signals`). A rank that is still
alive ``STOP_GRACE_S`` later is blocked in native code, where no Python handler runs: a parent killed
while its ranks met left one rank waiting in the rendezvous for a peer that had already stopped,
until ``train.collective_timeout_s``. The parent would kill such a rank after the same grace (Note
[Stopping the ranks]); with the parent gone, the watch logs it and sends the rank SIGKILL itself.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
from multiprocessing import resource_tracker
import os
import queue
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any, Sequence

import psutil

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # Note [A hangup is a stop]
RETRY_S = 0.005  # Note [Interrupts and finalizers]: a finalizer returns well within this
POLL_S = 0.1
STOP_GRACE_S = 10.0  # Note [Stopping the ranks]: a rank stops within a step; this is for one stuck in native code


class Interrupted(KeyboardInterrupt):
    """The run was stopped by one of :data:`STOP_SIGNALS`; a ``KeyboardInterrupt``, so every cleanup for Ctrl-C runs.

    Attributes:
        signum: the signal received; the CLI exits with ``128 + signum``.
    """

    def __init__(self, signum: int, detail: str = "") -> None:
        self.signum, self.detail = signum, detail
        name = signal.Signals(signum).name
        super().__init__(f"interrupted by {name}" + (f": {detail}" if detail else ""))

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self) -> tuple[type, tuple[int, str]]:
        return Interrupted, (self.signum, self.detail)


def _installable(signums: Sequence[int]) -> list[int]:
    """The signals this process may take over: on the main thread only, never one inherited as ignored."""
    if threading.current_thread() is not threading.main_thread():
        return []
    return [s for s in signums if signal.getsignal(s) is not signal.SIG_IGN]


@contextlib.contextmanager
def stop_signals_blocked(signums: Sequence[int] = STOP_SIGNALS):
    """``signums`` of the stop signals held pending on this thread (and in processes it starts) for the
    block, the others not (Note [Ranks start deaf]); the previous mask comes back on exit, delivering
    what is pending."""
    resource_tracker.ensure_running()  # its first start unblocks both signals (CPython's own mask trick)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    signal.pthread_sigmask(signal.SIG_SETMASK, (previous - set(STOP_SIGNALS)) | set(signums))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def unblock_stop_signals() -> None:
    """A rank whose handlers are installed: take the stop signals again (Note [Ranks start deaf])."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def ignore_stop_signals() -> None:
    """A rank whose work has ended: stop signals no longer interrupt it (Note [Interrupts and finalizers])."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def stop_when_parent_dies(parent: int) -> ParentWatch:
    """A rank: SIGTERM to itself once the process ``parent`` has ended (Note [No rank outlives its parent]).

    Returns:
        The watch, which also answers whether the parent has ended (swapkit.distributed.rank_end Note [An
        orphaned rank removes the run's files]).
    """
    watch = ParentWatch(parent)
    threading.Thread(target=_watch_parent, args=(watch,), name="swapkit-parent-watch", daemon=True).start()
    return watch


class ParentWatch:
    """The process that started this rank, and this rank's start time (so a reused pid is not taken for it)."""

    def __init__(self, parent: int) -> None:
        self.parent, self.born = parent, psutil.Process().create_time()

    def gone(self) -> bool:
        return _has_ended(self.parent, self.born)


def _watch_parent(watch: ParentWatch) -> None:
    _wait_for_end(watch.parent, watch.born)
    logger.warning("swapkit: the swapkit train process (pid %d) that started this rank is gone; stopping",
                   watch.parent)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(STOP_GRACE_S)  # still running: the parent would kill it now (Note [No rank outlives its parent])
    logger.warning("swapkit: this rank did not stop within %g s (blocked in native code: a rendezvous or a "
                   "collective waiting for a rank that is gone); killing it", STOP_GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_for_end(pid: int, born_before: float) -> None:
    """Return once the process ``pid``, started before ``born_before``, has ended (Note [No rank outlives its
    parent])."""
    while not _has_ended(pid, born_before):
        time.sleep(POLL_S)


def _has_ended(pid: int, born_before: float) -> bool:
    """The process ``pid``, started before ``born_before``, has ended: gone, a zombie (its parent has not reaped
    it yet), or its pid names a process started later."""
    try:
        process = psutil.Process(pid)
        return process.create_time() > born_before or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # a zombie's details, too
        return True
    except psutil.AccessDenied:  # /proc hides it (hidepid): its pid is all there is to watch
        return not psutil.pid_exists(pid)


def _in_finalizer(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def _interrupt_propagating() -> bool:
    """An :class:`Interrupted`, or an exception raised while one was handled, is being handled now."""
    exc = sys.exc_info()[1]
    while exc is not None:
        if isinstance(exc, Interrupted):
            return True
        exc = exc.__context__
    return False


class _StopHandlers:
    """The stop signals go to ``self._handle`` while installed (main thread only, an inherited ignore kept)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> _StopHandlers:
        """Take over the stop signals; leaving a ``with`` block restores the previous handlers."""
        for signum in _installable(STOP_SIGNALS):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __enter__(self) -> _StopHandlers:
        return self.install()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        raise NotImplementedError


class StopOnSignal(_StopHandlers):
    """The stop signals raise :class:`Interrupted`, never inside a finalizer (Note [Interrupts and finalizers]).

    For processes swapkit owns: a rank, or the CLI's single-process run. Installed on entry (on the
    main thread only), the previous handlers restored on exit. An ``Exception`` leaving the block after
    a stop signal is its consequence (a peer rank gone, a cleanup the interrupt cut short) and leaves as
    :class:`Interrupted`, the failure chained as its cause.

    Attributes:
        signum: the first stop signal received, ``None`` if none.
    """

    def __init__(self) -> None:
        super().__init__()
        self._raised = False
        self._exiting = False  # __exit__ began: a signal is only recorded, __exit__ raises it
        self._lock = threading.Lock()  # installed or not, as the retry thread sees it
        self._retries: queue.SimpleQueue | None = None  # put() is safe in a handler and a finalizer
        self._unraisable: Any = None

    def install(self) -> StopOnSignal:
        super().install()
        if self._previous:  # Note [Interrupts and finalizers]
            self._retries = queue.SimpleQueue()
            threading.Thread(target=self._retry, args=(self._retries,), name="swapkit-signal-retry",
                             daemon=True).start()
            self._unraisable, sys.unraisablehook = sys.unraisablehook, self._hook
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        # A signal from here on (a retry landing while this waits for the lock) is recorded, not raised
        # half-way through restoring the handlers; the end of this method raises it.
        self._exiting = True
        with self._lock:  # no retry re-sends once the handlers are the previous ones again
            installed = bool(self._previous)
            super().__exit__(exc_type, exc, tb)
        if installed:
            sys.unraisablehook, self._unraisable = self._unraisable, None
            self._retries.put(None)
        if isinstance(exc, Exception) and self.signum is not None:
            # After a stop signal a failure is its consequence (a peer rank gone, a cleanup cut short by
            # the interrupt): report the stop, keep the failure as the cause (`-v` logs it).
            logger.debug("swapkit: the run failed after %s", signal.Signals(self.signum).name, exc_info=exc)
            raise Interrupted(self.signum) from exc
        if exc is None and self.signum is not None and not self._raised:
            self._raised = True
            raise Interrupted(self.signum)  # owed since a finalizer deferred it (Note [Interrupts and finalizers])

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
        if self._exiting:
            self._raised = False  # owed: the end of __exit__ raises it unless an exception already leaves
            return
        if self._raised and _interrupt_propagating():
            return  # the first is propagating: a second signal must not cut its cleanup short
        if _in_finalizer(frame):
            self._retries.put(self.signum)
            return
        self._raised = True
        raise Interrupted(self.signum)

    def _hook(self, unraisable: Any) -> None:
        """An :class:`Interrupted` lost in a finalizer ``_handle`` could not see: ask for it again."""
        if isinstance(unraisable.exc_value, Interrupted) and self._retries is not None:
            self._raised = False
            self._retries.put(unraisable.exc_value.signum)
            return
        (self._unraisable or sys.__unraisablehook__)(unraisable)

    def _retry(self, retries: queue.SimpleQueue) -> None:
        """The retry thread: re-send a deferred signal to the main thread once its finalizer returned."""
        main = threading.main_thread().ident
        for signum in iter(retries.get, None):
            time.sleep(RETRY_S)
            with self._lock:
                if self._previous:  # still installed: the signal reaches _handle
                    signal.pthread_kill(main, signum)


class ForwardSignals(_StopHandlers):
    """The parent's side of Note [Stopping the ranks]: remember a stop signal, stop and reap the ranks.

    Attributes:
        signum: the first stop signal received, ``None`` if none.
        repeated: a second one arrived (the ranks are killed at once).
    """

    def __init__(self) -> None:
        super().__init__()
        self.repeated = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
        else:
            self.repeated = True

    def stop(self, processes: Sequence[Any], grace_s: float) -> int:
        """Forward SIGTERM to the live ``processes``, wait up to ``grace_s``, kill the rest, reap all.

        Returns:
            How many had to be killed.
        """
        alive = [p for p in processes if p.is_alive()]
        for process in alive:
            _send(process, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(p.is_alive() for p in alive) and time.monotonic() < deadline and not self.repeated:
            multiprocessing.connection.wait([p.sentinel for p in alive if p.is_alive()], timeout=POLL_S)
        killed = [p for p in alive if p.is_alive()]
        for process in killed:
            process.kill()
        for process in processes:
            process.join()
        return len(killed)


def _send(process: Any, signum: int) -> None:
    try:
        os.kill(process.pid, signum)
    except ProcessLookupError:  # it exited since is_alive()
        pass


def stopped_ranks(signum: int, stopped: int, killed: int) -> Interrupted:
    """The parent's :class:`Interrupted`: ``interrupted by SIGINT: stopped 2 rank processes``, or, when every rank
    had ended its work before the signal came, that the run was complete but for the summary."""
    if stopped == 0:
        return Interrupted(signum, "every rank had finished its steps; the summary was not printed")
    text = f"stopped {stopped} rank process{'es' if stopped != 1 else ''}"
    return Interrupted(signum, text + (f" ({killed} killed after the grace period)" if killed else ""))
