"""Issue 12, property: random and hostile configs thrown at the CLI always end in exit 0 or 2 (plan), or
0, 1 or 2 (train), with at most one short message, no traceback and no internal error, in bounded time."""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swapkit import cli

#: Examples per run: a few seconds in CI; SWAPKIT_HOSTILE_EXAMPLES=2000 for a longer hunt.
EXAMPLES = int(os.environ.get("SWAPKIT_HOSTILE_EXAMPLES", "60"))
SLOW = "a" * 40 + "!"
NASTY_STRINGS = ["1:30", "010", "0x1F", "(a|aa)+$", "a{99999999999}", "(" * 300, ".*", r"feed_forward\.mul",
                 "attention", SLOW, "2024-01-01", "~", "yes", "", " ", "\\.", r"\.\.", "[", "é" * 50, "cuda"]
SECTIONS = {
    "model.model_config": ["num_layers", "offset", "pp_interleave_num", "hidden_size", "num_heads",
                           "intermediate_size", "vocab_size", "seq_length", "rms_norm_eps", "rope_theta",
                           "hidden_dropout", "layers_path", "use_flash_attention"],
    "parallel_config": ["pipeline_stage", "data_parallel"],
    "recompute_config": ["recompute", "select_recompute", "select_comm_recompute", "select_recompute_exclude",
                         "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules",
                         "use_reentrant", "mp_comm_recompute"],
    "swap_config": ["swap", "default_prefetch", "layer_swap", "op_swap"],
    "runtime": ["engine", "engine_options", "min_offload_bytes", "max_host_bytes", "skip_tail_offload"],
    "train": ["steps", "batch_size", "lr", "weight_decay", "grad_clip", "dtype", "seed", "resume"],
}
KEY_PATHS = [f"{section}.{key}" for section, keys in SECTIONS.items() for key in keys]
HOSTILE_TEXTS = [
    "l0: &l0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 9)) + "model: *l8\n",
    "model: {model_config: {num_layers: " + "[" * 3000 + "]" * 3000 + "}}\n",
    "model: &m {model_config: *m}\n",
    "model:\n  model_config:\n    num_layers: 1:30\n",
    "model:\n  model_config:\n    num_layers: 010\n",
    "model:\n  model_config:\n    num_layers: 4\n    num_layers: 5\n",
    "\x00\x01\x02",
    "- just\n- a list\n",
    "model: !!python/object:os.system {}\n",
    "model:\n  model_config:\n    num_layers: 4\n"
    "runtime:\n  engine_options: {latency_s: .inf, bandwidth_gbps: 1.0e-300}\n",
    "",
]

scalars = st.one_of(st.integers(-2 ** 70, 2 ** 70), st.integers(-3, 8), st.floats(), st.booleans(), st.none(),
                    st.text(max_size=20), st.sampled_from(NASTY_STRINGS))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(
    st.sampled_from(["op_name", "backward_prefetch", "layers", "latency_s", "x", r".*\.norm"]) | st.text(max_size=8),
    inner, max_size=4), max_leaves=16)


def base() -> dict:
    return {"model": {"model_config": {"num_layers": 4, "hidden_size": 32, "num_heads": 4, "intermediate_size": 64,
                                       "vocab_size": 64, "seq_length": 16}},
            "train": {"batch_size": 2, "steps": 1}}


def put(config: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else {}
    node[last] = value


@st.composite
def configs(draw) -> str:
    """YAML text: a valid config with a few keys set to random, often hostile, values — or a hostile file."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from(HOSTILE_TEXTS) | st.text(max_size=200))
    config = base()
    for dotted in draw(st.lists(st.sampled_from(KEY_PATHS) | st.text(min_size=1, max_size=12), max_size=5)):
        put(config, dotted, draw(values))
    return yaml.safe_dump(config, allow_unicode=True)


def run(command: str, text: str, capsys, extra: list[str]) -> tuple[int, str, float]:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.yaml"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        start = time.perf_counter()
        try:
            status = cli.main([command, str(path), *extra])
        except SystemExit as usage:  # argparse's own usage errors (`--set -x`): exit 2 with its message
            status = usage.code
        return status, capsys.readouterr().err, time.perf_counter() - start


def assert_clean(status: int, err: str, seconds: float, allowed: set[int]) -> None:
    assert status in allowed, err
    assert "Traceback" not in err and "swapkit: failed:" not in err, err  # no escaped exception
    assert seconds < 10, seconds
    assert len(err) < 20_000, len(err)
    messages = [line for line in err.splitlines() if line.startswith(("swapkit: ", "swapkit plan: error:",
                                                                         "swapkit train: error:"))]
    assert len(messages) == (0 if status == 0 else 1), err  # one message, and only when it failed


overrides = st.lists(st.builds("{}={}".format, st.sampled_from(KEY_PATHS) | st.text(max_size=12),
                                st.sampled_from(NASTY_STRINGS + ["[&a [1, 1], *a]", "{", ".inf", "1e999"])
                                | st.text(max_size=30)), max_size=3)


@settings(max_examples=EXAMPLES, deadline=10_000, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
@given(text=configs(), sets=overrides)
def test_plan_survives_random_and_hostile_configs(text, sets, capsys):
    extra = [arg for item in sets for arg in ("--set", item)]
    assert_clean(*run("plan", text, capsys, ["--json", *extra]), allowed={0, 2})


@settings(max_examples=max(EXAMPLES // 5, 12), deadline=10_000, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
@given(text=configs())
def test_train_survives_random_and_hostile_configs(text, capsys):
    assert_clean(*run("train", text, capsys, ["--steps", "1", "--no-progress"]), allowed={0, 1, 2})
