"""swap_config normalization (DESIGN §3 "swap_config"): default strategy, layer_swap, op_swap."""
from __future__ import annotations

import logging

import pytest

from swapkit import ConfigError, build_plan, load_config
from swapkit.config.errors import show
from swapkit.plan.normalize import DEFAULT_SWAP_OP, SwapRule


def formative(swap, num_layers=4):
    config = load_config({"model": {"model_config": {"num_layers": num_layers}}, "swap_config": swap})
    return build_plan(config).formative


def error(swap, num_layers=4) -> str:
    with pytest.raises(ConfigError) as info:
        load_config({"model": {"model_config": {"num_layers": num_layers}}, "swap_config": swap})
    return str(info.value)


def test_default_strategy_when_both_lists_are_absent():
    result = formative({"swap": True})
    assert DEFAULT_SWAP_OP == r".*\.flash_attention"
    assert result.layer_swap == ()
    assert result.op_swap == {r".*\.flash_attention": (SwapRule(1, True),)}
    assert formative({"swap": True, "default_prefetch": 10}).op_swap == {
        r".*\.flash_attention": (SwapRule(10, True),)}


def test_default_strategy_log_lines():
    lines = formative({"swap": True, "default_prefetch": 10}).log_lines(swap_on=True)
    assert lines[-2:] == ["Formative layer swap: []",
                          "Formative op swap: {'.*\\\\.flash_attention': [{'backward_prefetch': 10, 'layers': True}]}"]


@pytest.mark.parametrize("swap", [{"swap": True, "op_swap": []}, {"swap": True, "layer_swap": []},
                                  {"swap": True, "layer_swap": [], "op_swap": []}])
def test_explicit_empty_list_disables_the_default(swap):
    result = formative(swap)
    assert result.layer_swap == () and result.op_swap == {}


def test_no_swap_rules_when_swap_is_off():
    result = formative({"swap": False, "layer_swap": [{"backward_prefetch": 2, "layers": [0]}]})
    assert result.layer_swap == () and result.op_swap == {}
    assert result.log_lines(swap_on=False)[-1].startswith("Formative select_comm_recompute_exclude")


def test_layer_swap_list():
    result = formative({"swap": True, "layer_swap": [{"backward_prefetch": 20, "layers": [0, 3]},
                                                          {"backward_prefetch": 5, "layers": [3, 1]}]})
    assert result.layer_swap == (SwapRule(20, (0, 3)), SwapRule(5, (3, 1)))
    assert result.op_swap == {}
    single = formative({"swap": True, "layer_swap": [{"backward_prefetch": 2, "layers": [1]}]})
    assert single.layer_swap == (SwapRule(2, (1,)),)
    assert single.log_lines(True)[-2] == "Formative layer swap: [{'backward_prefetch': 2, 'layers': [1]}]"


@pytest.mark.parametrize("key, entry", [
    ("layer_swap", {"backward_prefetch": 2, "layers": [1]}),
    ("op_swap", {"op_name": "attention", "backward_prefetch": 7, "layers": True}),
])
def test_a_single_mapping_counts_as_a_one_item_list(key, entry):
    """DESIGN §3: ``layer_swap`` / ``op_swap`` take a list or one dict."""
    single = load_config({"model": {"model_config": {"num_layers": 4}}, "swap_config": {"swap": True, key: entry}})
    listed = load_config({"model": {"model_config": {"num_layers": 4}}, "swap_config": {"swap": True, key: [entry]}})
    assert getattr(single.swap, key) == getattr(listed.swap, key) and len(getattr(single.swap, key)) == 1


def test_op_swap_groups_by_op_name_in_order_of_first_appearance():
    result = formative({"swap": True, "op_swap": [
        {"op_name": ["feed_forward", "attention"], "backward_prefetch": 1, "layers": [0]},
        {"op_name": "attention", "backward_prefetch": 2, "layers": [1, 2]},
        {"op_name": r".*\.norm", "backward_prefetch": 3, "layers": True},
        {"op_name": "feed_forward", "backward_prefetch": 4, "layers": [3]},
    ]})
    assert list(result.op_swap) == ["feed_forward", "attention", r".*\.norm"]
    assert result.op_swap["feed_forward"] == (SwapRule(1, (0,)), SwapRule(4, (3,)))
    assert result.op_swap["attention"] == (SwapRule(1, (0,)), SwapRule(2, (1, 2)))
    assert result.op_swap[r".*\.norm"] == (SwapRule(3, True),)


