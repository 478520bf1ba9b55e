"""SIGINT and SIGTERM: ``swapkit train`` stops its ranks, reaps them and says so in one line.

The end-to-end tests run the CLI as a subprocess in its own session (as a scheduler or a terminal
would start it), wait for its first step, signal it and check the exit status, the output and that
none of its processes is left. The in-process tests drive ``StopOnSignal`` with ``signal.raise_signal``,
which runs the handler at once, inside the caller (a finalizer, a ``finally`` block).
"""
from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from swapkit.distributed.signals import Interrupted, StopOnSignal, _wait_for_end
from tests.dist_utils import run_script

ROOT = Path(__file__).resolve().parents[1]
BOUND_S = 20  # generous for a loaded 2-core box; stopping takes about 2 s


@pytest.fixture
def start_train():
    """Start ``swapkit train`` in its own session (SIGINT and SIGHUP back to their defaults: a background suite
    inherits SIGINT ignored, one started with ``nohup`` SIGHUP); whatever a test leaves running is killed with its
    whole group."""
    children: list[subprocess.Popen] = []

    def start(*args: str, launcher: tuple[str, ...] = (), sigint: Any = signal.SIG_DFL) -> subprocess.Popen:
        def child_setup() -> None:
            os.setsid()
            signal.signal(signal.SIGINT, sigint)
            signal.signal(signal.SIGHUP, signal.SIG_DFL)

        command = [sys.executable, "-m", *launcher, "swapkit.cli", "train", *args, "--no-progress"]
        children.append(subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True, preexec_fn=child_setup))
        return children[-1]

    yield start
    for child in children:
        try:  # the whole group, parent alive or not: ranks a failed test left behind go too
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.communicate()


