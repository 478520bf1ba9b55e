"""What ``swapkit plan --budget`` tells the user: about their config, never about the planner's own runs."""
from __future__ import annotations

import logging

import pytest
import yaml

from swapkit.cli import main
from swapkit.config.types import RuntimeConfig
from swapkit.planner.quiet import held_warnings, setting_warnings

CONFIG = {
    "model": {"model_config": {"num_layers": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 88,
                               "vocab_size": 64, "seq_length": 32}},
    "runtime": {"engine": "thread", "min_offload_bytes": 1024},
    "train": {"steps": 3, "batch_size": 2, "lr": 1e-3},
}


@pytest.fixture(autouse=True)
def restore_swapkit_logger():
    logger = logging.getLogger("swapkit")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


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
