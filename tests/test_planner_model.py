"""The budget planner's pure side: the replay of the session's rules, the greedy choice, the YAML."""
from __future__ import annotations

import pytest
import yaml

from swapkit.config.errors import ConfigError
from swapkit.load import load_config
from swapkit.plan.emit import layer_rows, op_pattern, planned_config, planned_sections
from swapkit.plan.planner import (KEEP, RECOMPUTE, BudgetError, Choice, Planned, Planner, plan_budget, reachable_peak,
                                  useful_scopes)
from swapkit.plan.simulate import Link, Links, simulate
from swapkit.plan.size import parse_size
from swapkit.plan.trace import PRE, FlatSave, FlatStep, Free, Save, Segment, Trace, Unpack, compose

KIB4 = 4096
FAST = Links(Link(0.0, 1e15), Link(0.0, 1e15))


def chain(n: int, nbytes: int = KIB4, dt: float = 1e-3, resave: dict[int, int] | None = None) -> FlatStep:
    """``n`` storages saved one per tick in layer 0, a final uncounted save, then a reverse backward."""
    forward = [FlatSave((i,), nbytes, 0, "", dt) for i in range(n)]
    for tick, storage in sorted((resave or {}).items()):
        forward.insert(tick, FlatSave((storage,), nbytes, 0, "", dt))
    forward.append(FlatSave(None, 0, None, None, dt))
    backward = []
    for tick in range(len(forward) - 2, -1, -1):
        backward.append(("u", tick, dt))
        if forward[tick].storage is not None and tick == _first(forward, forward[tick].storage):
            backward.append(("f", forward[tick].storage, 0.0))
    return FlatStep(tuple(forward), tuple(backward), 0.01)


def _first(forward, storage) -> int:
    return next(i for i, save in enumerate(forward) if save.storage == storage)


def swap_all(k: int):
    return lambda layer, scope: k if layer == 0 else None


def test_keep_everything_holds_every_distinct_storage_until_backward():
    step = chain(6)
    p = simulate(step, lambda layer, scope: None, FAST)
    assert (p.peak_device_bytes, p.moved_bytes_per_step, p.late_fetches) == (6 * KIB4, 0, 0)
    assert p.step_seconds == pytest.approx(13 * 1e-3 + 0.01)


def test_swap_k1_on_a_fast_link_holds_one_storage_in_forward_and_two_in_backward():
    p = simulate(chain(6), swap_all(1), FAST)
    # forward: tick t releases t-1 before adding t; backward: unpacking t fetches t and t-1
    assert p.peak_device_bytes == 2 * KIB4
    assert p.moved_bytes_per_step == 2 * 6 * KIB4
    assert p.late_fetches == 1  # only the first unpack: nothing fetched it ahead


def test_a_slow_link_delays_releases_and_exposes_waits():
    slow = Links(Link(0.0, KIB4 / 2.5e-3), Link(0.0, KIB4 / 2.5e-3))  # a copy takes 2.5 compute ticks
    fast, late = simulate(chain(6), swap_all(1), FAST), simulate(chain(6), swap_all(1), slow)
    assert fast.peak_device_bytes < late.peak_device_bytes < 6 * KIB4
    assert late.late_fetches > fast.late_fetches and late.wait_seconds > 1e-3
    assert late.step_seconds == pytest.approx(fast.step_seconds - fast.wait_seconds + late.wait_seconds)


def test_small_storages_and_the_forward_tail_are_not_offloaded():
    assert simulate(chain(6, nbytes=512), swap_all(1), FAST).moved_bytes_per_step == 0
    tail = simulate(chain(6), swap_all(7), FAST)  # every t + 7 reaches past the 7 forward ticks
    assert (tail.moved_bytes_per_step, tail.peak_device_bytes) == (0, 6 * KIB4)
    some = simulate(chain(6), swap_all(4), FAST)  # ticks 0 to 2 only: t + 4 < 7
    assert some.moved_bytes_per_step == 2 * 3 * KIB4


def test_a_later_save_of_the_same_storage_pushes_its_release_out():
    once = simulate(chain(6), swap_all(1), FAST)
    again = simulate(chain(6, resave={3: 0}), swap_all(1), FAST)  # storage 0 saved again at tick 3
    assert again.peak_device_bytes == once.peak_device_bytes + KIB4


# ---------------------------------------------------------------------- planner on a synthetic trace