def wait_for_step(child: subprocess.Popen, pattern: str = "step 1/", timeout_s: float = 180) -> list[str]:
    """Read stderr until the first step is logged (training has started); the lines read so far. Reads the
    pipe's descriptor with a deadline (a hung start fails the test instead of hanging it), bypassing the
    text reader's buffer so that ``communicate`` later reads the rest."""
    fd, data, deadline = child.stderr.fileno(), b"", time.monotonic() + timeout_s
    while pattern.encode() not in data:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {pattern!r} within {timeout_s} s:\n" + data.decode(errors="replace"))
        if select.select([fd], [], [], min(left, 1.0))[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError("the run ended before its first step:\n" + data.decode(errors="replace"))
            data += chunk
    return data.decode(errors="replace").splitlines(keepends=True)


def interrupt(child: subprocess.Popen, signum: int, whole_group: bool) -> tuple[str, list[psutil.Process]]:
    """Send ``signum`` to the parent only (``kill -INT PID``) or to its process group (Ctrl-C); its stderr."""
    processes = psutil.Process(child.pid).children(recursive=True)
    if whole_group:
        os.killpg(child.pid, signum)
    else:
        os.kill(child.pid, signum)
    _, err = child.communicate(timeout=BOUND_S)  # not stopped in time: TimeoutExpired, the fixture kills it
    return err, processes


def assert_all_gone(processes: list[psutil.Process]) -> None:
    _, alive = psutil.wait_procs(processes, timeout=10)  # the resource tracker ends once its pipe closes
    assert alive == [], f"left behind: {[(p.pid, p.status()) for p in alive]}"


@pytest.mark.parametrize("signum, code, whole_group", [
    (signal.SIGINT, 130, False),   # kill -INT PID
    (signal.SIGTERM, 143, False),  # a scheduler's stop
    (signal.SIGINT, 130, True),    # Ctrl-C: every rank gets it from the terminal and from the parent
], ids=["sigint-parent", "sigterm-parent", "ctrl-c-group"])
def test_a_pipeline_run_stops_every_rank_on_a_signal(start_train, signum, code, whole_group):
    child = start_train(str(ROOT / "configs" / "pp2.yaml"), "--steps", "100000")
    seen = wait_for_step(child)
    assert len(_ranks_of(child)) == 2
    err, processes = interrupt(child, signum, whole_group)
    output = "".join(seen) + err
    assert child.returncode == code, output[-3000:]
    name = signal.Signals(signum).name  # a rank past the grace period on a loaded box is killed, and says so
    assert re.search(rf"swapkit: interrupted by {name}: stopped 2 rank processes( \(\d killed after the grace "
                     r"period\))?\n", err), err
    assert "Traceback" not in output and "Exception ignored" not in output, output[-3000:]
    assert "step 100000/" not in output  # stopped, not finished
    assert_all_gone(processes)


def test_under_torchrun_each_rank_stops_with_one_line(start_train):
    """torchrun forwards the signal to its ranks (the README's torchrun command); its own report is torchrun's."""
    torchrun = ("torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", "127.0.0.1:0", "-m")
    child = start_train(str(ROOT / "configs" / "pp2.yaml"), "--steps", "100000", launcher=torchrun)
    seen = wait_for_step(child)
    err, processes = interrupt(child, signal.SIGTERM, whole_group=False)
    output = "".join(seen) + err
    assert output.count("swapkit: interrupted by SIGTERM\n") == 2, output[-3000:]
    assert "swapkit: failed" not in output and "Exception ignored" not in output, output[-3000:]
    assert_all_gone(processes)


def test_ranks_stop_when_swapkit_train_itself_is_killed(start_train):
    """kill -9 (or the out-of-memory killer) on the parent forwards nothing. torch.multiprocessing asks Linux
    for SIGINT to a rank whose parent dies, but a run started as a background job of a script (`swapkit train
    ... &`) inherits SIGINT ignored, and its ranks went on training to the last step as orphans, writing
    checkpoints a resumed run would race. Each rank now notices its parent is gone and stops
    (Note [No rank outlives its parent])."""
    child = start_train(str(ROOT / "configs" / "pp2.yaml"), "--steps", "100000", sigint=signal.SIG_IGN)
    seen = wait_for_step(child)
    processes = psutil.Process(child.pid).children(recursive=True)
    assert len(_ranks_of(child)) == 2
    os.kill(child.pid, signal.SIGKILL)
    _, err = child.communicate(timeout=BOUND_S)  # EOF only once every rank closed the pipe: none left running
    output = "".join(seen) + err
    assert child.returncode == -signal.SIGKILL
    # the first rank to notice says so; its peer may end first on the connection that rank closed
    assert re.search(rf"\[rank [01]\] WARNING - swapkit: the swapkit train process \(pid {child.pid}\) that started "
                     "this rank is gone; stopping", output), output[-3000:]
    assert "step 100000/" not in output
    assert_all_gone(processes)


def test_a_single_process_run_stops_on_sigterm_and_keeps_its_metrics(start_train, tmp_path):
    metrics = tmp_path / "metrics.json"
    child = start_train(str(ROOT / "configs" / "tiny.yaml"), "--steps", "100000", "--metrics-out", str(metrics))
    seen = wait_for_step(child)
    err, _ = interrupt(child, signal.SIGTERM, whole_group=False)
    assert child.returncode == 143, "".join(seen) + err
    assert err.endswith("swapkit: interrupted by SIGTERM\n") and "Traceback" not in err
    assert json.loads(metrics.read_text())["summary"]["status"] == "interrupted"


# ---------------------------------------------------------------------- StopOnSignal in this process

@pytest.fixture(autouse=True)
def _sigint_raises():
    """Python's own SIGINT handler while a test runs: a suite started in the background inherits SIGINT
    ignored, and StopOnSignal keeps an inherited ignore."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


class SignalsWhileFinalized:
    """Its finalizer receives SIGINT half-way, as a record's ``__del__`` can under Ctrl-C."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def __del__(self) -> None:
        signal.raise_signal(signal.SIGINT)  # the handler runs here, inside the finalizer
        self.log.append("finalized")


def wait_for_retry() -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.001)
    raise AssertionError("the deferred interrupt never came")


