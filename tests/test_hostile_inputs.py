"""Issue 12, table-driven: every class of bad input ends in one clear message, the right exit status
(2 config/usage, 1 runtime), no traceback, within 10 seconds and bounded memory and output."""
from __future__ import annotations

import math
import os
import resource
import time
from pathlib import Path

import pytest

from swapkit import cli
from swapkit.engine.thread import CopyCancelled, ThreadCopyEngine
from swapkit.train import loop as train_loop

import torch

BASE = "model:\n  model_config:\n    num_layers: 2\n    hidden_size: 32\n    intermediate_size: 64\n" \
       "    vocab_size: 64\n    seq_length: 16\ntrain:\n  batch_size: 2\n"
SLOW = "a" * 60 + "!"  # text on which (a|aa)+$ backtracks for ever with `re`


def bomb(levels: int = 9, indent: str = "") -> str:
    """Billion laughs: the last anchor expands to 9**levels scalars."""
    lines = [f"{indent}l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"{indent}l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def flow_bomb(levels: int = 9) -> str:
    inner = "&l0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"
    parts = [inner] + [f"&l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "[" + ", ".join(parts) + "]"


def with_model(**keys) -> str:
    """BASE with more (or overriding) ``model_config`` keys."""
    lines = [line for line in BASE.splitlines(keepends=True) if line.strip().split(":")[0] not in keys]
    at = lines.index("    seq_length: 16\n") + 1 if "seq_length" not in keys else 3
    return "".join(lines[:at] + [f"    {k}: {v}\n" for k, v in keys.items()] + lines[at:])


def unknown_keys(count: int) -> str:
    return BASE + "".join(f"k{i}: 1\n" for i in range(count))


# (id, command, config text or a callable(tmp_path) -> config path, extra args, exit status, expected text)
CASES = [
    # ---- hangs and memory blow-ups
    ("regex-vs-regex-exclude", "plan", BASE + f"recompute_config:\n  select_recompute: {{'{SLOW}': true}}\n"
     "  select_recompute_exclude: {'(a|aa)+$': true}\n", [], 2,
     ["recompute_config.select_recompute_exclude", "catastrophic backtracking"]),
    ("regex-vs-regex-overrides-swap", "plan", BASE + "swap_config:\n  swap: true\n  op_swap:\n"
     f"    - {{op_name: '{SLOW}', backward_prefetch: 1, layers: [0]}}\n"
     "recompute_config:\n  select_recompute: {'(a|aa)+$': [0]}\n", [], 2,
     ["swap_config.op_swap", "catastrophic backtracking"]),
    ("pattern-too-long", "plan", BASE + f"recompute_config:\n  select_recompute: ['{'a' * 300}']\n", [], 2,
     ["recompute_config.select_recompute", "at most 200 characters"]),
    ("pattern-repeat-overflow", "plan", BASE + "recompute_config:\n  select_recompute: ['a{99999999999}']\n",
     [], 2, ["recompute_config.select_recompute", "does not compile"]),
    ("pattern-nested-repeats", "plan", BASE + "recompute_config:\n  select_recompute: "
     "['(?:(?:(?:a{65535}){65535}){65535})']\n", [], 2, ["does not compile: counted repetition up to"]),
    ("too-many-patterns", "plan", BASE + "recompute_config:\n  select_recompute: {"
     + ", ".join(f"'attention\\.x{i}': true" for i in range(100)) + "}\n", [], 2,
     ["recompute_config.select_recompute: got", "expected at most 64 op patterns. It lists 100"]),
    ("layer-list-longer-than-model", "plan", BASE + "swap_config:\n  swap: true\n  layer_swap: [{backward_prefetch: 1, "
     "layers: [" + ", ".join(["0"] * 30_000) + "]}]\n", [], 2,
     ["swap_config.layer_swap[0].layers: got [0, 0, 0", "at most num_layers (2) layer indices. It lists 30,000"]),
    ("pattern-2000-groups", "plan", BASE + f"recompute_config:\n  select_recompute: ['{'(' * 2000}a{')' * 2000}']\n",
     [], 2, ["recompute_config.select_recompute", "at most 200 characters"]),
    ("alias-bomb-num-layers", "plan", bomb() + BASE.replace("num_layers: 2", "num_layers: *l8"), [], 2,
     ["alias bomb", "line"]),
    ("alias-bomb-offset", "plan", bomb() + BASE.replace("num_layers: 2", "num_layers: 2\n    offset: *l8"), [], 2,
     ["alias bomb"]),
    ("alias-bomb-recompute", "plan", bomb() + BASE + "recompute_config:\n  recompute: *l8\n", [], 2, ["alias bomb"]),
    ("alias-bomb-set", "plan", BASE, ["--set", f"recompute_config.recompute={flow_bomb()}"], 2,
     ["--set recompute_config.recompute", "alias bomb"]),
    ("recursive-alias", "plan", BASE + "recompute_config:\n  recompute: &r [*r]\n", [], 2, ["recursive"]),
    ("num-layers-schema-max", "plan", BASE.replace("num_layers: 2", "num_layers: 100000"), [], 2,
     ["model.model_config.num_layers: got 100000; expected an integer from 1 to 1024"]),
    ("pipeline-grid-huge", "plan", BASE.replace("num_layers: 2", "num_layers: 8\n    pp_interleave_num: 1024")
     + "parallel_config:\n  pipeline_stage: 4096\n", [], 2,
     ["parallel_config.pipeline_stage: got 4096; expected an integer from 1 to 256",
      "pp_interleave_num: got 1024; expected an integer from 1 to 64"]),
    ("many-unknown-keys", "plan", unknown_keys(20_000), [], 2, ["k0: unknown key", "... and 19,980 more unknown keys"]),
    ("many-written-values", "plan", BASE + "x: [" + ", ".join(["1"] * 300_000) + "]\n", [], 2,
     ["more than 50,000 values"]),
    ("latency-1e9", "train", BASE + "runtime:\n  engine_options: {latency_s: 1.0e+9}\n", [], 2,
     ["runtime.engine_options.latency_s: got 1000000000.0; expected a number >= 0 and <= 1"]),
    ("latency-inf", "train", BASE + "runtime:\n  engine_options: {latency_s: .inf}\n", [], 2,
     ["runtime.engine_options.latency_s: got inf", "finite"]),
    ("bandwidth-1e-300", "train", BASE + "runtime:\n  engine_options: {bandwidth_gbps: 1.0e-300}\n", [], 2,
     ["runtime.engine_options.bandwidth_gbps: got 1e-300; expected a number >= 0.001"]),
    ("fifo-config", "plan", lambda tmp: _fifo(tmp), [], 2, ["not a regular file"]),
    ("dev-zero-config", "plan", lambda tmp: Path("/dev/zero"), [], 2, ["/dev/zero is not a regular file"]),
    ("huge-config-file", "plan", lambda tmp: _write(tmp, BASE + "#" * (2 << 20) + "\n"), [], 2,
     ["larger than 1024 KiB"]),
    # ---- exceptions that used to escape the loader
    ("deep-nesting", "plan", BASE + "recompute_config:\n  recompute: " + "[" * 5000 + "]" * 5000 + "\n", [], 2,
     ["nested deeper than 64 levels"]),
    ("long-config-path", "plan", lambda tmp: tmp / ("x" * 5000 + ".yaml"), [], 2, ["File name too long"]),
    ("huge-seed", "train", BASE + "  seed: " + str(10 ** 30) + "\n", [], 2,
     ["train.seed: got", "expected an integer from 0 to 9223372036854775807"]),
    ("huge-integer-literal", "plan", BASE.replace("num_layers: 2", "num_layers: " + "9" * 5000), [], 2,
     ["YAML value cannot be read"]),
    ("unallocatable-model", "train", with_model(vocab_size=1048576, hidden_size=65536), [], 2,
     ["model.model_config: the built-in model", "Reduce these sizes"]),
    ("unallocatable-batch", "train", BASE.replace("batch_size: 2", "batch_size: 65536").replace(
        "seq_length: 16", "seq_length: 65536"), [], 2, ["train.batch_size 65536", "needs about"]),
    ("cuda-engine-on-cpu", "train", BASE + "runtime:\n  engine: cuda\n", [], 2,
     ["runtime.engine: got 'cuda' but the model trains on cpu"]),
    # ---- silent nonsense
    ("lr-inf", "train", BASE + "  lr: .inf\n", [], 2, ["train.lr: got inf", "finite"]),
    ("weight-decay-inf", "train", BASE + "  weight_decay: .inf\n", [], 2, ["train.weight_decay: got inf"]),
    ("rms-norm-eps-inf", "train", with_model(rms_norm_eps=".inf"), [], 2, ["model.model_config.rms_norm_eps: got inf"]),
    ("lr-nan", "train", BASE + "  lr: .nan\n", [], 2, ["train.lr: got nan"]),
    ("sexagesimal-steps", "train", BASE + "  steps: 1:30\n", [], 2, ["train.steps: got '1:30'", "base-60"]),
    ("octal-seed", "train", BASE + "  seed: 010\n", [], 2, ["train.seed: got '010'", "octal"]),
    ("quoted-lr", "train", BASE + "  lr: '0.1'\n", [], 2,
     ["train.lr: got '0.1'; expected a number > 0. '0.1' is text because it is quoted; write the number unquoted: 0.1"]),
    ("quoted-steps-set", "train", BASE, ["--set", "train.steps='5'"], 2,
     ["got '5'; expected an integer >= 1. '5' is text because it is quoted; write the number unquoted: 5"]),
    ("sexagesimal-set", "train", BASE, ["--set", "train.steps=1:30"], 2,
     ["train.steps (from --set train.steps=1:30): got '1:30'", "base-60"]),
    # ---- outputs checked before the first step
    ("metrics-missing-parent", "train", BASE, ["--metrics-out", "{tmp}/missing/m.json"], 2,
     ["--metrics-out: got", "does not exist"]),
    ("metrics-is-a-directory", "train", BASE, ["--metrics-out", "{tmp}"], 2, ["which is a directory"]),
    ("metrics-parent-is-a-file", "train", BASE, ["--metrics-out", "{tmp}/bad.yaml/m.json"], 2, ["is a file"]),
    ("save-dir-is-a-file", "train", BASE + "  save_dir: {tmp}/bad.yaml\n", [], 2,
     ["train.save_dir: got", "which is a file"]),
    ("save-dir-under-a-file", "train", BASE + "  save_dir: {tmp}/bad.yaml/ckpt\n", [], 2,
     ["train.save_dir: got", "cannot create the folder"]),
    ("metrics-is-a-fifo", "train", BASE, ["--metrics-out", "{tmp}/m.fifo"], 2, ["which is not a regular file"]),
    ("metrics-is-the-config", "train", BASE, ["--metrics-out", "{tmp}/bad.yaml"], 2,
     ["--metrics-out: got", "the config file of this run; writing there would replace it"]),
    ("steps-flag-huge", "train", BASE, ["--steps", str(10 ** 30)], 2, ["--steps: got", "<= 1,000,000,000"]),
]


def _fifo(tmp: Path) -> Path:
    path = tmp / "config.fifo"
    os.mkfifo(path)
    return path


def _write(tmp: Path, text: str) -> Path:
    path = tmp / "big.yaml"
    path.write_text(text)
    return path


def run_cli(command: str, config, args: list[str], tmp_path: Path, capsys) -> tuple[int, str, float, int]:
    """Run the CLI in this process; returns (status, stderr, seconds, peak RSS growth in bytes)."""
    if callable(config):
        path = config(tmp_path)
    else:
        path = _write(tmp_path, config.replace("{tmp}", str(tmp_path))) if config else None
        path = path.rename(tmp_path / "bad.yaml")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if any(a.endswith(".fifo") for a in args):
        os.mkfifo(args[-1])
    extra = ["--no-progress", "--steps", "1"] if command == "train" and "--steps" not in args else []
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    status = cli.main([command, str(path), *extra, *args])
    seconds = time.perf_counter() - start
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) * 1024
    return status, capsys.readouterr().err, seconds, grown


@pytest.mark.parametrize("command, config, args, status, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_class_ends_in_one_clear_message(command, config, args, status, expected, tmp_path, capsys):
    got, err, seconds, grown = run_cli(command, config, args, tmp_path, capsys)
    assert got == status, err
    for text in expected:
        assert text in err, err
    assert "Traceback" not in err
    assert seconds < 10, seconds
    assert len(err) < 10_000, len(err)
    assert grown < 1 << 30, grown
    assert "swapkit train summary" not in err  # nothing trained


def test_the_table_covers_every_class_of_the_issue():
    assert len(CASES) >= 44
    assert {c[4] for c in CASES} == {2}  # every one of these is a config or usage problem


def test_200k_unknown_keys_in_a_dict_are_counted_not_listed():
    from swapkit import ConfigError, load_config

    raw = {"model": {"model_config": {"num_layers": 2}}, **{f"k{i}": 1 for i in range(200_000)}}
    start = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    text = str(info.value)
    assert time.perf_counter() - start < 10
    assert text.startswith("invalid swapkit config (200,000 problems):")
    assert text.endswith("... and 199,980 more unknown keys (fix the ones listed and run again)")
    assert len(text.splitlines()) == 22 and len(text) < 10_000


def test_values_in_messages_are_summarised_whatever_their_size():
    from swapkit import ConfigError, load_config

    nested = [[list(range(1000))] * 500]  # 500,000 values
    with pytest.raises(ConfigError) as info:
        load_config({"model": {"model_config": {"num_layers": nested}}})
    line = str(info.value).splitlines()[1]
    assert line.startswith("  - model.model_config.num_layers: got [[[0, 1, 2, 3, 4, 5, 6, 7, ...], ")
    assert len(line) < 200
    with pytest.raises(ConfigError, match="holding more than 1,000,000 values"):
        load_config({"model": {"model_config": {"num_layers": [[list(range(10_000))] * 1000]}}})


def test_numbers_are_read_as_yaml_1_2_writes_them():
    from swapkit.config.yaml_reader import parse_yaml

    read = parse_yaml("a: 1:30\nb: 010\nc: 1e-3\nd: 1.5e3\ne: 0x1F\nf: 2024-01-01\ng: 1_000\nh: -0.5\ni: .inf\n")
    assert read == {"a": "1:30", "b": "010", "c": 0.001, "d": 1500.0, "e": 31, "f": "2024-01-01", "g": 1000,
                    "h": -0.5, "i": math.inf}


def test_a_folder_that_cannot_be_written_is_refused_before_the_first_step(tmp_path, capsys, monkeypatch):
    """Read-only folders, simulated: as root a chmod'ed folder stays writable, so the probe's write fails."""
    from swapkit.train import files

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(files.tempfile, "mkstemp", read_only)
    config = _write(tmp_path, BASE + f"  save_dir: {tmp_path}/ckpt\n")
    args = ["--steps", "1", "--no-progress", "--metrics-out", str(tmp_path / "m.json")]
    assert cli.main(["train", str(config), *args]) == 2
    err = capsys.readouterr().err
    assert f"--metrics-out: got {tmp_path / 'm.json'}; cannot write in {tmp_path}: Permission denied" in err
    assert f"train.save_dir: got {tmp_path / 'ckpt'}; cannot write in {tmp_path / 'ckpt'}: Permission denied" in err
    assert not (tmp_path / "m.json").exists()


# ---------------------------------------------------------------- runtime failures (exit 1)

def test_a_nan_loss_stops_the_run_with_exit_1_naming_the_step(tmp_path, capsys, monkeypatch):
    real, calls = train_loop.lm_loss, []

    def loss_turns_nan(logits, targets):
        calls.append(1)
        loss = real(logits, targets)
        return loss * math.nan if len(calls) == 3 else loss

    monkeypatch.setattr(train_loop, "lm_loss", loss_turns_nan)
    config = _write(tmp_path, BASE)
    metrics = tmp_path / "m.json"
    status = cli.main(["train", str(config), "--steps", "5", "--no-progress", "--metrics-out", str(metrics)])
    err = capsys.readouterr().err
    assert status == 1, err
    assert "swapkit: the loss is nan at step 3; the run stopped before updating the weights" in err
    assert "Traceback" not in err
    assert len(calls) == 3  # no step after the bad one
    assert '"status": "failed"' in metrics.read_text()


def test_an_unexpected_exception_is_one_line_with_exit_1(tmp_path, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(train_loop, "lm_loss", broken)
    status = cli.main(["train", str(_write(tmp_path, BASE)), "--steps", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert status == 1
    assert "swapkit: failed: ZeroDivisionError: boom; rerun with -v for the traceback" in err
    assert "Traceback" not in err


def test_an_unexpected_exception_names_the_error_it_wraps(tmp_path, capsys, monkeypatch):
    """torch's pipeline stages wrap a forward's or backward's error in a RuntimeError of their own whose text
    does not name it (``[Stage 1] failed to run forward: args: ...``); a torchrun rank printed only that."""
    def broken(*args, **kwargs):
        try:
            raise ZeroDivisionError("boom")
        except ZeroDivisionError as err:
            raise RuntimeError("\n            [Stage 1] failed to run forward:\n            kwargs: {}\n") from err

    monkeypatch.setattr(train_loop, "lm_loss", broken)
    status = cli.main(["train", str(_write(tmp_path, BASE)), "--steps", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert status == 1
    assert ("swapkit: failed: RuntimeError: [Stage 1] failed to run forward: kwargs: {}; caused by "
            "ZeroDivisionError: boom; rerun with -v for the traceback\n") in err, err
    assert "Traceback" not in err


# ---------------------------------------------------------------- the thread engine's link options

@pytest.mark.parametrize("options, message", [
    ({"latency_s": 1e9}, "latency_s: got 1000000000.0"),
    ({"latency_s": math.inf}, "latency_s: got inf"),
    ({"latency_s": -1}, "latency_s: got -1"),
    ({"bandwidth_gbps": 1e-300}, "bandwidth_gbps: got 1e-300"),
    ({"bandwidth_gbps": math.nan}, "bandwidth_gbps: got nan"),
])
def test_the_thread_engine_refuses_links_that_would_hang_or_overflow(options, message):
    with pytest.raises(ValueError, match=message):
        ThreadCopyEngine("cpu", **options)


def test_close_does_not_wait_for_copies_sleeping_on_their_latency():
    engine = ThreadCopyEngine("cpu", latency_s=1.0)
    copies = [engine.offload(torch.ones(64), torch.empty(64)) for _ in range(5)]
    time.sleep(0.05)  # the first copy is asleep in the worker
    start = time.perf_counter()
    engine.close()
    assert time.perf_counter() - start < 0.5  # not 5 x 1 s
    assert all(c.done and isinstance(c.error, CopyCancelled) for c in copies)
    engine.latency_s = 0.0
    engine.wait(engine.offload(torch.ones(4), torch.empty(4)))  # usable again, nothing stale raised
    engine.synchronize()
    engine.close()


def test_leaving_a_block_on_ctrl_c_does_not_drain_the_emulated_link():
    """The session's ``__exit__`` synchronizes while KeyboardInterrupt propagates: sleeping copies are cancelled."""
    engine = ThreadCopyEngine("cpu", latency_s=1.0)
    copies = [engine.offload(torch.ones(64), torch.empty(64)) for _ in range(10)]
    start = time.perf_counter()
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        engine.synchronize()  # no CopyCancelled raised: cancelled copies are no failure
    assert time.perf_counter() - start < 2  # not 10 x 1 s
    assert sum(isinstance(c.error, CopyCancelled) for c in copies) >= 9
    engine.latency_s = 0.0
    dst = torch.empty(4)
    engine.wait(engine.offload(torch.ones(4), dst))  # the next step copies normally
    assert torch.equal(dst, torch.ones(4))
    engine.close()


def test_ctrl_c_with_a_slow_emulated_link_exits_at_once(tmp_path):
    """``latency_s`` at its bound (1 s per copy): Ctrl-C mid-step still ends the run within seconds."""
    import signal
    import subprocess
    import sys

    text = BASE.replace("num_layers: 2", "num_layers: 4") + "  steps: 100\nswap_config:\n  swap: true\n"
    text += "  layer_swap: [{backward_prefetch: 2, layers: true}]\nruntime:\n  min_offload_bytes: 0\n"
    config = _write(tmp_path, text + "  engine_options: {latency_s: 1.0}\n")  # ~40 copies queued: 40 s to drain
    # A suite started as a background job of a script (`pytest &`, nohup) inherits SIGINT ignored, and Python
    # keeps an inherited SIG_IGN: the child would never see the Ctrl-C. Give it the default disposition.
    child = subprocess.Popen([sys.executable, "-m", "swapkit.cli", "train", str(config), "--no-progress"],
                             stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1],
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in child.stderr:  # the plan is logged just before the first step
            if "Set layer swap at layer 3" in line:
                break
        time.sleep(1.5)  # copies are queued and sleeping on their latency
        start = time.perf_counter()
        child.send_signal(signal.SIGINT)
        err = child.communicate(timeout=60)[1]
        seconds = time.perf_counter() - start
    finally:
        child.kill()
    assert child.returncode == 130, err
    assert "swapkit: interrupted" in err and "Traceback" not in err
    assert seconds < 8, seconds  # Note [Ctrl-C and the emulated link]: not the queue's 40 x 1 s
