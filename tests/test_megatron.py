"""The Megatron recompute dialect (DESIGN §6, seeds 000 and 002): validation and translation."""
from __future__ import annotations

import logging

import pytest

from swapkit import ConfigError, build_plan, load_config
from swapkit.config.types import MEGATRON_MODULES

VALID_MODULES = "valid modules: core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts"


def raw_config(recompute, num_layers=4, stages=1, chunks=1, offset=0):
    return {"model": {"model_config": {"num_layers": num_layers, "pp_interleave_num": chunks, "offset": offset}},
            "parallel_config": {"pipeline_stage": stages}, "recompute_config": recompute}


def plan_of(recompute, **layout):
    return build_plan(load_config(raw_config(recompute, **layout)))


def error(recompute, **layout) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(raw_config(recompute, **layout))
    return info.value


def full_layers(plan):
    return [layer.layer for layer in plan.layers if layer.full]


# ---------------------------------------------------------------- validation

def test_selective_takes_no_num_layers():
    err = error({"recompute_granularity": "selective", "recompute_num_layers": 2})
    assert [str(p) for p in err.problems] == [
        "recompute_config.recompute_num_layers: selective recompute takes no recompute_num_layers "
        "(Megatron rule); remove it"]


def test_selective_takes_no_method():
    err = error({"recompute_granularity": "selective", "recompute_method": "block"})
    assert [p.path for p in err.problems] == ["recompute_config.recompute_method"]
    assert "is not supported with recompute_granularity: selective" in str(err)


def test_selective_needs_a_non_empty_module_list():
    err = error({"recompute_granularity": "selective", "recompute_modules": []})
    assert "recompute_config.recompute_modules: got []; expected a non-empty string or a non-empty list" in str(err)


def test_unknown_modules_list_the_valid_ones():
    err = error({"recompute_granularity": "selective", "recompute_modules": ["core_attn", "attn", "mlp"]})
    assert len(err.problems) == 1
    assert ("recompute_config.recompute_modules: got ['core_attn', 'attn', 'mlp']; expected Megatron module names"
            in str(err))
    assert "Unknown ['attn']" in str(err)
    assert VALID_MODULES in str(err)


def test_a_module_listed_twice_is_warned_and_recomputed_once(caplog):
    recompute = {"recompute_granularity": "selective", "recompute_modules": ["mlp", "core_attn", "mlp"]}
    with caplog.at_level("WARNING", logger="swapkit"):
        config = load_config(raw_config(recompute))
    expected = ("recompute_config.recompute_modules lists ['mlp'] more than once (['mlp', 'core_attn', 'mlp']); "
                "a module is recomputed once, the repeats do nothing: list each module once")
    assert config.warnings == (expected,)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [expected]
    once = build_plan(load_config(raw_config(recompute | {"recompute_modules": ["mlp", "core_attn"]})))
    assert build_plan(config).layers == once.layers  # what the warning says: the repeat changed nothing
    assert load_config(raw_config(recompute | {"recompute_modules": ["mlp", "core_attn"]})).warnings == ()


def test_module_without_scope_mapping_names_module_scopes():
    # the config alone loads (a model's preset may map moe_act); the plan for the built-in model cannot
    config = load_config(raw_config({"recompute_granularity": "selective", "recompute_modules": ["moe_act"]}))
    with pytest.raises(ConfigError) as info:
        build_plan(config)
    err = info.value
    assert str(err.problems[0]) == (
        "recompute_config.recompute_modules: module 'moe_act' has no op scope in this model; add "
        "recompute_config.module_scopes.moe_act: '<op pattern>' (mapped: core_attn, layernorm, mlp), or set "
            "model.model_config.preset to a model family that has it")


def test_full_needs_method_and_num_layers():
    err = error({"recompute_granularity": "full"})
    assert [p.path for p in err.problems] == ["recompute_config.recompute_method",
                                              "recompute_config.recompute_num_layers"]
    assert "is required with recompute_granularity: full; use uniform or block" in str(err)
    err = error({"recompute_granularity": "full", "recompute_method": "block"})
    assert [p.path for p in err.problems] == ["recompute_config.recompute_num_layers"]
    err = error({"recompute_granularity": "full", "recompute_num_layers": 1})
    assert [p.path for p in err.problems] == ["recompute_config.recompute_method"]


def test_full_takes_no_modules():
    err = error({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1,
                 "recompute_modules": ["mlp"]})
    assert str(err.problems[0]) == ("recompute_config.recompute_modules: applies only to recompute_granularity: "
                                    "selective; remove it")


