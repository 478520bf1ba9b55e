"""Note [Two readings of a recompute list]: whenever a recompute list may be read in the meaning it was
not written for, a warning shows what it selects as per-stage counts and as layer indices."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from swapkit.config.errors import ConfigError
from swapkit.load import load_config
from swapkit.plan.plan import build_plan

ROOT = Path(__file__).resolve().parents[1]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_swap_on_over_per_stage_counts_shows_both_readings(caplog):
    caplog.set_level(logging.WARNING, logger="swapkit")
    config = load_config({"model": {"model_config": {"num_layers": 4}}, "parallel_config": {"pipeline_stage": 2},
                          "recompute_config": {"recompute": [2, 2]}, "swap_config": {"swap": True}})
    assert [layer.full for layer in build_plan(config).layers] == [False, False, True, False]  # indices win
    assert _warnings(caplog) == [
        "recompute_config.recompute: [2, 2] reads like per-stage counts (a repeated value), but swap_config.swap is on, so MindFormers reads it as global layer indices: with swap off, "
        "per-stage counts selecting layers [0, 1, 2, 3]; with swap on, global layer indices selecting layers [2]. "
        "If you meant counts, set swap_config.swap: false; if you meant indices, list each layer once"]


def test_an_index_past_the_last_layer_also_shows_both_readings(caplog):
    caplog.set_level(logging.WARNING, logger="swapkit")
    config = load_config({"model": {"model_config": {"num_layers": 4}}, "parallel_config": {"pipeline_stage": 2},
                          "recompute_config": {"select_recompute": {"feed_forward": [1, 5]}},
                          "swap_config": {"swap": True}})
    readings = [m for m in _warnings(caplog) if "reads like per-stage counts" in m]
    assert len(readings) == 1
    assert "with swap off, per-stage counts selecting feed_forward on layers [0, 2, 3]" in readings[0]
    assert "with swap on, global layer indices selecting feed_forward on layers [1]" in readings[0]
    # MindFormers' own rule stays: the index is kept as written and matches no layer
    assert any("layer indices [5] match no layer" in m for m in build_plan(config).warnings)


def test_indices_that_read_as_indices_are_not_warned(caplog):
    caplog.set_level(logging.WARNING, logger="swapkit")
    load_config({"model": {"model_config": {"num_layers": 4}}, "parallel_config": {"pipeline_stage": 2},
                 "recompute_config": {"recompute": [0, 3], "select_recompute": {"feed_forward": [1, 2]}},
                 "swap_config": {"swap": True}})
    assert _warnings(caplog) == []


def test_a_list_invalid_as_counts_says_so(caplog):
    caplog.set_level(logging.WARNING, logger="swapkit")
    load_config({"model": {"model_config": {"num_layers": 4}}, "recompute_config": {"recompute": [1, 1]},
                 "swap_config": {"swap": True}})
    assert ("with swap off, per-stage counts selecting nothing (the list is not valid in this reading); with swap "
            "on, global layer indices selecting layers [1]") in _warnings(caplog)[0]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_no_shipped_config_is_read_in_a_doubtful_meaning(path, caplog):
    caplog.set_level(logging.WARNING, logger="swapkit")
    load_config(path)
    assert not [m for m in _warnings(caplog) if "reads like per-stage counts" in m or "changes what" in m]


def test_swap_off_over_more_entries_than_stages_points_at_swap_mode():
    with pytest.raises(ConfigError) as info:
        load_config({"model": {"model_config": {"num_layers": 4}}, "recompute_config": {"recompute": [0, 3]}})
    assert "recompute_config.recompute: got [0, 3]; expected at most pipeline_stage (1) per-stage counts" in str(
        info.value)
    assert "if these are layer indices, set swap_config.swap: true" in str(info.value)