def test_an_interrupt_inside_a_finalizer_is_raised_after_it(monkeypatch):
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    log: list[str] = []
    with pytest.raises(Interrupted) as info:
        with StopOnSignal():
            SignalsWhileFinalized(log)  # no reference kept: finalized at once
            assert log == ["finalized"]  # the finalizer ran to its end ...
            wait_for_retry()  # ... and the interrupt comes right after it
    assert unraisable == []  # without StopOnSignal: "Exception ignored in ... __del__", and the interrupt is lost
    assert info.value.signum == signal.SIGINT and str(info.value) == "interrupted by SIGINT"


def test_a_second_signal_does_not_cut_the_cleanup_short():
    cleaned = []
    with pytest.raises(Interrupted) as info:
        with StopOnSignal():
            try:
                signal.raise_signal(signal.SIGTERM)
            finally:
                signal.raise_signal(signal.SIGINT)  # Ctrl-C reaches a rank twice: remembered, not raised
                cleaned.append(True)
    assert cleaned == [True] and info.value.signum == signal.SIGTERM


def test_a_signal_after_an_interrupt_was_caught_raises_again():
    with StopOnSignal():
        with pytest.raises(Interrupted):
            signal.raise_signal(signal.SIGINT)
        with pytest.raises(Interrupted):  # something caught the first and went on: Ctrl-C still works
            signal.raise_signal(signal.SIGINT)


def test_a_failure_after_a_stop_signal_is_reported_as_the_stop():
    with pytest.raises(Interrupted) as info:
        with StopOnSignal():
            try:
                signal.raise_signal(signal.SIGTERM)
            except Interrupted:
                pass  # a rank's cleanup caught it, then its peer's collective failed
            raise RuntimeError("Connection closed by peer")
    assert info.value.signum == signal.SIGTERM and isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(RuntimeError):  # without a signal a failure stays itself
        with StopOnSignal():
            raise RuntimeError("a real failure")


def test_handlers_are_restored_and_an_inherited_ignore_is_kept():
    before = signal.getsignal(signal.SIGINT)
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with StopOnSignal():
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # nohup: stays ignored
            assert signal.getsignal(signal.SIGINT) is not before
        assert signal.getsignal(signal.SIGINT) is before
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_signal_deferred_by_a_finalizer_is_raised_when_the_block_ends_first():
    with pytest.raises(Interrupted) as info:
        with StopOnSignal():
            SignalsWhileFinalized([])  # the retry is 5 ms away: the block ends before it
    assert info.value.signum == signal.SIGINT


def test_an_interrupt_lost_in_a_weakref_callback_comes_again(monkeypatch):
    """A finalizer ``_in_finalizer`` cannot see: the unraisable hook asks for the signal again."""
    import weakref

    class Target:
        pass

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(Interrupted):
        with StopOnSignal():
            target = Target()
            weakref.finalize(target, signal.raise_signal, signal.SIGTERM)
            del target  # the callback raises Interrupted: Python cannot propagate it out of a callback
            wait_for_retry()
    assert unraisable == []


def test_a_second_signal_during_an_unrelated_except_raises():
    with StopOnSignal():
        with pytest.raises(Interrupted):
            signal.raise_signal(signal.SIGINT)
        with pytest.raises(Interrupted):
            try:
                raise KeyError("x")
            except KeyError:  # handling an exception that is not the interrupt: the signal still raises
                signal.raise_signal(signal.SIGTERM)


def test_ranks_that_end_within_the_join_that_saw_the_signal_still_report_the_stop(tmp_path):
    """A rank stopped by a signal exits 0 (torch's spawn wrapper takes the KeyboardInterrupt): if every
    rank ended within the join during which the signal came, the parent must report the stop, not load
    a result rank 0 never wrote."""
    from types import SimpleNamespace

    from swapkit.distributed.launch import _join
    from swapkit.distributed.signals import ForwardSignals

    ended = SimpleNamespace(is_alive=lambda: False, join=lambda: None, pid=-1)
    signals = ForwardSignals()

    def join(timeout: float, grace_period: float | None = None) -> bool:
        signals.signum = signal.SIGTERM  # the signal arrives during this join, and both ranks end
        return True

    context = SimpleNamespace(join=join, processes=[ended, ended])
    with pytest.raises(Interrupted) as info:
        _join(context, tmp_path, signals)
    assert info.value.signum == signal.SIGTERM and "stopped 2 rank processes" in str(info.value)


