"""Issue 12: checkpoints never lose a run — atomic writes (also on a full disk), choice by step number,
fallback over broken files, the config stored and compared on resume, kill -9 during a save."""
from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from swapkit import cli
from swapkit.load import load_config
from swapkit.train import checkpoint as ckpt
from swapkit.train import loop as train_loop
from swapkit.train import format_summary, train
from swapkit.train.checkpoint import checkpoints

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"model_config": {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "intermediate_size": 64,
                          "vocab_size": 64, "seq_length": 16}}


def config(tmp_path: Path | None = None, model: dict | None = None, **train_keys):
    keys = {"batch_size": 2, **train_keys}
    if tmp_path is not None:
        keys.setdefault("save_dir", str(tmp_path / "ckpt"))
    model_config = {**MODEL["model_config"], **(model or {})}
    return load_config({"model": {"model_config": model_config}, "train": keys})


def write_yaml(path: Path, cfg: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(cfg))
    return path


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


# ---------------------------------------------------------------- choosing a checkpoint

def test_checkpoints_are_chosen_by_step_number_not_string_order(tmp_path):
    for name in ("step_9999999.pt", "step_10000000.pt", "step_best.pt", "step_0000002.pt", "step_3.pt.bak",
                 ".step_0000004.pt.abc.tmp"):
        (tmp_path / name).write_bytes(b"x")
    assert [p.name for p in checkpoints(tmp_path)] == ["step_10000000.pt", "step_9999999.pt", "step_0000002.pt"]


