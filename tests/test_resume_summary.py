"""The summary of a resumed run: its figures cover the steps run since the resume, and say so.

swapkit.train.summary Note [Figures after a resume]: the records of a resumed run start at step 1
(the checkpoint's are continued), and the steps before the resume may have run with another swap
config; medians over all of them mixed the two runs.
"""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from swapkit.load import load_config
from swapkit.train import format_summary, train

MODEL = {"model_config": {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "intermediate_size": 64,
                          "vocab_size": 64, "seq_length": 16}}
SWAP = {"swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": [0, 1]}]}


def config(tmp_path: Path, swap: dict | None = None, resume: bool = False):
    raw = {"model": MODEL, "train": {"batch_size": 2, "save_dir": str(tmp_path / "ckpt"), "resume": resume}}
    if swap is not None:
        raw.update(swap_config=swap, runtime={"min_offload_bytes": 0})
    return load_config(raw)


def test_figures_are_over_the_steps_since_a_resume_that_turned_swap_on(tmp_path):
    train(config(tmp_path), steps=2, progress=False)  # no swap: steps 1-2 offload nothing
    metrics = tmp_path / "metrics.json"
    result = train(config(tmp_path, SWAP, resume=True), steps=4, progress=False, metrics_out=metrics)
    summary = result.summary
    assert [r["step"] for r in result.steps] == [1, 2, 3, 4]  # the records before the resume are kept
    assert [r["step"] for r in json.loads(metrics.read_text())["steps"]] == [1, 2, 3, 4]
    before, since = result.steps[:2], result.steps[2:]
    assert all(r["offloaded_bytes"] == 0 for r in before) and all(r["offloaded_bytes"] > 0 for r in since)
    assert summary["steps"] == 4
    for key in ("offloaded_bytes", "prefetched_bytes", "saved_bytes", "step_time_s"):
        name = "median_step_time_s" if key == "step_time_s" else f"{key}_per_step"
        assert summary[name] == statistics.median(r[key] for r in since), key
    assert summary["peak_device_bytes"] == max(r["peak_device_bytes"] for r in since)
    assert summary["late_fetches"] == sum(r["late_fetches"] for r in since)
    assert summary["figures_steps"] == {"first": 3, "last": 4, "count": 2, "since_resume": True}
    assert summary["first_loss"] == result.steps[0]["loss"]  # the loss spans the whole run
    assert "swap_config.swap: false -> true (allowed: it does not change the math)" in summary["resume_changes"]
    table = format_summary(summary)
    assert re.search(r"\n  figures below \(time, bytes, late fetches\) over +steps 3-4: the 2 run since the resume "
                     r"\(the earlier ones ran before it, maybe with another config; the metrics file keeps every "
                     r"step\)\n", table), table


def test_a_resume_that_runs_no_step_shows_the_checkpoints_figures_and_says_so(tmp_path):
    first = train(config(tmp_path, SWAP), steps=2, progress=False)
    again = train(config(tmp_path, SWAP, resume=True), steps=2, progress=False)
    assert again.summary["figures_steps"] == {"first": 1, "last": 2, "count": 2, "since_resume": False}
    assert again.summary["offloaded_bytes_per_step"] == first.summary["offloaded_bytes_per_step"] > 0
    assert "steps 1-2, from the checkpoint: no step ran since the resume" in format_summary(again.summary)


def test_a_run_that_did_not_resume_covers_every_step_and_adds_no_row(tmp_path):
    summary = train(config(tmp_path, SWAP), steps=2, progress=False).summary
    assert "figures_steps" not in summary
    assert "figures below" not in format_summary(summary)


def test_a_resume_past_the_steps_to_run_warns_and_leaves_the_checkpoint_as_it_was(tmp_path, caplog):
    """A checkpoint at step 4 resumed with steps=2 ran nothing without a word, and the end of the run saved
    the checkpoint again: step_0000004.pt then held the resuming config (here swap off), not its own."""
    train(config(tmp_path, SWAP), steps=4, progress=False)
    saved = tmp_path / "ckpt" / "step_0000004.pt"
    before = saved.read_bytes()
    again = train(config(tmp_path, resume=True), steps=2, progress=False)
    assert again.summary["steps"] == 4 and again.summary["figures_steps"]["since_resume"] is False
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(f"train.resume: {saved} is at step 4, and this run is to stop at step 2 (--steps or train.steps): "
               "no step runs; set a higher --steps or train.steps to train further" in m for m in warnings), warnings
    assert saved.read_bytes() == before  # not saved again with the resuming config
    assert sorted(p.name for p in saved.parent.iterdir()) == ["step_0000004.pt"]