def test_a_stop_after_every_rank_finished_says_so(tmp_path):
    """A Ctrl-C while the ranks were already exiting after their last step said ``stopped 0 rank processes``: the
    run was complete (checkpoints and metrics written); only the summary was not printed."""
    from types import SimpleNamespace

    from swapkit.distributed.launch import _join
    from swapkit.distributed.signals import ForwardSignals

    for rank in range(2):
        (tmp_path / f"done{rank}").touch()
    exiting = SimpleNamespace(is_alive=lambda: False, join=lambda: None, pid=-1)
    signals = ForwardSignals()

    def join(timeout: float, grace_period: float | None = None) -> bool:
        signals.signum = signal.SIGINT  # the ranks wrote their done files and are still exiting
        return False

    with pytest.raises(Interrupted) as info:
        _join(SimpleNamespace(join=join, processes=[exiting, exiting]), tmp_path, signals)
    assert str(info.value) == "interrupted by SIGINT: every rank had finished its steps; the summary was not printed"


def test_ctrl_c_while_the_ranks_start_stops_them_without_tracebacks(start_train, monkeypatch):
    """Note [Ranks start deaf]: a stop while the ranks start (the fork server may still be importing torch:
    swapkit.distributed.rank_start Note [Ranks forked from a preloaded server]) is held until the parent and
    each rank have their handlers installed. The parent is starting ranks once its rank folder exists (made
    with its signal handlers, in a TMPDIR of this test's own)."""
    own = Path(tempfile.mkdtemp(prefix="t", dir=tempfile.gettempdir()))  # short: the server's socket is in it
    monkeypatch.setenv("TMPDIR", str(own))
    child = start_train(str(ROOT / "configs" / "pp2.yaml"), "--steps", "100000")
    deadline = time.monotonic() + 60
    while not list(own.glob("swapkit-ranks-*")) and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert list(own.glob("swapkit-ranks-*")), "the run never started its ranks"
    time.sleep(0.02)  # the folder is made just before the handlers are installed; ranks take longer to start
    err, processes = interrupt(child, signal.SIGINT, whole_group=True)
    assert child.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "Exception ignored" not in err and "Terminating process" not in err, err[-3000:]
    assert re.search(r"swapkit: interrupted by SIGINT: stopped 2 rank processes", err), err
    assert_all_gone(processes)


@pytest.mark.parametrize("signum, code, whole_group", [
    (signal.SIGINT, 130, True),    # Ctrl-C
    (signal.SIGTERM, 143, False),  # a scheduler's stop: before, the default action, silent, with the server's folder left
], ids=["ctrl-c-group", "sigterm-parent"])
def test_a_stop_before_the_ranks_start_leaves_no_process_and_no_file(start_train, monkeypatch, signum, code,
                                                                     whole_group):
    """rank_start Note [The server starts first]: the fork server runs while the parent still imports torch,
    before launch installs its handlers. cli Note [Stopped early]: a stop then ends the parent with one line
    and an orderly exit, which removes the server's socket folder, and the server ends with it (it holds
    SIGINT blocked and ends when its parent's pipe closes)."""
    own = Path(tempfile.mkdtemp(prefix="t", dir=tempfile.gettempdir()))  # short: the server's socket is in it
    monkeypatch.setenv("TMPDIR", str(own))
    child = start_train(str(ROOT / "configs" / "pp2.yaml"), "--steps", "100000")
    deadline = time.monotonic() + 60
    while _fork_server(child) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _fork_server(child) is not None
    err, processes = interrupt(child, signum, whole_group)
    assert child.returncode == code, err[-3000:]
    assert "Traceback" not in err and "Exception ignored" not in err and "Terminating process" not in err, err[-3000:]
    name = signal.Signals(signum).name  # with "stopped 2 rank processes" if they had started
    assert re.fullmatch(rf"swapkit: interrupted by {name}(: stopped 2 rank processes.*)?\n", err), err
    assert_all_gone(processes)
    assert not list(own.glob("pymp-*")) and not list(own.glob("swapkit-ranks-*")), list(own.iterdir())


