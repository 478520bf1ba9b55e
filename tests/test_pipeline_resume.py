"""Resuming a multi-process ``swapkit train`` (gloo on CPU): every rank resumes the same step, and a
config problem a rank meets is reported like the single-process one (exit 2, one message).

One 2-stage run writes the per-rank checkpoints (module fixture); each test copies them.
"""
from __future__ import annotations

import pickle
import shutil

import pytest
import torch

from swapkit.config.errors import ConfigError, Problem
from swapkit.distributed import launch
from swapkit.train.errors import RunFailed
from tests.test_pipeline_train import losses, run_cli


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp2_resume")
    code, metrics = run_cli("pp2.yaml", tmp, "pp2", "--steps", "2", "--set", f"train.save_dir={tmp / 'ckpt'}")
    assert code == 0
    return tmp / "ckpt", metrics


def resume_args(folder, *sets: str) -> list[str]:
    args = ["--set", f"train.save_dir={folder}", "--set", "train.resume=true",
            "--set", "train.collective_timeout_s=30"]  # a rank left waiting fails in seconds, not minutes
    return args + [arg for value in sets for arg in ("--set", value)]


def test_a_config_error_in_a_rank_is_one_message_with_exit_2(saved, tmp_path, capsys):
    folder = tmp_path / "ckpt"
    shutil.copytree(saved[0], folder)
    code, _ = run_cli("pp2.yaml", tmp_path, "seed", "--steps", "3", *resume_args(folder, "train.seed=1"))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "train.seed: 0 -> 1 (changed since step_0000002.pt was saved)" in err
    assert "Traceback" not in err


def _fail(folder, rank: int, when: float, error: BaseException | None = None) -> None:
    if error is not None:
        (folder / f"failed{rank}.pkl").write_bytes(pickle.dumps(launch._reportable(error)))
    (folder / f"failed{rank}.txt").write_text(f"{when}\nTraceback (most recent call last):\n  boom {rank}\n")


def test_the_first_failed_rank_is_reported_with_its_traceback_or_its_own_error(tmp_path):
    _fail(tmp_path, 1, 2.0)
    _fail(tmp_path, 0, 1.0, RunFailed("the loss is nan at step 3"))
    error = launch._first_failure(tmp_path, 1, "noticed")
    assert isinstance(error, RunFailed) and str(error) == "rank 0: the loss is nan at step 3"
    _fail(tmp_path, 2, 0.5)  # an earlier failure that is no user error: its traceback, as RankFailed
    error = launch._first_failure(tmp_path, 1, "noticed")
    assert isinstance(error, launch.RankFailed)
    assert str(error).startswith("rank 2 failed (2 other rank(s) failed after it):") and "boom 2" in str(error)
    _fail(tmp_path, 3, 0.1, ConfigError([Problem("train.seed", "0 -> 1")], "pp2.yaml"))
    error = launch._first_failure(tmp_path, 1, "noticed")
    assert isinstance(error, ConfigError) and error.problems == (Problem("train.seed", "0 -> 1"),)
    assert error.source == "pp2.yaml"
