"""Per-layer plan decisions (DESIGN §3 "Per-layer decision", §4 "Recompute wins", §8 JSON)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from swapkit import ConfigError, build_plan, load_config
from swapkit.config.types import Config, ModelConfig, SwapConfig, SwapEntry
from swapkit.plan.report import layer_lines, plan_report, resolve_layer, table, unmatched, unmatched_errors

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SEED_OFFSET = [[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]

# The child-name tree of one MindFormers-style Llama decoder layer (DESIGN §7), for the pure report.
LINEAR = {"matmul": {}}
NORM = {"norm": {}}
LLAMA_LAYER = {
    "attention_norm": NORM,
    "attention": {"wq": LINEAR, "wk": LINEAR, "wv": LINEAR, "wo": LINEAR, "flash_attention": {}},
    "ffn_norm": NORM,
    "feed_forward": {"w1": {"matmul": {}, "activation": {"silu": {}}}, "w2": LINEAR, "w3": LINEAR, "mul": {}},
}


def plan_of(num_layers=4, stages=1, chunks=1, offset=0, recompute=None, swap=None):
    raw = {"model": {"model_config": {"num_layers": num_layers, "offset": offset, "pp_interleave_num": chunks}},
           "parallel_config": {"pipeline_stage": stages}}
    if recompute is not None:
        raw["recompute_config"] = recompute
    if swap is not None:
        raw["swap_config"] = swap
    return build_plan(load_config(raw))


def seed_plan():
    return plan_of(48, 5, 2, SEED_OFFSET, recompute={
        "recompute": [[2, 1, 0, 0, 0], [1, 0, 0, 0, 0]],
        "select_recompute": {
            r"feed_forward\.w1\.activation\.silu": True,
            r"feed_forward\.mul": True,
            r"feed_forward\.w1\.matmul": [[1, 0, 0, 0, 0], [2, 1, 0, 0, 0]],
            r"feed_forward\.w3\.matmul": [2, 1, 0, 0, 0],
        },
        "select_comm_recompute": [r"ffn_norm\.norm", r"attention_norm\.norm"],
    })


DEFAULTS = (r"feed_forward\.w1\.activation\.silu", r"feed_forward\.mul")
COMM = (r"ffn_norm\.norm", r"attention_norm\.norm")


# ---------------------------------------------------------------- recompute decisions

def test_seed001_full_layers_are_the_first_of_each_chunk():
    plan = seed_plan()
    # layer_recompute [[2, 1, 0, 0, 0], [1, 0, 0, 0, 0]]: chunk (0,0) starts at 0, (0,1) at 4, (1,0) at 24
    assert [layer.layer for layer in plan.layers if layer.full] == [0, 1, 4, 24]
    assert plan.layers[0].unit == (0, 0)
    assert plan.layers[2].unit is None


def test_full_beats_select():
    plan = seed_plan()
    for i in (0, 1, 4, 24):
        assert plan.layers[i].select == () and plan.layers[i].comm == ()


def test_select_and_comm_per_layer():
    plan = seed_plan()
    assert plan.layers[2].select == DEFAULTS
    assert plan.layers[2].comm == COMM
    # w1.matmul [[1, 0, 0, 0, 0], [2, 1, 0, 0, 0]]: layers 0 (full), 24 (full), 25 and 29
    assert plan.layers[25].select == DEFAULTS + (r"feed_forward\.w1\.matmul",)
    assert plan.layers[29].select == DEFAULTS + (r"feed_forward\.w1\.matmul",)
    assert plan.layers[26].select == DEFAULTS
    # w3.matmul [2, 1, 0, 0, 0] -> [[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]: layers 0, 4, 24, all full
    assert not any(r"feed_forward\.w3\.matmul" in layer.select for layer in plan.layers)
    assert plan.layers[47].select == DEFAULTS and plan.layers[47].comm == COMM
    assert (plan.layers[47].stage, plan.layers[47].chunk) == (4, 1)
    assert (plan.layers[29].stage, plan.layers[29].chunk) == (1, 1)


def test_select_counts_start_at_each_chunk():
    plan = plan_of(8, 2, 2, recompute={"select_recompute": {"attention": [[1, 0], [0, 2]]},
                                       "select_comm_recompute": [3, 0]})
    assert [layer.layer for layer in plan.layers if layer.select] == [0, 6, 7]
    # comm: stage 0 gets 3 layers dealt over chunks (0,0)=2, (1,0)=1 -> layers 0, 1, 4
    assert [layer.layer for layer in plan.layers if layer.comm] == [0, 1, 4]
    assert plan.layers[0].comm == (r".*\.norm",)


def test_recompute_true_makes_every_layer_full():
    plan = plan_of(3, recompute={"recompute": True, "select_recompute": True})
    assert all(layer.full and layer.select == () for layer in plan.layers)


def test_swap_mode_uses_global_indices():
    plan = plan_of(6, 2, recompute={"recompute": [4], "select_recompute": {"attention": [0, 4, 5]},
                                    "select_comm_recompute": True},
                   swap={"swap": True, "op_swap": []})
    assert [layer.layer for layer in plan.layers if layer.full] == [4]
    assert [layer.layer for layer in plan.layers if layer.select] == [0, 5]
    assert all(layer.comm == (r".*\.norm",) for layer in plan.layers if not layer.full)
    assert plan.swap is True


def test_swap_mode_recompute_true():
    plan = plan_of(3, recompute={"recompute": True}, swap={"swap": True, "op_swap": []})
    assert all(layer.full for layer in plan.layers)


# ---------------------------------------------------------------- swap decisions

def test_layer_swap_first_entry_wins():
    plan = plan_of(4, swap={"swap": True, "layer_swap": [{"backward_prefetch": 20, "layers": [0, 3]},
                                                         {"backward_prefetch": 5, "layers": [3, 1]}]})
    assert [layer.layer_swap for layer in plan.layers] == [20, 5, None, 20]
    assert all(layer.op_swap == () for layer in plan.layers)


def test_layer_swap_true_covers_every_layer():
    plan = plan_of(3, swap={"swap": True, "layer_swap": [{"backward_prefetch": 2, "layers": True}]})
    assert [layer.layer_swap for layer in plan.layers] == [2, 2, 2]


def test_op_swap_first_entry_per_op_wins():
    plan = plan_of(4, swap={"swap": True, "op_swap": [
        {"op_name": "attention", "backward_prefetch": 20, "layers": [0, 1]},
        {"op_name": ["feed_forward", "attention"], "backward_prefetch": 7, "layers": [1, 2]},
    ]})
    assert [layer.op_swap for layer in plan.layers] == [
        (("attention", 20),),
        (("attention", 20), ("feed_forward", 7)),
        (("attention", 7), ("feed_forward", 7)),
        (),
    ]


def test_no_swaps_when_swap_is_off():
    plan = plan_of(2, swap={"swap": False, "layer_swap": [{"backward_prefetch": 2, "layers": True}]})
    assert all(layer.layer_swap is None and layer.op_swap == () for layer in plan.layers)
    assert plan.swap is False


def test_default_strategy_per_layer():
    plan = plan_of(2, swap={"swap": True, "default_prefetch": 3})
    assert [layer.op_swap for layer in plan.layers] == [((r".*\.flash_attention", 3),)] * 2


# ---------------------------------------------------------------- recompute wins over swap

def test_full_layer_overrides_its_layer_swap_and_op_swaps():
    plan = plan_of(3, recompute={"recompute": [1]}, swap={
        "swap": True, "layer_swap": [{"backward_prefetch": 2, "layers": [1, 2]}],
        "op_swap": [{"op_name": "attention", "backward_prefetch": 4, "layers": [1]}]})
    assert plan.layers[1].full
    assert plan.layers[1].layer_swap == 2  # still listed: what the config asks for
    assert plan.layers[1].overridden == ("layer", "attention")
    assert plan.layers[2].overridden == ()


@pytest.mark.parametrize("select, op, overridden", [
    ("attention", "attention", True),  # equal scope
    ("feed_forward", r"feed_forward\.w1", True),  # inside the recomputed scope
    (r"feed_forward\.w.*", r"feed_forward\.w1\.matmul", True),  # regex scope, deeper op
    (".*", "attention", True),
    (r"feed_forward\.w1", "feed_forward", False),  # the swap encloses the recomputed op: not overridden
    ("attention", "feed_forward", False),
    (r"attention\.wq", r"attention\.wk", False),
])
def test_op_swap_overridden_by_select(select, op, overridden):
    plan = plan_of(2, recompute={"select_recompute": {select: [0]}},
                   swap={"swap": True, "op_swap": [{"op_name": op, "backward_prefetch": 1, "layers": True}]})
    assert plan.layers[0].overridden == ((op,) if overridden else ())
    assert plan.layers[1].overridden == ()  # not select-recomputed there
    assert plan.layers[0].op_swap == ((op, 1),)


def test_op_swap_overridden_by_comm_recompute():
    plan = plan_of(2, recompute={"select_comm_recompute": [1]}, swap={
        "swap": True, "op_swap": [{"op_name": r"ffn_norm\.norm", "backward_prefetch": 1, "layers": True},
                                  {"op_name": "ffn_norm", "backward_prefetch": 1, "layers": True}]})
    assert plan.layers[1].comm == (r".*\.norm",)
    assert plan.layers[1].overridden == (r"ffn_norm\.norm",)


# ---------------------------------------------------------------- the four seed 001 swap cases

def seed_config_plan(name):
    return build_plan(load_config(CONFIGS / name))


def test_seed001_case1_default_strategy():
    plan = seed_config_plan("seed001_swap_default.yaml")
    assert [layer.op_swap for layer in plan.layers] == [((r".*\.flash_attention", 10),)] * 4
    assert all(layer.layer_swap is None and not layer.full and not layer.select for layer in plan.layers)


def test_seed001_case2_layer_swap():
    plan = seed_config_plan("seed001_swap_layer.yaml")
    assert [layer.layer_swap for layer in plan.layers] == [20, None, None, 20]
    assert all(layer.op_swap == () for layer in plan.layers)


SEED_OP_SWAPS = [
    (("attention", 20),),
    (("attention", 20), ("feed_forward", 15)),
    (("attention", 20), ("feed_forward", 15)),
    (("attention", 10),),
]


def test_seed001_case3_op_swap():
    plan = seed_config_plan("seed001_swap_op.yaml")
    assert [layer.op_swap for layer in plan.layers] == SEED_OP_SWAPS
    assert all(layer.layer_swap is None and layer.overridden == () for layer in plan.layers)


def test_seed001_case4_op_swap_with_select_recompute():
    plan = seed_config_plan("seed001_swap_recompute.yaml")
    assert [layer.op_swap for layer in plan.layers] == SEED_OP_SWAPS
    assert [layer.select for layer in plan.layers] == [("feed_forward",), (), (), ("feed_forward",)]
    assert [layer.comm for layer in plan.layers] == [()] * 4
    assert all(layer.overridden == () for layer in plan.layers)


# ---------------------------------------------------------------- per-layer lines (pure, on a tree)

def lines_for(plan, i):
    return [message for _, message in layer_lines(plan, plan.layers[i], resolve_layer(plan.layers[i], LLAMA_LAYER))]


def test_seed001_case_lines_on_a_llama_tree():
    op = seed_config_plan("seed001_swap_op.yaml")
    assert lines_for(op, 1) == ["Set op_swap at layer 1: .attention, value=20, .feed_forward, value=15"]
    default = seed_config_plan("seed001_swap_default.yaml")
    assert lines_for(default, 0) == ["Set op_swap at layer 0: attention.flash_attention, value=10"]
    layer = seed_config_plan("seed001_swap_layer.yaml")
    assert lines_for(layer, 3) == ["Set layer swap at layer 3 and value is: 20"]
    assert lines_for(layer, 1) == []
    both = seed_config_plan("seed001_swap_recompute.yaml")
    assert lines_for(both, 3) == ["Set select recompute at layer 3: feed_forward",
                                  "Set op_swap at layer 3: .attention, value=10"]


def test_recompute_lines_without_swap_say_on():
    plan = seed_plan()
    assert lines_for(plan, 0) == ["Set full recompute at layer 0"]
    assert lines_for(plan, 2) == [
        "Set select recompute on at layer 2: feed_forward.w1.activation.silu, feed_forward.mul",
        "Set select comm recompute on at layer 2: ffn_norm.norm, attention_norm.norm",
    ]


def test_overridden_swaps_are_warned_per_layer():
    plan = plan_of(2, recompute={"recompute": [0], "select_recompute": {"attention": [1]}}, swap={
        "swap": True, "layer_swap": [{"backward_prefetch": 2, "layers": [0]}],
        "op_swap": [{"op_name": r"attention\.wq", "backward_prefetch": 1, "layers": True}]})
    report = [(level, message) for level, message in plan_report(plan, [LLAMA_LAYER, LLAMA_LAYER])
              if level == "WARNING"]
    assert report == [
        ("WARNING", "layer swap at layer 0 has no effect: the layer is fully recomputed (recompute wins over swap)"),
        ("WARNING", "op swap attention.wq at layer 0 has no effect: the layer is fully recomputed "
                    "(recompute wins over swap)"),
        ("WARNING", "op swap attention.wq at layer 1 has no effect: attention is recomputed "
                    "(recompute wins over swap)"),
    ]


def test_unmatched_patterns_are_reported_once():
    plan = plan_of(3, recompute={"select_recompute": ["missing_op", "attention"]})
    assert unmatched(plan, [LLAMA_LAYER] * 3) == []  # nowhere: an error, below
    assert unmatched_errors(plan, [LLAMA_LAYER] * 3) == [
        "recompute_config.select_recompute[0]: select_recompute pattern 'missing_op' matches no sub-module in any "
        "layer of the model; its layers' children are: attention, attention_norm, feed_forward, ffn_norm. Write one "
        "of these names, or a path below one with \\. between the names (e.g. 'attention\\.flash_attention')"]
    partial = [LLAMA_LAYER, {"mlp": {}}, LLAMA_LAYER]
    assert unmatched(plan, partial) == [
        "select_recompute pattern 'attention' matches no sub-module in layer(s) [1]; it has no effect there"]


def test_table_has_one_row_per_layer():
    text = table(seed_config_plan("seed001_swap_op.yaml"))
    rows = text.splitlines()
    assert rows[0].split() == ["layer", "stage", "chunk", "full", "select", "comm", "swaps", "overridden"]
    assert len(rows) == 5
    assert "attention:20, feed_forward:15" in rows[2]


# ---------------------------------------------------------------- plan built from a hand-made Config

def test_build_plan_checks_a_hand_built_config():
    with pytest.raises(ConfigError) as info:
        build_plan(Config(model=ModelConfig(num_layers=4, offset=[1, 2, 3])))
    assert "model.model_config.offset: got [1, 2, 3]" in str(info.value)


def test_build_plan_on_a_hand_built_swap_config():
    swap = SwapConfig(swap=True, layer_swap=(SwapEntry(3, (1,)),), op_swap=())
    plan = build_plan(Config(model=ModelConfig(num_layers=2), swap=swap))
    assert [layer.layer_swap for layer in plan.layers] == [None, 3]


# ---------------------------------------------------------------- JSON shape (DESIGN §8)

def test_json_shape():
    plan = build_plan(load_config(CONFIGS / "seed001_swap_recompute.yaml"))
    data = json.loads(json.dumps(plan.to_json()))
    assert data["layout"]["layer_list"] == [[4]]
    assert data["layout"]["layer_accu"] == [[4]]
    assert data["layout"]["pp_ids"] == [0, 0, 0, 0]
    assert data["layout"]["interleave_ids"] == [0, 0, 0, 0]
    assert set(data["formative"]) == {"layer_recompute", "select_recompute", "select_comm_recompute",
                                      "select_recompute_exclude", "select_comm_recompute_exclude",
                                      "layer_swap", "op_swap"}
    assert data["formative"]["select_recompute"] == {"feed_forward": [0, 3]}
    assert data["formative"]["op_swap"] == {
        "attention": [{"backward_prefetch": 20, "layers": [0, 1, 2]}, {"backward_prefetch": 10, "layers": [3]}],
        "feed_forward": [{"backward_prefetch": 15, "layers": [1, 2]}],
    }
    layer1 = data["layers"][1]
    assert {"layer", "stage", "chunk", "full", "select", "comm", "layer_swap", "op_swap", "overridden"} <= set(layer1)
    assert layer1["op_swap"] == [["attention", 20], ["feed_forward", 15]]
    assert layer1["layer_swap"] is None and layer1["full"] is False and layer1["overridden"] == []
    assert data["layers"][0]["select"] == ["feed_forward"]
    assert [layer["layer"] for layer in data["layers"]] == [0, 1, 2, 3]


def test_json_patterns_as_written_and_overridden_values():
    plan = plan_of(2, recompute={"recompute": [0], "select_recompute": {r"feed_forward\.w1": [1]}}, swap={
        "swap": True, "layer_swap": [{"backward_prefetch": 4, "layers": [0]}],
        "op_swap": [{"op_name": r"feed_forward\.w1\.matmul", "backward_prefetch": 2, "layers": True}]})
    layers = json.loads(json.dumps(plan.to_json()))["layers"]
    assert layers[0]["full"] is True and layers[0]["layer_swap"] == 4
    assert layers[0]["overridden"] == ["layer", "feed_forward\\.w1\\.matmul"]
    assert layers[1]["select"] == ["feed_forward\\.w1"]
    assert layers[1]["op_swap"] == [["feed_forward\\.w1\\.matmul", 2]]
    assert layers[1]["overridden"] == ["feed_forward\\.w1\\.matmul"]


def test_json_seed_layout():
    data = seed_plan().to_json()
    assert data["layout"]["layer_list"] == [[4, 5, 5, 5, 5], [5, 5, 5, 5, 4]]
    assert data["layout"]["layer_accu"] == [[4, 9, 14, 19, 24], [29, 34, 39, 44, 48]]
    assert data["formative"]["layer_recompute"] == [[2, 1, 0, 0, 0], [1, 0, 0, 0, 0]]
    assert len(data["layers"]) == 48
    layer24 = data["layers"][24]
    assert (layer24["stage"], layer24["chunk"], layer24["full"], layer24["select"]) == (0, 1, True, [])


def test_overridden_is_not_over_reported_for_regex_op_patterns():
    """A select of feed_forward must not mark an op swap of `.*\\.wq` (attention.wq) as overridden."""
    from swapkit import build_plan, load_config

    raw = {"model": {"model_config": {"num_layers": 2}},
           "recompute_config": {"select_recompute": {"feed_forward": [0]}},
           "swap_config": {"swap": True, "op_swap": [
               {"op_name": r".*\.wq", "backward_prefetch": 1, "layers": [0]},
               {"op_name": r"feed_forward\.w1", "backward_prefetch": 1, "layers": [0]}]}}
    plan = build_plan(load_config(raw))
    assert plan.layers[0].overridden == (r"feed_forward\.w1",)

