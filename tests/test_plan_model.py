"""`swapkit plan CONFIG --model ...`: resolve a config against a model built on the meta device."""
from __future__ import annotations

import json

import pytest

from swapkit.cli import main

try:
    import transformers  # noqa: F401
    needs_hf = pytest.mark.skipif(False, reason="")
except ImportError:
    needs_hf = pytest.mark.skip(reason="needs transformers (pip install -e '.[hf]')")

CONFIG = ("swap_config: {swap: true, op_swap: [{op_name: attention, backward_prefetch: 2, layers: true}]}\n"
          "recompute_config: {select_comm_recompute: [0]}\n")


def plan_json(capsys, tmp_path, *argv, config=CONFIG):
    path = tmp_path / "c.yaml"
    path.write_text(config)
    status = main(["plan", str(path), "--json", *argv])
    out, err = capsys.readouterr()
    return status, (json.loads(out) if status == 0 else None), err


def test_own_model_by_factory(capsys, tmp_path):
    config = "model: {model_config: {preset: gpt2}}\n" + CONFIG
    status, plan, err = plan_json(capsys, tmp_path, "--model", "tests.user_models:tiny_gpt", config=config)
    assert status == 0, err
    assert [layer["op_swap"] for layer in plan["layers"]] == [[["attn", 2]]] * 3  # counted: 3 layers
    assert plan["layers"][0]["comm"] == ["(ln_1|ln_2)"] and plan["layers"][1]["comm"] == []


@needs_hf
def test_hf_model_type(capsys, tmp_path):
    status, plan, err = plan_json(capsys, tmp_path, "--model", "hf:llama")
    assert status == 0, err
    assert len(plan["layers"]) == 32  # Llama's default config, built on the meta device: no memory
    assert plan["preset"] == "llama" and plan["layers"][5]["op_swap"] == [["self_attn", 2]]
    assert plan["layers"][0]["comm"] == ["(input_layernorm|post_attention_layernorm)"]


@needs_hf
def test_hf_config_json(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt_neox", "hidden_size": 32, "num_hidden_layers": 3,
                                "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 64}))
    status, plan, err = plan_json(capsys, tmp_path, "--model", f"hf:{path}")
    assert status == 0, err
    assert [layer["op_swap"] for layer in plan["layers"]] == [[["attention", 2]]] * 3


@needs_hf
def test_table_and_summary_name_the_preset(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG)
    assert main(["plan", str(path), "--model", "hf:gpt2"]) == 0
    out = capsys.readouterr().out
    table, summary = out.strip().split("\n\n")
    assert len(table.splitlines()) == 13
    assert summary.splitlines()[:3] == [
        "12 layers, 1 pipeline stage(s) x 1 chunk(s); recompute dialect mindformers; swap on; model preset gpt2",
        "full recompute: none", "comm recompute (ln_1|ln_2): layers 0"]
    assert "op swap attn: layers 0-11" in summary
    assert "note: preset gpt2: 'attention' -> 'attn'" in summary


@pytest.mark.parametrize("spec, message", [
    ("nomodule", "--model: 'nomodule': expected pkg.module:factory, hf:<model_type> or hf:<path to config.json>"),
    ("no_such_pkg:f", "--model: 'no_such_pkg:f': cannot import no_such_pkg"),
    ("tests.user_models:nope", "--model: 'tests.user_models:nope': tests.user_models has no attribute 'nope'"),
    ("tests.user_models:torch", "--model: 'tests.user_models:torch': torch is a module, not callable; name a "
                                "function or class that builds the model with no arguments"),
    ("tests.user_models:Block", "--model: 'tests.user_models:Block': Block() raised TypeError: "),
    pytest.param("hf:not_a_model", "--model: hf:not_a_model: not a transformers model_type nor a config.json path; "
                 "e.g. llama, qwen2, gpt2 or a path to a config.json", marks=needs_hf),
    pytest.param("hf:lama", "--model: hf:lama: not a transformers model_type nor a config.json path; did you mean "
                 "llama", marks=needs_hf),
])
def test_bad_model_specs_are_usage_errors(capsys, tmp_path, spec, message):
    status, _, err = plan_json(capsys, tmp_path, "--model", spec)
    assert status == 2
    assert "Traceback" not in err and message in err


@needs_hf
@pytest.mark.parametrize("values, message", [
    ({"hidden_size": "big"}, "transformers refuses this config.json: StrictDataclassFieldValidationError: "
                             "Validation error for field 'hidden_size'"),
    ({"hidden_size": 30}, "transformers refuses this config.json: StrictDataclassClassValidationError: "),
    ({"model_type": "gpt2", "n_embd": 30, "n_head": 4, "n_layer": 2, "vocab_size": 64},
     "transformers cannot build a model from this config: ValueError: `embed_dim` must be divisible by num_heads"),
])
@pytest.mark.parametrize("budget", [[], ["--budget", "1MiB"]], ids=["plan", "budget"])
def test_a_config_json_transformers_refuses_is_a_usage_error_naming_the_file(capsys, tmp_path, values, message,
                                                                             budget):
    """Its values failed inside transformers: exit 1, 'failed: StrictDataclassFieldValidationError', no file."""
    path = tmp_path / "config.json"
    llama = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "vocab_size": 64}
    path.write_text(json.dumps(values if "model_type" in values else {**llama, **values}))
    status, _, err = plan_json(capsys, tmp_path, "--model", f"hf:{path}", *budget)
    assert status == 2, err
    assert f"invalid swapkit command line (1 problem):\n  - --model: hf:{path}: {message}" in err
    assert err.rstrip().endswith("; correct that value in the config") and "Traceback" not in err