def synthetic_trace(layers: int = 3, saves: int = 4, nbytes: int = 1 << 20, recompute_seconds: float = 5e-3) -> Trace:
    """Each layer saves ``saves`` storages (the first in ``attention``, the rest in ``feed_forward``);
    recomputed it saves one input and its backward takes ``recompute_seconds`` longer."""
    keep, recompute = {PRE: Segment((), ())}, {PRE: Segment((), ())}
    for s in range(layers):
        scopes = ["attention"] + ["feed_forward"] * (saves - 1)
        forward = tuple(Save((s, i), nbytes, scopes[i], 1e-3) for i in range(saves))
        backward = tuple(e for i in reversed(range(saves)) for e in (Unpack(s, i, 1e-3), Free((s, i))))
        keep[s] = Segment(forward, backward)
        recompute[s] = Segment((Save((s, 0), nbytes, "", 1e-3),),
                               (Unpack(s, 0, saves * 2e-3 + recompute_seconds), Free((s, 0))))
    post = Segment((Save(None, 0, None, 1e-3),), ())
    keep[layers] = recompute[layers] = post
    order = (layers, *reversed(range(layers)), PRE)
    return Trace(layers, {"keep": keep, "recompute": recompute}, order, {"keep": 0.01, "recompute": 0.01},
                 {(s, ""): 4e-3 for s in range(layers)})


def planner_for(trace: Trace, links: Links = FAST) -> Planner:
    scopes = [useful_scopes(trace, i, ["", "attention", "feed_forward"], 1024) for i in range(trace.num_layers)]
    return Planner(trace, links, scopes, 1024)


def test_compose_recomputed_layers_replace_their_saves_and_renumber_ticks():
    trace = synthetic_trace()
    step = compose(trace, frozenset({1}))
    assert [save.layer for save in step.forward] == [0] * 4 + [1] + [2] * 4 + [None]
    unpacked = [event[1] for event in step.backward if event[0] == "u"]
    assert unpacked == [8, 7, 6, 5, 4, 3, 2, 1, 0]


def test_forward_time_stays_with_its_segment_in_every_mode():
    """Note [Forward time is tiled by segment]: a recomputed layer saves only its inputs at its
    start; its forward is its tail, not the next segment's first save."""
    from swapkit.planner.segments import to_segments

    # keep run: PRE 0..1, layer 0 1..5 (saves at 2 and 4), post 5..6 (save at 6)
    keep, _ = to_segments([(PRE, (PRE, 0), 8, None, 1.0), (0, (0, 0), 8, "", 2.0), (0, (0, 1), 8, "", 4.0),
                           (1, (1, 0), 8, None, 6.0)], [], 0.0, 1, {PRE: 1.0, 0: 5.0})
    # recompute run: layer 0 saves its input at 1.5 and ends at 5.5
    recompute, _ = to_segments([(PRE, (PRE, 0), 8, None, 1.0), (0, ("in", 0, 0), 8, "", 1.5),
                                (1, (1, 0), 8, None, 6.5)], [], 0.0, 1, {PRE: 1.0, 0: 5.5})
    assert [save.seconds for save in keep[0].forward] == [1.0, 2.0] and keep[0].tail == 1.0
    assert recompute[0].tail == 4.0 and recompute[1].forward[0].seconds == 1.0  # not the 5.0 since the last save
    trace = Trace(1, {"keep": keep, "recompute": recompute}, (1, 0, PRE), {"keep": 0.0, "recompute": 0.0})
    assert sum(save.seconds for save in compose(trace, frozenset({0})).forward) == pytest.approx(6.5)
    assert sum(save.seconds for save in compose(trace, frozenset()).forward) == pytest.approx(6.0)


def test_records_that_die_in_forward_are_taken_off_at_the_next_save():
    from swapkit.planner.segments import to_segments

    saves = [(0, (0, 0), 100, "", 1.0), (0, (0, 1), 100, "", 2.0), (0, (0, 2), 100, "", 3.0)]
    events = [("f", (0, 0), 1.5), ("u", (0, 2), 4.0), ("u", (0, 1), 5.0), ("f", (0, 1), 5.5)]
    segments, _ = to_segments(saves, events, 0.0, 1, {PRE: 0.5, 0: 3.0})
    assert [save.frees for save in segments[0].forward] == [(), ((0, 0),), ()]
    assert [type(e).__name__ for e in segments[0].backward] == ["Unpack", "Unpack", "Free"]
    trace = Trace(1, {"keep": segments}, (0, 1, PRE), {"keep": 0.0})
    assert simulate(compose(trace), lambda layer, scope: None, FAST).peak_device_bytes == 200


