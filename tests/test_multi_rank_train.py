"""``swapkit train`` on several ranks (gloo on CPU, 2 processes) where it must behave as one process does:
every rank resumes the same step; a config problem or a NaN a rank meets is reported like the
single-process one (one message, exit 2 or 1); outputs, engine and memory are checked before any rank
starts; each stage logs its own layers; bf16 autocast; Megatron uniform units under FSDP2.

One 2-stage run writes the per-rank checkpoints (module fixture); each resume test copies them.
"""
from __future__ import annotations

import math
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
    assert "train.seed (from --set train.seed=1): 0 -> 1 (changed since step_0000002.pt was saved)" in err
    assert "Traceback" not in err


def _fail(folder, rank: int, when: float, error: BaseException | None = None) -> None:
    if error is not None:
        (folder / f"failed{rank}.pkl").write_bytes(pickle.dumps(launch._reportable(error, 300.0)))
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


def test_a_collective_timeout_is_reported_with_the_setting_that_bounds_it(tmp_path):
    """Note [Errors a rank reports as they are]: a rank whose peer stopped answering (stuck in Python, or much
    slower) fails in gloo after train.collective_timeout_s; the run printed that rank's traceback, ending in
    ``Timed out waiting 10000ms for send operation to complete``, which names neither the setting nor the cause."""
    timed_out = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 10000ms for send "
                             "operation to complete")
    assert launch._reportable(RuntimeError("Mismatch in shape"), 10.0) is None
    (tmp_path / "failed0.pkl").write_bytes(pickle.dumps(launch._reportable(timed_out, 10.0)))
    (tmp_path / "failed0.txt").write_text("1.0\nTraceback (most recent call last):\n  boom 0\n")
    error = launch._first_failure(tmp_path, 1, "noticed")
    assert isinstance(error, RunFailed)
    assert str(error) == (
        "rank 0: a collective waited train.collective_timeout_s (10 s) for another rank and gave up: a rank "
        "stopped answering (stuck, or much slower than the others: then raise train.collective_timeout_s); "
        "torch: RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 10000ms for send "
        "operation to complete")


def test_every_rank_resumes_the_newest_step_all_ranks_saved(saved, tmp_path, capfd):
    """Rank 0 saved step 4 and rank 1 did not (killed between the two saves): both resume step 2."""
    folder = tmp_path / "ckpt"
    shutil.copytree(saved[0], folder)
    state = torch.load(folder / "rank000" / "step_0000002.pt", weights_only=True)
    torch.save({**state, "step": 4}, folder / "rank000" / "step_0000004.pt")
    stale = folder / "rank001" / ".step_0000003.pt.x1y2z3.tmp"  # left by kill -9 during a save
    stale.write_bytes(b"half a checkpoint")
    code, metrics = run_cli("pp2.yaml", tmp_path, "resumed", "--steps", "3", *resume_args(folder))
    assert not stale.exists()
    err = capfd.readouterr().err  # the ranks' logs
    assert code == 0, err
    assert "resumed from" in err and "rank000/step_0000002.pt at step 2" in err
    assert "step_0000004.pt is newer than the newest step every rank saved (2)" in err
    assert losses(metrics)[:2] == losses(saved[1])
    assert [step["step"] for step in metrics["steps"]] == [1, 2, 3]


def test_ranks_without_a_checkpoint_beside_ranks_with_one_fail_before_training(saved, tmp_path, capsys):
    folder = tmp_path / "ckpt"
    shutil.copytree(saved[0], folder)
    shutil.rmtree(folder / "rank001")
    code, _ = run_cli("pp2.yaml", tmp_path, "missing", "--steps", "3", *resume_args(folder))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "train.resume (from --set train.resume=true): no checkpoint step that every rank saved" in err
    assert "rank 1: none" in err and "Traceback" not in err


