"""`swapkit plan` end to end (DESIGN §8): seed 001 log lines, --json, exit status 2 on bad configs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from swapkit.cli import main
from swapkit.load import load_config

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
SEED_CONFIGS = sorted(CONFIGS.glob("*.yaml"))


pytestmark = pytest.mark.usefixtures("cli_loggers_restored")  # conftest


def run_main(capsys, *argv):
    status = main(["plan", *map(str, argv)])
    out, err = capsys.readouterr()
    return status, out, err


def run_subprocess(*argv):
    return subprocess.run([sys.executable, "-m", "swapkit.cli", "plan", *map(str, argv)], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)


def info_lines(stderr: str) -> list[str]:
    return [line[len("INFO - "):] for line in stderr.splitlines() if line.startswith("INFO - ")]


def squash(line: str) -> str:
    """Modulo whitespace and modulo repr's doubled backslashes (the seed's markdown lost one)."""
    return "".join(line.replace("\\\\", "\\").split())


# ---------------------------------------------------------------- the seed 001 swap cases (logs as the seed shows)

SEED_CASES = {
    "seed001_swap_default.yaml": [
        "Set op_swap at layer 0: attention.flash_attention, value=10",
        "Set op_swap at layer 1: attention.flash_attention, value=10",
        "Set op_swap at layer 2: attention.flash_attention, value=10",
        "Set op_swap at layer 3: attention.flash_attention, value=10",
    ],
    "seed001_swap_layer.yaml": [
        "Set layer swap at layer 0 and value is: 20",
        "Set layer swap at layer 3 and value is: 20",
    ],
    "seed001_swap_op.yaml": [
        "Set op_swap at layer 0: .attention, value=20",
        "Set op_swap at layer 1: .attention, value=20, .feed_forward, value=15",
        "Set op_swap at layer 2: .attention, value=20, .feed_forward, value=15",
        "Set op_swap at layer 3: .attention, value=10",
    ],
    "seed001_swap_recompute.yaml": [
        "Set select recompute at layer 0: feed_forward",
        "Set op_swap at layer 0: .attention, value=20",
        "Set op_swap at layer 1: .attention, value=20, .feed_forward, value=15",
        "Set op_swap at layer 2: .attention, value=20, .feed_forward, value=15",
        "Set select recompute at layer 3: feed_forward",
        "Set op_swap at layer 3: .attention, value=10",
    ],
}


@pytest.mark.parametrize("name", sorted(SEED_CASES))
def test_seed001_swap_case_lines(capsys, name):
    status, out, err = run_main(capsys, "--log", CONFIGS / name)
    assert status == 0
    set_lines = [line for line in info_lines(err) if line.startswith("Set ")]
    assert set_lines == SEED_CASES[name]  # exactly the seed's lines, in the seed's order
    warnings = [line for line in err.splitlines() if line.startswith("WARNING")]
    assert warnings == ["WARNING - context.memory_optimize_level has no effect in PyTorch eager; accepted and ignored"]
    assert out.splitlines()[0].split() == ["layer", "stage", "chunk", "full", "select", "comm", "swaps", "overridden"]


def test_seed001_swap_case_formative_swap_lines(capsys):
    _, _, err = run_main(capsys, "--log", CONFIGS / "seed001_swap_op.yaml")
    lines = info_lines(err)
    assert "Formative layer swap: []" in lines
    assert ("Formative op swap: {'attention': [{'backward_prefetch': 20, 'layers': [0, 1, 2]}, "
            "{'backward_prefetch': 10, 'layers': [3]}], 'feed_forward': [{'backward_prefetch': 15, 'layers': [1, 2]}]}"
            in lines)


# ---------------------------------------------------------------- the seed 001 recompute example

SEED_FORMATIVE = [
    "Formative layer_recompute: [[2, 1, 0, 0, 0], [1, 0, 0, 0, 0]]",
    r"Formative select_recompute: {'feed_forward\.w1\.activation\.silu': [[4, 5, 5, 5, 5], [5, 5, 5, 5, 4]], "
    r"'feed_forward\.mul': [[4, 5, 5, 5, 5], [5, 5, 5, 5, 4]], 'feed_forward\.w1\.matmul': [[1, 0, 0, 0, 0], "
    r"[2, 1, 0, 0, 0]], 'feed_forward\.w3\.matmul': [[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]}",
    r"Formative select_comm_recompute: {'ffn_norm\.norm': [[4, 5, 5, 5, 5], [5, 5, 5, 5, 4]], "
    r"'attention_norm\.norm': [[4, 5, 5, 5, 5], [5, 5, 5, 5, 4]]}",
]


def test_seed001_recompute_formative_lines(capsys):
    status, _, err = run_main(capsys, "--log", CONFIGS / "seed001_recompute_pp.yaml")
    assert status == 0
    lines = info_lines(err)
    assert lines[0] == "num_layers per stage: [[4, 5, 5, 5, 5], [5, 5, 5, 5, 4]]"
    assert lines[1] == "Accumulated num_layers per stage: [[4, 9, 14, 19, 24], [29, 34, 39, 44, 48]]"
    formative = [line for line in lines if line.startswith("Formative ")]
    assert [squash(line) for line in formative[:3]] == [squash(line) for line in SEED_FORMATIVE]
    assert "'feed_forward\\\\.mul'" in formative[1]  # Python repr, as MindFormers logs it
    assert "Set full recompute at layer 0" in lines
    assert "Set full recompute at layer 24" in lines
    assert "Set select recompute on at layer 2: feed_forward.w1.activation.silu, feed_forward.mul" in lines
    assert "Set select comm recompute on at layer 2: ffn_norm.norm, attention_norm.norm" in lines
    assert ("Set select recompute on at layer 25: feed_forward.w1.activation.silu, feed_forward.mul, "
            "feed_forward.w1.matmul") in lines
    assert not any(line.startswith("Set select recompute on at layer 0:") for line in lines)


@pytest.mark.parametrize("path", SEED_CONFIGS, ids=[p.name for p in SEED_CONFIGS])
def test_every_shipped_config_plans_with_exit_0(capsys, path):
    status, out, err = run_main(capsys, path)
    assert status == 0
    assert "Traceback" not in err
    table, summary = out.strip().split("\n\n")
    assert len(table.splitlines()) == 1 + load_config(path).model.num_layers  # header + one row per layer
    assert summary.splitlines()[0].startswith(f"{load_config(path).model.num_layers} layers, ")
    assert "INFO" not in err  # MindFormers' log lines only with --log


# ---------------------------------------------------------------- --json

LAYER_KEYS = {"layer", "stage", "chunk", "full", "select", "comm", "layer_swap", "op_swap", "overridden"}


def test_json_is_one_document_on_stdout(capsys):
    status, out, err = run_main(capsys, "--log", "--json", CONFIGS / "seed001_swap_recompute.yaml")
    assert status == 0
    data = json.loads(out)  # raises on anything but exactly one JSON document
    assert set(data["layout"]) >= {"layer_list", "layer_accu", "pp_ids", "interleave_ids"}
    assert set(data["formative"]) == {"layer_recompute", "select_recompute", "select_comm_recompute",
                                      "select_recompute_exclude", "select_comm_recompute_exclude",
                                      "layer_swap", "op_swap"}
    assert [set(layer) >= LAYER_KEYS for layer in data["layers"]] == [True] * 4
    assert [layer["op_swap"] for layer in data["layers"]] == [
        [["attention", 20]], [["attention", 20], ["feed_forward", 15]],
        [["attention", 20], ["feed_forward", 15]], [["attention", 10]]]
    assert [layer["select"] for layer in data["layers"]] == [["feed_forward"], [], [], ["feed_forward"]]
    assert "Formative" not in out and "Formative select_recompute" in err


def test_json_reports_overridden_swaps(capsys, tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text("""
model: {model_config: {num_layers: 2}}
recompute_config: {recompute: [0]}
swap_config:
  swap: true
  layer_swap: [{backward_prefetch: 3, layers: [0, 1]}]
