"""Strict config loading (DESIGN §2): unknown keys, MindSpore-only keys, types, files, overrides."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from swapkit import Config, ConfigError, build_plan, load_config
from swapkit.config.types import EngineOptions, MindFormersRecompute

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))
MINIMAL = {"model": {"model_config": {"num_layers": 4}}}


def with_sections(**sections) -> dict:
    raw = {"model": {"model_config": {"num_layers": 4}}}
    raw.update(sections)
    return raw


def problems_of(raw, overrides=()) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(raw, overrides=overrides)
    return [str(problem) for problem in info.value.problems]


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------- shipped configs

@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads_and_plans(path):
    config = load_config(path)
    plan = build_plan(config)
    assert config.source == str(path)
    assert len(plan.layers) == config.model.num_layers
    assert [layer.layer for layer in plan.layers] == list(range(config.model.num_layers))


def test_there_are_shipped_configs():
    assert {p.name for p in CONFIGS} >= {"seed001_recompute_pp.yaml", "seed001_swap_default.yaml",
                                         "seed001_swap_layer.yaml", "seed001_swap_op.yaml",
                                         "seed001_swap_recompute.yaml"}


def test_minimal_config_defaults():
    config = load_config(MINIMAL)
    assert isinstance(config, Config)
    assert config.model.num_layers == 4 and config.model.offset == 0 and config.model.pp_interleave_num == 1
    assert config.parallel.pipeline_stage == 1
    assert config.recompute == MindFormersRecompute()
    assert config.swap.swap is False and config.swap.default_prefetch == 1
    assert config.swap.layer_swap is None and config.swap.op_swap is None
    assert config.runtime.engine == "auto" and config.runtime.engine_options == EngineOptions()
    assert config.train.dtype == "fp32"
    assert config.no_effect == ()


def test_null_sections_mean_defaults():
    config = load_config(with_sections(recompute_config=None, swap_config=None, runtime=None, train=None,
                                       context=None, parallel_config=None))
    assert config.parallel.pipeline_stage == 1 and config.train.steps == 20


def test_dtype_aliases():
    assert load_config(with_sections(train={"dtype": "bfloat16"})).train.dtype == "bf16"


# ---------------------------------------------------------------- unknown keys

@pytest.mark.parametrize("raw, expected", [
    (with_sections(trian={}), "trian: unknown key; did you mean 'train'?"),
    ({"model": {"model_config": {"num_layers": 4, "num_layer": 4}}},
     "model.model_config.num_layer: unknown key; did you mean 'num_layers'?"),
    (with_sections(parallel_config={"pipline_stage": 2}),
     "parallel_config.pipline_stage: unknown key; did you mean 'pipeline_stage'?"),
    (with_sections(recompute_config={"select_recompue": True}),
     "recompute_config.select_recompue: unknown key; did you mean 'select_recompute'?"),
    (with_sections(swap_config={"swap": True, "op_swap": [{"op_name": "a", "backward_prefetch": 1, "layers": [0],
                                                            "layer": [1]}]}),
     "swap_config.op_swap[0].layer: unknown key; did you mean 'layers'?"),
    (with_sections(runtime={"engine_options": {"latency": 1}}),
     "runtime.engine_options.latency: unknown key; did you mean 'latency_s'?"),
    (with_sections(context={"memory_optimise_level": "O0"}),
     "context.memory_optimise_level: unknown key; did you mean 'memory_optimize_level'?"),
    (with_sections(train={"stesp": 3}), "train.stesp: unknown key; did you mean 'steps'?"),
])
def test_unknown_keys_suggest_the_closest(raw, expected):
    assert expected in problems_of(raw)


@pytest.mark.parametrize("raw, expected", [
    ({"swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": True}]},
     ["swap: unknown key here; 'swap' is a key of swap_config: move it to swap_config.swap",
      "layer_swap: unknown key here; 'layer_swap' is a key of swap_config: move it to swap_config.layer_swap"]),
    ({"recompute_method": "block", "recompute_granularity": "full", "recompute_num_layers": 1},
     ["recompute_method: unknown key here; 'recompute_method' is a key of recompute_config: move it to "
      "recompute_config.recompute_method",
      "recompute_granularity: unknown key here; 'recompute_granularity' is a key of recompute_config: move it to "
      "recompute_config.recompute_granularity",
      "recompute_num_layers: unknown key here; 'recompute_num_layers' is a key of recompute_config: move it to "
      "recompute_config.recompute_num_layers"]),
    ({"model_config": {"num_layers": 4}},
     ["model_config: unknown key here; 'model_config' is a key of model: move it to model.model_config"]),
    (with_sections(swap_config={"swap": True, "recompute": True}),
     ["swap_config.recompute: unknown key here; 'recompute' is a key of recompute_config: move it to "
      "recompute_config.recompute"]),
    (with_sections(runtime={"latency_s": 0.1}),
     ["runtime.latency_s: unknown key here; 'latency_s' is a key of runtime.engine_options: move it to "
      "runtime.engine_options.latency_s"]),
    ({"model": {"model_config": {"num_layers": 4}}, "steps": 3, "pipeline_stage": 1},
     ["steps: unknown key here; 'steps' is a key of train: move it to train.steps",
      "pipeline_stage: unknown key here; 'pipeline_stage' is a key of parallel_config: move it to "
      "parallel_config.pipeline_stage"]),
])
def test_a_key_in_the_wrong_section_names_its_section(raw, expected):
    """schema Note [Keys written in the wrong section]: before, `layer_swap` at the top level got
    "did you mean 'layer_scale'?" (a MindFormers trainer key) and `swap` a list of 40 trainer keys."""
    assert problems_of(raw) == expected


def test_unknown_key_without_a_close_match_lists_the_known_keys():
    (message,) = problems_of(with_sections(runtime={"zzz": 1}))
    assert message.startswith("runtime.zzz: unknown key; known keys: engine, engine_options, max_host_bytes")


# ---------------------------------------------------------------- MindSpore-only keys

NO_EFFECT = {
    "context": {"memory_optimize_level": "O0", "mode": 0, "device_target": "Ascend"},
    "recompute_config": {"recompute": True, "mp_comm_recompute": True, "parallel_optimizer_comm_recompute": False,
                         "recompute_slice_activation": True},
    "parallel_config": {"pipeline_stage": 1, "data_parallel": 8, "model_parallel": 1, "use_seq_parallel": True},
    "seed": 0,
    "trainer": {"type": "CausalLanguageModelingTrainer"},
}
NO_EFFECT_PATHS = [
    "seed", "trainer", "model.model_config.use_flash_attention", "model.model_config.compute_dtype", "model.arch",
    "parallel_config.model_parallel", "parallel_config.use_seq_parallel",
    "recompute_config.mp_comm_recompute", "recompute_config.parallel_optimizer_comm_recompute",
    "recompute_config.recompute_slice_activation", "context.memory_optimize_level", "context.mode",
    "context.device_target",
]


def test_mindspore_only_keys_load_and_are_listed(caplog):
    raw = {"model": {"arch": {"type": "LlamaForCausalLM"},
                     "model_config": {"num_layers": 4, "use_flash_attention": True, "compute_dtype": "bfloat16"}},
           **NO_EFFECT}
    with caplog.at_level(logging.WARNING, logger="swapkit"):
        config = load_config(raw)
    assert sorted(config.no_effect) == sorted(NO_EFFECT_PATHS)
    assert config.recompute.recompute is True
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for path in NO_EFFECT_PATHS:
        matching = [w for w in warnings if w.startswith(f"{path} has no effect in PyTorch eager")]
        assert len(matching) == 1, (path, warnings)
    assert len(warnings) == len(NO_EFFECT_PATHS)


def test_the_trainer_and_model_keys_of_mindformers_llama_family_files_load():
    """DESIGN §2: a MindFormers file loads unchanged. MindFormers' own Llama-family training YAMLs (llama2,
    llama3.1, mixtral, qwen2.5) carry these keys, and each was an unknown key: none of those files loaded."""
    raw = {
        "auto_tune": False, "filepath_prefix": "./autotune", "autotune_per_step": 10, "profile_communication": False,
        "profile_memory": True, "profiler_level": 1, "remote_save_url": "obs://bucket", "eval_callbacks": [
            {"type": "ObsMonitor"}], "ignore_data_skip": False, "load_ckpt_format": "safetensors", "use_legacy": True,
        "transform_process_num": 1,
        "parallel_config": {"pipeline_stage": 1, "seq_split_num": 1},
        "model": {"model_config": {
            "num_layers": 4, "emb_dropout_prob": 0.0, "rotary_pct": 1.0, "rotary_emb_base": 1000000,
            "max_position_embedding": 131072, "initializer_range": 0.02, "compute_in_2d": True, "kv_channels": 128,
            "tie_word_embeddings": False, "use_ring_attention": False, "use_attn_mask_compression": True,
            "use_eod_attn_mask_compression": False, "residual_dtype": None, "attn_proj_has_bias": False,
            "parallel_optimizer": False, "init_method_std": 0.01, "quant_config": None, "llm_backend": "",
            "input_sliced_sig": False, "rmsnorm_compute_2d": False, "chunk_prefill": False,
            "calculate_per_token_loss": False, "return_hidden_states": False, "moe_config": {"expert_num": 8}}},
    }
    config = load_config(raw)
    assert "profile_memory" in config.no_effect and "model.model_config.rotary_emb_base" in config.no_effect
    assert "parallel_config.seq_split_num" in config.no_effect


@pytest.mark.parametrize("section, path, key", [
    ({"seed": 42}, "seed", "train.seed"),
    ({"model": {"model_config": {"num_layers": 4, "batch_size": 2}}}, "model.model_config.batch_size",
     "train.batch_size"),
    ({"model": {"model_config": {"num_layers": 4, "compute_dtype": "bfloat16"}}}, "model.model_config.compute_dtype",
     "train.dtype"),
    ({"runner_config": {"batch_size": 2, "epochs": 1}}, "runner_config", "train.batch_size and train.steps"),
    ({"optimizer": {"type": "AdamW", "learning_rate": 1e-4}}, "optimizer", "train.lr and train.weight_decay"),
])
def test_a_mindformers_trainer_key_names_swapkits_own(caplog, section, path, key):
    """A MindFormers file's ``seed: 42`` was only "ignored": swapkit train then trained with seed 0 and the
    warning did not say which key it reads."""
    raw = {"model": {"model_config": {"num_layers": 4}}, **section}
    with caplog.at_level(logging.WARNING, logger="swapkit"):
        load_config(raw)
    assert caplog.messages == [f"{path} has no effect in PyTorch eager; accepted and ignored: swapkit train "
                               f"reads {key} instead"]


@pytest.mark.parametrize("parallel, expected", [
    ({"micro_batch_num": 4}, ["parallel_config.micro_batch_num: 4 has no effect with pipeline_stage 1 and "
                              "data_parallel 1 (one process, no pipeline); to split a step into micro-batches "
                              "there, set train.gradient_accumulation_steps instead"]),
    ({"pipeline_schedule": "gpipe"}, ["parallel_config.pipeline_schedule: gpipe has no effect with pipeline_stage 1 "
                                      "(no pipeline); drop it, or set pipeline_stage above 1"]),
    ({"micro_batch_num": 1}, []),  # one micro-batch is what one process runs anyway
    ({"micro_batch_num": 4, "pipeline_stage": 2, "pipeline_schedule": "gpipe"}, []),
    ({"micro_batch_num": 4, "data_parallel": 2}, []),  # several ranks: each replica runs 4
])
def test_pipeline_keys_without_a_pipeline_are_warned(parallel, expected, caplog):
    raw = {"model": {"model_config": {"num_layers": 4}}, "parallel_config": parallel}
    with caplog.at_level(logging.WARNING, logger="swapkit"):
        load_config(raw)
    assert [r.getMessage() for r in caplog.records] == expected


def test_seed_config_with_context_warns_once(caplog):
    with caplog.at_level(logging.WARNING, logger="swapkit"):
        config = load_config(Path(CONFIGS[0]).parent / "seed001_swap_default.yaml")
    assert config.no_effect == ("context.memory_optimize_level",)
    assert [r.getMessage() for r in caplog.records] == [
        "context.memory_optimize_level has no effect in PyTorch eager; accepted and ignored"]


@pytest.mark.parametrize("raw, expected", [
    (with_sections(context={"memory_optimize_level": "O3"}),
     "context.memory_optimize_level: got 'O3'; expected one of 'O0', 'O1'"),
    (with_sections(recompute_config={"mp_comm_recompute": 1}),
     "recompute_config.mp_comm_recompute: got 1; expected true or false"),
    (with_sections(parallel_config={"model_parallel": 0}),  # data_parallel is swapkit's own key now (FSDP2)
     "parallel_config.model_parallel: got 0; expected an integer >= 1"),
    (with_sections(parallel_config={"data_parallel": 0}),
     "parallel_config.data_parallel: got 0; expected an integer from 1 to 65536"),
    (with_sections(seed=-1), "seed: got -1; expected an integer >= 0"),
    (with_sections(context=["O0"]), "context: got ['O0']; expected a mapping of keys to values"),
])
def test_mindspore_only_keys_are_type_checked(raw, expected):
    assert expected in problems_of(raw)


def test_invalid_no_effect_key_is_not_listed():
    with pytest.raises(ConfigError):
        load_config(with_sections(recompute_config={"mp_comm_recompute": "yes"}))


# ---------------------------------------------------------------- wrong types

@pytest.mark.parametrize("raw, expected", [
    ({"model": {"model_config": {"num_layers": True}}}, "model.model_config.num_layers: got true; expected an integer"),
    ({"model": {"model_config": {"num_layers": "4"}}}, "model.model_config.num_layers: got '4'; expected an integer"),
    ({"model": {"model_config": {"num_layers": 4.0}}}, "model.model_config.num_layers: got 4.0; expected an integer"),
    ({"model": {"model_config": {"num_layers": 0}}}, "model.model_config.num_layers: got 0; expected an integer from 1 to 1024"),
    ({"model": {"model_config": {"num_layers": 4, "pp_interleave_num": False}}},
     "model.model_config.pp_interleave_num: got false; expected an integer from 1 to 64"),
    ({"model": {"model_config": {"num_layers": 4, "hidden_size": 30, "num_heads": 4}}},
     "model.model_config.hidden_size: got 30; expected a multiple of num_heads (4) with an even head size"),
    ({"model": {"model_config": {"num_layers": 4, "rms_norm_eps": 0}}},
     "model.model_config.rms_norm_eps: got 0; expected a number > 0"),
    ({"model": {"model_config": {"num_layers": 4, "hidden_dropout": 1.0}}},
     "model.model_config.hidden_dropout: got 1.0; expected a number >= 0 and < 1"),
    ({"model": {"model_config": {"num_layers": 4, "layers_path": ""}}},
     "model.model_config.layers_path: got ''; expected a non-empty string"),
    ({"model": {"model_config": {"num_layers": 4, "layers_path": ["a.b", "a.b"]}}},
     "model.model_config.layers_path: got ['a.b', 'a.b']; expected a non-empty string or a list of distinct"),
    ({"model": {"model_config": {"num_layers": 4, "layers_path": []}}},
     "model.model_config.layers_path: got []; expected a non-empty string or a list of distinct"),
    (with_sections(parallel_config={"pipeline_stage": "2"}), "parallel_config.pipeline_stage: got '2'; expected an int"),
    (with_sections(parallel_config={"pipeline_stage": True}), "parallel_config.pipeline_stage: got true; expected an"),
    (with_sections(swap_config={"swap": "yes"}), "swap_config.swap: got 'yes'; expected true or false"),
    (with_sections(swap_config={"swap": 1}), "swap_config.swap: got 1; expected true or false"),
    (with_sections(swap_config={"default_prefetch": True}),
     "swap_config.default_prefetch: got true; expected an integer >= 1"),
    (with_sections(runtime={"engine": "gpu"}), "runtime.engine: got 'gpu'; expected one of 'auto', 'cuda', 'thread'"),
    (with_sections(runtime={"engine": "threads"}),  # a misspelt choice gets a did-you-mean, as a misspelt key does
     "runtime.engine: got 'threads'; expected one of 'auto', 'cuda', 'thread'. Did you mean 'thread'?"),
    (with_sections(parallel_config={"pipeline_schedule": "1F1B"}),
     "parallel_config.pipeline_schedule: got '1F1B'; expected one of 'gpipe', '1f1b', 'interleaved_1f1b'. Did you "
     "mean '1f1b'?"),
    (with_sections(runtime={"min_offload_bytes": -1}), "runtime.min_offload_bytes: got -1; expected an integer >= 0"),
    (with_sections(runtime={"max_host_bytes": 0}), "runtime.max_host_bytes: got 0; expected an integer >= 1"),
    (with_sections(runtime={"max_host_bytes": "4GiB"}),  # a size as --budget takes it: the bytes to write
     "runtime.max_host_bytes: got '4GiB'; expected a whole byte count >= 1. This key takes plain bytes, not a size "
     "with a unit: write 4294967296"),
    (with_sections(runtime={"min_offload_bytes": "1.5 kb"}),
     "runtime.min_offload_bytes: got '1.5 kb'; expected a whole byte count >= 0. This key takes plain bytes, not a "
     "size with a unit: write 1500"),
    (with_sections(runtime={"min_offload_bytes": "512b"}),  # bytes written with the unit b: the bytes
     "runtime.min_offload_bytes: got '512b'; expected a whole byte count >= 0. This key takes plain bytes, not a "
     "size with a unit: write 512"),
    (with_sections(runtime={"max_host_bytes": "0.0001KiB"}),  # under one byte: not "write 0", which is refused too
     "runtime.max_host_bytes: got '0.0001KiB'; expected a whole byte count >= 1. This key takes plain bytes, not a "
     "size with a unit: that is 0.1024 bytes; write a whole number of bytes >= 1"),
    (with_sections(runtime={"max_host_bytes": "0kb"}),  # whole, but under the minimum
     "runtime.max_host_bytes: got '0kb'; expected a whole byte count >= 1. This key takes plain bytes, not a "
     "size with a unit: that is 0 bytes; write a whole number of bytes >= 1"),
    (with_sections(runtime={"min_offload_bytes": "9" * 5000 + "GiB"}),  # its bytes: more digits than str(int) writes
     "runtime.min_offload_bytes: got '" + "9" * 27 + "..." + "9" * 25 + "GiB'; expected an integer >= 0"),
    (with_sections(runtime={"engine_options": {"latency_s": -1}}),
     "runtime.engine_options.latency_s: got -1; expected a number >= 0"),
    (with_sections(runtime={"engine_options": {"bandwidth_gbps": float("nan")}}),
     "runtime.engine_options.bandwidth_gbps: got nan; expected a number >= 0.001"),
    (with_sections(train={"lr": 0}), "train.lr: got 0; expected a number > 0"),
    (with_sections(train={"dtype": "fp16"}), "train.dtype: got 'fp16'; expected one of 'fp32', 'bf16'"),
    (with_sections(train={"steps": 1.5}), "train.steps: got 1.5; expected an integer >= 1"),
    (with_sections(train={"device": "npu"}), "train.device: got 'npu'; expected one of 'cpu', 'cuda'"),
    (with_sections(recompute_config={"use_reentrant": "no"}),
     "recompute_config.use_reentrant: got 'no'; expected true or false"),
    (with_sections(recompute_config=True), "recompute_config: got true; expected a mapping of keys to values"),
    (with_sections(swap_config=[1]), "swap_config: got [1]; expected a mapping of keys to values"),
    ({"model": {"model_config": None}}, "model.model_config: got null; expected a mapping"),
    ({"model": {"model_config": 3}}, "model.model_config: got 3; expected a mapping"),
])
def test_wrong_types(raw, expected):
    problems = problems_of(raw)
    assert any(p.startswith(expected) for p in problems), problems


def test_a_choice_suggests_only_a_close_option():
    """fp16 is no misspelling of bf16: no did-you-mean that would change the number format."""
    problems = problems_of(with_sections(train={"dtype": "fp16"}))
    assert "train.dtype: got 'fp16'; expected one of 'fp32', 'bf16'" in problems, problems


def test_num_layers_is_optional_at_load_and_required_to_plan():
    # a model given to apply() or `swapkit plan --model` counts its layers; without one the plan needs it
    config = load_config({"model": {"model_config": {}}, "swap_config": {"swap": True}})
    assert config.model.num_layers is None
    for short in ({"swap_config": {"swap": True}}, {"model": {}, "swap_config": {"swap": True}}):
        assert load_config(short) == config  # the model section may be left out altogether
    with pytest.raises(ConfigError) as info:
        build_plan(config)
    assert "model.model_config.num_layers: missing; give the layer count, or pass the model to swapkit.apply" \
        in str(info.value)


def test_long_values_are_shortened():
    (message,) = problems_of(with_sections(train={"device": "x" * 200}))
    assert message.startswith("train.device: got 'xxxx")
    assert "..." in message and len(message) < 200


# ---------------------------------------------------------------- one error for all problems

def test_all_problems_of_a_file_in_one_error(tmp_path):
    path = write(tmp_path, """