@pytest.mark.parametrize("sets, change", [
    (["parallel_config.micro_batch_num=2"], "parallel_config.micro_batch_num: 4 -> 2"),
    (["parallel_config.micro_batch_num=null"], "parallel_config.micro_batch_num: 4 -> 2"),  # default: pipeline_stage
    (["parallel_config.pipeline_schedule=gpipe"], None),  # the same math on another schedule: allowed
])
def test_a_changed_micro_batch_num_is_refused_like_gradient_accumulation(saved, tmp_path, capsys, sets, change):
    """Step s feeds micro-batches d*M .. d*M+M-1: another M trains on other data from the same weights."""
    folder = tmp_path / "ckpt"
    shutil.copytree(saved[0], folder)
    code, metrics = run_cli("pp2.yaml", tmp_path, "micro", "--steps", "3", *resume_args(folder, *sets))
    err = capsys.readouterr().err
    if change is None:
        assert code == 0, err
        assert losses(metrics)[:2] == losses(saved[1])
        return
    assert code == 2, err
    key, values = change.split(": ", 1)  # the change came from the command line: the problem names the --set
    assert f"{key} (from --set {sets[0]}): {values} (changed since step_0000002.pt was saved)" in err
    resume_line = err.split(" - train.resume (from --set train.resume=true): ", 1)[1].split("\n", 1)[0]
    assert "parallel_config" in resume_line and "Traceback" not in err


def test_one_process_ignores_micro_batch_num_on_resume(tmp_path):
    from swapkit.train.resume_check import apply_resume_config, config_record
    from swapkit.load import load_config

    base = {"model": {"model_config": {"num_layers": 2}}}
    old = load_config({**base, "parallel_config": {"micro_batch_num": 4}})
    assert apply_resume_config(load_config(base), config_record(old), tmp_path / "step_0000001.pt") == []


def _nan_at_step_2(rank, world, config):
    """One pipeline rank of ``config`` whose loss turns NaN at step 2; returns what it raised and the optimizer steps."""
    from swapkit.distributed import train as dist_train

    real_loss, real_batch, current, steps = dist_train.lm_loss, dist_train._batch, [0], []

    def batch(run, dp_rank, step):
        current[0] = step
        return real_batch(run, dp_rank, step)

    def loss_turns_nan(logits, targets):
        return real_loss(logits, targets) * (math.nan if current[0] == 2 else 1.0)

    original_step = torch.optim.AdamW.step

    def counted_step(self, *args, **kwargs):
        steps.append(1)
        return original_step(self, *args, **kwargs)

    dist_train.lm_loss, dist_train._batch, torch.optim.AdamW.step = loss_turns_nan, batch, counted_step
    try:
        dist_train.train_rank(config, torch.device("cpu"), rank, world, steps=4, progress=False)
    except RunFailed as err:
        return str(err), len(steps)
    return None, len(steps)


def test_a_nan_loss_stops_every_rank_before_the_optimizer_step():
    from swapkit.load import load_config
    from tests.dist_utils import run_ranks
    from tests.test_pipeline_train import CONFIGS

    config = load_config(CONFIGS / "pp2.yaml")
    results = run_ranks(_nan_at_step_2, 2, config)
    for message, optimizer_steps in results:
        assert message is not None and message.startswith("the loss is nan at step 2; the run stopped before")
        assert optimizer_steps == 1  # step 1 only: step 2's NaN gradients never reached the weights


def test_each_pipeline_stage_logs_its_own_layers_and_the_whole_model_lines_once(tmp_path, capfd):
    code, _ = run_cli("pp2.yaml", tmp_path, "logs", "--steps", "1")
    err = capfd.readouterr().err
    assert code == 0, err
    assert "[rank 0] INFO - Set layer swap at layer 0 and value is: 4" in err
    assert "[rank 1] INFO - Set layer swap at layer 4 and value is: 4" in err  # stage 1's layers: its rank logs them
    assert "[rank 1] INFO - Set op_swap at layer 5: .attention, value=4" in err
    assert err.count("INFO - Formative op swap: ") == 1 and err.count("INFO - num_layers per stage: ") == 1
    assert "[rank 1] INFO - step" not in err


def test_megatron_uniform_units_train_under_fsdp2_data_parallel(tmp_path):
    """A uniform unit runs its second layer's forward inside the first layer's call: FSDP2 must gather
    the whole unit's weights there (one FSDP2 group per unit), not per layer."""
    from swapkit.load import load_config
    from swapkit.train import train

    config = tmp_path / "uniform.yaml"
    config.write_text(
        "model: {model_config: {num_layers: 4, hidden_size: 32, num_heads: 2, intermediate_size: 64, "
        "vocab_size: 64, seq_length: 16}}\n"
        "parallel_config: {data_parallel: 2}\n"
        "recompute_config: {recompute_granularity: full, recompute_method: uniform, recompute_num_layers: 2}\n"
        "train: {steps: 2, batch_size: 2}\n")
    code, metrics = run_cli(str(config), tmp_path, "uniform")
    assert code == 0
    single = load_config(config, ["parallel_config.data_parallel=1", "train.gradient_accumulation_steps=2"])
    torch.testing.assert_close(losses(metrics), train(single, progress=False).losses, rtol=1e-5, atol=0)