def test_op_swap_one_item_list():
    result = formative({"swap": True, "op_swap": [{"op_name": "attention", "backward_prefetch": 7, "layers": True}]})
    assert result.op_swap == {"attention": (SwapRule(7, True),)}


def test_layers_true_collapses_entries_with_one_prefetch():
    result = formative({"swap": True, "layer_swap": [{"backward_prefetch": 3, "layers": [0]},
                                                          {"backward_prefetch": 3, "layers": True}]})
    assert result.layer_swap == (SwapRule(3, True),)
    result = formative({"swap": True, "op_swap": [
        {"op_name": "attention", "backward_prefetch": 4, "layers": True},
        {"op_name": "attention", "backward_prefetch": 4, "layers": [1]},
        {"op_name": "feed_forward", "backward_prefetch": 9, "layers": [1]},
    ]})
    assert result.op_swap == {"attention": (SwapRule(4, True),), "feed_forward": (SwapRule(9, (1,)),)}


def test_layers_true_with_inconsistent_prefetch_is_an_error():
    message = error({"swap": True, "layer_swap": [{"backward_prefetch": 3, "layers": True},
                                                        {"backward_prefetch": 4, "layers": [1]}]})
    assert "swap_config.layer_swap[1].backward_prefetch: got 4; expected 3 like the other entries" in message
    message = error({"swap": True, "op_swap": [
        {"op_name": "feed_forward", "backward_prefetch": 1, "layers": [0]},
        {"op_name": "attention", "backward_prefetch": 2, "layers": [0]},
        {"op_name": "attention", "backward_prefetch": 5, "layers": True},
    ]})
    assert "swap_config.op_swap[2].backward_prefetch: got 5; expected 2 like the other entries" in message


def test_different_prefetch_without_layers_true_is_fine():
    result = formative({"swap": True, "layer_swap": [{"backward_prefetch": 3, "layers": [0]},
                                                          {"backward_prefetch": 4, "layers": False}]})
    assert result.layer_swap == (SwapRule(3, (0,)), SwapRule(4, ()))


@pytest.mark.parametrize("prefetch", [0, -2, True, 1.5, "3"])
def test_backward_prefetch_must_be_a_positive_int(prefetch):
    message = error({"swap": True, "layer_swap": [{"backward_prefetch": prefetch, "layers": [0]}]})
    assert "swap_config.layer_swap[0].backward_prefetch: got " in message
    assert "expected an integer >= 1" in message
    message = error({"swap": True, "op_swap": [{"op_name": "a", "backward_prefetch": 1, "layers": [0]},
                                                     {"op_name": "a", "backward_prefetch": prefetch, "layers": [1]}]})
    assert "swap_config.op_swap[1].backward_prefetch: got " in message


def test_default_prefetch_must_be_a_positive_int():
    message = error({"swap": True, "default_prefetch": 0})
    assert "swap_config.default_prefetch: got 0; expected an integer >= 1" in message


def test_swap_section_is_validated_when_swap_is_false():
    message = error({"swap": False, "layer_swap": [{"backward_prefetch": 0, "layers": [9]}],
                          "op_swap": [{"op_name": "x(", "backward_prefetch": 3, "layers": True},
                                      {"op_name": "x(", "backward_prefetch": 1, "layers": [0]}]})
    assert "swap_config.layer_swap[0].backward_prefetch: got 0" in message
    assert ("swap_config.layer_swap[0].layers: got [9]; expected global layer indices 0 to 3 (num_layers is 4). "
            "Out of range: [9]; remove them, or list layers below 4") in message
    assert "swap_config.op_swap[0].op_name: got 'x('" in message
    message = error({"swap": False, "op_swap": [{"op_name": "a", "backward_prefetch": 3, "layers": True},
                                                      {"op_name": "a", "backward_prefetch": 1, "layers": [0]}]})
    assert "swap_config.op_swap[1].backward_prefetch: got 1; expected 3 like the other entries" in message


@pytest.mark.parametrize("entry, fragment", [
    ({"backward_prefetch": 1}, "swap_config.layer_swap[0].layers: is required"),
    ({"layers": [0]}, "swap_config.layer_swap[0].backward_prefetch: is required"),
    ({"backward_prefetch": 1, "layers": [0], "op_name": "a"}, "swap_config.layer_swap[0].op_name: unknown key"),
    ({"backward_prefetch": 1, "layer": [0]}, "swap_config.layer_swap[0].layer: unknown key; did you mean 'layers'?"),
    ({"backward_prefetch": 1, "layers": [[0, 1]]}, "2-D lists are not allowed here"),
    ({"backward_prefetch": 1, "layers": 2}, "swap_config.layer_swap[0].layers: got 2"),
    ("layers", "swap_config.layer_swap[0]: got 'layers'; expected a mapping"),
])
def test_bad_layer_swap_entries(entry, fragment):
    assert fragment in error({"swap": True, "layer_swap": [entry]})