model:
  model_config:
    num_layers: 4
    hiden_size: 32
parallel_config:
  pipeline_stage: 2
recompute_config:
  recompute: [[0, 1]]
  mp_comm_recompute: maybe
swap_config:
  swap: true
  default_prefetch: 0
  op_swap:
    - op_name: 'attention('
      backward_prefetch: -1
      layers: [0, 7]
runtime:
  engine: tpu
""")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    paths = [p.path for p in err.problems]
    assert paths == [
        "model.model_config.hiden_size",
        "recompute_config.mp_comm_recompute",
        "swap_config.default_prefetch",
        "swap_config.op_swap[0].op_name",  # in the order the keys are written
        "swap_config.op_swap[0].backward_prefetch",
        "swap_config.op_swap[0].layers",
        "runtime.engine",
        "recompute_config.recompute",
    ]
    text = str(err)
    assert text.startswith(f"invalid swapkit config in {path} (8 problems):\n  - model.model_config.hiden_size")
    assert "did you mean 'hidden_size'?" in text
    assert err.source == str(path)


def test_semantic_and_type_problems_together():
    problems = problems_of({"model": {"model_config": {"num_layers": 8, "offset": [1, 2]}},
                            "parallel_config": {"pipeline_stage": 4}, "train": {"steps": 0}})
    assert [p.split(":")[0] for p in problems] == ["train.steps", "model.model_config.offset"]


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# ---------------------------------------------------------------- files

def test_yaml_syntax_error(tmp_path):
    path = write(tmp_path, "model:\n  model_config:\n    num_layers: [4\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (problem,) = info.value.problems
    assert str(problem).startswith("YAML syntax error at line 4, column 1:")
    assert str(path) in str(info.value)


def test_yaml_tab_indentation_is_a_syntax_error(tmp_path):
    path = write(tmp_path, "model:\n\tmodel_config: {}\n")
    with pytest.raises(ConfigError, match=r"YAML syntax error at line 2"):
        load_config(path)


@pytest.mark.parametrize("text, fix", [
    ("model:\n\tmodel_config: {}\n", "YAML syntax error at line 2, column 1: found character '\\t' that cannot "
     "start any token. YAML indents with spaces: replace the tab with spaces"),
    ("model: {model_config: {num_layers: 2}}\n---\ntrain: {}\n", "YAML syntax error at line 2, column 1: expected a "
     "single document in the stream but found another document. A config is one YAML document: remove the '---' "
     "line and merge the documents"),
])
def test_yaml_syntax_errors_say_the_fix(tmp_path, text, fix):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert [str(p) for p in info.value.problems] == [fix]


def test_a_pattern_in_double_quotes_says_to_use_single_quotes(tmp_path):
    """In YAML double quotes a backslash starts an escape, and MindFormers' patterns are full of them."""
    path = write(tmp_path, 'model: {model_config: {num_layers: 2}}\nrecompute_config:\n  select_recompute:\n'
                           '    "feed_forward\\.mul": true\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert [str(p) for p in info.value.problems] == [
        "YAML syntax error at line 4, column 19: found unknown escape character '.'. In double quotes a backslash "
        "starts an escape: write an op pattern in single quotes ('feed_forward\\.mul') or unquoted"]


