"""Layout rules (DESIGN §3): layers -> (pipeline stage, interleave chunk, position in chunk)."""
from __future__ import annotations

import logging

import pytest

from swapkit import ConfigError, load_config
from swapkit.config.errors import Problems
from swapkit.plan.layout import OFFSET_PATH, build_layout


def layout_of(num_layers, stages, chunks=1, offset=0):
    problems = Problems()
    layout = build_layout(num_layers, stages, chunks, offset, problems)
    assert not problems.items, problems.items
    return layout


def offset_error(num_layers, stages, chunks, offset) -> str:
    """Load a config with this layout; return the one ConfigError message it raises."""
    raw = {
        "model": {"model_config": {"num_layers": num_layers, "offset": offset, "pp_interleave_num": chunks}},
        "parallel_config": {"pipeline_stage": stages},
    }
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    return str(info.value)


# ---------------------------------------------------------------- the seed 001 layout

SEED_OFFSET = [[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]


def test_seed001_layout_layer_list_and_accu():
    layout = layout_of(48, 5, 2, SEED_OFFSET)
    assert layout.layer_list == ((4, 5, 5, 5, 5), (5, 5, 5, 5, 4))
    assert layout.layer_accu == ((4, 9, 14, 19, 24), (29, 34, 39, 44, 48))


def test_seed001_layout_ids_and_positions():
    layout = layout_of(48, 5, 2, SEED_OFFSET)
    expected_pp = [0] * 4 + [1] * 5 + [2] * 5 + [3] * 5 + [4] * 5 + [0] * 5 + [1] * 5 + [2] * 5 + [3] * 5 + [4] * 4
    assert list(layout.pp_ids) == expected_pp
    assert list(layout.interleave_ids) == [0] * 24 + [1] * 24
    assert layout.positions[:9] == (0, 1, 2, 3, 0, 1, 2, 3, 4)
    assert layout.positions[24:30] == (0, 1, 2, 3, 4, 0)
    assert layout.positions[44:] == (0, 1, 2, 3)
    assert layout.stage_totals() == (9, 10, 10, 10, 9)
    assert list(layout.chunk_layers(1, 0)) == [24, 25, 26, 27, 28]
    assert layout.chunk_start(0, 1) == 4


def test_seed001_layout_log_lines():
    lines = layout_of(48, 5, 2, SEED_OFFSET).log_lines()
    assert lines[0] == "num_layers per stage: [[4, 5, 5, 5, 5], [5, 5, 5, 5, 4]]"
    assert lines[1] == "Accumulated num_layers per stage: [[4, 9, 14, 19, 24], [29, 34, 39, 44, 48]]"
    assert lines[2].startswith("Pipeline id list with start_stage: [0, 0, 0, 0, 1, 1, 1, 1, 1, 2,")
    assert lines[3].startswith("Interleave id list: [0, 0, ")


# ---------------------------------------------------------------- avg and offset broadcasting

def test_average_without_offset():
    layout = layout_of(12, 3, 2)
    assert layout.layer_list == ((2, 2, 2), (2, 2, 2))
    assert layout.layer_accu == ((2, 4, 6), (8, 10, 12))
    assert layout.pp_ids == (0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2)
    assert layout.interleave_ids == (0,) * 6 + (1,) * 6
    assert layout.positions == (0, 1) * 6


def test_scalar_offset_broadcasts_to_every_cell():
    # A scalar s adds s to all P*V cells, so with P*V > 1 only s == 0 can add up to L; a nonzero
    # scalar shows its broadcast grid in the error.
    assert layout_of(6, 2, 1, 0).layer_list == ((3, 3),)
    problems = Problems()
    assert build_layout(9, 2, 1, 1, problems) is None
    assert "layers per chunk [[5, 5]] add up to 10, not num_layers (9)" in str(problems.items[0])
    problems = Problems()
    assert build_layout(12, 2, 2, -1, problems) is None
    assert "layers per chunk [[2, 2], [2, 2]] add up to 8, not num_layers (12)" in str(problems.items[0])
    assert problems.items[0].path == OFFSET_PATH


def test_one_dimensional_offset_broadcasts_to_every_interleave_row():
    # L=10, P=2, V=2: avg 2, remainder 2; offset [1, 0] adds 1 to stage 0 of both rows.
    layout = layout_of(10, 2, 2, [1, 0])
    assert layout.layer_list == ((3, 2), (3, 2))
    assert layout.layer_accu == ((3, 5), (8, 10))
    assert layout.pp_ids == (0, 0, 0, 1, 1, 0, 0, 0, 1, 1)
    assert layout.interleave_ids == (0,) * 5 + (1,) * 5


def test_two_dimensional_offset_used_as_is():
    layout = layout_of(10, 2, 2, [[1, 0], [0, 1]])
    assert layout.layer_list == ((3, 2), (2, 3))
    assert layout.layer_accu == ((3, 5), (7, 10))
    assert layout.positions == (0, 1, 2, 0, 1, 0, 1, 0, 1, 2)


def test_one_stage_interleaved():
    layout = layout_of(5, 1, 2, [[1], [0]])
    assert layout.layer_list == ((3,), (2,))
    assert layout.pp_ids == (0,) * 5
    assert layout.interleave_ids == (0, 0, 0, 1, 1)


def test_first_and_last_chunks_may_be_empty():
    layout = layout_of(8, 4, 1, [-2, 1, 1, 0])
    assert layout.layer_list == ((0, 3, 3, 2),)
    assert layout.pp_ids == (1, 1, 1, 2, 2, 2, 3, 3)
    assert layout.positions == (0, 1, 2, 0, 1, 2, 0, 1)
    layout = layout_of(8, 4, 1, [1, 1, 0, -2])
    assert layout.layer_list == ((3, 3, 2, 0),)
    assert layout.pp_ids == (0, 0, 0, 1, 1, 1, 2, 2)


@pytest.mark.parametrize("offset", [0, 7, -3, [5], [[2]]])
def test_offset_ignored_without_pipeline_or_interleave(offset):
    layout = layout_of(4, 1, 1, offset)
    assert layout.layer_list == ((4,),)
    assert layout.layer_accu == ((4,),)
    assert layout.pp_ids == (0, 0, 0, 0)
    assert layout.positions == (0, 1, 2, 3)


def test_offset_ignored_through_load_config():
    config = load_config({"model": {"model_config": {"num_layers": 3, "offset": 5}}})
    assert config.model.offset == 5  # kept as written, ignored by the layout


@pytest.mark.parametrize("offset, warned", [(5, True), ([[2]], True), (0, False), ([0], False)])
def test_an_ignored_offset_is_warned(caplog, offset, warned):
    """MindFormers ignores the offset with one stage and one chunk; a non-zero one then did nothing, silently."""
    with caplog.at_level(logging.WARNING, logger="swapkit"):
        load_config({"model": {"model_config": {"num_layers": 3, "offset": offset}}})
    message = (f"model.model_config.offset: {offset} has no effect with pipeline_stage 1 and pp_interleave_num 1 "
               "(one chunk holds every layer; ignored, as in MindFormers); remove it, or set pipeline_stage or "
               "pp_interleave_num above 1")
    assert (message in caplog.messages) is warned


# ---------------------------------------------------------------- errors name model.model_config.offset

def test_offset_path_constant():
    assert OFFSET_PATH == "model.model_config.offset"


@pytest.mark.parametrize(
    "stages, chunks, offset, fragment",
    [
        (4, 1, [1, 2], "It has 2 entries but pipeline_stage is 4"),
        (2, 2, [[0, 0], [0, 0], [0, 0]], "Found 3 rows of lengths [2, 2, 2]"),
        (2, 2, [[0, 0], [0, 0, 0]], "Found 2 rows of lengths [2, 3]"),
        (2, 1, "two", "expected an integer, a list of 2 integers (one per stage) or a [1][2] grid"),
        (2, 1, True, "got true; expected an integer"),
        (2, 1, [0.5, -0.5], "got [0.5, -0.5]"),
        (2, 2, [[0, 0], 0], "a [2][2] grid"),
    ],
)
def test_bad_offset_shape(stages, chunks, offset, fragment):
    message = offset_error(8, stages, chunks, offset)
    assert "model.model_config.offset: got" in message
    assert fragment in message


def test_wrong_sum_names_the_remainder():
    assert layout_of(11, 2, 2, [[1, 1], [1, 0]]).layer_list == ((3, 3), (3, 2))
    message = offset_error(11, 2, 2, [[1, 1], [1, 1]])
    assert "model.model_config.offset: layers per chunk [[3, 3], [3, 3]] add up to 12, not num_layers (11)" in message
    assert "num_layers % (pipeline_stage * pp_interleave_num) = 3" in message


def test_sum_is_checked_after_broadcasting():
    # MindFormers checks sum(offset) == L % (P*V) before broadcasting: [1, 0] passes its check
    # for L=9, P=2, V=2 (9 % 4 = 1) but broadcasts to 10 slots. We refuse it.
    message = offset_error(9, 2, 2, [1, 0])
    assert "model.model_config.offset: layers per chunk [[3, 2], [3, 2]] add up to 10, not num_layers (9)" in message


def test_negative_chunk():
    message = offset_error(8, 4, 1, [3, -3, 0, 0])
    assert ("model.model_config.offset: got [[5, -1, 2, 2]]; expected no chunk with a negative number of layers"
            in message)


def test_empty_interior_chunk():
    message = offset_error(8, 4, 1, [1, -2, 1, 0])
    assert "model.model_config.offset: layers per chunk [[3, 0, 3, 2]] leave chunk(s) [1] (row-major) empty" in message


def test_empty_interior_chunk_across_interleave_rows():
    # row-major flat index 2 is chunk (1, 0): empty although it is the first cell of its row
    message = offset_error(8, 2, 2, [[1, 1], [-2, 0]])
    assert "leave chunk(s) [2] (row-major) empty" in message
    assert message.count("model.model_config.offset") == 1


# ---------------------------------------------------------------- fewer layers than chunks

def test_more_stages_than_layers_says_so_before_any_offset_arithmetic(capsys):
    from swapkit.cli import main

    assert main(["plan", "configs/tiny.yaml", "--set", "parallel_config.pipeline_stage=8"]) == 2
    err = capsys.readouterr().err
    assert ("  - parallel_config.pipeline_stage (from --set parallel_config.pipeline_stage=8): got 8; expected no more chunks (pipeline_stage x pp_interleave_num "
            "= 8 x 1 = 8) than model.model_config.num_layers (4) can fill: 8 chunks need num_layers >= 8, one layer "
            "per chunk with offset 0. Set parallel_config.pipeline_stage to at most 4, or num_layers to at least 8"
            ) in err, err
    assert "add up to" not in err and "(1 problem)" in err


def test_interleave_chunks_count_too():
    message = offset_error(4, 2, 3, 0)
    assert "parallel_config.pipeline_stage: got 2; expected no more chunks (pipeline_stage x pp_interleave_num = " \
           "2 x 3 = 6) than model.model_config.num_layers (4)" in message
    assert "Set parallel_config.pipeline_stage to at most 1 (or lower model.model_config.pp_interleave_num), or " \
           "num_layers to at least 6" in message and OFFSET_PATH not in message


def test_with_offsets_only_the_first_and_last_chunk_may_be_empty():
    message = offset_error(4, 8, 1, [0, 1, 1, 1, 1, 0, 0, 0])
    assert "8 chunks need num_layers >= 6, whatever the offset, only the first and the last chunk may be empty. " \
           "Set parallel_config.pipeline_stage to at most 6, or num_layers to at least 6" in message
    assert layout_of(6, 8, 1, [0, 1, 1, 1, 1, 1, 1, 0]).layer_list == ((0, 1, 1, 1, 1, 1, 1, 0),)  # 6 still fits
    assert layout_of(8, 8).layer_list == ((1,) * 8,)


def test_too_few_layers_and_a_malformed_offset_are_both_reported():
    message = offset_error(4, 8, 1, [1, 2])
    assert "(2 problems)" in message and "model.model_config.offset: got [1, 2]" in message
    assert "parallel_config.pipeline_stage: got 8" in message and "num_layers >= 6" in message