def test_a_misspelt_required_key_is_one_problem_not_two():
    """Before: '...backward_prefech: unknown key; did you mean ...' and '...backward_prefetch: is required'."""
    message = error({"swap": True, "layer_swap": [{"backward_prefech": 1, "layers": [0]}],
                     "op_swap": [{"op_name": "a", "layers": [0]}]})
    assert "swap_config.layer_swap[0].backward_prefech: unknown key; did you mean 'backward_prefetch'?" in message
    assert "swap_config.layer_swap[0].backward_prefetch: is required" not in message
    assert "swap_config.op_swap[0].backward_prefetch: is required" in message  # missing, not misspelt


def test_a_misspelt_required_key_past_the_listed_problems_is_still_counted():
    """Past the first 20 problems an unknown key gets no "did you mean", so the key it would name is still
    'is required' (it was dropped: counted nowhere, named nowhere)."""
    from swapkit.config.errors import Problems
    from swapkit.config.swap_entries import read_swap_entries

    problems = Problems()
    for index in range(20):
        problems.add(f"earlier{index}", "some problem")
    read_swap_entries([{"op_nam": "a", "backward_prefetch": 1, "layers": [0]}], "swap_config.op_swap", problems,
                      with_op=True, num_layers=4)
    assert [str(p) for p in problems.items[20:]] == ["swap_config.op_swap[0].op_nam: unknown key",
                                                      "swap_config.op_swap[0].op_name: is required"]


def test_op_swap_needs_op_name():
    message = error({"swap": True, "op_swap": [{"backward_prefetch": 1, "layers": [0]}]})
    assert "swap_config.op_swap[0].op_name: is required" in message
    message = error({"swap": True, "op_swap": [{"op_name": [], "backward_prefetch": 1, "layers": [0]}]})
    assert ("swap_config.op_swap[0].op_name: got []; expected a non-empty string or a non-empty list of strings"
            in message)


def test_swap_lists_of_the_wrong_type():
    message = error({"swap": True, "layer_swap": "all", "op_swap": 3})
    assert "swap_config.layer_swap: got 'all'; expected a list of {backward_prefetch, layers} mappings" in message
    assert "swap_config.op_swap: got 3; expected a list of {op_name, backward_prefetch, layers} mappings" in message


# ---------------------------------------------------------------- Note [Swap settings that do less than written]

def swap_warnings(caplog, swap, num_layers=4) -> list[str]:
    with caplog.at_level(logging.WARNING, logger="swapkit"):
        load_config({"model": {"model_config": {"num_layers": num_layers}}, "swap_config": swap})
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("key, entry", [
    ("layer_swap", {"backward_prefetch": 2, "layers": [0, 3, 0, 3, 1]}),
    ("op_swap", {"op_name": "attention", "backward_prefetch": 2, "layers": [0, 3, 0, 3, 1]}),
])
def test_a_layer_listed_twice_is_warned_once(caplog, key, entry):
    warnings = swap_warnings(caplog, {"swap": True, key: [{**entry, "layers": [2]}, entry]}, num_layers=6)
    assert warnings == [f"swap_config.{key}[1].layers lists layer(s) [0, 3] more than once ([0, 3, 0, 3, 1]); a "
                        "layer is swapped once, the repeats do nothing: list each layer once"]


@pytest.mark.parametrize("key, entry", [
    ("layer_swap", {"backward_prefetch": 2}),
    ("op_swap", {"op_name": "attention", "backward_prefetch": 2}),
])
@pytest.mark.parametrize("layers, shown", [(False, "false"), ([], "[]")])
def test_an_entry_that_names_no_layer_is_warned(caplog, key, entry, layers, shown):
    warnings = swap_warnings(caplog, {"swap": True, key: [{**entry, "layers": [1]}, {**entry, "layers": layers}]})
    assert warnings == [f"swap_config.{key}[1].layers is {shown}: this entry swaps no layer; list the layers it "
                        "should swap (or true for all), or remove the entry"]


