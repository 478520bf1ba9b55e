"""A rank, the fork server or ``swapkit train`` itself dies mid-run: one message, nothing left behind.

End to end, as ``tests/test_signals.py`` runs them: ``swapkit train`` in its own session, here with a TMPDIR
of the test's own, so that every file the run leaves in the temporary folder is seen
(``swapkit.distributed.rank_end`` Notes [A rank has ended when its process has] and [An orphaned rank removes
the run's files], ``swapkit.distributed.launch`` Note [A rank's progress bar lock]).
"""
from __future__ import annotations

import os
import re
import signal
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from tests.test_signals import BOUND_S, ROOT, _fork_server, _ranks_of, assert_all_gone, start_train, wait_for_step

__all__ = ["start_train"]  # the fixture, used by name

PP2 = str(ROOT / "configs" / "pp2.yaml")


@pytest.fixture
def own_tmpdir(monkeypatch) -> Path:
    """The run's TMPDIR: short (the fork server's socket is in it) and empty."""
    folder = Path(tempfile.mkdtemp(prefix="t", dir=tempfile.gettempdir()))
    monkeypatch.setenv("TMPDIR", str(folder))
    return folder


def leftovers(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


def running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_rank_killed_with_sigkill_ends_the_run_with_one_message(start_train, own_tmpdir):
    """Before, ``multiprocessing``'s resource tracker warned of a leaked semaphore (tqdm's lock, which the
    killed rank never released) after swapkit's message, and torch logged each rank it terminated."""
    child = start_train(PP2, "--steps", "100000")
    seen = wait_for_step(child)
    processes = psutil.Process(child.pid).children(recursive=True)
    ranks = _ranks_of(child)
    assert len(ranks) == 2
    ranks[1].kill()
    _, err = child.communicate(timeout=BOUND_S)
    output = "".join(seen) + err
    assert child.returncode == 1, output[-3000:]
    assert re.search(r"swapkit: rank [01] was killed by SIGKILL \(.*\); the other ranks were stopped\n$", err), err
    assert "Traceback" not in output and "Terminating process" not in output and "leaked" not in output, err
    assert_all_gone(processes)
    assert leftovers(own_tmpdir) == []


def test_a_dead_fork_server_ends_the_run_only_after_its_ranks(start_train, own_tmpdir):
    """``multiprocessing`` learns that a forked rank ended from the fork server; a server that dies reports
    every rank as ended (255) while they still run. The parent exited at once, and the ranks, still
    stopping, wrote their failures into the rank folder it had removed: each left a
    ``pytorch-errorfile-*.pickle`` in TMPDIR."""
    child = start_train(PP2, "--steps", "100000")
    seen = wait_for_step(child)
    processes = psutil.Process(child.pid).children(recursive=True)
    ranks = _ranks_of(child)
    assert len(ranks) == 2
    _fork_server(child).kill()
    assert child.wait(timeout=BOUND_S) == 1
    assert [rank.pid for rank in ranks if running(rank)] == []  # ended before the parent did
    _, err = child.communicate(timeout=BOUND_S)
    assert "or the fork server it was forked from died" in err, "".join(seen) + err
    assert "Traceback" not in err and "Terminating process" not in err, err
    assert_all_gone(processes)
    assert leftovers(own_tmpdir) == []


def test_a_killed_swapkit_train_leaves_no_temporary_files(start_train, own_tmpdir):
    """kill -9 on the parent: its ranks stop (Note [No rank outlives its parent]), and they, the last
    processes of the run, remove its rank folder and the fork server's socket folder; before, those and a
    ``pytorch-errorfile-*.pickle`` of a rank that failed on its stopped peer stayed in TMPDIR."""
    child = start_train(PP2, "--steps", "100000")
    wait_for_step(child)
    processes = psutil.Process(child.pid).children(recursive=True)
    assert len(_ranks_of(child)) == 2
    os.kill(child.pid, signal.SIGKILL)
    child.communicate(timeout=BOUND_S)  # EOF once every rank closed the pipe
    assert_all_gone(processes)
    assert leftovers(own_tmpdir) == []


def test_ranks_are_spawned_when_tmpdir_is_too_long_for_the_fork_servers_socket(tmp_path):
    """rank_start Note [A fork server needs a short TMPDIR]: the server listens on a Unix socket in TMPDIR, whose
    path Linux caps at 108 bytes; a longer TMPDIR failed every CPU pipeline run with ``swapkit: failed:
    OSError: AF_UNIX path too long``. In a process of its own, so that this test starts the server."""
    from tests.dist_utils import run_script

    deep = Path(tempfile.mkdtemp(dir=tempfile.gettempdir())) / ("d" * 100)
    deep.mkdir()
    script = ("import logging, multiprocessing, os\n"
              "from multiprocessing import forkserver\n"
              "from swapkit.distributed.rank_start import start_method\n"
              "logging.basicConfig(format='%(levelname)s - %(message)s')\n"
              "print(start_method('cpu', preload=()), forkserver._forkserver._forkserver_pid)\n")
    done = run_script(tmp_path / "long_tmpdir.py", script, env={"TMPDIR": str(deep)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["spawn", "None"]  # no server started, no failed one either
    assert f"TMPDIR ({deep}) is too long for the Unix socket of the fork server" in done.stderr, done.stderr
    short = run_script(tmp_path / "short_tmpdir.py", script, env={"TMPDIR": tempfile.gettempdir()})
    assert short.stdout.split()[0] == "forkserver" and short.stderr == "", short.stderr


#: installed as sitecustomize in every process of the run: rank 1 dies before it joins the process group
DIES_BEFORE_THE_RENDEZVOUS = '''
import importlib.abc, importlib.util, os, sys

def _patch(launch):
    join_group = launch._init
    def _init(config, device, rank, world, init_method):
        if rank == 1:
            print("rank 1 dies now", file=sys.stderr, flush=True)
            os._exit(3)
        return join_group(config, device, rank, world, init_method)
    launch._init = _init

class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "swapkit.distributed.launch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        spec.loader.exec_module = lambda module: (run(module), _patch(module))
        return spec

sys.meta_path.insert(0, _Finder())
'''


def test_a_rank_that_dies_before_the_rendezvous_ends_the_run_within_seconds(start_train, own_tmpdir, monkeypatch):
    """launch Note [Peers of a failed rank]: its peers wait for it in the rendezvous, in native code where
    SIGTERM runs no handler, and torch's join gave them 30 s before SIGKILL: the run took 40-50 s to say so."""
    (own_tmpdir / "site").mkdir()
    (own_tmpdir / "site" / "sitecustomize.py").write_text(DIES_BEFORE_THE_RENDEZVOUS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(own_tmpdir / "site"), str(ROOT)]))
    child = start_train(PP2, "--steps", "100000")
    seen = wait_for_step(child, "rank 1 dies now")
    started = time.monotonic()
    _, err = child.communicate(timeout=BOUND_S)
    output = "".join(seen) + err
    assert child.returncode == 1, output[-3000:]
    assert "swapkit: rank 1 exited with code 3 without a Python error; the other ranks were stopped\n" in err, err
    assert time.monotonic() - started < 15, output[-3000:]  # 2 x 2 s of grace and the exits; 30 s before
    assert leftovers(own_tmpdir) == ["site"]


def test_a_terminal_hangup_stops_the_run_as_sigterm_does(start_train, own_tmpdir):
    """signals Note [A hangup is a stop]: closing the terminal (or an SSH session dropping) sends SIGHUP to every
    process of the run; its default action ended each at once, and the rank folder and the fork server's socket
    stayed in TMPDIR."""
    child = start_train(PP2, "--steps", "100000")
    seen = wait_for_step(child)
    processes = psutil.Process(child.pid).children(recursive=True)
    os.killpg(child.pid, signal.SIGHUP)
    _, err = child.communicate(timeout=BOUND_S)
    output = "".join(seen) + err
    assert child.returncode == 128 + signal.SIGHUP, output[-3000:]
    assert re.search(r"swapkit: interrupted by SIGHUP: stopped 2 rank processes( \(\d killed after the grace "
                     r"period\))?\n$", err), err
    assert "Traceback" not in output and "Exception ignored" not in output, output[-3000:]
    assert_all_gone(processes)
    assert leftovers(own_tmpdir) == []