def test_resume_refuses_checkpoints_written_by_another_process_layout(tmp_path, capsys):
    """Not a silent start from step 0 beside them: one process writes save_dir/step_*.pt, ranks
    save_dir/rankNNN/step_*.pt."""
    from swapkit.cli import main
    from tests.test_pipeline_train import CONFIGS

    (tmp_path / "ranks" / "rank000").mkdir(parents=True)
    (tmp_path / "ranks" / "rank000" / "step_0000002.pt").write_bytes(b"")
    code = main(["train", str(CONFIGS / "tiny.yaml"), "--no-progress", "--steps", "1",
                 "--set", f"train.save_dir={tmp_path / 'ranks'}", "--set", "train.resume=true"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "rank000/step_0000002.pt" in err and "written by a run on several ranks" in err

    (tmp_path / "single").mkdir()
    (tmp_path / "single" / "step_0000002.pt").write_bytes(b"")
    code, _ = run_cli("pp2.yaml", tmp_path, "single", "--steps", "3", *resume_args(tmp_path / "single"))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "step_0000002.pt" in err and "written by a run in one process" in err


def test_a_rank_killed_by_a_signal_is_named_with_the_likely_cause():
    import torch.multiprocessing as mp

    killed = mp.ProcessExitedException("process 1 terminated with signal SIGKILL", 1, 123, -9, "SIGKILL")
    assert launch.exit_message(killed) == (
        "rank 1 was killed by SIGKILL (the kernel's out-of-memory killer, or kill -9: check dmesg; lower "
        "train.batch_size or the model sizes if memory ran out); the other ranks were stopped")
    exited = mp.ProcessExitedException("process 0 terminated with exit code 3", 0, 123, 3)
    assert launch.exit_message(exited) == "rank 0 exited with code 3 without a Python error; the other ranks were stopped"
    server_died = mp.ProcessExitedException("process 0 terminated with exit code 255", 0, 123, 255)
    assert launch.exit_message(server_died) == (
        "rank 0 exited with code 255 without a Python error, or the fork server it was forked from died (every rank "
        "it forked then reads as 255); the other ranks were stopped")


def test_bf16_autocast_runs_in_the_pipeline_as_in_one_process(tmp_path):
    from swapkit.load import load_config
    from swapkit.train import train
    from tests.test_pipeline_train import CONFIGS

    code, metrics = run_cli("pp2.yaml", tmp_path, "bf16", "--steps", "3", "--set", "train.dtype=bf16")
    assert code == 0
    one_process = ["parallel_config.pipeline_stage=1", "model.model_config.offset=0",
                   "train.gradient_accumulation_steps=4"]
    bf16 = train(load_config(CONFIGS / "pp2.yaml", [*one_process, "train.dtype=bf16"]), steps=3, progress=False)
    fp32 = train(load_config(CONFIGS / "pp2.yaml", one_process), steps=3, progress=False)
    torch.testing.assert_close(losses(metrics), bf16.losses, rtol=1e-5, atol=0)
    assert abs(losses(metrics)[2] - fp32.losses[2]) > 10 * abs(losses(metrics)[2] - bf16.losses[2])  # not fp32


@pytest.mark.parametrize("args, message", [
    (["--metrics-out", "{tmp}/missing/m.json"], "--metrics-out: got {tmp}/missing/m.json; its folder {tmp}/missing "
                                                "does not exist"),
    (["--set", "train.save_dir={tmp}/file"], "train.save_dir (from --set train.save_dir={tmp}/file): got {tmp}/file, "
                                             "which is a file"),
    (["--set", "runtime.engine=cuda"], "runtime.engine (from --set runtime.engine=cuda): got 'cuda' but the model "
                                       "trains on cpu"),
    (["--set", "model.model_config.vocab_size=1048576", "--set", "model.model_config.hidden_size=65536"],
     "needs about 3594.6 GiB; cpu has"),
    (["--set", "swap_config.op_swap=[{{op_name: attn, backward_prefetch: 1, layers: true}}]"],  # braces: .format
     "swap_config.op_swap[0].op_name (from --set swap_config.op_swap=[{{op_name: attn, backward_prefetch: 1, "
     "layers: true}}]): op_swap pattern 'attn' matches no sub-module in any layer of LlamaModel.layers; did you "
     "mean 'attention'?"),
    (["--set", "model.model_config.layers_path=model.layers"],  # named before the patterns are bound
     "got 'model.layers'; the built-in model keeps its layers in 'layers'"),
])
def test_a_multi_rank_run_checks_its_outputs_engine_and_memory_before_any_rank_starts(tmp_path, capsys, monkeypatch,
                                                                                      args, message):
    """As one process does (README: before the first step); before, each failed inside the ranks, the
    metrics file only after the first step had trained."""
    from swapkit.cli import main
    from swapkit.distributed import launch as launch_module
    from tests.test_pipeline_train import CONFIGS

    (tmp_path / "file").write_text("")
    monkeypatch.setattr(launch_module.mp, "start_processes", lambda *a, **k: pytest.fail("a rank was started"))
    code = main(["train", str(CONFIGS / "pp2.yaml"), "--no-progress", "--steps", "1",
                 *[arg.format(tmp=tmp_path) for arg in args]])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message.format(tmp=tmp_path) in err and "Traceback" not in err


def test_under_torchrun_only_rank_0_checks_the_metrics_file_it_alone_writes(tmp_path, monkeypatch):
    """The other ranks may run on machines without that folder."""
    from swapkit.load import load_config
    from tests.test_pipeline_train import CONFIGS

    config = load_config(CONFIGS / "pp2.yaml")
    monkeypatch.setattr(launch, "_torchrun_rank", lambda *args: "trained")
    monkeypatch.setenv("WORLD_SIZE", "2")
    missing = tmp_path / "missing" / "m.json"
    monkeypatch.setenv("RANK", "1")
    assert launch.launch(config, torch.device("cpu"), steps=1, metrics_out=missing) == "trained"
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="--metrics-out: got .*; its folder .* does not exist"):
        launch.launch(config, torch.device("cpu"), steps=1, metrics_out=missing)


def test_more_started_ranks_than_this_machine_can_hold_fail_before_any_starts(capsys, monkeypatch):
    """data_parallel: 65536 (within the schema's limit) would start 131,072 processes."""
    from swapkit.cli import main
    from tests.test_pipeline_train import CONFIGS

    monkeypatch.setattr(launch.mp, "start_processes", lambda *a, **k: pytest.fail("a rank was started"))
    code = main(["train", str(CONFIGS / "pp2.yaml"), "--no-progress", "--set", "parallel_config.data_parallel=65536"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "parallel_config: asks for 131,072 rank processes on this machine (pipeline_stage 2 x data_parallel " \
           "65536); each holds at least 16.0 MiB of its own before it builds anything, beside the 256.0 MiB of " \
           "the process with torch loaded that they are forked from" in err
    assert "Traceback" not in err


def _rank_with_its_own_config(rank: int, world: int, sets: list[dict]) -> str:
    """One torchrun rank as swapkit train runs it (launch._run), with its own config file's values."""
    from swapkit.load import load_config
    from tests.test_pipeline_train import CONFIGS

    raw = load_config(CONFIGS / "pp2.yaml")
    config = load_config({**_as_dict(CONFIGS / "pp2.yaml"), **sets[rank]})
    assert config.model == raw.model  # the layout is the same: apply's layout check would not catch it
    try:
        launch._run(config, torch.device("cpu"), rank, world, {"steps": 2 + rank, "progress": False})
    except ConfigError as err:
        return str(err)
    return "trained"


def _as_dict(path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def test_ranks_started_with_different_run_settings_all_fail_at_once_naming_each_key():
    """Under torchrun each rank reads its own copy of the config: rank 1's micro_batch_num 2 where rank 0's
    is 4 (and one more --steps) used to leave both waiting for pipeline messages until the collective
    timeout (300 s). Every rank now raises the same error before the first step; rank 1's other swap
    settings are allowed and not named."""
    swap = {"swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": True}]}
    sets = [{}, {"parallel_config": {"pipeline_stage": 2, "micro_batch_num": 2}, "swap_config": swap}]
    from tests.dist_utils import run_ranks

    messages = run_ranks(_rank_with_its_own_config, 2, sets, timeout_s=90)
    assert messages[0] == messages[1]
    assert "parallel_config.micro_batch_num: rank 0 has 4 but rank 1 has 2" in messages[0]
    assert "steps (train.steps or --steps): rank 0 has 2 but rank 1 has 3" in messages[0]
    assert messages[0].count("\n  - ") == 2  # rank 1's own swap_config is no problem