def test_overlapping_layer_swap_entries_warn_which_wins(caplog):
    swap = {"swap": True, "layer_swap": [{"backward_prefetch": 20, "layers": [0, 3]},
                                         {"backward_prefetch": 5, "layers": [3, 1]},
                                         {"backward_prefetch": 20, "layers": [0]}]}  # same value: harmless
    assert swap_warnings(caplog, swap) == [
        "swap_config.layer_swap[0] and swap_config.layer_swap[1] both list layer(s) [3] with different "
        "backward_prefetch (20 and 5); the first entry wins: they get backward_prefetch 20 from "
        "swap_config.layer_swap[0], and swap_config.layer_swap[1]'s 5 is ignored for them; list each layer in one entry"]
    plan = build_plan(load_config({"model": {"model_config": {"num_layers": 4}}, "swap_config": swap}))
    assert [layer.layer_swap for layer in plan.layers] == [20, 5, None, 20]  # what the warning says


def test_overlapping_op_swap_entries_warn_per_op_name(caplog):
    swap = {"swap": True, "op_swap": [{"op_name": ["attention", "feed_forward"], "backward_prefetch": 2, "layers": [1]},
                                      {"op_name": "feed_forward", "backward_prefetch": 2, "layers": [1, 2]},
                                      {"op_name": "attention", "backward_prefetch": 9, "layers": [1, 2]}]}
    assert swap_warnings(caplog, swap) == [
        "swap_config.op_swap[0] and swap_config.op_swap[2] for op_name 'attention' both list layer(s) [1] with "
        "different backward_prefetch (2 and 9); the first entry wins: they get backward_prefetch 2 from "
        "swap_config.op_swap[0], and swap_config.op_swap[2]'s 9 is ignored for them; list each layer in one entry"]
    plan = build_plan(load_config({"model": {"model_config": {"num_layers": 4}}, "swap_config": swap}))
    assert plan.layers[1].op_swap == (("attention", 2), ("feed_forward", 2))


def test_many_overlaps_are_counted_not_listed(caplog):
    entries = [{"backward_prefetch": 1 + i, "layers": [0]} for i in range(9)]
    warnings = swap_warnings(caplog, {"swap": True, "layer_swap": entries})
    assert len(warnings) == 5
    assert warnings[-1].endswith("(3 more overlapping pairs of swap_config.layer_swap not listed)")


@pytest.mark.parametrize("lists, given", [
    ({"layer_swap": [{"backward_prefetch": 3, "layers": [0]}]}, "swap_config.layer_swap is given"),
    ({"op_swap": []}, "swap_config.op_swap is given"),  # an empty list turns the default strategy off too
    ({"layer_swap": [], "op_swap": []}, "swap_config.layer_swap and swap_config.op_swap are given"),
])
def test_default_prefetch_next_to_swap_lists_is_warned(caplog, lists, given):
    warnings = swap_warnings(caplog, {"swap": True, "default_prefetch": 10, **lists})
    empty = [key for key, entries in lists.items() if not entries]  # lists that leave nothing to swap at all
    nothing = [f"swap_config.swap is true but swap_config.{' and '.join(empty)} {'are' if len(empty) > 1 else 'is'} "
               "empty and nothing is recomputed: the config changes nothing, every saved tensor stays on the "
               "device; list the layers or ops to swap (or leave the lists out for MindFormers' default op swap)"]
    assert warnings == (nothing if len(empty) == len(lists) else []) + [
        "swap_config.default_prefetch (10) is ignored: it applies only to the default swap strategy "
        f"(swap_config.swap: true with neither layer_swap nor op_swap), as in MindFormers, and {given}; set "
        "backward_prefetch in each entry and remove default_prefetch"]


@pytest.mark.parametrize("swap", [{"swap": False}, {}])  # swap defaults to false
def test_default_prefetch_while_swap_is_off_is_warned(caplog, swap):
    assert swap_warnings(caplog, {**swap, "default_prefetch": 3}) == [
        "swap_config.default_prefetch (3) is inactive because swap_config.swap is false; set swap_config.swap: "
        "true to swap with the default strategy, or remove default_prefetch"]


def test_settings_that_do_what_they_say_are_not_warned(caplog):
    assert swap_warnings(caplog, {"swap": True, "default_prefetch": 10}) == []
    assert swap_warnings(caplog, {"swap": True, "layer_swap": [{"backward_prefetch": 3, "layers": [0, 1]},
                                                                {"backward_prefetch": 4, "layers": [2]}]}) == []