@pytest.mark.parametrize("key, value, fragment", [
    ("recompute_granularity", "partial", "got 'partial'; expected one of 'full', 'selective'"),
    ("recompute_method", "even", "got 'even'; expected one of 'uniform', 'block'"),
    ("recompute_num_layers", 0, "got 0; expected an integer >= 1"),
    ("recompute_num_layers", True, "got true; expected an integer >= 1"),
    ("recompute_activations", "yes", "got 'yes'; expected true or false"),
])
def test_wrong_types(key, value, fragment):
    recompute = {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1, key: value}
    err = error(recompute)
    assert [p.path for p in err.problems] == [f"recompute_config.{key}"]
    assert fragment in str(err)


def test_recompute_activations_means_selective():
    plan = plan_of({"recompute_activations": True})
    assert plan.dialect == "megatron"
    assert all(layer.select == (r"attention\.flash_attention",) and not layer.full for layer in plan.layers)
    assert plan.summary == "Megatron recompute: granularity=selective, modules=['core_attn']"


def test_recompute_activations_contradicts_full():
    err = error({"recompute_activations": True, "recompute_granularity": "full", "recompute_method": "block",
                 "recompute_num_layers": 1})
    assert [p.path for p in err.problems] == ["recompute_config.recompute_activations"]
    assert "contradicts recompute_granularity: full" in str(err)


def test_distribute_saved_activations_only_with_full(caplog):
    err = error({"recompute_granularity": "selective", "distribute_saved_activations": True})
    assert str(err.problems[0]) == ("recompute_config.distribute_saved_activations: got true; expected false unless "
                                    "recompute_granularity is full (Megatron rule)")
    config = load_config(raw_config({"recompute_granularity": "full", "recompute_method": "block",
                                     "recompute_num_layers": 1, "distribute_saved_activations": True}))
    assert config.recompute.distribute_saved_activations is True
    assert "recompute_config.distribute_saved_activations" in config.no_effect


def test_keys_without_granularity():
    err = error({"recompute_method": "block", "recompute_num_layers": 2})
    assert [p.path for p in err.problems] == ["recompute_config.recompute_method",
                                              "recompute_config.recompute_num_layers"]
    assert "has no meaning without recompute_granularity" in str(err)


def test_mixing_dialects_is_an_error():
    err = error({"recompute": True, "select_recompute": True, "recompute_granularity": "full",
                 "recompute_method": "block", "recompute_num_layers": 1})
    assert str(err.problems[0]) == (
        "recompute_config: mixes the MindFormers keys (recompute, select_recompute) with the Megatron keys "
        "(recompute_granularity, recompute_method, recompute_num_layers); use one dialect per file")
    assert "recompute_activations" in str(error({"select_recompute": True, "recompute_activations": True}))


def test_only_common_keys_default_to_mindformers():
    assert plan_of({"use_reentrant": True}).dialect == "mindformers"
    assert plan_of({}).dialect == "mindformers"


def test_module_names_are_megatrons():
    assert MEGATRON_MODULES == ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")


# ---------------------------------------------------------------- translation

def test_block_is_the_first_n_layers_of_each_stage():
    plan = plan_of({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 3},
                   num_layers=8, stages=2)
    assert full_layers(plan) == [0, 1, 2, 4, 5, 6]
    assert all(layer.unit == (layer.layer, layer.layer) for layer in plan.layers if layer.full)
    assert plan.formative.layer_recompute == ((3, 3),)
    assert plan.summary == "Megatron recompute: granularity=full, method=block, num_layers=3"


def test_block_with_interleave_is_per_chunk():
    # layer_list [[3, 2], [2, 3]]: chunks start at 0, 3, 5, 7
    plan = plan_of({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2},
                   num_layers=10, stages=2, chunks=2, offset=[[1, 0], [0, 1]])
    assert full_layers(plan) == [0, 1, 3, 4, 5, 6, 7, 8]
    assert plan.formative.layer_recompute == ((2, 2), (2, 2))


def test_block_larger_than_a_stage_recomputes_the_stage():
    plan = plan_of({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 9},
                   num_layers=4, stages=2)
    assert full_layers(plan) == [0, 1, 2, 3]