def test_a_factory_in_the_current_folder_imports_as_with_python_m(capsys, tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text("from tests.user_models import TinyGPT\n\ndef make():\n"
                                           "    return TinyGPT()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    config = "model: {model_config: {preset: gpt2}}\n" + CONFIG
    status, plan, err = plan_json(capsys, tmp_path, "--model", "my_models:make", config=config)
    assert status == 0, err
    assert len(plan["layers"]) == 3


@needs_hf
def test_a_config_for_another_layer_count_says_how_to_let_swapkit_count(capsys, tmp_path):
    status, _, err = plan_json(capsys, tmp_path, "--model", "hf:gpt2", config="model: {model_config: {num_layers: 4}}\n")
    assert status == 2
    assert ("GPT2LMHeadModel.transformer.h holds 12 layers but the config says model.model_config.num_layers: 4; make them agree, or "
            "leave num_layers out and swapkit counts the layers (on the command line: --set "
            "model.model_config.num_layers=null)") in err


@needs_hf
def test_hf_layer_paths_are_those_of_the_trained_form_as_with_budget(capsys, tmp_path):
    """`--layers model.layers` (the README's --budget example) works without --budget too: both build
    the causal-LM model; before, plain `plan --model hf:` built LlamaModel, whose layers are `layers`."""
    status, plan, err = plan_json(capsys, tmp_path, "--model", "hf:llama", "--layers", "model.layers")
    assert status == 0, err
    assert len(plan["layers"]) == 32 and plan["preset"] == "llama"


def test_without_model_num_layers_is_required(capsys, tmp_path):
    status, _, err = plan_json(capsys, tmp_path)
    assert status == 2
    assert "model.model_config.num_layers: missing; give the layer count, or pass the model" in err


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == "swapkit 0.1.0"


def test_help_texts_have_no_restructuredtext_backticks(capsys):
    for argv in (["--help"], ["plan", "--help"], ["train", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "``" not in capsys.readouterr().out


def test_out_of_range_swap_mode_indices_load_are_kept_and_warned(capsys, tmp_path):
    config = ("model: {model_config: {num_layers: 4}}\nswap_config: {swap: true}\n"
              "recompute_config: {recompute: [0, 9, -1]}\n")
    status, plan, err = plan_json(capsys, tmp_path, config=config)
    assert status == 0, err
    assert plan["formative"]["layer_recompute"] == [0, 9, -1]  # as written, as MindFormers keeps them
    assert [layer["full"] for layer in plan["layers"]] == [True, False, False, False]
    assert ("WARNING - recompute_config.recompute: layer indices [9, -1] match no layer (the model has layers 0-3); "
            "kept as written, as MindFormers does, and they do nothing") in err.splitlines()


def test_megatron_module_scope_that_binds_nowhere_is_an_error(capsys, tmp_path):
    config = ("model: {model_config: {num_layers: 2}}\nrecompute_config: {recompute_granularity: selective, "
              "recompute_modules: [mlp], module_scopes: {mlp: ffn}}\n")
    status, _, err = plan_json(capsys, tmp_path, config=config)
    assert status == 2
    assert "recompute_config.module_scopes pattern 'ffn' matches no sub-module in any layer of LlamaModel.layers; its layers' " \
           "children are: attention, attention_norm, feed_forward, ffn_norm, hidden_dropout" in err


@needs_hf
def test_several_containers_say_how_to_choose_them(capsys, tmp_path):
    status, _, err = plan_json(capsys, tmp_path, "--model", "hf:t5")
    assert status == 2 and "Traceback" not in err
    assert ("several layer containers in T5Model: encoder.block (6 x T5Block), decoder.block (6 x T5Block); say "
            "which hold the layers, in order.") in err
    assert "In a YAML config: set model.model_config.layers_path: [encoder.block, decoder.block]" in err
    assert "num_layers is" not in err and "None" not in err
    status, plan, err = plan_json(capsys, tmp_path, "--model", "hf:t5", "--set",
                                  "model.model_config.layers_path=[encoder.block, decoder.block]")
    assert status == 0, err
    assert len(plan["layers"]) == 12  # what the message says to write works


def test_preset_that_does_not_fit_the_builtin_model(capsys, tmp_path):
    config = "model: {model_config: {num_layers: 2, preset: llama}}\nswap_config: {swap: true}\n"
    status, _, err = plan_json(capsys, tmp_path, config=config)
    assert status == 2
    assert ("op_swap pattern 'self_attn' matches no sub-module in any layer of LlamaModel.layers. The llama model preset "
            "translated '.*\\.flash_attention' (swapkit's default swap op for "
            "swap_config.swap: true) to 'self_attn', but '.*\\.flash_attention' matches this model's layers as "
            "written") in err
    assert "needs no preset: remove model.model_config.preset" in err