""")
    status, out, err = run_main(capsys, "--json", path)
    assert status == 0
    layers = json.loads(out)["layers"]
    assert [layer["overridden"] for layer in layers] == [["layer"], []]
    assert [layer["layer_swap"] for layer in layers] == [3, 3]
    assert ("WARNING - layer swap at layer 0 has no effect: the layer is fully recomputed "
            "(recompute wins over swap)") in err.splitlines()


def test_set_override_on_the_command_line(capsys):
    status, out, err = run_main(capsys, "--json", "--set", "swap_config.swap=false", CONFIGS / "seed001_swap_op.yaml")
    assert status == 0
    assert all(layer["op_swap"] == [] for layer in json.loads(out)["layers"])
    assert "Set op_swap" not in err


def test_unmatched_pattern_is_an_error(capsys, tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("model: {model_config: {num_layers: 2}}\nrecompute_config: {select_recompute: [atention]}\n")
    status, out, err = run_main(capsys, path)
    assert status == 2 and out == ""
    assert "Traceback" not in err
    assert err == (f"swapkit: invalid swapkit config in {path} (1 problem):\n  - recompute_config.select_recompute[0]: "
                   "select_recompute pattern 'atention' matches no sub-module in any layer of LlamaModel.layers; did "
                   "you mean 'attention'? Replace 'atention' with 'attention'\n")


# ---------------------------------------------------------------- subprocess, as a user runs it

def test_subprocess_seed_case_and_json():
    result = run_subprocess(CONFIGS / "seed001_swap_op.yaml", "--json", "--log")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["layers"][1]["op_swap"] == [["attention", 20], ["feed_forward", 15]]
    assert "INFO - Set op_swap at layer 1: .attention, value=20, .feed_forward, value=15" in result.stderr.splitlines()


def test_subprocess_bad_config_exits_2_without_traceback(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  model_config:\n    num_layers: [4\n")
    result = run_subprocess(path)
    assert result.returncode == 2
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith(f"swapkit: invalid swapkit config in {path} (1 problem):\n  - YAML syntax error")


# ---------------------------------------------------------------- exit 2, one message, no traceback

BAD_CONFIGS = {
    "yaml_syntax": ("model: {model_config: {num_layers: 4}\n", "YAML syntax error"),
    "empty": ("", "the config is empty"),
    "wrong_types": ("model: {model_config: {num_layers: four}}\nswap_config: {swap: maybe}\n",
                    "model.model_config.num_layers: got 'four'; expected an integer from 1 to 1024"),
    "too_long_list": ("model: {model_config: {num_layers: 4}}\nparallel_config: {pipeline_stage: 2}\n"
                      "recompute_config: {recompute: [1, 1, 1]}\n",
                      "recompute_config.recompute: got [1, 1, 1]; expected at most pipeline_stage (2)"),
    "negative_count": ("model: {model_config: {num_layers: 4}}\nrecompute_config: {select_recompute: [-1]}\n",
                       "recompute_config.select_recompute: got [-1]; expected counts >= 0"),
    "offset_shape": ("model: {model_config: {num_layers: 4, offset: [1, -1, 0]}}\n"
                     "parallel_config: {pipeline_stage: 2}\n",
                     "model.model_config.offset: got [1, -1, 0]"),
    "offset_sum": ("model: {model_config: {num_layers: 4, offset: [1, 0]}}\nparallel_config: {pipeline_stage: 2}\n",
                   "model.model_config.offset: layers per chunk [[3, 2]] add up to 5, not num_layers (4)"),
    "swap_mode_2d": ("model: {model_config: {num_layers: 4}}\nrecompute_config: {recompute: [[0, 1]]}\n"
                     "swap_config: {swap: true}\n",
                     "recompute_config.recompute: got [[0, 1]]; expected a flat list of global layer indices"),
    "inconsistent_prefetch": ("model: {model_config: {num_layers: 4}}\nswap_config:\n  swap: true\n  layer_swap:\n"
                              "    - {backward_prefetch: 2, layers: true}\n    - {backward_prefetch: 3, layers: [1]}\n",
                              "swap_config.layer_swap[1].backward_prefetch: got 3; expected 2 like the other entries"),
    "zero_prefetch": ("model: {model_config: {num_layers: 4}}\nswap_config:\n  swap: true\n  op_swap:\n"
                      "    - {op_name: attention, backward_prefetch: 0, layers: [0]}\n",
                      "swap_config.op_swap[0].backward_prefetch: got 0; expected an integer >= 1"),
    "bad_regex": ("model: {model_config: {num_layers: 4}}\n"
                  "recompute_config:\n  select_recompute: {'attention\\.wq(': true}\n",
                  "recompute_config.select_recompute.attention\\.wq(: got 'attention\\\\.wq('"),
    "unknown_megatron_module": ("model: {model_config: {num_layers: 4}}\nrecompute_config:\n"
                                "  recompute_granularity: selective\n  recompute_modules: [attn]\n",
                                "recompute_config.recompute_modules: got ['attn']; expected Megatron module names"),
    "mixed_dialects": ("model: {model_config: {num_layers: 4}}\nrecompute_config:\n  recompute: true\n"
                       "  recompute_granularity: full\n", "recompute_config: mixes the MindFormers keys (recompute)"),
}


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_bad_config_exits_2_with_one_message(capsys, tmp_path, name):
    text, expected = BAD_CONFIGS[name]
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    status, out, err = run_main(capsys, path)
    assert status == 2
    assert out == ""
    assert "Traceback" not in err
    assert err.count("invalid swapkit config") == 1
    assert err.startswith(f"swapkit: invalid swapkit config in {path} (")
    assert expected in err


def test_missing_file_exits_2(capsys, tmp_path):
    status, out, err = run_main(capsys, tmp_path / "nope.yaml")
    assert status == 2 and out == ""
    assert err == f"swapkit: invalid swapkit config (1 problem):\n  - config file not found: {tmp_path / 'nope.yaml'}\n"


def test_bad_set_exits_2(capsys):
    status, _, err = run_main(capsys, "--set", "train.steps", CONFIGS / "seed001_swap_op.yaml")
    assert status == 2
    assert "--set: got 'train.steps'; expected dotted.key=value" in err


def test_usage_error_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan"])
    assert info.value.code == 2
    assert "the following arguments are required: config" in capsys.readouterr().err


def test_cli_json_overridden_is_exact_for_the_builtin_model(tmp_path, capsys):
    """Megatron core_attn recomputes attention.flash_attention; the default swap `.*\\.flash_attention`
    names exactly that scope, which only the module tree can tell."""
    import json

    import yaml

    from swapkit.cli import main

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"model_config": {"num_layers": 2}},
        "recompute_config": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
        "swap_config": {"swap": True}}))
    assert main(["plan", str(path), "--json"]) == 0
    layers = json.loads(capsys.readouterr().out)["layers"]
    assert [layer["overridden"] for layer in layers] == [[r".*\.flash_attention"]] * 2


def test_table_and_summary_show_patterns_as_written(capsys):
    r"""A pattern copied from the table back into a config means the same: ``\.`` stays ``\.``."""
    status, out, err = run_main(capsys, "--log", CONFIGS / "seed001_recompute_pp.yaml")
    assert status == 0
    table, summary = out.strip().split("\n\n")
    assert r"feed_forward\.w1\.activation\.silu, feed_forward\.mul" in table.splitlines()[3]
    assert r"ffn_norm\.norm, attention_norm\.norm" in table.splitlines()[3]
    assert r"select recompute feed_forward\.w1\.matmul: layers 25, 29" in summary.splitlines()
    assert r"comm recompute ffn_norm\.norm: layers 2-3, 5-23, 25-47" in summary.splitlines()
    # MindFormers' own lines are unchanged: a Python dict repr, backslashes doubled
    assert ("INFO - Formative select_comm_recompute: {'ffn_norm\\\\.norm': [[4, 5, 5, 5, 5], [5, 5, 5, 5, 4]], "
            "'attention_norm\\\\.norm': [[4, 5, 5, 5, 5], [5, 5, 5, 5, 4]]}") in err.splitlines()
    status, out, _ = run_main(capsys, "--json", CONFIGS / "seed001_recompute_pp.yaml")
    assert json.loads(out)["layers"][25]["select"][2] == r"feed_forward\.w1\.matmul"


def test_pattern_from_the_table_works_in_a_config(capsys, tmp_path):
    path = tmp_path / "op.yaml"
    path.write_text("model: {model_config: {num_layers: 2}}\nswap_config: {swap: true, op_swap: "
                    "[{op_name: '.*\\.flash_attention', backward_prefetch: 1, layers: true}]}\n")
    status, out, err = run_main(capsys, path)
    assert status == 0, err
    cell = out.splitlines()[1].split()[6]
    assert cell == r".*\.flash_attention:1"
    path.write_text(path.read_text().replace(r".*\.flash_attention", cell[:-2]))
    assert run_main(capsys, path)[0] == 0


# ---------------------------------------------------------------- Note [Blame the command line]

def test_a_bad_key_from_set_names_the_set_not_the_file(capsys):
    status, out, err = run_main(capsys, CONFIGS / "tiny.yaml", "--set", "swap_config.swp=true")
    assert status == 2 and out == ""
    assert err == ("swapkit: invalid swapkit command line (1 problem):\n"
                   "  - swap_config.swp (from --set swap_config.swp=true): unknown key; did you mean 'swap'?\n")


def test_file_and_set_problems_are_each_blamed_on_their_source(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: {model_config: {num_layers: 4}}\ntrain: {lr: -1}\n")
    status, _, err = run_main(capsys, path, "--set", "swap_config.layer_swap=[{layers: [9], backward_prefetch: 1}]",
                              "--set", "train.steps=0")
    assert status == 2
    assert err == (f"swapkit: invalid swapkit config in {path} (3 problems):\n"
                   "  - swap_config.layer_swap[0].layers (from --set swap_config.layer_swap=[{layers: [9], "
                   "backward_prefetch: 1}]): got [9]; expected global layer indices 0 to 3 (num_layers is 4). "
                   "Out of range: [9]; remove them, or list layers below 4\n"
                   "  - train.lr: got -1; expected a number > 0\n"
                   "  - train.steps (from --set train.steps=0): got 0; expected an integer >= 1\n")


def test_the_last_set_that_wrote_a_key_is_named(capsys):
    status, _, err = run_main(capsys, CONFIGS / "tiny.yaml", "--set", "train.steps=2", "--set", "train={steps: 0}")
    assert status == 2
    assert "  - train.steps (from --set train={steps: 0}): got 0; expected an integer >= 1\n" in err


def test_a_bad_swap_override_is_not_called_a_flip(capsys):
    status, _, err = run_main(capsys, CONFIGS / "tiny.yaml", "--set", "swap_config.swap=y")
    assert status == 2
    assert err.startswith("swapkit: invalid swapkit command line (1 problem):\n"
                          "  - swap_config.swap (from --set swap_config.swap=y): got 'y'; expected true or false. ")
    assert "flips" not in err


def test_an_op_swap_typo_names_its_key_value_and_fix(capsys, tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("model: {model_config: {num_layers: 2}}\nswap_config:\n  swap: true\n  op_swap:\n"
                    "    - op_name: atention\n      backward_prefetch: 1\n      layers: [0]\n")
    status, out, err = run_main(capsys, path)
    assert status == 2 and out == ""
    assert err == (f"swapkit: invalid swapkit config in {path} (1 problem):\n"
                   "  - swap_config.op_swap[0].op_name: op_swap pattern 'atention' matches no sub-module in any layer "
                   "of LlamaModel.layers; did you mean 'attention'? Replace 'atention' with 'attention'\n")
    status, _, err = run_main(capsys, CONFIGS / "tiny.yaml", "--set",
                              "swap_config.op_swap=[{op_name: atention, backward_prefetch: 1, layers: [1]}]")
    assert status == 2
    assert err.startswith("swapkit: invalid swapkit command line (1 problem):\n  - swap_config.op_swap[0].op_name "
                          "(from --set swap_config.op_swap=[{op_name: atention, backward_prefetch: 1, layers: [1]}]): "
                          "op_swap pattern 'atention' matches no sub-module")


@pytest.mark.parametrize("argv, verbose", [
    (["-v", "train", "c.yaml"], True), (["train", "c.yaml", "-v"], True), (["plan", "c.yaml", "--verbose"], True),
    (["train", "c.yaml"], False), (["-v", "plan", "c.yaml", "--json"], True),
])
def test_verbose_may_follow_the_command(argv, verbose):
    """``swapkit train CONFIG -v`` was 'unrecognized arguments: -v'; it now means what ``swapkit -v train`` does."""
    from swapkit.cli import _parser

    assert _parser().parse_args(argv).verbose is verbose


def test_an_exclude_is_logged_once_between_the_layout_and_the_formative_lines(capsys, tmp_path):
    """MindFormers' LayerSetting logs the removal once, after the layout lines and before "Formative ...";
    it was logged by every normalization (load_config's check and build_plan's), before the layout."""
    config = tmp_path / "exclude.yaml"
    config.write_text("model: {model_config: {num_layers: 4}}\n"
                      "recompute_config: {select_recompute: true, select_recompute_exclude: ['feed_forward\\.mul']}\n")
    status, _, err = run_main(capsys, "--log", config)
    assert status == 0
    lines = info_lines(err)
    removal = (r"The pattern feed_forward\.mul in select_recompute conflicts with select_recompute_exclude and will be "
               "removed.")
    assert lines.count(removal) == 1
    assert lines.index("Interleave id list: [0, 0, 0, 0]") < lines.index(removal) < lines.index(
        r"Formative select_recompute: {'feed_forward\\.w1\\.activation\\.silu': [[4]]}")


@pytest.mark.parametrize("command", ["plan", "train"])
def test_an_override_written_without_set_names_set(capsys, command):
    """``swapkit train cfg.yaml swap_config.swap=false`` (torchtune's and Hydra's form) was argparse's bare
    'unrecognized arguments'; the error now says how swapkit takes an override."""
    with pytest.raises(SystemExit) as info:
        main([command, str(CONFIGS / "tiny.yaml"), "swap_config.swap=false", "--bogus"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert ("unrecognized arguments: swap_config.swap=false --bogus; to override a config value write "
            "--set swap_config.swap=false") in err


def test_seed001s_w3_matmul_recomputes_nothing_and_says_so(capsys):
    r"""Seed 001's ``'feed_forward\.w3\.matmul': [2,1,0,0,0]`` deals to layers 0, 4 and 24, which its
    ``recompute: [[2,1,0,0,0],[1,0,0,0,0]]`` fully recomputes (full wins): the pattern does nothing, as the
    summary shows (no "select recompute feed_forward\.w3\.matmul" line); MindFormers says nothing."""
    status, out, err = run_main(capsys, CONFIGS / "seed001_recompute_pp.yaml")
    assert status == 0
    assert not any(r"feed_forward\.w3\.matmul" in line for line in out.splitlines())
    assert [line for line in err.splitlines() if line.startswith("WARNING")] == [
        r"WARNING - recompute_config.select_recompute.feed_forward\.w3\.matmul: every layer it selects [0, 4, 24] is "
        "fully recomputed, and full recompute wins: it recomputes nothing; take those layers out of recompute where "
        "this op alone should be recomputed, or remove the pattern"]


def test_a_one_layer_built_in_model_plans_as_it_trains(capsys, tmp_path, monkeypatch):
    """`swapkit train` binds the built-in model's `layers`, but `swapkit plan` (and --budget, before it
    measures) auto-detected the container, which one layer is not ("no ... repeated layers in LlamaModel;
    pass layers='path.to.layers'"): a config that trains could not be planned."""
    from swapkit.planner import command

    path = tmp_path / "one.yaml"
    path.write_text("model:\n  model_config: {num_layers: 1, hidden_size: 32, num_heads: 4, intermediate_size: 64,"
                    " vocab_size: 64, seq_length: 16}\nswap_config: {swap: true, layer_swap: "
                    "[{backward_prefetch: 1, layers: [0]}]}\n", encoding="utf-8")
    status, out, err = run_main(capsys, path, "--json")
    assert status == 0, err
    assert json.loads(out)["layers"][0]["layer_swap"] == 1

    def measured(*args, **kwargs):
        raise RuntimeError("measuring")  # reached: the input's patterns were checked against the model

    monkeypatch.setattr(command, "measure", measured)
    status, _, err = run_main(capsys, path, "--budget", "1MiB")
    assert status == 1 and "failed: RuntimeError: measuring" in err, err