def test_uniform_groups_of_n_within_each_chunk():
    plan = plan_of({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
                   num_layers=10, stages=2, chunks=2, offset=[[1, 0], [0, 1]])
    assert full_layers(plan) == list(range(10))
    assert [layer.unit for layer in plan.layers] == [
        (0, 1), (0, 1), (2, 2),  # chunk (0, 0): 3 layers
        (3, 4), (3, 4),  # chunk (0, 1)
        (5, 6), (5, 6),  # chunk (1, 0)
        (7, 8), (7, 8), (9, 9),  # chunk (1, 1): 3 layers
    ]
    assert plan.to_json()["layers"][0]["unit"] == [0, 1]


def test_uniform_one_layer_per_unit():
    plan = plan_of({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1})
    assert [layer.unit for layer in plan.layers] == [(0, 0), (1, 1), (2, 2), (3, 3)]


@pytest.mark.parametrize("modules, patterns", [
    (["core_attn"], (r"attention\.flash_attention",)),
    (["layernorm"], (r".*_norm",)),
    (["mlp"], ("feed_forward",)),
    (["mlp", "core_attn"], ("feed_forward", r"attention\.flash_attention")),
    (None, (r"attention\.flash_attention",)),  # the default module list is [core_attn]
])
def test_selective_modules_map_to_op_patterns(modules, patterns):
    recompute = {"recompute_granularity": "selective"}
    if modules is not None:
        recompute["recompute_modules"] = modules
    plan = plan_of(recompute)
    assert all(layer.select == patterns and layer.comm == () and not layer.full for layer in plan.layers)
    assert list(plan.formative.select_recompute) == list(patterns)
    assert plan.formative.layer_recompute == ((0,),)


def test_custom_module_scopes():
    plan = plan_of({"recompute_granularity": "selective", "recompute_modules": ["moe_act", "core_attn"],
                    "module_scopes": {"moe_act": r"feed_forward\.w1\.activation",
                                      "core_attn": ["attn", r"attention\.core"]}})
    assert plan.layers[0].select == (r"feed_forward\.w1\.activation", "attn", r"attention\.core")


def test_bad_module_scopes():
    err = error({"recompute_granularity": "selective", "module_scopes": {"attention": "x", "core_attn": "a("}})
    assert [p.path for p in err.problems] == ["recompute_config.module_scopes.attention",
                                              "recompute_config.module_scopes.core_attn"]
    assert "expected a Megatron module name (core_attn, moe_act" in str(err)
    assert "Component 'a(' does not compile" in str(err)
    err = error({"recompute_granularity": "selective", "module_scopes": ["core_attn"]})
    assert "recompute_config.module_scopes: got ['core_attn']; expected a mapping" in str(err)


def test_megatron_with_swap():
    config = raw_config({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1})
    config["swap_config"] = {"swap": True, "layer_swap": [{"backward_prefetch": 2, "layers": [0, 1]}]}
    plan = build_plan(load_config(config))
    assert plan.layers[0].overridden == ("layer",)
    assert plan.layers[1].overridden == () and plan.layers[1].layer_swap == 2


def test_the_keys_written_are_recorded_but_are_not_a_setting_a_checkpoint_compares():
    """Note [Where a pattern was written]: errors name the key written; a resume compares settings only."""
    from swapkit.train.resume_check import config_record

    config = load_config({"model": {"model_config": {"num_layers": 2}},
                          "recompute_config": {"recompute_granularity": "selective", "module_scopes": {"mlp": "x"}}})
    assert config.recompute.given == ("module_scopes", "recompute_granularity", "module_scopes.mlp")
    assert "given" not in config_record(config)["recompute_config"]


def test_keys_left_unset_with_null_are_not_written():
    """Seed 000's Llama3 recipe turns recompute off with ``recompute_granularity = None`` and
    ``recompute_modules = None``: keys given as null (or false) are Megatron's defaults, not settings."""
    plan = plan_of({"recompute_granularity": None, "recompute_modules": None, "recompute_method": None,
                    "recompute_num_layers": None, "distribute_saved_activations": False})
    assert plan.dialect == "megatron" and not any(layer.recomputes for layer in plan.layers)
    plan = plan_of({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1,
                    "recompute_modules": None})
    assert full_layers(plan) == [0]


def test_module_scopes_without_granularity_is_an_error():
    err = error({"module_scopes": {"core_attn": "attention"}})
    assert [p.path for p in err.problems] == ["recompute_config.module_scopes"]
    assert "has no meaning without recompute_granularity" in str(err)


def test_module_scopes_with_full_granularity_is_warned(caplog):
    with caplog.at_level(logging.WARNING, logger="swapkit"):
        plan = plan_of({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1,
                        "module_scopes": {"core_attn": "attention"}})
    assert full_layers(plan) == [0]
    assert ("recompute_config.module_scopes maps recompute_modules to op scopes, which only "
            "recompute_granularity: selective uses; it does nothing with full: remove it") in caplog.text