def test_a_storage_crossing_layers_is_one_storage_whatever_mode_each_layer_runs_in():
    """Note [Storages that cross layers]: rotary embeddings made before layer 0 and saved by every
    layer are counted once, also when layer 0 (which saved them first) is recomputed."""
    rope = ("in", 0, 1)

    def segment(names):
        return Segment(tuple(Save(n, 1000, "", 1e-3) for n in names), ())

    keep = {PRE: segment([]), 0: segment([("in", 0, 0), rope, (0, 0)]), 1: segment([("out", 0, 0), rope, (1, 0)]),
            2: segment([("out", 1, 0)])}
    recompute = {PRE: segment([]), 0: segment([("in", 0, 0), rope]), 1: segment([("out", 0, 0), rope]),
                 2: segment([("out", 1, 0)])}
    trace = Trace(2, {"keep": keep, "recompute": recompute}, (2, 1, 0, PRE), {"keep": 0.0, "recompute": 0.0})
    peaks = [simulate(compose(trace, recomputed), lambda layer, scope: None, FAST).peak_device_bytes
             for recomputed in (frozenset(), frozenset({0}), frozenset({0, 1}))]
    assert peaks == [6000, 5000, 4000]


def test_each_copy_costs_the_compute_thread_the_measured_overhead():
    from swapkit.planner.run import copy_overhead

    trace = synthetic_trace()
    step = compose(trace)
    swap = lambda layer, scope: None if layer is None else 1  # noqa: E731 - the probe
    plain = simulate(step, swap, FAST)
    assert plain.copies > 0
    charged = simulate(step, swap, Links(FAST.d2h, FAST.h2d, 0.0, 1e-3))
    assert charged.step_seconds == pytest.approx(plain.step_seconds + plain.copies * 1e-3)
    assert charged.peak_device_bytes == plain.peak_device_bytes  # a fast link: releases still in time
    keep = simulate(step, lambda layer, scope: None, FAST).step_seconds
    # the probe ran 0.1 s slower than keep where the replay predicts no difference: 0.1 s over its copies
    overhead = copy_overhead(trace, FAST, 1.0, 1.1 + plain.step_seconds - keep, 1024)
    assert overhead * plain.copies == pytest.approx(0.1)
    assert copy_overhead(trace, FAST, 1.0, 0.9, 1024) == 0.0  # noise never makes copies free


def test_useful_scopes_drop_a_scope_that_owns_exactly_what_its_layer_owns():
    trace = synthetic_trace(saves=1)  # only attention saves: the layer and attention own the same bytes
    assert useful_scopes(trace, 0, ["", "attention", "feed_forward"], 1024) == [""]
    assert useful_scopes(synthetic_trace(), 0, ["", "attention", "feed_forward"], 1024) == [
        "", "attention", "feed_forward"]


def test_a_budget_above_the_baseline_keeps_everything():
    planner = planner_for(synthetic_trace())
    planned = plan_budget(planner, 12 << 20)  # exactly the baseline
    assert planned.choices == (KEEP, KEEP, KEEP)
    assert planned.predicted == planned.baseline


def test_on_a_free_link_the_planner_swaps_instead_of_recomputing():
    planner = planner_for(synthetic_trace())
    planned = plan_budget(planner, 6 << 20)
    assert planned.predicted.peak_device_bytes <= 6 << 20 < planned.baseline.peak_device_bytes
    assert all(choice.action in ("keep", "swap") for choice in planned.choices)
    assert planned.predicted.step_seconds == pytest.approx(planned.baseline.step_seconds)


def test_on_a_slow_link_the_planner_recomputes_instead_of_waiting():
    slow = Links(Link(0.0, 1e8), Link(0.0, 1e8))  # 10 ms per MiB against 1 ms of compute per save
    planner = planner_for(synthetic_trace(), slow)
    planned = plan_budget(planner, 6 << 20)
    assert planned.predicted.peak_device_bytes <= 6 << 20
    assert RECOMPUTE in planned.choices
    swapped_everything = planner.predict(tuple(Choice("swap", ("",), 1) for _ in range(3)))
    assert planned.predicted.step_seconds < swapped_everything.step_seconds


def test_below_the_reachable_minimum_the_error_names_it():
    planner = planner_for(synthetic_trace())
    lowest = reachable_peak(planner)
    assert lowest < planner.predict((KEEP,) * 3).peak_device_bytes
    with pytest.raises(BudgetError) as err:
        plan_budget(planner, lowest - 1)
    assert err.value.reachable == lowest
    assert f"smallest reachable peak_device_bytes is {lowest} bytes" in str(err.value)