def _fork_server(child: subprocess.Popen) -> psutil.Process | None:
    """The fork server ``swapkit train`` started its ranks from, once it exists."""
    for process in psutil.Process(child.pid).children():
        try:
            if "multiprocessing.forkserver" in " ".join(process.cmdline()):
                return process
        except psutil.Error:  # gone, or not exec'd yet
            pass
    return None


def _ranks_of(child: subprocess.Popen) -> list[psutil.Process]:
    """The rank processes (forked by the fork server), as far as they exist yet."""
    server = _fork_server(child)
    return [] if server is None else server.children()


def _returns_within(seconds: float, function: Any, *args: Any) -> bool:
    thread = threading.Thread(target=function, args=args, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


def test_a_rank_sees_its_parent_end_when_it_is_a_zombie_is_reaped_or_its_pid_names_a_later_process():
    """Note [No rank outlives its parent]: a forked rank's parent process is the fork server, so it watches the
    swapkit train process by pid. A killed parent is a zombie until its own parent reaps it; a reaped one's pid
    may name a process started after the rank."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    while psutil.Process(ended.pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.01)
    assert _returns_within(5, _wait_for_end, ended.pid, time.time())  # a zombie
    ended.wait()
    assert _returns_within(5, _wait_for_end, ended.pid, time.time())  # reaped: no such process
    assert _returns_within(5, _wait_for_end, os.getpid(), 0.0)  # a process started after the rank did


def test_the_fork_server_holds_sigint_only_so_what_else_forks_from_it_still_stops_on_sigterm(tmp_path):
    """swapkit.distributed.rank_start Note [Ranks forked from a preloaded server]: the server is process-wide
    and outlives the launch; a pool forked from it later stops its workers with SIGTERM. In a process of its
    own, so that this test starts the server (nothing preloaded: it starts in milliseconds)."""
    done = run_script(tmp_path / "pool_after_ranks.py",
                      "import multiprocessing, signal\n"
                      "from swapkit.distributed.rank_start import start_method\n"
                      "def blocked(_):\n"
                      "    return sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, ()))\n"
                      "if __name__ == '__main__':\n"
                      "    before = signal.pthread_sigmask(signal.SIG_BLOCK, ())\n"
                      "    assert start_method('cpu', preload=()) == 'forkserver'\n"
                      "    assert signal.pthread_sigmask(signal.SIG_BLOCK, ()) == before  # the parent's mask is back\n"
                      "    with multiprocessing.get_context('forkserver').Pool(1) as pool:\n"
                      "        print(pool.map(blocked, [0]))\n")
    assert done.returncode == 0, done.stderr
    (worker_mask,) = json.loads(done.stdout)
    assert signal.SIGINT in worker_mask and signal.SIGTERM not in worker_mask, worker_mask


def test_a_rank_whose_parent_is_gone_and_that_cannot_stop_is_killed_after_the_grace(tmp_path):
    """Note [No rank outlives its parent]: a rank blocked in native code (a rendezvous with a peer that already
    stopped) runs no Python handler; with the parent gone, nobody else kills it after the grace."""
    done = run_script(tmp_path / "stuck_rank.py",
                      "import signal, subprocess, sys, time\n"
                      "from swapkit.distributed import signals\n"
                      "signals.STOP_GRACE_S = 0.5\n"
                      "signal.signal(signal.SIGTERM, lambda *_: None)  # the stop reaches no Python code\n"
                      "gone = subprocess.Popen([sys.executable, '-c', 'pass'])\n"
                      "gone.wait()\n"
                      "signals.stop_when_parent_dies(gone.pid)\n"
                      "time.sleep(60)\n", timeout_s=50)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert "that started this rank is gone; stopping" in done.stderr
    assert "this rank did not stop within 0.5 s (blocked in native code" in done.stderr