def test_a_doubled_backslash_in_a_pattern_says_to_write_one(tmp_path):
    """The log lines show patterns as Python's repr, which doubles the backslash; copied into single quotes,
    the pattern's first component ended in a lone backslash: 'bad escape (end of pattern)'."""
    path = write(tmp_path, "model: {model_config: {num_layers: 2}}\nrecompute_config:\n  select_recompute:\n"
                           "    'feed_forward\\\\.mul': true\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (problem,) = info.value.problems
    assert str(problem).endswith(
        "a backslash doubled as in the log lines (Python's repr doubles it): write one, feed_forward\\.mul")


def test_two_merge_keys_in_one_mapping_are_a_duplicate_key(tmp_path):
    """Two ``<<`` keys are a duplicate key like any other (PyYAML silently let the second one's values win)."""
    path = write(tmp_path, "model:\n  model_config:\n    <<: {num_layers: 2}\n    <<: {num_layers: 3}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert [str(p) for p in info.value.problems] == [
        "YAML error at line 4, column 5: duplicate key '<<' (first given at line 3); merge several mappings with "
        "one key: <<: [*a, *b]"]


@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n"])
def test_empty_file(tmp_path, text):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert [str(p) for p in info.value.problems] == [
        "the config is empty; expected a mapping with at least model.model_config.num_layers"]


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value.problems[0]) == f"config file not found: {path}"


