"""``swapkit train`` end to end (DESIGN §8, §9): CLI, numerics against a plain loop, resume, Ctrl-C.

Golden losses: ``tests/golden/tiny_loss.json`` holds the first losses of ``configs/tiny.yaml``.
After an intended change to the model, the data or the loop, regenerate it with
``SWAPKIT_UPDATE_GOLDEN=1 pytest tests/test_train.py -k golden -p no:cacheprovider`` and commit the
file together with the change that explains it.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import swapkit
import swapkit.train.loop as train_mod
from swapkit import ConfigError, cli, load_config
from swapkit.train.model import build_model, lm_loss
from swapkit.train import SyntheticTokens, format_summary, latest_checkpoint, resolve_device, train

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny.yaml"
GOLDEN = Path(__file__).resolve().parent / "golden" / "tiny_loss.json"
STEP_FIELDS = {"step", "loss", "step_time_s", "peak_device_bytes", "offloaded_bytes"}

# A smaller variant of the tiny model for the numerics tests: two layers, shorter sequences.
MODEL = {"model_config": {"num_layers": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
                          "vocab_size": 64, "seq_length": 32}}
SWAP = {"swap": True, "layer_swap": [{"backward_prefetch": 3, "layers": [0]}],
        "op_swap": [{"op_name": "feed_forward", "backward_prefetch": 2, "layers": [1]}]}
RECOMPUTE = {"recompute": [1], "select_recompute": {r"attention\.flash_attention": True}}


def small_config(swap=None, recompute=None, **train_keys):
    raw = {"model": MODEL, "train": {"batch_size": 4, "lr": 3e-3, **train_keys}}
    if swap is not None:
        raw["swap_config"] = swap
    if recompute is not None:
        raw["recompute_config"] = recompute
    return load_config(raw)


def plain_losses(config, steps):
    """The same training without swapkit: no hooks, no wrappers — the reference of DESIGN §9."""
    cfg = config.train
    torch.manual_seed(cfg.seed)
    model = build_model(config.model, seed=cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    data = SyntheticTokens(cfg.seed, cfg.batch_size, config.model.seq_length, config.model.vocab_size)
    losses = []
    for step in range(1, steps + 1):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in range(cfg.gradient_accumulation_steps):
            inputs, targets = data.batch(step, micro)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.dtype == "bf16"):
                logits = model(inputs)
            loss = lm_loss(logits, targets) / cfg.gradient_accumulation_steps
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        losses.append(total)
    return losses, model


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "swapkit.cli", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


# ``python -m swapkit.cli`` with a thread engine whose ``ready`` waits for the copy (tests.toys.ReadyWhenDone):
# each swapped storage is released exactly at its horizon. With the plain engine a loaded machine's copy thread
# may finish none of a forward's copies before its last save, and that step then holds everything
# (swapkit.runtime.swap_schedule Note [Releases never stall compute]); benchmarks/ measure how copy timing moves
# the peak.
RELEASED_AT_HORIZON = """
import runpy
from swapkit.engine.thread import ThreadCopyEngine

def ready(self, copy):
    self.wait(copy)
    return True