def test_layer_rows_charge_recompute_time_and_exposed_waits_to_their_layer():
    slow = Links(Link(0.0, 1e15), Link(0.0, 1e8))  # prompt offloads, 10 ms per MiB back
    trace = synthetic_trace()
    planner = planner_for(trace, slow)
    choices = (Choice("swap", ("",), 1), RECOMPUTE, KEEP)
    predicted = planner.predict(choices)
    rows = layer_rows(trace, Planned(choices, predicted, planner.predict((KEEP,) * 3)), 1024)
    waits = dict(predicted.layer_wait)
    assert waits[0] > 0 and set(waits) == {0}  # only layer 0 swaps
    assert rows[0]["predicted_cost_seconds"] == pytest.approx(waits[0])
    assert rows[1]["predicted_cost_seconds"] == pytest.approx(4e-3)  # its forward, run again in backward
    assert (rows[2]["predicted_cost_seconds"], rows[2]["swapped_bytes"]) == (0.0, 0)
    assert rows[0]["swapped_bytes"] == 4 << 20 and rows[0]["swapped_scopes"] == [""]


# ---------------------------------------------------------------------- emitted YAML and sizes

def test_planned_sections_load_unchanged_with_global_indices():
    choices = (Choice("swap", ("",), 2), RECOMPUTE, Choice("swap", ("attention.wq", "feed_forward"), 4), KEEP)
    raw = {"model": {"model_config": {"num_layers": 4}}, "swap_config": {"swap": False}, "train": {"steps": 2}}
    text = yaml.safe_dump(planned_config(raw, choices))
    plan = __import__("swapkit").build_plan(load_config(yaml.safe_load(text)))
    assert [layer.layer_swap for layer in plan.layers] == [2, None, None, None]
    assert [layer.full for layer in plan.layers] == [False, True, False, False]
    assert plan.layers[2].op_swap == ((r"attention\.wq", 4), ("feed_forward", 4))
    assert load_config(yaml.safe_load(text)).train.steps == 2


def test_select_recompute_is_written_in_swap_mode_and_wins_over_swaps_inside_it():
    from swapkit.plan.planner import with_select

    choice = with_select(Choice("swap", ("feed_forward.w1", "attention"), 4), "feed_forward")
    assert choice == Choice("swap", ("attention",), 4, "feed_forward")
    assert with_select(Choice("swap", ("feed_forward",), 2), "feed_forward") == Choice("keep", select="feed_forward")
    choices = (choice, Choice(select="feed_forward"), RECOMPUTE)
    plan = __import__("swapkit").build_plan(load_config({"model": {"model_config": {"num_layers": 3}},
                                                         **planned_sections(choices)}))
    assert [layer.select for layer in plan.layers] == [("feed_forward",), ("feed_forward",), ()]
    assert plan.layers[0].op_swap == (("attention", 4),) and plan.layers[2].full
    assert choice.mode == "select:feed_forward" and choice.describe() == "swap attention k=4 + recompute feed_forward"


def test_keeping_everything_is_written_without_swap():
    sections = planned_sections((KEEP, KEEP))
    assert sections["swap_config"] == {"swap": False}
    assert sections["recompute_config"]["recompute"] is False


def test_op_pattern_names_exactly_one_path():
    assert op_pattern("attention.flash_attention") == r"attention\.flash_attention"


@pytest.mark.parametrize("text, expected", [("64MiB", 64 << 20), ("1.5GiB", 3 << 29), ("500MB", 500 * 10**6),
                                            ("4096", 4096), ("2 kib", 2048),
                                            ("1.1KiB", 1126), (".5KB", 500), ("1" + "0" * 18, 10**18)])
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "64XB", "-1MiB", "0", "1..5GiB", "MiB", "2EiB"])
def test_bad_sizes_are_clean_errors(text):
    with pytest.raises(ConfigError, match="--budget: got .*expected"):
        parse_size(text)


@pytest.mark.parametrize("text", ["1.5", "2.5B", "1000.25"])
def test_fractional_byte_count_is_an_error_not_truncated(text):
    with pytest.raises(ConfigError, match="--budget: got .*a byte count must be a whole number: write"):
        parse_size(text)


def test_sizes_beyond_one_exbibyte_are_refused_before_float_arithmetic():
    assert parse_size("1048576TiB") == 2**60
    for text in ("1048577TiB", "9" * 400):  # float('9' * 400) is inf: int() of it raised OverflowError
        with pytest.raises(ConfigError, match=r"--budget: got .*expected at most 1 EiB"):
            parse_size(text)


def test_a_size_of_thousands_of_digits_is_a_clean_error_not_a_crash():
    """'9' * 5000 raised ValueError (Python's 4300-digit int limit) from Fraction: `swapkit plan --budget`
    exited 1 with "failed: ValueError: Exceeds the limit", not 2 naming --budget; the message quoted all
    5000 characters."""
    for text in ("9" * 5000, "0." + "0" * 5000 + "1", "1" * 5000 + "MiB"):
        with pytest.raises(ConfigError, match=r"--budget: got '.*\([0-9,]+ more characters\); "
                                              r"expected at most 1 EiB .* 40 digits") as info:
            parse_size(text)
        assert len(str(info.value)) < 600
