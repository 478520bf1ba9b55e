"""What ``swapkit plan --budget`` tells the user: about their config, never about the planner's own runs."""
from __future__ import annotations

import logging

import pytest
import torch
import yaml

from swapkit.cli import main
from swapkit.config.types import EngineOptions, RuntimeConfig
from swapkit.planner.progress import Progress, emulated_latency
from swapkit.planner.quiet import held_warnings, setting_warnings, stage_setting_warnings
from tests.test_planner import CONFIG as PLANNER_CONFIG

#: test_planner's config with two layers (these tests need fewer)
CONFIG = {**PLANNER_CONFIG, "model": {"model_config": {**PLANNER_CONFIG["model"]["model_config"], "num_layers": 2}}}


pytestmark = pytest.mark.usefixtures("cli_loggers_restored")  # conftest


@pytest.fixture(autouse=True, scope="module")
def _quick_copies(inline_copies, one_thread):
    """Copies that finish when issued, one intra-op thread (conftest)."""


def write(tmp_path, config):
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


@pytest.mark.parametrize("setting, said", [
    ("runtime.min_offload_bytes=100000000", "runtime.min_offload_bytes: 100000000 is larger than every saved tensor"),
    ("runtime.max_host_bytes=1", "runtime.max_host_bytes: 1 is smaller than every saved tensor the planner could swap"),
])
def test_the_swap_probes_warnings_become_one_about_the_users_setting(tmp_path, capfd, setting, said):
    """The probe session said 'swap moved nothing ... in step 1' about a swap the user never configured."""
    assert main(["plan", str(write(tmp_path, CONFIG)), "--budget", "1GiB", "--set", setting]) == 0
    err = capfd.readouterr().err
    assert "moved nothing" not in err and "step 1" not in err
    assert err.count(said) == 1


def test_the_held_back_warnings_show_at_debug_naming_the_measurement_run(caplog):
    logger = logging.getLogger("swapkit.planner.run")
    with caplog.at_level(logging.DEBUG, logger="swapkit"):
        with held_warnings(logger):
            logging.getLogger("swapkit.runtime.session").warning("swap moved nothing")
            logging.getLogger("swapkit.runtime.session").info("Set layer swap at layer 0")
        logging.getLogger("swapkit.runtime.session").warning("after the block")
    shown = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert ("INFO", "Set layer swap at layer 0") in shown and ("WARNING", "after the block") in shown
    assert ("DEBUG", "a measurement run (a config the planner wrote, not yours) warned: swap moved nothing") in shown
    assert ("WARNING", "swap moved nothing") not in shown


def test_settings_that_leave_something_to_swap_say_nothing():
    assert setting_warnings(RuntimeConfig(min_offload_bytes=1024, max_host_bytes=1 << 20), [512, 4096, 65536]) == []
    assert setting_warnings(RuntimeConfig(min_offload_bytes=1 << 20), []) == []


def test_an_emulated_latency_is_announced_and_every_round_logged(tmp_path, capfd):
    """A 0.2 s latency made a 2-layer plan take a minute in silence."""
    argv = ["plan", str(write(tmp_path, CONFIG)), "--budget", "1GiB", "--set", "runtime.engine_options.latency_s=0.001"]
    assert main(argv) == 0
    err = capfd.readouterr().err
    assert ("runtime.engine_options.latency_s: 0.001 emulates a slow link: every copy of the planner's swap probe "
            "and of its link measurement sleeps it (the link measurement alone: 32 copies, 0.0 s)") in err
    rounds = [line for line in err.splitlines() if line.startswith("INFO - measured round ")]
    total = int(rounds[0].split(" of ")[1].split()[0])
    assert len(rounds) == total >= 4 and f"measured round {total} of {total}" in rounds[-1]
    assert "(keep, recompute, probe" in rounds[0]


def test_without_an_emulated_latency_the_rounds_show_only_with_v(tmp_path, capfd):
    path = str(write(tmp_path, CONFIG))
    assert main(["plan", path, "--budget", "1GiB"]) == 0
    assert "measured round" not in capfd.readouterr().err
    assert main(["-v", "plan", path, "--budget", "1GiB"]) == 0
    assert "DEBUG - measured round 1 of " in capfd.readouterr().err


PIPELINE = {**CONFIG, "parallel_config": {"pipeline_stage": 2, "micro_batch_num": 2}}


def test_a_pipeline_config_hears_about_its_settings_once_not_once_per_stage(tmp_path, capfd):
    """Each stage is measured on its own; the slow link and min_offload_bytes are the config's, not a stage's."""
    argv = ["plan", str(write(tmp_path, PIPELINE)), "--budget", "1GiB", "--set", "runtime.min_offload_bytes=100000000",
            "--set", "runtime.engine_options.latency_s=0.001"]
    assert main(argv) == 0
    err = capfd.readouterr().err
    assert err.count("emulates a slow link") == 1
    assert "(the link measurement alone: 32 copies on each of 2 stages, 0.1 s)" in err
    assert err.count("runtime.min_offload_bytes: 100000000 is larger than every saved tensor of any stage") == 1
    assert err.count("is larger than every saved tensor") == 1


