r"""Normalization (DESIGN §3): count values, pattern dicts and swap mode (swap_config: test_normalize_swap.py).

Every expected grid is written out by hand from the rules in DESIGN §3 (and, for the seed 001
example, copied from the seed's log).
"""
from __future__ import annotations

import pytest

from swapkit import ConfigError, build_plan, load_config
from swapkit.config.errors import Problems
from swapkit.plan.layout import build_layout
from swapkit.plan.normalize import DEFAULT_COMM, DEFAULT_SELECT, normalize_counts

SEED_OFFSET = [[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
SEED_LIST = ((4, 5, 5, 5, 5), (5, 5, 5, 5, 4))
ZEROS_5x2 = ((0, 0, 0, 0, 0), (0, 0, 0, 0, 0))


def raw_config(num_layers=4, stages=1, chunks=1, offset=0, recompute=None, swap=None) -> dict:
    raw = {
        "model": {"model_config": {"num_layers": num_layers, "offset": offset, "pp_interleave_num": chunks}},
        "parallel_config": {"pipeline_stage": stages},
    }
    if recompute is not None:
        raw["recompute_config"] = recompute
    if swap is not None:
        raw["swap_config"] = swap
    return raw


def formative(**kwargs):
    return build_plan(load_config(raw_config(**kwargs))).formative


def seed_formative(recompute=None, swap=None):
    return formative(num_layers=48, stages=5, chunks=2, offset=SEED_OFFSET, recompute=recompute, swap=swap)


def error(**kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(raw_config(**kwargs))
    return str(info.value)


def seed_layout():
    return build_layout(48, 5, 2, SEED_OFFSET, Problems())


def counts(value, layout=None):
    problems = Problems()
    grid = normalize_counts(value, layout or seed_layout(), "recompute_config.recompute", problems)
    assert not problems.items, problems.items
    return grid


# ---------------------------------------------------------------- seed 001, recompute

def test_seed001_recompute_true_is_layer_list():
    assert seed_formative({"recompute": True}).layer_recompute == SEED_LIST


def test_seed001_recompute_per_stage_is_dealt_over_chunks():
    assert seed_formative({"recompute": [2, 1, 0, 0, 0]}).layer_recompute == ((1, 1, 0, 0, 0), (1, 0, 0, 0, 0))


def test_seed001_recompute_per_chunk_unchanged():
    grid = [[1, 0, 0, 0, 0], [2, 1, 0, 0, 0]]
    assert seed_formative({"recompute": grid}).layer_recompute == ((1, 0, 0, 0, 0), (2, 1, 0, 0, 0))


SEED_SELECT = {
    r"feed_forward\.w1\.activation\.silu": True,
    r"feed_forward\.mul": True,
    r"feed_forward\.w1\.matmul": [[1, 0, 0, 0, 0], [2, 1, 0, 0, 0]],
    r"feed_forward\.w3\.matmul": [2, 1, 0, 0, 0],
}
SEED_COMM = [r"ffn_norm\.norm", r"attention_norm\.norm"]

# Copied from seed 001. The seed is markdown that lost one backslash of Python's repr: MindFormers
# logs repr(dict), which doubles every backslash (DESIGN §3 shows 'feed_forward\\.mul'). Before
# comparing we turn our doubled backslashes into single ones, which is what the seed shows.
SEED_LOG_SELECT = (
    r"Formative select_recompute: {'feed_forward\.w1\.activation\.silu': [[4, 5, 5, 5, 5], [5, 5, 5, 5, 4]], "
    r"'feed_forward\.mul': [[4, 5, 5, 5, 5], [5, 5, 5, 5, 4]], 'feed_forward\.w1\.matmul': [[1, 0, 0, 0, 0], "
    r"[2, 1, 0, 0, 0]], 'feed_forward\.w3\.matmul': [[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]}"
)
SEED_LOG_COMM = (
    r"Formative select_comm_recompute: {'ffn_norm\.norm': [[4, 5, 5, 5, 5], [5, 5, 5, 5, 4]], "
    r"'attention_norm\.norm': [[4, 5, 5, 5, 5], [5, 5, 5, 5, 4]]}"
)
SEED_LOG_LAYER = "Formative layer_recompute: [[2, 1, 0, 0, 0], [1, 0, 0, 0, 0]]"


def squash(line: str) -> str:
    """Compare modulo whitespace and modulo repr's doubled backslashes (see above)."""
    return "".join(line.replace("\\\\", "\\").split())


def test_seed001_select_and_comm_formative_values():
    result = seed_formative({"recompute": [[2, 1, 0, 0, 0], [1, 0, 0, 0, 0]], "select_recompute": SEED_SELECT,
                             "select_comm_recompute": SEED_COMM})
    assert result.layer_recompute == ((2, 1, 0, 0, 0), (1, 0, 0, 0, 0))
    assert list(result.select_recompute) == list(SEED_SELECT)  # order as written
    assert result.select_recompute[r"feed_forward\.w3\.matmul"] == ((1, 1, 0, 0, 0), (1, 0, 0, 0, 0))
    assert result.select_recompute[r"feed_forward\.w1\.matmul"] == ((1, 0, 0, 0, 0), (2, 1, 0, 0, 0))
    assert result.select_comm_recompute == {SEED_COMM[0]: SEED_LIST, SEED_COMM[1]: SEED_LIST}


def test_seed001_formative_log_lines_match_the_seed():
    result = seed_formative({"recompute": [[2, 1, 0, 0, 0], [1, 0, 0, 0, 0]], "select_recompute": SEED_SELECT,
                             "select_comm_recompute": SEED_COMM})
    lines = result.log_lines(swap_on=False)
    assert lines[0] == SEED_LOG_LAYER
    assert squash(lines[1]) == squash(SEED_LOG_SELECT)
    assert squash(lines[2]) == squash(SEED_LOG_COMM)
    # and we really print repr (doubled backslashes), as MindFormers does
    assert "{'feed_forward\\\\.w1\\\\.activation\\\\.silu': [[4, 5, 5, 5, 5]" in lines[1]
    assert lines[3:] == ["Formative select_recompute_exclude: {}", "Formative select_comm_recompute_exclude: {}"]


# ---------------------------------------------------------------- count values

def test_true_and_false():
    assert counts(True) == SEED_LIST
    assert counts(False) == ZEROS_5x2


def test_per_stage_count_is_clipped_to_the_stage_total():
    # stage 0 holds 4 + 5 = 9 layers, stage 1 holds 10
    assert counts([100, 3]) == ((4, 2, 0, 0, 0), (5, 1, 0, 0, 0))


def test_round_robin_skips_full_chunks():
    # one stage, two chunks of 3 and 7 layers: 8 layers dealt c0, c1, c0, c1, c0, c1, c1, c1
    layout = build_layout(10, 1, 2, [[-2], [2]], Problems())
    assert layout.layer_list == ((3,), (7,))
    assert counts([8], layout) == ((3,), (5,))
    assert counts([6], layout) == ((3,), (3,))
    assert counts([1], layout) == ((1,), (0,))


def test_per_stage_list_shorter_than_pipeline_stage():
    assert counts([3]) == ((2, 0, 0, 0, 0), (1, 0, 0, 0, 0))
    assert counts([]) == ZEROS_5x2


def test_bools_inside_a_per_stage_list():
    assert counts([True, False, 2, 0, True]) == ((4, 0, 1, 0, 5), (5, 0, 1, 0, 4))


def test_per_chunk_grid_is_clipped_per_cell():
    assert counts([[9, 1, 0, 0, 0], [0, 0, 0, 0, 9]]) == ((4, 1, 0, 0, 0), (0, 0, 0, 0, 4))


def test_per_chunk_grid_bools_per_cell_and_per_row():
    assert counts([[True, False, 0, 0, 0], [0, 0, 0, 0, True]]) == ((4, 0, 0, 0, 0), (0, 0, 0, 0, 4))
    assert counts([True, [1, 0, 0, 0, 0]]) == ((4, 5, 5, 5, 5), (1, 0, 0, 0, 0))
    assert counts([[0, 0, 0, 0, 2], False]) == ((0, 0, 0, 0, 2), (0, 0, 0, 0, 0))


def test_list_of_strings_as_recompute_means_all_layers():
    assert seed_formative({"recompute": ["attention", "feed_forward"]}).layer_recompute == SEED_LIST


def test_negative_per_stage_count_is_an_error():
    message = error(num_layers=4, stages=2, recompute={"recompute": [1, -1]})
    assert "recompute_config.recompute: got [1, -1]; expected counts >= 0" in message
    assert "Negative counts [-1] are not allowed" in message


def test_negative_per_chunk_count_names_the_row():
    message = error(num_layers=8, stages=2, chunks=2, recompute={"select_recompute": {"attention": [[0, 0], [0, -2]]}})
    assert "recompute_config.select_recompute.attention[1]: got [0, -2]; expected counts >= 0" in message


def test_list_longer_than_pipeline_stage_is_an_error():
    message = error(num_layers=4, stages=2, recompute={"recompute": [1, 1, 1]})
    assert "recompute_config.recompute: got [1, 1, 1]; expected at most pipeline_stage (2) per-stage counts" in message


@pytest.mark.parametrize("grid", [
    [[1, 1], [1, 1], [1, 1]],  # 3 rows for pp_interleave_num 2
    [[1, 1, 1], [1, 1]],  # a row of 3 for pipeline_stage 2
    [[1, "x"], [1, 1]],  # a string cell
    [[1, 1.5], [1, 1]],  # a float cell
])
def test_wrong_grid_shape_is_an_error(grid):
    message = error(num_layers=8, stages=2, chunks=2, recompute={"recompute": grid})
    assert "recompute_config.recompute: got " in message
    assert "expected a [2][2] grid (pp_interleave_num rows of pipeline_stage counts" in message


@pytest.mark.parametrize("value", [3, "all", 1.0, None, {"a": 1}, [1, "a"], [[[1]]]])
def test_other_count_values_are_errors(value):
    message = error(num_layers=4, stages=2, recompute={"recompute": value})
    assert "recompute_config.recompute: got " in message


# ---------------------------------------------------------------- select / comm dicts

def test_default_patterns():
    assert DEFAULT_SELECT == (r"feed_forward\.mul", r"feed_forward\.w1\.activation\.silu")
    assert DEFAULT_COMM == (r".*\.norm",)
    result = formative(recompute={"select_recompute": True, "select_comm_recompute": [2]})
    assert result.select_recompute == {r"feed_forward\.mul": ((4,),), r"feed_forward\.w1\.activation\.silu": ((4,),)}
    assert result.select_comm_recompute == {r".*\.norm": ((2,),)}


def test_defaults_with_a_per_chunk_grid():
    result = seed_formative({"select_comm_recompute": [[1, 0, 0, 0, 0], [0, 0, 0, 0, 9]]})
    assert result.select_comm_recompute == {r".*\.norm": ((1, 0, 0, 0, 0), (0, 0, 0, 0, 4))}


def test_false_gives_the_defaults_with_zero_counts():
    result = formative(recompute={"select_recompute": False})
    assert result.select_recompute == {r"feed_forward\.mul": ((0,),), r"feed_forward\.w1\.activation\.silu": ((0,),)}


def test_list_of_strings_names_the_patterns_for_all_layers():
    result = formative(num_layers=6, stages=2, recompute={"select_recompute": ["attention", r"feed_forward\.w2"]})
    assert result.select_recompute == {"attention": ((3, 3),), r"feed_forward\.w2": ((3, 3),)}


def test_dict_maps_each_key_in_order():
    result = formative(num_layers=6, stages=2, recompute={
        "select_recompute": {"zeta": [1], "alpha": True, "mid": [[2, 0]]},
        "select_comm_recompute": {r"attention_norm\.norm": [0, 1]},
    })
    assert list(result.select_recompute) == ["zeta", "alpha", "mid"]
    assert result.select_recompute == {"zeta": ((1, 0),), "alpha": ((3, 3),), "mid": ((2, 0),)}
    assert result.select_comm_recompute == {r"attention_norm\.norm": ((0, 1),)}


def test_invalid_regex_in_a_pattern_key():
    message = error(recompute={"select_recompute": {r"feed_forward\.w(1": True}})
    assert "recompute_config.select_recompute.feed_forward\\.w(1: got 'feed_forward\\\\.w(1'" in message
    assert "Component 'w(1' does not compile" in message


def test_empty_component_in_a_pattern_key():
    message = error(recompute={"select_comm_recompute": [r"ffn_norm\.\.norm"]})
    assert "recompute_config.select_comm_recompute[0]" in message
    assert "no empty component" in message


def test_bad_value_inside_a_dict_names_the_key():
    message = error(num_layers=4, stages=2, recompute={"select_recompute": {"attention": [1, 2, 3]}})
    assert "recompute_config.select_recompute.attention: got [1, 2, 3]; expected at most pipeline_stage (2)" in message


# ---------------------------------------------------------------- excludes

def test_exclude_removes_the_same_pattern():
    result = formative(recompute={"select_recompute": True, "select_recompute_exclude": {r"feed_forward\.mul": True}})
    assert list(result.select_recompute) == [r"feed_forward\.w1\.activation\.silu"]
    assert result.select_recompute_exclude == {r"feed_forward\.mul": ((4,),)}


def test_exclude_regex_matches_select_literal():
    result = formative(recompute={"select_recompute": [r"feed_forward\.mul", r"feed_forward\.w2", "attention"],
                                  "select_recompute_exclude": [r"feed_forward\.w.*"]})
    assert list(result.select_recompute) == [r"feed_forward\.mul", "attention"]


def test_select_regex_matches_exclude_literal():
    # the select pattern .*\.norm fullmatches the exclude's components ffn_norm, norm
    result = formative(recompute={"select_comm_recompute": True, "select_comm_recompute_exclude": [r"ffn_norm\.norm"]})
    assert result.select_comm_recompute == {}
    assert result.select_comm_recompute_exclude == {r"ffn_norm\.norm": ((4,),)}


def test_exclude_needs_the_same_number_of_components():
    result = formative(recompute={"select_recompute": [r"feed_forward\.mul", "feed_forward"],
                                  "select_recompute_exclude": [r".*"]})
    assert list(result.select_recompute) == [r"feed_forward\.mul"]


def test_exclude_only_touches_its_own_setting():
    result = formative(recompute={"select_recompute": ["attention"], "select_comm_recompute": ["attention"],
                                  "select_recompute_exclude": ["attention"]})
    assert result.select_recompute == {}
    assert result.select_comm_recompute == {"attention": ((4,),)}


def test_exclude_is_global_whatever_its_counts():
    # Deliberate (MindFormers' LayerSetting): an exclude removes the pattern for every layer, even
    # with counts that select no layer; excludes have no defaults and use count semantics.
    result = formative(num_layers=4, stages=2, recompute={
        "select_recompute": {"attention": True}, "select_recompute_exclude": {"attention": [0, 0]}})
    assert result.select_recompute == {}
    assert result.select_recompute_exclude == {"attention": ((0, 0),)}
    assert result.log_lines(swap_on=False)[0] == (
        "The pattern attention in select_recompute conflicts with select_recompute_exclude and will be removed.")


def test_exclude_default_is_empty():
    result = formative(recompute={"select_recompute_exclude": True, "select_comm_recompute_exclude": [1]})
    assert result.select_recompute_exclude == {} and result.select_comm_recompute_exclude == {}
    assert list(result.select_recompute) == list(DEFAULT_SELECT)


def plan_warnings(**kwargs) -> tuple[str, ...]:
    return build_plan(load_config(raw_config(**kwargs))).warnings


IDLE = ("removes no {kind} pattern that recomputes a layer ({what}): it does nothing. An exclude removes each "
        "{kind} pattern with as many dot-separated parts, each part fullmatching the other's; fix the pattern, or "
        "remove it")


@pytest.mark.parametrize("recompute, swap, warning", [
    # misspelt: it names none of the patterns
    ({"select_recompute": True, "select_recompute_exclude": ["feed_forward.mull"]}, None,
     "recompute_config.select_recompute_exclude: 'feed_forward.mull' " + IDLE.format(
         kind="select_recompute", what=r"the patterns that do: feed_forward\.mul, feed_forward\.w1\.activation\.silu")),
    # names a pattern of the other key
    ({"select_comm_recompute": True, "select_recompute": ["attention"], "select_recompute_exclude": [r"ffn_norm\.norm"]},
     None, r"recompute_config.select_recompute_exclude: 'ffn_norm\\.norm' " + IDLE.format(
         kind="select_recompute", what="the patterns that do: attention")),
    # names a pattern whose counts select no layer (select_recompute is off)
    ({"select_recompute_exclude": [r"feed_forward\.mul"]}, None,
     r"recompute_config.select_recompute_exclude: 'feed_forward\\.mul' " + IDLE.format(
         kind="select_recompute", what="select_recompute recomputes no layer that is not fully recomputed")),
    # full recompute wins on every layer the pattern selects
    ({"recompute": True, "select_comm_recompute": True, "select_comm_recompute_exclude": [r".*\.norm"]}, None,
     r"recompute_config.select_comm_recompute_exclude: '.*\\.norm' " + IDLE.format(
         kind="select_comm_recompute", what="select_comm_recompute recomputes no layer that is not fully recomputed")),
    # swap mode: global indices, the pattern's list names no layer
    ({"select_recompute": {"attention": [], "feed_forward": [2]}, "select_recompute_exclude": ["attention"]},
     {"swap": True, "op_swap": []}, "recompute_config.select_recompute_exclude: 'attention' " + IDLE.format(
         kind="select_recompute", what="the patterns that do: feed_forward")),
])
def test_an_exclude_that_removes_nothing_is_warned(recompute, swap, warning):
    """Note [Excludes that remove nothing]"""
    warnings = plan_warnings(recompute=recompute, swap=swap)
    assert warnings == (warning,), warnings


@pytest.mark.parametrize("recompute, swap, warning", [
    # full recompute wins on every layer the pattern selects (MindFormers files often carry both)
    ({"recompute": True, "select_recompute": {"feed_forward": True}}, None,
     "recompute_config.select_recompute.feed_forward: every layer it selects [0, 1, 2, 3] is fully recomputed, and "
     "full recompute wins: it recomputes nothing; take those layers out of recompute where this op alone should be "
     "recomputed, or remove the pattern"),
    # counts that select no layer
    ({"select_comm_recompute": [r"ffn_norm\.norm"], "select_recompute": {"attention": [0]}}, None,
     "recompute_config.select_recompute.attention: its counts [0] select no layer: it recomputes nothing; give "
     "the layers to recompute, or remove the pattern"),
    # swap mode: an empty list of layer indices
    ({"select_recompute": {"attention": [], "feed_forward": [2]}}, {"swap": True, "op_swap": []},
     "recompute_config.select_recompute.attention: its layer indices [] select no layer: it recomputes nothing; "
     "give the layers to recompute, or remove the pattern"),
])
def test_a_written_select_pattern_that_recomputes_nothing_is_warned(recompute, swap, warning):
    """Note [Select patterns that recompute nothing]: the pattern was written, and does nothing."""
    warnings = plan_warnings(recompute=recompute, swap=swap)
    assert warnings == (warning,), warnings


def test_default_select_patterns_that_recompute_nothing_are_not_warned():
    """``select_recompute: false`` or counts of 0 turn the default patterns off: that is no mistake."""
    assert plan_warnings(recompute={"recompute": True, "select_recompute": True, "select_comm_recompute": [0]}) == ()


def test_an_exclude_written_as_true_or_counts_names_no_pattern():
    assert plan_warnings(recompute={"select_recompute": True, "select_recompute_exclude": True}) == (
        "recompute_config.select_recompute_exclude: true names no pattern (an exclude has no default patterns): it "
        "does nothing; list the patterns to exclude, or remove it",)


def test_excludes_that_remove_a_recomputing_pattern_are_not_warned():
    assert plan_warnings(recompute={"select_recompute": True, "select_recompute_exclude": [r"feed_forward\.mul"],
                                    "select_comm_recompute": True, "select_comm_recompute_exclude": [r"ffn_norm\.norm"],
                                    "recompute": [1]}) == ()


def test_use_reentrant_where_nothing_is_recomputed_is_warned():
    expected = ("recompute_config.use_reentrant: true has no effect: this config recomputes no layer and no op; set "
                "recompute (or select_recompute) to recompute, or remove use_reentrant",)
    assert plan_warnings(recompute={"use_reentrant": True}) == expected
    assert plan_warnings(recompute={"use_reentrant": True, "select_comm_recompute": [1]}) == ()
    megatron = {"recompute_granularity": "selective", "recompute_modules": ["mlp"], "use_reentrant": True}
    assert plan_warnings(recompute=megatron) == ()


# ---------------------------------------------------------------- swap mode: global layer indices

SWAP_ON = {"swap": True, "op_swap": []}


def test_swap_mode_recompute_indices():
    result = formative(num_layers=6, stages=2, recompute={"recompute": [0, 5, 3]}, swap=SWAP_ON)
    assert result.layer_recompute == (0, 5, 3)
    assert formative(num_layers=6, recompute={"recompute": True}, swap=SWAP_ON).layer_recompute is True
    assert formative(num_layers=6, recompute={"recompute": False}, swap=SWAP_ON).layer_recompute == ()


def test_swap_mode_select_dict_and_defaults():
    result = formative(num_layers=4, recompute={"select_recompute": {"feed_forward": [0, 3], "attention": [1]},
                                                "select_comm_recompute": [1]}, swap=SWAP_ON)
    assert result.select_recompute == {"feed_forward": (0, 3), "attention": (1,)}
    assert result.select_comm_recompute == {r".*\.norm": (1,)}
    assert formative(recompute={"select_recompute": False}, swap=SWAP_ON).select_recompute == {
        r"feed_forward\.mul": (), r"feed_forward\.w1\.activation\.silu": ()}


def test_swap_mode_excludes_keep_count_semantics():
    result = formative(num_layers=4, recompute={"select_recompute_exclude": {"attention": [2]}}, swap=SWAP_ON)
    assert result.select_recompute_exclude == {"attention": ((2,),)}


@pytest.mark.parametrize("key, value, path, fix, swap", [
    ("recompute", "True", "recompute_config.recompute", "'True' is text because it is quoted; write true unquoted",
     None),
    ("recompute", "yes", "recompute_config.recompute", "'yes' is text because it is quoted; write true unquoted",
     SWAP_ON),
    ("select_recompute", {"feed_forward": "false"}, "recompute_config.select_recompute.feed_forward",
     "'false' is text because it is quoted; write false unquoted", None),
    ("recompute", ["1", 0], "recompute_config.recompute",
     "'1' is text because it is quoted; write the number unquoted: 1", None),
    ("recompute", ["1", 0], "recompute_config.recompute",
     "'1' is text because it is quoted; write the number unquoted: 1", SWAP_ON),
])
def test_a_quoted_count_or_boolean_says_to_unquote_it(key, value, path, fix, swap):
    """A boolean key given 'true' says to write true; a count value did not (bools given as strings)."""
    message = error(num_layers=4, recompute={key: value}, swap=swap)
    assert f"{path}: got " in message
    assert fix in message


def test_a_select_key_that_is_not_text_is_named_as_a_key_not_a_list_index():
    """``select_recompute: {1: true}`` was reported at ``select_recompute[1]``, which reads as a list index."""
    message = error(recompute={"select_recompute": {1: True, "": True}})
    assert "recompute_config.select_recompute.1: got 1; expected an op pattern" in message
    assert "recompute_config.select_recompute.'': got ''; expected an op pattern" in message
    assert "select_recompute[1]" not in message


def test_swap_mode_exclude_written_as_indices_is_told_it_keeps_counts():
    """An exclude written as layer indices beside a swap-mode select dict was told to "set swap_config.swap:
    true", which it was: the fix must say that excludes keep counts and remove their pattern from every layer."""
    message = error(num_layers=4, recompute={"select_recompute": {"attention": [1]},
                                             "select_recompute_exclude": {"attention": [1, 2]}}, swap=SWAP_ON)
    assert "recompute_config.select_recompute_exclude.attention: got [1, 2]; expected at most pipeline_stage (1)" \
        in message
    assert "set swap_config.swap: true" not in message
    assert ("It has 2; an exclude keeps per-stage counts with swap_config.swap: true (only recompute, "
            "select_recompute and select_comm_recompute take layer indices) and removes its pattern from every "
            "layer whatever its counts: write true") in message


@pytest.mark.parametrize("key, value, path", [
    ("recompute", [[0, 1], [2]], "recompute_config.recompute"),
    ("select_recompute", {"feed_forward": [[0], [1]]}, "recompute_config.select_recompute.feed_forward"),
    ("select_comm_recompute", [[1, 0]], "recompute_config.select_comm_recompute"),
])
def test_swap_mode_two_dimensional_lists_are_errors(key, value, path):
    message = error(num_layers=4, recompute={key: value}, swap=SWAP_ON)
    assert f"{path}: got " in message
    assert "a flat list of global layer indices; 2-D lists are not allowed here" in message


@pytest.mark.parametrize("key", ["select_recompute", "select_comm_recompute"])
@pytest.mark.parametrize("value", [2, "attention", None, 1.5, True, False])
def test_swap_mode_non_list_dict_values_are_errors(key, value):
    # MindFormers' check_rules: "Layer info of select_recompute must be list when enabling swap"
    message = error(num_layers=4, recompute={key: {"feed_forward": value}}, swap=SWAP_ON)
    assert f"recompute_config.{key}.feed_forward: got " in message
    assert f"expected a list of layer indices. MindFormers: Layer info of {key} must be list when enabling swap" \
        in message


def test_swap_mode_out_of_range_indices_are_kept_and_warned():
    # MindFormers keeps them in its Formative lines and they match no layer: a MindFormers file must load.
    plan = build_plan(load_config(raw_config(num_layers=4, recompute={
        "recompute": [0, 4, -1], "select_recompute": {"feed_forward": [7, 1]}}, swap=SWAP_ON)))
    assert plan.formative.layer_recompute == (0, 4, -1)
    assert plan.formative.to_json()["select_recompute"] == {"feed_forward": [7, 1]}
    assert [layer.full for layer in plan.layers] == [True, False, False, False]
    assert [layer.select for layer in plan.layers] == [(), ("feed_forward",), (), ()]
    assert plan.warnings == (
        "recompute_config.recompute: layer indices [4, -1] match no layer (the model has layers 0-3); kept as "
        "written, as MindFormers does, and they do nothing",
        "recompute_config.select_recompute.feed_forward: layer indices [7] match no layer (the model has layers "
        "0-3); kept as written, as MindFormers does, and they do nothing")


def test_swap_mode_bools_are_not_indices():
    message = error(num_layers=4, recompute={"recompute": [True, 1]}, swap=SWAP_ON)
    assert "recompute_config.recompute: got [True, 1]" in message