def test_broken_checkpoints_fall_back_to_the_newest_valid_one(tmp_path, caplog):
    straight = train(config(), steps=4, progress=False).losses
    train(config(tmp_path, save_interval=1), steps=2, progress=False)
    folder = tmp_path / "ckpt"
    good = folder / "step_0000001.pt"
    data = (folder / "step_0000002.pt").read_bytes()
    (folder / "step_0000002.pt").write_bytes(data[: len(data) // 2])  # truncated
    (folder / "step_0000003.pt").write_bytes(b"")  # empty
    (folder / "step_0000004.pt").write_bytes(os.urandom(4096))  # garbage
    torch.save({"step": 7}, folder / "step_0000005.pt")  # loads, but is no checkpoint
    resumed = train(config(tmp_path, resume=True), steps=4, progress=False)
    assert resumed.losses == straight  # bit for bit, from step 1's checkpoint
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert [m.split("skipping ")[1].split(",")[0] for m in skipped] == [
        str(folder / f"step_000000{i}.pt") for i in (5, 4, 3, 2)]
    assert resumed.summary["resumed_from"] == str(good)


def test_no_valid_checkpoint_is_a_config_error_exit_2(tmp_path, capsys):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "step_0000002.pt").write_bytes(b"garbage")
    path = write_yaml(tmp_path / "c.yaml", {"model": MODEL, "train": {"batch_size": 2, "save_dir": str(folder),
                                                                       "resume": True}})
    assert cli.main(["train", str(path), "--steps", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"train.resume: no valid checkpoint in {folder}: step_0000002.pt" in err
    assert "Traceback" not in err


# ---------------------------------------------------------------- a full disk

def test_a_full_disk_during_a_save_leaves_no_temporary_file_and_exits_1(tmp_path, capsys, monkeypatch):
    real_save, saves = torch.save, []

    def save_until_the_disk_is_full(obj, file):
        saves.append(1)
        if len(saves) == 2:
            file.write(b"x" * 100_000)  # half a checkpoint reached the disk, then it was full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save(obj, file)

    monkeypatch.setattr(ckpt.torch, "save", save_until_the_disk_is_full)
    folder = tmp_path / "ckpt"
    path = write_yaml(tmp_path / "c.yaml", {"model": MODEL, "train": {"batch_size": 2, "save_dir": str(folder),
                                                                       "save_interval": 1}})
    assert cli.main(["train", str(path), "--steps", "4", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"swapkit: cannot write {folder / 'step_0000002.pt'}: No space left on device; nothing was left" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in folder.iterdir()) == ["step_0000001.pt"]  # no .tmp, the older one intact
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    resumed = train(config(tmp_path, resume=True), steps=4, progress=False)  # the next resume works
    assert resumed.losses == train(config(), steps=4, progress=False).losses


def test_a_full_disk_while_writing_metrics_leaves_no_temporary_file(tmp_path, capsys, monkeypatch):
    real_fsync, calls = os.fsync, []

    def fsync_on_a_full_disk(fd):
        calls.append(fd)
        if len(calls) >= 2:  # the disk stays full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_on_a_full_disk)
    metrics = tmp_path / "m.json"
    path = write_yaml(tmp_path / "c.yaml", {"model": MODEL, "train": {"batch_size": 2}})
    assert cli.main(["train", str(path), "--steps", "3", "--no-progress", "--metrics-out", str(metrics)]) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert leftovers(tmp_path) == []
    assert [s["step"] for s in json.loads(metrics.read_text())["steps"]] == [1]  # the last complete write


# ---------------------------------------------------------------- resume with another config

def test_resume_refuses_a_changed_model_or_data_listing_each_difference(tmp_path, capsys):
    train(config(tmp_path), steps=1, progress=False)
    changed = {"model": {"model_config": {**MODEL["model_config"], "num_heads": 2, "rope_theta": 500000.0,
                                          "rms_norm_eps": 1.0e-6}},
               "train": {"batch_size": 4, "seed": 1, "dtype": "bf16", "save_dir": str(tmp_path / "ckpt"),
                         "resume": True}}
    assert cli.main(["train", str(write_yaml(tmp_path / "c.yaml", changed)), "--steps", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "step_0000001.pt does not fit model.model_config and train: the model or the data changed" in err
    for line in ("model.model_config.num_heads: 4 -> 2", "model.model_config.rope_theta: 10000.0 -> 500000.0",
                 "model.model_config.rms_norm_eps: 1e-05 -> 1e-06", "train.seed: 0 -> 1",
                 "train.batch_size: 2 -> 4", "train.dtype: 'fp32' -> 'bf16'"):
        assert f"  - {line} (changed since step_0000001.pt was saved)" in err, line


def test_resume_takes_the_configs_optimizer_values_and_says_so(tmp_path, monkeypatch):
    train(config(tmp_path), steps=1, progress=False)
    groups = []

    def recording_resume(run):
        ckpt.resume(run)
        groups.extend(dict(lr=g["lr"], weight_decay=g["weight_decay"]) for g in run.optimizer.param_groups)

    monkeypatch.setattr(train_loop, "resume", recording_resume)
    result = train(config(tmp_path, resume=True, lr=1e-3, weight_decay=0.1), steps=2, progress=False)
    assert groups == [{"lr": 1e-3, "weight_decay": 0.1}]  # not the checkpoint's 3e-3 / 0
    changes = result.summary["resume_changes"]
    assert "train.lr: 0.003 -> 0.001 (the config's value is used)" in changes
    assert "train.weight_decay: 0.0 -> 0.1 (the config's value is used)" in changes
    assert "train.lr: 0.003 -> 0.001 (the config's value is used)" in format_summary(result.summary)


def test_resume_allows_swap_and_recompute_changes_reports_them_and_matches_bit_for_bit(tmp_path):
    straight = train(config(), steps=4, progress=False).losses
    train(config(tmp_path), steps=2, progress=False)
    raw = {"model": MODEL, "train": {"batch_size": 2, "save_dir": str(tmp_path / "ckpt"), "resume": True},
           "swap_config": {"swap": True, "layer_swap": [{"backward_prefetch": 2, "layers": [0, 1]}]}}
    result = train(load_config(raw), steps=4, progress=False)
    assert result.losses == straight
    assert "swap_config.swap: false -> true (allowed: it does not change the math)" in result.summary["resume_changes"]
    assert result.steps[-1]["offloaded_bytes"] > 0  # the swap really ran after the resume



def test_resume_that_flips_swap_shows_both_readings_of_the_recompute_list(tmp_path, caplog):
    before = {"model": MODEL, "train": {"batch_size": 2, "save_dir": str(tmp_path / "ckpt")},
              "recompute_config": {"recompute": [1]}}
    train(load_config(before), steps=1, progress=False)
    after = {**before, "train": {**before["train"], "resume": True}, "swap_config": {"swap": True}}
    caplog.set_level(logging.WARNING, logger="swapkit")
    train(load_config(after), steps=2, progress=False)
    assert [r.getMessage() for r in caplog.records if "changes what" in r.getMessage()] == [
        "train.resume: swap_config.swap is on (step_0000001.pt was written with it off), which changes what "
        "recompute_config.recompute: [1] means: with swap off, per-stage counts selecting layers [0]; with swap on, "
        "global layer indices selecting layers [1]; now in effect: swap on"]

# ---------------------------------------------------------------- kill -9 during a save

CHILD = textwrap.dedent("""
    import io, os, sys, time
    import torch
    from swapkit.train import checkpoint, train
    from swapkit.load import load_config
    real_save, calls = torch.save, []

    def slow_save(obj, file):  # the second save stops half-way until it is killed
        calls.append(1)
        if len(calls) < 2:
            return real_save(obj, file)
        buffer = io.BytesIO()
        real_save(obj, buffer)
        data = buffer.getvalue()
        file.write(data[: len(data) // 2])
        file.flush()
        open(sys.argv[2], "w").close()
        time.sleep(60)
        file.write(data[len(data) // 2:])

    checkpoint.torch.save = slow_save
    train(load_config(sys.argv[1]), steps=4, progress=False)
""")


def test_kill_9_during_a_save_never_corrupts_and_the_resume_matches(tmp_path):
    folder = tmp_path / "ckpt"
    raw = {"model": MODEL, "train": {"batch_size": 2, "save_dir": str(folder), "save_interval": 1}}
    path, marker = write_yaml(tmp_path / "c.yaml", raw), tmp_path / "saving"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(marker)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the child never reached its second save"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert [p.name for p in checkpoints(folder)] == ["step_0000001.pt"]  # step 2 never appeared half-written
    assert len(leftovers(folder)) == 1  # the killed save's temporary file
    resumed = train(config(tmp_path, resume=True), steps=4, progress=False)
    assert leftovers(folder) == []  # removed by the next run
    assert resumed.losses == train(config(), steps=4, progress=False).losses
    assert resumed.summary["resumed_from"] == str(folder / "step_0000001.pt")


# ---------------------------------------------------------------- a fresh run in a used save_dir

@pytest.mark.parametrize("layout", ["step_0000002.pt", "rank001/step_0000002.pt"])
def test_a_fresh_run_refuses_a_save_dir_holding_earlier_checkpoints(tmp_path, capsys, layout):
    """A run with train.resume: false in a save_dir with checkpoints wrote over those of its own steps
    without a word (step_0000001.pt of the earlier run was lost) and left the newer ones beside its own, so
    the next resume continued the earlier run (its step 2), silently dropping this one's work."""
    folder = tmp_path / "ckpt"
    (folder / layout).parent.mkdir(parents=True)
    for name in ("step_0000001.pt", "step_0000002.pt"):
        (folder / layout).with_name(name).write_bytes(b"an earlier run")
    path = write_yaml(tmp_path / "c.yaml", {"model": MODEL, "train": {"batch_size": 2, "save_dir": str(folder),
                                                                       "save_interval": 1}})
    assert cli.main(["train", str(path), "--steps", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert (f"train.save_dir: got {folder}, which holds 2 checkpoint(s) of an earlier run (the newest: "
            f"{folder / layout}); with train.resume: false this run starts from step 0") in err, err
    assert "Set train.resume: true to continue that run, or choose another train.save_dir" in err
    assert "Traceback" not in err
    assert {p.read_bytes() for p in folder.rglob("step_*.pt")} == {b"an earlier run"}  # nothing written over


def test_metrics_rewrites_take_a_bounded_share_of_the_run(tmp_path, monkeypatch):
    """--metrics-out was rewritten whole after every step: a write grows with the steps so far, so a long
    run spent most of its time rewriting it (2000 steps of a 1-layer model: 11 s, with --metrics-out
    82 s). Writes are now spaced out (summary Note [Metrics writes]); the file still ends complete."""
    from swapkit.train import summary

    real_write, writes = summary.atomic_write, []

    def slow_write(path, write):  # a metrics file of many steps
        time.sleep(0.05)
        writes.append(path)
        real_write(path, write)

    monkeypatch.setattr(summary, "atomic_write", slow_write)
    metrics = tmp_path / "m.json"
    train(config(), steps=8, metrics_out=metrics, progress=False)
    document = json.loads(metrics.read_text())
    assert [s["step"] for s in document["steps"]] == list(range(1, 9)) and document["summary"]["steps"] == 8
    assert document["summary"]["status"] == "completed"
    assert 2 <= len(writes) <= 4, len(writes)  # after step 1, at the end, and only when the time allows between