def test_a_setting_that_leaves_only_some_stages_nothing_names_them():
    runtime = RuntimeConfig(min_offload_bytes=4096)
    assert stage_setting_warnings(runtime, [[512, 1024], [1024, 2048]]) == [
        "runtime.min_offload_bytes: 4096 is larger than every saved tensor of any stage (the largest is 2048 bytes): "
        "the planner found nothing to swap (it plans keep and recompute only); lower it to 2048 or less to let it swap"]
    per_stage = stage_setting_warnings(runtime, [[512, 8192], [1024, 2048]])
    assert len(per_stage) == 1 and per_stage[0].startswith(
        "runtime.min_offload_bytes: 4096 is larger than every saved tensor of stage 1 (the largest is 2048 bytes)")
    assert stage_setting_warnings(runtime, [[8192], [4096]]) == []


def test_the_estimate_counts_the_rounds_left_at_the_longest_round_and_the_link(caplog):
    progress = Progress(4, slow=True, after=6.4)
    with caplog.at_level(logging.DEBUG, logger="swapkit"):
        for seconds in (12.0, 0.5, 11.0, 12.0):
            progress.round_done(["keep", "probe"], seconds)
    assert [r.getMessage().split("; ")[-1] for r in caplog.records] == [
        "about 42 s left", "about 30 s left", "about 18 s left", "about 6 s left"]
    assert {r.levelname for r in caplog.records} == {"INFO"}


def test_the_cuda_engine_sleeps_no_emulated_latency():
    options = {"engine_options": EngineOptions(latency_s=0.2)}
    assert emulated_latency(RuntimeConfig(engine="auto", **options), "cuda") == 0.0
    assert emulated_latency(RuntimeConfig(engine="auto", **options), "cpu") == 0.2
    assert emulated_latency(RuntimeConfig(engine="thread", **options), "cuda") == 0.2


UNMATCHED = {**CONFIG, "swap_config": {"swap": True, "op_swap": [{"op_name": "nosuchop", "backward_prefetch": 1,
                                                                  "layers": True}]}}


@pytest.mark.parametrize("command", ["plan", "train"])
def test_a_pattern_that_matches_nothing_is_refused_under_budget_as_without(tmp_path, capsys, monkeypatch, command):
    def no_measuring(*args, **kwargs):
        raise AssertionError("measured before checking the input's patterns")

    monkeypatch.setattr("swapkit.planner.command.measure", no_measuring)
    assert main([command, str(write(tmp_path, UNMATCHED)), "--budget", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert "swap_config.op_swap[0].op_name: op_swap pattern 'nosuchop' matches no sub-module in any layer" in err
    assert main(["plan", str(write(tmp_path, UNMATCHED))]) == 2  # plain plan says the same
    assert "op_swap pattern 'nosuchop' matches no sub-module" in capsys.readouterr().err


def test_budget_says_once_that_it_replaces_the_input_sections_and_not_how_to_activate_them(tmp_path, capfd):
    inactive = {**CONFIG, "swap_config": {"swap": False, "layer_swap": [{"backward_prefetch": 1, "layers": [0]}]},
                "recompute_config": {"recompute": False}, "context": {"memory_optimize_level": "O1"}}
    assert main(["plan", str(write(tmp_path, inactive)), "--budget", "1GiB"]) == 0
    err = capfd.readouterr().err
    assert "inactive" not in err and "set swap_config.swap: true" not in err
    assert err.count("WARNING - --budget replaces recompute_config and swap_config with the plan it chooses") == 1
    assert err.count("context.memory_optimize_level has no effect") == 1  # the input's other warnings stay


def test_budget_without_swap_or_recompute_sections_says_nothing_about_them(tmp_path, capfd):
    assert main(["plan", str(write(tmp_path, CONFIG)), "--budget", "1GiB"]) == 0
    assert "--budget replaces" not in capfd.readouterr().err


def test_rounds_are_counted_right_when_the_first_rounds_pick_no_more_modes(monkeypatch, caplog):
    """A pipeline stage with nothing to select logged an empty round for the modes it did not pick: "round 5 of 4 ()"."""
    from swapkit.planner import sampling

    class FakeRun:
        last, scopes = None, []

        def __init__(self, *args):
            pass

        def step_pair(self, number, record):
            pass

        def result(self, factor):
            return ()

        def close(self):
            pass

    monkeypatch.setattr(sampling, "ModeRun", FakeRun)
    monkeypatch.setattr(sampling, "pooled_factor", lambda runs: 1.0)
    with caplog.at_level(logging.DEBUG, logger="swapkit.planner.progress"):  # the CLI tests set its level
        sampling.measure_modes({"keep": None, "probe": None}, lambda tracer, scopes: {}, torch.device("cpu"), [],
                               steps=3, warmup=1, model=None)
    rounds = [r.getMessage() for r in caplog.records if r.getMessage().startswith("measured round ")]
    # the total is known once the warm-up picked the later modes: none here, so their warm-up never runs
    assert [line.split(" (")[0] for line in rounds] == ["measured round 1 of 5"] + [
        f"measured round {n} of 4" for n in range(2, 5)]
    assert all("(keep, probe)" in line for line in rounds)
