"""``swapkit train`` with pipeline and data parallel configs: the CLI starts the ranks itself (gloo on CPU).

Each multi-process run is shared by the tests that read it (module fixtures); the single-process
references run in this process.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from swapkit.cli import main
from swapkit.load import load_config
from swapkit.train import train
from swapkit.train.summary import format_summary

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def run_cli(config: str, tmp: Path, name: str, *extra: str) -> tuple[int, dict | None]:
    metrics = tmp / f"{name}.json"
    code = main(["train", str(CONFIGS / config), "--no-progress", "--metrics-out", str(metrics), *extra])
    return code, json.loads(metrics.read_text()) if metrics.exists() else None


def losses(metrics: dict) -> list[float]:
    return [step["loss"] for step in metrics["steps"]]


def single_process_losses(config: str, steps: int) -> list[float]:
    """The same model and micro-batches in one process, as gradient accumulation."""
    cfg = load_config(CONFIGS / config)
    accumulation = cfg.parallel.data_parallel * (cfg.parallel.micro_batch_num or cfg.parallel.pipeline_stage)
    single = load_config(CONFIGS / config, [
        "parallel_config.pipeline_stage=1", "parallel_config.data_parallel=1", "parallel_config.micro_batch_num=null",
        "parallel_config.pipeline_schedule=null", "model.model_config.offset=0",
        "model.model_config.pp_interleave_num=1", f"train.gradient_accumulation_steps={accumulation}"])
    return train(single, steps=steps, progress=False).losses


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp2")
    code, metrics = run_cli("pp2.yaml", tmp, "pp2", "--steps", "2", "--set", f"train.save_dir={tmp / 'ckpt'}")
    assert code == 0
    return tmp, metrics


def test_pp2_losses_match_single_process_gradient_accumulation(pp2):
    _, metrics = pp2
    torch.testing.assert_close(losses(metrics), single_process_losses("pp2.yaml", 2), rtol=1e-5, atol=0)


def test_pp2_metrics_hold_one_row_per_stage(pp2):
    _, metrics = pp2
    for step in metrics["steps"]:
        assert [row["stage"] for row in step["stages"]] == [0, 1]
        assert all(row["micro_steps"] == 4 and row["offloaded_bytes"] > 0 for row in step["stages"])
        assert step["offloaded_bytes"] == sum(row["offloaded_bytes"] for row in step["stages"])
        assert step["peak_device_bytes"] == max(row["peak_device_bytes"] for row in step["stages"])
    assert [row["stage"] for row in metrics["summary"]["stages"]] == [0, 1]
    assert metrics["env"]["world_size"] == 2 and metrics["env"]["pipeline_schedule"] == "1f1b"


def test_pp2_swap_off_gives_identical_losses(pp2, tmp_path):
    _, metrics = pp2
    code, off = run_cli("pp2.yaml", tmp_path, "off", "--steps", "2", "--set", "swap_config.swap=false")
    assert code == 0
    assert all(row["offloaded_bytes"] == 0 for step in off["steps"] for row in step["stages"])
    assert losses(off) == losses(metrics)


def test_pp2_checkpoint_resume_per_rank(pp2, tmp_path):
    tmp, metrics = pp2
    saved = tmp / "ckpt"
    assert sorted(p.name for p in saved.iterdir()) == ["rank000", "rank001"]
    assert all((saved / rank / "step_0000002.pt").exists() for rank in ("rank000", "rank001"))
    folder = tmp_path / "ckpt"
    shutil.copytree(saved, folder)
    code, resumed = run_cli("pp2.yaml", tmp_path, "resumed", "--steps", "3", "--set", f"train.save_dir={folder}",
                            "--set", "train.resume=true")
    assert code == 0
    assert losses(resumed)[:2] == losses(metrics)
    torch.testing.assert_close(losses(resumed), single_process_losses("pp2.yaml", 3), rtol=1e-5, atol=0)


def test_pp2_resume_with_no_step_to_run_leaves_every_ranks_checkpoint_as_it_was(pp2, tmp_path, capfd):
    """Each rank saved its step again at the end of a resume that ran no step, with the resuming config
    as the record (swapkit.train.checkpoint Note [Nothing to run])."""
    tmp, _ = pp2
    folder = tmp_path / "ckpt"
    shutil.copytree(tmp / "ckpt", folder)
    before = {path: path.read_bytes() for path in folder.rglob("step_*.pt")}
    code, _ = run_cli("pp2.yaml", tmp_path, "again", "--steps", "2", "--set", f"train.save_dir={folder}",
                      "--set", "train.resume=true", "--set", "swap_config.swap=false")
    assert code == 0
    assert "is at step 2, and this run is to stop at step 2" in capfd.readouterr().err
    assert {path: path.read_bytes() for path in folder.rglob("step_*.pt")} == before


def test_a_failing_rank_stops_every_rank_with_its_error(pp2, tmp_path, capsys):
    tmp, _ = pp2
    folder = tmp_path / "ckpt"
    shutil.copytree(tmp / "ckpt", folder)
    (folder / "rank001" / "step_0000002.pt").write_bytes(b"not a checkpoint")
    code, _ = run_cli("pp2.yaml", tmp_path, "broken", "--steps", "3", "--set", f"train.save_dir={folder}",
                      "--set", "train.resume=true")
    err = capsys.readouterr().err
    assert code == 2, err  # no valid checkpoint: a config problem, as in one process (it was exit 1, a traceback)
    assert ("train.resume (from --set train.resume=true): no checkpoint step that every rank saved and can load "
            "in") in err
    assert "not valid: rank001/step_0000002.pt (UnpicklingError" in err
    assert "Traceback" not in err


def test_vpp2_losses_match_single_process(tmp_path):
    code, metrics = run_cli("pp2_vpp2.yaml", tmp_path, "vpp", "--steps", "2")
    assert code == 0
    assert metrics["env"]["pipeline_schedule"] == "interleaved_1f1b"
    assert all(row["micro_steps"] == 8 for step in metrics["steps"] for row in step["stages"])
    torch.testing.assert_close(losses(metrics), single_process_losses("pp2_vpp2.yaml", 2), rtol=1e-5, atol=0)


def test_pp2_dp2_fsdp2_losses_match_single_process(tmp_path):
    code, metrics = run_cli("pp2_dp2.yaml", tmp_path, "dp", "--steps", "2")
    assert code == 0
    assert metrics["env"]["world_size"] == 4 and metrics["env"]["data_parallel"] == 2
    assert all(row["offloaded_bytes"] > 0 for step in metrics["steps"] for row in step["stages"])
    # the figures are one replica's, and the summary says so (they read as the whole run's)
    assert metrics["summary"]["data_parallel"] == 2
    assert re.search(r"\n  data-parallel replicas +2; the bytes, peaks and late fetches above are replica 0's",
                     format_summary(metrics["summary"]))
    torch.testing.assert_close(losses(metrics), single_process_losses("pp2_dp2.yaml", 2), rtol=1e-5, atol=0)


@pytest.mark.parametrize("overrides, message", [
    (["train.gradient_accumulation_steps=2"],
     "train.gradient_accumulation_steps (from --set train.gradient_accumulation_steps=2): got 2"),
    (["parallel_config.pipeline_schedule=gpipe", "model.model_config.pp_interleave_num=2",
      "model.model_config.offset=0", "model.model_config.num_layers=8"], "use interleaved_1f1b"),
    (["parallel_config.micro_batch_num=1"], "parallel_config.micro_batch_num (from --set parallel_config."
                                            "micro_batch_num=1): got 1; pipeline_schedule 1f1b needs at least "
                                            "pipeline_stage (2) micro-batches (torch's Schedule1F1B refuses fewer); "
                                            "set it to 2, or use pipeline_schedule gpipe"),
    (["parallel_config.micro_batch_num=5", "parallel_config.pipeline_schedule=interleaved_1f1b",
      "model.model_config.pp_interleave_num=2", "model.model_config.offset=0", "model.model_config.num_layers=8"],
     "parallel_config.micro_batch_num (from --set parallel_config.micro_batch_num=5): got 5; pipeline_schedule "
     "interleaved_1f1b runs max(1, 5 // pipeline_stage 2) = 2 rounds and needs a multiple of them (torch's "
     "ScheduleInterleaved1F1B); set it to 4 or 6"),
])
def test_bad_parallel_settings_fail_before_any_rank_starts(overrides, message, capsys):
    sets = [arg for value in overrides for arg in ("--set", value)]
    assert main(["train", str(CONFIGS / "pp2.yaml"), "--no-progress", *sets]) == 2
    assert message in capsys.readouterr().err


def test_micro_batches_not_a_multiple_of_the_stages_train_as_torch_allows(tmp_path):
    """3 micro-batches on 2 stages with 1F1B (torch takes any count >= the stages; swapkit train used to
    ask for a multiple of pipeline_stage): every stage runs 3 micro-steps and brings back what it swapped,
    and the losses are one process accumulating the same 3 micro-batches."""
    code, metrics = run_cli("pp2.yaml", tmp_path, "m3", "--steps", "2", "--set", "parallel_config.micro_batch_num=3")
    assert code == 0
    assert metrics["env"]["micro_batch_num"] == 3 and metrics["env"]["pipeline_schedule"] == "1f1b"
    for step in metrics["steps"]:
        assert [row["micro_steps"] for row in step["stages"]] == [3, 3]
        # the rest of what a stage swapped was still on the device when its backward began (used in place)
        assert all(row["offloaded_bytes"] >= row["prefetched_bytes"] > 0 for row in step["stages"])
    single = load_config(CONFIGS / "pp2.yaml", [
        "parallel_config.pipeline_stage=1", "parallel_config.micro_batch_num=null", "parallel_config.pipeline_schedule=null",
        "model.model_config.offset=0", "train.gradient_accumulation_steps=3"])
    torch.testing.assert_close(losses(metrics), train(single, steps=2, progress=False).losses, rtol=1e-5, atol=0)
