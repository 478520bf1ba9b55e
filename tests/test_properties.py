"""Property tests: random valid layouts and count values normalize as DESIGN §3 says; random junk
in recompute_config / swap_config only ever raises ConfigError."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swapkit import ConfigError, build_plan, load_config
from swapkit.config.errors import Problems
from swapkit.plan.layout import build_layout
from swapkit.plan.normalize import normalize_counts

FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def layouts(draw):
    """(L, P, V, offset as written, expected layer_list) with every chunk >= 1 layer."""
    stages, chunks = draw(st.integers(1, 6)), draw(st.integers(1, 3))
    sizes = draw(st.lists(st.integers(1, 6), min_size=stages * chunks, max_size=stages * chunks))
    num_layers = sum(sizes)
    if stages * chunks == 1:
        return num_layers, stages, chunks, draw(st.integers(-3, 3)), ((num_layers,),)
    average = num_layers // (stages * chunks)
    grid = [[sizes[v * stages + s] - average for s in range(stages)] for v in range(chunks)]
    offset = grid
    if all(row == grid[0] for row in grid) and draw(st.booleans()):
        offset = grid[0]  # the 1-D form broadcasts to every row
        if all(cell == offset[0] for cell in offset) and draw(st.booleans()):
            offset = offset[0]  # the scalar form
    expected = tuple(tuple(sizes[v * stages:(v + 1) * stages]) for v in range(chunks))
    return num_layers, stages, chunks, offset, expected


def count_cells(max_value):
    return st.one_of(st.integers(0, max_value), st.booleans())


@st.composite
def layout_and_counts(draw):
    num_layers, stages, chunks, offset, expected = draw(layouts())
    top = 2 * max(max(row) for row in expected)
    kind = draw(st.sampled_from(["bool", "1d", "2d"]))
    if kind == "bool":
        value = draw(st.booleans())
    elif kind == "1d":
        value = draw(st.lists(count_cells(2 * top), max_size=stages))
    else:
        # per-row bools, but at least one list row: a list of bools alone is a 1-D per-stage value
        # (as in MindFormers), so [False, True] never means two rows
        cells = st.lists(count_cells(top), min_size=stages, max_size=stages)
        value = draw(st.lists(st.one_of(st.booleans(), cells), min_size=chunks, max_size=chunks))
        value[draw(st.integers(0, chunks - 1))] = draw(cells)
    return num_layers, stages, chunks, offset, expected, value


def layout_of(num_layers, stages, chunks, offset):
    problems = Problems()
    layout = build_layout(num_layers, stages, chunks, offset, problems)
    assert not problems.items, problems.items
    return layout


@FAST
@given(layouts())
def test_random_valid_layouts(case):
    num_layers, stages, chunks, offset, expected = case
    layout = layout_of(num_layers, stages, chunks, offset)
    assert layout.layer_list == expected
    # layers fill the chunks in row-major order, each chunk contiguous, positions counting from 0
    flat = [(v, s) for v in range(chunks) for s in range(stages)]
    walk = [(v, s, p) for (v, s) in flat for p in range(expected[v][s])]
    assert list(zip(layout.interleave_ids, layout.pp_ids, layout.positions)) == walk
    assert layout.layer_accu[-1][-1] == num_layers


def expected_cell(value, size):
    return size if value is True else 0 if value is False else min(value, size)


@FAST
@given(layout_and_counts())
def test_random_counts_normalize_within_chunk_sizes(case):
    num_layers, stages, chunks, offset, sizes, value = case
    layout = layout_of(num_layers, stages, chunks, offset)
    problems = Problems()
    grid = normalize_counts(value, layout, "recompute_config.recompute", problems)
    assert not problems.items
    assert len(grid) == chunks and all(len(row) == stages for row in grid)
    assert all(0 <= grid[v][s] <= sizes[v][s] for v in range(chunks) for s in range(stages))
    if isinstance(value, bool):
        assert grid == (sizes if value else layout.zeros())
    elif any(isinstance(row, list) for row in value):  # 2-D: clipped per cell
        for v, row in enumerate(value):
            cells = [row] * stages if isinstance(row, bool) else row
            assert list(grid[v]) == [expected_cell(c, size) for c, size in zip(cells, sizes[v])]
    else:  # 1-D: dealt per stage
        totals = layout.stage_totals()
        for s in range(stages):
            count = value[s] if s < len(value) else 0
            column = [grid[v][s] for v in range(chunks)]
            assert sum(column) == expected_cell(count, totals[s])  # min(count, stage total)
            for v in range(chunks):  # round robin: an unfilled chunk lags no later chunk, any chunk by <= 1
                if column[v] < sizes[v][s]:
                    assert all(column[w] <= column[v] + (w < v) for w in range(chunks))


@FAST
@given(layout_and_counts())
def test_plan_recomputes_the_first_n_layers_of_each_chunk(case):
    num_layers, stages, chunks, offset, sizes, value = case
    plan = build_plan(load_config({
        "model": {"model_config": {"num_layers": num_layers, "offset": offset, "pp_interleave_num": chunks}},
        "parallel_config": {"pipeline_stage": stages}, "recompute_config": {"recompute": value}}))
    grid = plan.formative.layer_recompute
    for layer in plan.layers:
        position = plan.layout.positions[layer.layer]
        assert layer.full == (position < grid[layer.chunk][layer.stage])


# ---------------------------------------------------------------- junk only raises ConfigError

scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.floats(allow_nan=True),
                    st.sampled_from(["", "attention", r"feed_forward\.mul", "x(", r"a\.\.b", ".*"]))
junk = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.one_of(st.sampled_from(["attention", "layers", "op_name", "backward_prefetch", "(", ""]),
                              st.integers(-1, 3)), inner, max_size=3)), max_leaves=10)
swap_entry = st.dictionaries(st.sampled_from(["op_name", "backward_prefetch", "layers", "extra"]), junk, max_size=4)
recompute_keys = ["recompute", "select_recompute", "select_comm_recompute", "select_recompute_exclude",
                  "select_comm_recompute_exclude", "recompute_granularity", "recompute_method",
                  "recompute_num_layers", "recompute_modules", "recompute_activations", "module_scopes"]


@st.composite
def junk_configs(draw):
    recompute = draw(st.one_of(junk, st.dictionaries(st.sampled_from(recompute_keys), junk, max_size=4)))
    swap = draw(st.one_of(junk, st.fixed_dictionaries({}, optional={
        "swap": st.one_of(st.booleans(), junk), "default_prefetch": st.one_of(st.integers(-1, 3), junk),
        "layer_swap": st.one_of(junk, st.lists(swap_entry, max_size=3), swap_entry),
        "op_swap": st.one_of(junk, st.lists(swap_entry, max_size=3), swap_entry)})))
    stages, chunks = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    model_config = {"num_layers": draw(st.integers(stages * chunks, 8)), "pp_interleave_num": chunks}
    return {"model": {"model_config": model_config}, "parallel_config": {"pipeline_stage": stages},
            "recompute_config": recompute, "swap_config": swap}


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(junk_configs())
def test_junk_only_raises_config_error(raw):
    try:
        build_plan(load_config(raw))
    except ConfigError as err:
        assert err.problems and all(isinstance(str(p), str) for p in err.problems)
