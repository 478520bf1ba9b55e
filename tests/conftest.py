"""Shared pytest setup: ``@pytest.mark.cuda`` tests are skipped on machines without CUDA; shared fixtures."""
from __future__ import annotations

import getpass
import logging
import multiprocessing.util
import os
import re
import shutil
import tempfile

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def temporary_files_stay_in_one_folder():
    """Every temporary file the suite and the processes it starts make lands in one folder, removed when the
    test process exits: a process a test kills with SIGKILL cannot remove its own (``swapkit train``'s rank folder,
    multiprocessing's ``pymp-*`` folder, torchrun's ``torchelastic_*`` logs), and ``torch.multiprocessing``
    leaves a failed rank's ``pytorch-errorfile-*.pickle`` behind. The folder sits right in the system's
    temporary folder, not under pytest's deeper base folder: the fork server's socket lives in it, and a
    Unix socket's path may hold only about 100 bytes (macOS's temporary folder is 50 already). Inductor
    keeps its usual cache folder, so compiled kernels stay cached between runs."""
    base = tempfile.gettempdir()
    folder = tempfile.mkdtemp(prefix="swapkit-tests-", dir=base)
    with pytest.MonkeyPatch.context() as patch:
        if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
            patch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.join(base, f"torchinductor_{_user()}"))
        patch.setenv("TMPDIR", folder)  # the processes tests start
        patch.setattr(tempfile, "tempdir", None)  # this process: gettempdir() reads TMPDIR again
        yield folder
    tempfile.tempdir = None
    # removed at exit, after multiprocessing removed this process's own pymp-* folder in it (priority -100)
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(folder,), kwargs={"ignore_errors": True},
                                  exitpriority=-101)


def _user() -> str:
    """The user name in inductor's default cache folder (``torchinductor_<user>``), as
    ``torch._inductor.runtime.cache_dir_utils.default_cache_dir`` writes it; calling that would import
    Dynamo and inductor's config (1.3 s) in every test run, also of a single file that needs neither."""
    try:
        return re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    except (KeyError, OSError):  # no name for this uid (a container): inductor's own fallback
        return f"uid_{os.getuid()}"


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matrices: one intra-op thread is as fast and does not fight the other tests for cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def inline_copies():
    """The thread engine copies inline (as it does after ``close``), so a copy is finished when it is
    issued: releases happen exactly at their tick, whatever else the machine is running. Tests that
    compare a predicted ``peak_device_bytes`` with a measured one use it; how copy timing moves the
    peak on a real link is measured in ``benchmarks/``, not asserted in tests."""
    from swapkit.engine.thread import ThreadCopyEngine

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ThreadCopyEngine, "_ensure_worker", lambda self: False)
        yield


@pytest.fixture
def remove_sessions(monkeypatch):
    """Every session a test applies is removed after it: no worker thread or pending graph outlives it."""
    import swapkit

    made = []
    apply = swapkit.apply
    monkeypatch.setattr(swapkit, "apply", lambda *a, **k: made.append(apply(*a, **k)) or made[-1])
    yield
    for session in made:
        session.remove()


@pytest.fixture
def cli_loggers_restored():
    """``swapkit.cli.main`` configures the ``swapkit`` logger (handler, level, no propagation) and the
    planner's progress logger (its level); put both back as they were after the test."""
    loggers = [logging.getLogger(name) for name in ("swapkit", "swapkit.planner.progress")]
    saved = [(logger.handlers[:], logger.level, logger.propagate) for logger in loggers]
    yield
    for logger, (handlers, level, propagate) in zip(loggers, saved):
        logger.handlers[:], logger.level, logger.propagate = handlers, level, propagate