ThreadCopyEngine.ready = ready
runpy.run_module("swapkit.cli", run_name="__main__", alter_sys=True)
"""


def run_cli_released_at_horizon(*args):
    return subprocess.run([sys.executable, "-c", RELEASED_AT_HORIZON, *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


# ---------------------------------------------------------------- the CLI end to end

def test_cli_trains_tiny_and_writes_metrics(tmp_path):
    metrics = tmp_path / "metrics.json"
    done = run_cli_released_at_horizon("train", TINY, "--steps", 4, "--metrics-out", metrics)
    assert done.returncode == 0, done.stderr
    assert "swapkit train summary" in done.stdout
    assert "session accounting, not RSS" in done.stdout
    assert "bytes swapped per step" in done.stdout
    document = json.loads(metrics.read_text())
    assert [s["step"] for s in document["steps"]] == [1, 2, 3, 4]
    assert all(STEP_FIELDS <= set(s) for s in document["steps"])
    summary = document["summary"]
    assert summary["status"] == "completed"
    assert summary["offloaded_bytes_per_step"] > 0  # tiny.yaml swaps
    assert summary["peak_device_bytes"] < summary["saved_bytes_per_step"]  # ... and that saves memory
    assert {"torch", "python", "platform", "cpu_count", "device", "config"} <= set(document["env"])
    assert document["env"]["config"].endswith("tiny.yaml")
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("text, args, message", [
    ("train:\n  stpes: 3\n", [], "train.stpes: unknown key; did you mean 'steps'?"),
    ("", ["--steps", "0"], "--steps: got 0; expected an integer >= 1"),
    ("train:\n  resume: true\n", [], "train.resume: is true but train.save_dir is not set"),
    # no folder to write to: the interval silently saved nothing
    ("train:\n  save_interval: 5\n", [], "train.save_interval: is 5 but train.save_dir is not set, so no "
     "checkpoint is written; set train.save_dir to the checkpoint folder, or remove save_interval"),
], ids=["unknown-key", "zero-steps", "resume-without-save-dir", "save-interval-without-save-dir"])
def test_bad_config_exits_2(tmp_path, capsys, text, args, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  model_config:\n    num_layers: 2\n" + text)
    assert cli.main(["train", str(bad), "--no-progress", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("override, message", [
    ("runtime.engine=cuda", "runtime.engine (from --set runtime.engine=cuda): got 'cuda' but the model trains on cpu"),
    ("train.resume=true", "train.resume (from --set train.resume=true): is true but train.save_dir is not set"),
])
def test_a_problem_found_after_loading_names_the_set_that_wrote_it(tmp_path, capsys, override, message):
    """Checks made after the loader's (engine against device, resume against save_dir) blamed the file
    for what --set wrote (swapkit.config.loader Note [Blame the command line])."""
    good = tmp_path / "good.yaml"
    good.write_text("model:\n  model_config:\n    num_layers: 2\n")
    assert cli.main(["train", str(good), "--no-progress", "--steps", "1", "--set", override]) == 2
    err = capsys.readouterr().err
    assert "invalid swapkit command line (1 problem)" in err and message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when CUDA is missing")
def test_cuda_without_cuda_exits_2_with_a_clear_message():
    done = run_cli("train", TINY, "--device", "cuda", "--steps", 1, "--no-progress")
    assert done.returncode == 2
    assert "--device: got 'cuda' but CUDA is not available" in done.stderr
    assert "Traceback" not in done.stderr


def test_cuda_allocator_setting_is_made_only_for_cuda_and_respects_the_user(monkeypatch):
    config = load_config(TINY)

    def resolve_cuda():
        with contextlib.nullcontext() if torch.cuda.is_available() else pytest.raises(ConfigError):
            resolve_device(config, "cuda")

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:native")
    resolve_cuda()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "backend:native"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert resolve_device(config) == torch.device("cpu")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    resolve_cuda()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


# ---------------------------------------------------------------- learning and numerics

def test_synthetic_batches_are_a_pure_function_of_seed_step_and_micro_batch():
    data = SyntheticTokens(seed=3, batch_size=4, seq_length=16, vocab_size=64)
    again = SyntheticTokens(seed=3, batch_size=4, seq_length=16, vocab_size=64)
    inputs, targets = data.batch(5, 1)
    assert torch.equal(inputs, again.batch(5, 1)[0]) and torch.equal(targets, again.batch(5, 1)[1])
    assert not torch.equal(inputs, data.batch(5, 0)[0])
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the next tokens
    assert torch.equal(targets, data.successor[inputs])  # ... given by one fixed rule


def test_loss_decreases():
    losses = train(TINY, steps=15, progress=False).losses
    assert max(losses[-3:]) < 0.8 * losses[0], losses


@pytest.mark.parametrize("train_keys", [{}, {"gradient_accumulation_steps": 2}, {"dtype": "bf16"}],
                         ids=["fp32", "accumulation", "bf16"])
def test_swap_is_bit_identical_to_training_without_swapkit(train_keys):
    config = small_config(swap=SWAP, **train_keys)
    result = train(config, steps=4, progress=False)
    assert result.summary["offloaded_bytes_per_step"] > 0
    assert result.losses == plain_losses(config, 4)[0]


@pytest.mark.cuda
@pytest.mark.parametrize("train_keys", [{}, {"gradient_accumulation_steps": 2}, {"dtype": "bf16"}],
                         ids=["fp32", "accumulation", "bf16"])
def test_swap_on_cuda_is_bit_identical_to_the_same_run_without_swap(train_keys, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        swapped = train(small_config(swap=SWAP, **train_keys), steps=4, device="cuda", progress=False)
        kept = train(small_config(**train_keys), steps=4, device="cuda", progress=False)
    finally:
        torch.use_deterministic_algorithms(False)
    assert swapped.summary["offloaded_bytes_per_step"] > 0 and kept.summary["offloaded_bytes_per_step"] == 0
    assert swapped.losses == kept.losses
    summary = swapped.summary  # swapkit.train.summary Note [Memory figures]
    assert summary["cuda_max_memory_reserved"] >= summary["cuda_max_memory_allocated"] > 0
    assert "torch.cuda.max_memory_reserved (allocator retries)" in format_summary(summary)


def test_recompute_matches_training_without_swapkit():
    config = small_config(recompute=RECOMPUTE)
    torch.testing.assert_close(train(config, steps=4, progress=False).losses, plain_losses(config, 4)[0])


def test_golden_losses_of_the_default_config():
    expected = json.loads(GOLDEN.read_text())
    losses = train(TINY, steps=len(expected["losses"]), progress=False).losses
    if os.environ.get("SWAPKIT_UPDATE_GOLDEN"):
        expected.update(losses=losses, torch=torch.__version__)
        GOLDEN.write_text(json.dumps(expected, indent=2) + "\n")
    torch.testing.assert_close(losses, expected["losses"], rtol=1e-5, atol=0,
                               msg=lambda m: f"{m}\nIf the change is intended, regenerate: see {__name__}'s docstring")


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_trains(path):
    result = train(path, steps=2, progress=False)
    assert len(result.losses) == 2
    assert all(torch.isfinite(torch.tensor(result.losses)))


# ---------------------------------------------------------------- checkpoints

def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    straight = train(TINY, steps=6, progress=False).losses
    config = load_config(TINY, [f"train.save_dir={tmp_path}"])
    assert train(config, steps=3, progress=False).losses == straight[:3]
    resumed = train(load_config(TINY, [f"train.save_dir={tmp_path}", "train.resume=true"]), steps=6, progress=False)
    assert resumed.losses == straight
    assert latest_checkpoint(tmp_path).name == "step_0000006.pt"


def test_checkpoints_hold_a_plain_state_dict(tmp_path):
    config = small_config(swap=SWAP, recompute={"recompute": [1]}, save_dir=str(tmp_path), save_interval=2)
    train(config, steps=3, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000002.pt", "step_0000003.pt"]
    state = torch.load(tmp_path / "step_0000003.pt", weights_only=True)
    _, reference = plain_losses(config, 3)
    assert state["step"] == 3 and set(state) >= {"model", "optimizer", "rng"}
    assert state["model"].keys() == reference.state_dict().keys()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(state["model"][name], tensor, msg=name)


def test_resuming_another_models_checkpoint_is_a_config_error(tmp_path):
    train(small_config(save_dir=str(tmp_path)), steps=1, progress=False)
    wider = {"model_config": {**MODEL["model_config"], "hidden_size": 64}}
    other = load_config({"model": wider, "train": {"save_dir": str(tmp_path), "resume": True}})
    with pytest.raises(ConfigError, match="step_0000001.pt does not fit model.model_config"):
        train(other, steps=2, progress=False)


# ---------------------------------------------------------------- Ctrl-C

@pytest.fixture
def interrupt_at_step_3(monkeypatch):
    """Ctrl-C in the loss of step 3, inside ``with session:``; records the sessions train() applied."""
    calls, sessions = [], []

    def interrupted_loss(logits, targets):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return lm_loss(logits, targets)

    def recording_apply(*args, **kwargs):
        sessions.append(swapkit.api.apply(*args, **kwargs))
        return sessions[-1]

    monkeypatch.setattr(train_mod, "lm_loss", interrupted_loss)
    monkeypatch.setattr(train_mod.swapkit, "apply", recording_apply)
    return sessions


def test_ctrl_c_keeps_the_metrics_and_removes_the_session(tmp_path, interrupt_at_step_3):
    metrics = tmp_path / "metrics.json"
    with pytest.raises(KeyboardInterrupt):
        train(TINY, steps=5, metrics_out=metrics, progress=False)
    document = json.loads(metrics.read_text())
    assert [s["step"] for s in document["steps"]] == [1, 2]
    assert document["summary"]["status"] == "interrupted"
    (session,) = interrupt_at_step_3
    with pytest.raises(RuntimeError, match="was removed"):
        session.__enter__()


def test_ctrl_c_exits_130_through_the_cli(tmp_path, interrupt_at_step_3, capsys):
    metrics = tmp_path / "metrics.json"
    assert cli.main(["train", str(TINY), "--steps", "5", "--metrics-out", str(metrics), "--no-progress"]) == 130
    assert len(json.loads(metrics.read_text())["steps"]) == 2
    assert "interrupted" in capsys.readouterr().err


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_shows_loss_step_time_and_memory(monkeypatch):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    train(small_config(swap=SWAP), steps=2, progress=True)
    assert all(f"{name}=" in terminal.getvalue() for name in ("loss", "time", "peak", "offloaded"))


def test_summary_table_labels_cpu_memory_as_accounting():
    summary = train(small_config(swap=SWAP), steps=2, progress=False).summary
    table = format_summary(summary)
    assert "peak device-resident saved bytes (session accounting, not RSS)" in table
    assert "late fetches" in table and "host pool bytes" in table and "median step time" in table
    assert "torch.cuda" not in table and not any(key.startswith("cuda_") for key in summary)


def test_summary_table_shows_the_allocators_figures_on_cuda():
    summary = {**train(small_config(swap=SWAP), steps=2, progress=False).summary, "device": "cuda",
               "cuda_max_memory_allocated": 3 << 20, "cuda_max_memory_reserved": 5 << 20, "cuda_alloc_retries": 4}
    table = format_summary(summary)
    assert "peak device-resident saved bytes (session accounting)" in table  # not RSS only on CPU
    assert "torch.cuda.max_memory_allocated" in table
    line, = [row for row in table.splitlines() if "max_memory_reserved" in row]
    assert line.split()[0] == "torch.cuda.max_memory_reserved" and line.endswith("(4)")


# ---------------------------------------------------------------- train.gc_interval (swapkit.train.collector)


def test_gc_interval_turns_automatic_collection_off_and_collects_every_n_steps(monkeypatch):
    import gc

    seen = []  # (step, automatic collection on) as each step starts
    step_fn = train_mod._train_step

    def watched(run, step):
        seen.append((step, gc.isenabled()))
        return step_fn(run, step)

    full = []  # full collections, by the step count when they started

    def on_collect(phase, info):
        if phase == "start" and info["generation"] == 2:
            full.append(len(seen))

    monkeypatch.setattr(train_mod, "_train_step", watched)
    gc.callbacks.append(on_collect)
    try:
        result = train(small_config(swap=SWAP, gc_interval=2), steps=5, progress=False)
    finally:
        gc.callbacks.remove(on_collect)
    assert len(result.losses) == 5
    assert seen == [(step, False) for step in range(1, 6)]  # off for the whole run
    assert 0 in full and [n for n in full if n] == [2, 4]  # before the first step, then after steps 2 and 4
    assert gc.isenabled()  # back as it was


def test_gc_interval_is_validated_with_its_key_path():
    with pytest.raises(ConfigError, match=r"train\.gc_interval"):
        small_config(gc_interval=0)
    assert small_config().train.gc_interval is None  # Python's automatic collector by default


def test_a_run_started_with_stderr_closed_trains_without_its_progress_bar(monkeypatch):
    """``swapkit train ... 2>&-``: Python then has no ``sys.stderr``; asking it ``isatty`` failed the run."""
    monkeypatch.setattr(sys, "stderr", None)
    assert len(train(load_config(TINY), steps=1, progress=True).losses) == 1