def test_directory(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(str(tmp_path))
    assert str(info.value.problems[0]) == f"{tmp_path} is a directory; expected a YAML file"


def test_not_utf8(tmp_path):
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"\xff\xfe\x00model")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value.problems[0]).startswith(f"cannot read {path}:")


def test_duplicate_keys(tmp_path):
    path = write(tmp_path, "model:\n  model_config:\n    num_layers: 2\n    num_layers: 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value.problems[0]) == (
        "YAML error at line 4, column 5: duplicate key 'num_layers' (first given at line 3)")


def test_duplicate_top_level_sections(tmp_path):
    path = write(tmp_path, "model: {model_config: {num_layers: 2}}\ntrain: {}\ntrain: {steps: 3}\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'train' \(first given at line 2\)"):
        load_config(path)


def test_unhashable_key_is_a_config_error(tmp_path):
    path = write(tmp_path, "? [a, b]\n: 1\nmodel: {model_config: {num_layers: 2}}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "found unhashable key" in str(info.value)


def test_yaml_merge_keys_work(tmp_path):
    path = write(tmp_path, """
train: &common {steps: 3, batch_size: 2}
model:
  model_config: {num_layers: 2}
recompute_config:
  select_recompute:
    <<: {attention: true, feed_forward: [1]}
    feed_forward: [0]
""")
    config = load_config(path)
    assert config.recompute.select_recompute == {"attention": True, "feed_forward": [0]}


@pytest.mark.parametrize("text, shown", [("- a\n- b\n", "['a', 'b']"), ("hello\n", "'hello'"), ("3\n", "3")])
def test_top_level_must_be_a_mapping(tmp_path, text, shown):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert [str(p) for p in info.value.problems] == [f"got {shown}; expected a mapping of keys to values"]


def test_yaml_path_as_str_and_path(tmp_path):
    path = write(tmp_path, "model: {model_config: {num_layers: 3}}\n")
    assert load_config(str(path)).model.num_layers == 3
    assert load_config(path).model.num_layers == 3


def test_dict_input_is_not_modified():
    raw = {"model": {"model_config": {"num_layers": 2}}, "recompute_config": {"recompute": [1]}}
    load_config(raw, overrides=["model.model_config.num_layers=4", "train.steps=2"])
    assert raw == {"model": {"model_config": {"num_layers": 2}}, "recompute_config": {"recompute": [1]}}


# ---------------------------------------------------------------- --set overrides

def test_overrides_are_yaml_values(tmp_path):
    path = write(tmp_path, "model: {model_config: {num_layers: 3}}\n")
    config = load_config(path, overrides=["model.model_config.num_layers=6", "swap_config.swap=true",
                                          "recompute_config.recompute=[1, 0]", "parallel_config.pipeline_stage=2",
                                          "train.lr=1e-3", "runtime.engine=thread"])
    assert config.model.num_layers == 6
    assert config.swap.swap is True
    assert config.recompute.recompute == [1, 0]
    assert config.parallel.pipeline_stage == 2
    assert config.train.lr == 0.001
    assert config.runtime.engine == "thread"


def test_an_override_key_keeps_an_op_pattern_whole(tmp_path):
    r"""``--set recompute_config.select_recompute.feed_forward\.mul=[1]`` split the pattern at its ``\.``
    separator into the keys ``feed_forward\`` and ``mul``: a dot after a backslash is the pattern's, not a key path's."""
    path = write(tmp_path, "model: {model_config: {num_layers: 3}}\nrecompute_config:\n  select_recompute:\n"
                           "    'feed_forward\\.mul': true\n")
    config = load_config(path, overrides=[r"recompute_config.select_recompute.feed_forward\.mul=[1]",
                                          r"recompute_config.select_recompute.attention\.wq=[2]"])
    assert config.recompute.select_recompute == {r"feed_forward\.mul": [1], r"attention\.wq": [2]}
    problems = problems_of(MINIMAL, overrides=[r"recompute_config.select_recompute.feed_forward\.w9=x"])
    assert problems == [r"recompute_config.select_recompute.feed_forward\.w9 (from overrides[0] "
                        r"'recompute_config.select_recompute.feed_forward\\.w9=x'): got 'x'; expected true/false, "
                        "a list of per-stage counts (at most 1) or a [1][1] grid of per-chunk counts"]


def test_overrides_are_validated_like_the_file():
    problems = problems_of(MINIMAL, overrides=["train.steps=0", "swap_config.sawp=true"])
    assert sorted(problems) == [
        "swap_config.sawp (from overrides[1] 'swap_config.sawp=true'): unknown key; did you mean 'swap'?",
        "train.steps (from overrides[0] 'train.steps=0'): got 0; expected an integer >= 1"]


def test_overrides_given_as_one_string_name_the_fix():
    """A str is a sequence of characters: read as overrides it gave one '--set: got 's'' problem per letter."""
    with pytest.raises(TypeError, match=r"overrides: got the string 'train.steps=5'; expected a list of "
                                        r"'dotted.key=value' strings: overrides=\['train.steps=5'\]"):
        load_config(MINIMAL, overrides="train.steps=5")


def test_yaml_12_floats(tmp_path):
    # Note [YAML 1.1 scalars]: `1e-3` without a dot is a float, in files and in --set
    path = write(tmp_path, "model: {model_config: {num_layers: 3, rms_norm_eps: 1e-6}}\ntrain: {lr: 2E-4}\n")
    config = load_config(path, overrides=["train.weight_decay=1e-2"])
    assert (config.model.rms_norm_eps, config.train.lr, config.train.weight_decay) == (1e-6, 2e-4, 1e-2)


def test_booleans_are_read_as_pyyaml_and_mindformers_read_them(tmp_path):
    """Note [YAML 1.1 booleans]: yes/no/on/off are booleans (as in MindFormers), y/n are text."""
    path = write(tmp_path, "model: {model_config: {num_layers: 2}}\nswap_config: {swap: yes}\n"
                           "recompute_config: {use_reentrant: On, recompute: NO}\nruntime: {verify: off}\n")
    config = load_config(path)
    assert (config.swap.swap, config.recompute.use_reentrant, config.recompute.recompute, config.runtime.verify) == (
        True, True, False, False)
    assert load_config(path, overrides=["swap_config.swap=off"]).swap.swap is False
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()  # says so, not "YAML 1.2" for all
    assert ("Booleans are read as PyYAML (YAML 1.1) and so MindFormers reads them, so a MindFormers file means the "
            "same here: `true`/`false`, `yes`/`no`, `on`/`off` (lower, Title or UPPER case) are booleans; `y`, `n` and "
            "quoted words are text") in readme


@pytest.mark.parametrize("text, expected", [
    ("swap_config: {swap: y}", "swap_config.swap: got 'y'; expected true or false. Write true or false, unquoted (y, n "
                               "and quoted words are text; unquoted yes/no/on/off are booleans, as PyYAML and "
                               "MindFormers read them)"),
    ("recompute_config: {use_reentrant: 'yes'}", "recompute_config.use_reentrant: got 'yes'; expected true or false. "
                                                 "Write true or false, unquoted"),
    ("train: {dtype: off}", "train.dtype: got false; expected one of 'fp32', 'bf16'. An unquoted true/false, yes/no or "
                            "on/off is a boolean in YAML; quote it ('off') if you mean the text"),
    ("train: {save_dir: no}", "train.save_dir: got false; expected a non-empty string. An unquoted true/false"),
])
def test_boolean_and_text_mixups_say_what_to_write(tmp_path, text, expected):
    path = write(tmp_path, f"model: {{model_config: {{num_layers: 2}}}}\n{text}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (problem,) = info.value.problems
    assert str(problem).startswith(expected), str(problem)


def test_override_into_a_null_section():
    config = load_config({"model": {"model_config": {"num_layers": 2}}, "train": None}, overrides=["train.steps=7"])
    assert config.train.steps == 7


@pytest.mark.parametrize("override, expected", [
    ("train.steps", "overrides[1]: got 'train.steps'; expected dotted.key=value, for example train.steps=5"),
    ("=3", "overrides[1]: got '=3'; expected dotted.key=value"),
    ("train..steps=3", "overrides[1]: got 'train..steps=3'; expected dotted.key=value"),
    ("train.steps=[", "overrides[1] train.steps: got '['; expected a YAML value. YAML syntax error"),
    ("model.model_config.num_layers.x=1",
     "overrides[1] 'model.model_config.num_layers.x=1': got 4; expected model.model_config.num_layers to be a mapping"),
])
def test_bad_overrides(override, expected):
    problems = problems_of(MINIMAL, overrides=["train.steps=2", override])
    assert len(problems) == 1 and problems[0].startswith(expected), problems


@pytest.mark.parametrize("override, expected", [
    ("train.steps", "--set: got 'train.steps'; expected dotted.key=value, for example train.steps=5"),
    ("train.steps=[", "--set train.steps: got '['; expected a YAML value. YAML syntax error"),
    ("model.model_config.num_layers.x=1",
     "--set model.model_config.num_layers.x=1: got 4; expected model.model_config.num_layers to be a mapping"),
    ("train.steps=0", "train.steps (from --set train.steps=0): got 0; expected an integer >= 1"),
])
def test_overrides_from_the_command_line_name_set(override, expected):
    """loader Note [Naming an override]: the CLI's items name --set, and the error the command line."""
    from swapkit.config.loader import CommandLineOverrides

    with pytest.raises(ConfigError) as info:
        load_config(MINIMAL, overrides=CommandLineOverrides(["train.steps=2", override]))
    assert str(info.value).startswith("invalid swapkit command line (1 problem):\n  - " + expected), info.value


def test_overrides_from_python_name_the_argument_not_a_command_line():
    """loader Note [Naming an override]: load_config(..., overrides=[...]) has no --set to blame."""
    with pytest.raises(ConfigError) as info:
        load_config(MINIMAL, overrides=["train.steps=2", "swap_config.sawp=true"])
    assert str(info.value) == ("invalid swapkit overrides (1 problem):\n"
                               "  - swap_config.sawp (from overrides[1] 'swap_config.sawp=true'): unknown key; "
                               "did you mean 'swap'?")
    assert "--set" not in str(info.value) and "command line" not in str(info.value)
    with pytest.raises(ConfigError) as info:  # a problem of the file's own beside it: the config is named
        load_config(with_sections(train={"lr": -1}), overrides=["swap_config.sawp=true"])
    assert str(info.value).startswith("invalid swapkit config (2 problems):")


def test_an_override_of_one_list_item_is_refused_naming_the_list():
    """loader Note [A list item on the command line]: it wrote a key named 'layer_swap[0]' and blamed the file."""
    raw = with_sections(swap_config={"swap": True, "layer_swap": [{"backward_prefetch": 2, "layers": [0]}]})
    (problem,) = problems_of(raw, overrides=["swap_config.layer_swap[0].backward_prefetch=3"])
    assert problem == ("overrides[0]: got 'swap_config.layer_swap[0].backward_prefetch=3'; expected mapping keys "
                       "only; swap_config.layer_swap is a list, and an override cannot set one of its items. Set the "
                       "whole list: 'swap_config.layer_swap=[...]' (it is now [{'backward_prefetch': 2, 'layers': [0]}])")
    # a pattern key with brackets under a mapping is an ordinary key
    config = load_config(with_sections(swap_config={"swap": True}), overrides=["recompute_config.select_recompute.w[13]=[0]"])
    assert config.recompute.select_recompute == {"w[13]": [0]}


def test_an_override_of_one_list_item_by_a_dotted_index_is_refused_naming_the_list():
    """``swap_config.layer_swap.0.backward_prefetch=3`` (an index as a dotted part) said only that the list
    was expected to be a mapping; it gets the fix the ``[0]`` form gets."""
    raw = with_sections(swap_config={"swap": True, "layer_swap": [{"backward_prefetch": 2, "layers": [0]}]})
    (problem,) = problems_of(raw, overrides=["swap_config.layer_swap.0.backward_prefetch=3"])
    assert problem == ("overrides[0]: got 'swap_config.layer_swap.0.backward_prefetch=3'; expected mapping keys "
                       "only; swap_config.layer_swap is a list, and an override cannot set one of its items. Set the "
                       "whole list: 'swap_config.layer_swap=[...]' (it is now [{'backward_prefetch': 2, 'layers': [0]}])")


def test_spaces_around_the_dots_of_an_override_key_are_ignored():
    """``--set ' swap_config . swap =true'`` wrote a key 'swap_config ' and blamed the file for it."""
    config = load_config(MINIMAL, overrides=[" swap_config . swap =true"])
    assert config.swap.swap is True


@pytest.mark.parametrize("sections, expected", [
    ({"recompute_config": {"select_recompute": [r"feed_forward\.mul", "attention", r"feed_forward\.mul"]}},
     r"recompute_config.select_recompute lists ['feed_forward\\.mul'] more than once (['feed_forward\\.mul', "
     r"'attention', 'feed_forward\\.mul']); a pattern is recomputed once, the repeats do nothing: list each "
     "pattern once"),
    ({"swap_config": {"swap": True, "op_swap": [{"op_name": ["attention", "attention"], "backward_prefetch": 1,
                                                  "layers": True}]}},
     "swap_config.op_swap[0].op_name lists ['attention'] more than once (['attention', 'attention']); a pattern is "
     "swapped once, the repeats do nothing: list each pattern once"),
])
def test_a_pattern_listed_twice_is_warned(caplog, sections, expected):
    """As a module listed twice in recompute_modules and a layer listed twice in layers are."""
    with caplog.at_level(logging.WARNING, logger="swapkit"):
        config = load_config({"model": {"model_config": {"num_layers": 4}}, **sections})
    assert config.warnings == (expected,)
    assert caplog.messages == [expected]


def test_bad_overrides_are_collected_with_other_problems():
    problems = problems_of(with_sections(train={"lr": -1}), overrides=["nonsense", "train.steps=x"])
    assert problems[0].startswith("overrides[0]: got 'nonsense'")
    assert "train.steps (from overrides[1] 'train.steps=x'): got 'x'; expected an integer >= 1" in problems
    assert "train.lr: got -1; expected a number > 0" in problems


def test_absurd_sizes_are_errors_not_hangs():
    from swapkit import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config({"model": {"model_config": {"num_layers": 4_000_000_000, "pp_interleave_num": 5000}},
                     "parallel_config": {"pipeline_stage": 10**9}})
    text = str(err.value)
    assert "model.model_config.num_layers: got 4000000000; expected an integer from 1 to 1024" in text
    assert "model.model_config.pp_interleave_num: got 5000" in text
    assert "parallel_config.pipeline_stage: got 1000000000" in text


def test_unknown_top_level_key_lists_swapkits_sections_not_the_trainer_keys():
    """Before, the list began with 35 MindFormers trainer keys (auto_trans_ckpt, callbacks, ...)."""
    (message,) = problems_of({"foo": 1})
    assert message == ("foo: unknown key; known keys: context, model, parallel_config, recompute_config, runtime, "
                       "swap_config, train (and 47 MindFormers keys accepted with no effect)")
    (message,) = problems_of({"optimzer": {}})
    assert message == "optimzer: unknown key; did you mean 'optimizer'?"  # still suggested
    (message,) = problems_of(with_sections(context={"zzz": 1}))
    assert message.startswith("context.zzz: unknown key; known keys: affinity_cpu_list, ascend_config, ")


def test_a_missing_file_names_the_folder_it_was_looked_for_in_and_close_names(tmp_path, monkeypatch):
    """A new user ran a command from another folder, or wrote .yml for .yaml: the error said only 'not found'."""
    (tmp_path / "tiny.yaml").write_text("model: {model_config: {num_layers: 2}}\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config("tiny.yml")
    assert str(info.value.problems[0]) == (f"config file not found: tiny.yml (relative to the current directory, "
                                           f"{os.getcwd()}); did you mean tiny.yaml?")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "configs" / "tiny.yaml")  # an absolute path in a missing folder: nothing to add
    assert str(info.value.problems[0]) == f"config file not found: {tmp_path / 'configs' / 'tiny.yaml'}"


def test_the_planners_json_report_is_named_as_such_not_a_list_of_unknown_keys(tmp_path):
    """loader Note [The planner's JSON report is not a config]: the report's keys, as emit writes them."""
    report = {"budget_bytes": 1024, "plan": {"recompute_config": {}, "swap_config": {}},
              "layers": [], "predicted": {}, "baseline": {}}
    (problem,) = problems_of(report)
    assert "got the JSON report of `swapkit plan --budget --json`" in problem
    assert "swapkit plan CONFIG --budget SIZE --out planned.yaml" in problem


def test_an_override_that_flips_swap_is_named_once_where_the_problems_may_come_from(tmp_path):
    """load._blame_the_flip, with loader Note [Naming an override]: the CLI's --set or the Python argument."""
    from swapkit.config.loader import CommandLineOverrides

    path = write(tmp_path, "model: {model_config: {num_layers: 4}}\nrecompute_config: {recompute: [0, 3]}\n"
                           "swap_config: {swap: true}\n")
    tail = ("the override flips the file's true to false, and with it what the recompute lists mean (per-stage "
            "counts with swap off, global layer indices with swap on); the problems above may come from that: drop "
            "the {} or rewrite the lists")
    for overrides, origin, word in ((["train.steps=2", "swap_config.swap=false"],
                                     "overrides[1] 'swap_config.swap=false'", "override"),
                                    (CommandLineOverrides(["swap_config.swap=false"]),
                                     "--set swap_config.swap=false", "--set")):
        problems = problems_of(path, overrides=overrides)
        assert problems[0].startswith("recompute_config.recompute: got [0, 3]; expected at most pipeline_stage (1)")
        assert problems[1] == f"swap_config.swap (from {origin}): {tail.format(word)}"
