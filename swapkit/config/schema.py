"""The keys each config section accepts, with their checks and defaults.

``*_NO_EFFECT`` tables list MindSpore / MindFormers keys that a MindFormers file may carry: they
are type-checked, accepted, and reported once as having no effect in PyTorch eager, so a
MindFormers YAML loads unchanged.
"""
from __future__ import annotations

from swapkit.config import fields as F
from swapkit.config.fields import Key

anything, boolean, mapping, string = F.anything, F.boolean, F.mapping, F.string
integer, number, choice, optional = F.integer, F.number, F.choice, F.optional

# Note [Size limits]
# Upper bounds a real model never reaches (the largest public dense models have ~130 layers, 64
# pipeline stages, a 256k vocabulary, hidden 16k), chosen so that no accepted value can make
# `swapkit plan` slow or an error message huge: `num_layers` and P x V bound every per-layer and
# per-chunk structure. The engine options bound the thread engine's emulated link (PCIe latency is
# microseconds, its bandwidth tens of GB/s), so no copy sleeps for longer than a second.
LIMITS = {
    "num_layers": 1024, "pipeline_stage": 256, "pp_interleave_num": 64,
    "hidden_size": 65_536, "num_heads": 1024, "intermediate_size": 262_144, "vocab_size": 1_048_576,
    "seq_length": 1_048_576, "steps": 10**9, "batch_size": 65_536, "gradient_accumulation_steps": 65_536,
    "lr": 10.0, "weight_decay": 10.0, "seed": 2**63 - 1, "latency_s": 1.0, "bandwidth_gbps": (1e-3, 1e5),
    "data_parallel": 65_536, "micro_batch_num": 65_536,
}

TOP_KEYS = {
    "model": Key(anything),  # optional: a model given to apply() counts its layers
    "parallel_config": Key(anything),
    "recompute_config": Key(anything),
    "swap_config": Key(anything),
    "runtime": Key(anything),
    "train": Key(anything),
    "context": Key(anything),
}

# Top-level sections of a MindFormers run YAML that belong to its trainer, not to memory.
TOP_NO_EFFECT = {
    "seed": integer(0), "output_dir": string, "run_mode": string, "use_parallel": boolean,
    "load_checkpoint": anything, "src_strategy_path_or_dir": anything, "auto_trans_ckpt": boolean,
    "only_save_strategy": boolean, "resume_training": anything, "trainer": mapping,
    "runner_config": mapping, "runner_wrapper": mapping, "optimizer": mapping, "lr_schedule": mapping,
    "train_dataset": mapping, "train_dataset_task": mapping, "eval_dataset": mapping,
    "eval_dataset_task": mapping, "callbacks": anything, "processor": mapping, "moe_config": mapping,
    "parallel": mapping, "profile": boolean, "profile_start_step": integer(0), "profile_stop_step": integer(0),
    "init_start_profile": boolean, "layer_scale": boolean, "layer_decay": number(0), "lr_scale": boolean,
    "lr_scale_factor": integer(1), "micro_batch_interleave_num": integer(1), "do_eval": boolean,
    "eval_step_interval": integer(-1), "eval_epoch_interval": integer(-1), "metric": anything,
    # in MindFormers' own training YAMLs (llama2, llama3.1, mixtral, qwen2.5 ...): autotune, profiler, cloud, loading
    "auto_tune": boolean, "filepath_prefix": string, "autotune_per_step": integer(1), "profile_communication": boolean,
    "profile_memory": boolean, "profiler_level": integer(0), "remote_save_url": string, "eval_callbacks": anything,
    "ignore_data_skip": boolean, "load_ckpt_format": string, "use_legacy": boolean, "transform_process_num": integer(1),
}

#: MindFormers trainer keys that ``swapkit train`` has a key of its own for: a MindFormers file's ``seed: 42``
#: is ignored, and the warning names the key that is read instead.
SWAPKIT_KEYS = {
    "seed": "train.seed", "model.model_config.batch_size": "train.batch_size",
    "model.model_config.compute_dtype": "train.dtype", "runner_config": "train.batch_size and train.steps",
    "optimizer": "train.lr and train.weight_decay", "lr_schedule": "train.lr",
}

MODEL_KEYS = {"model_config": Key(mapping, None)}
MODEL_NO_EFFECT = {"arch": mapping}

MODEL_CONFIG_KEYS = {
    "num_layers": Key(optional(integer(1, LIMITS["num_layers"])), None),
    "offset": Key(anything, 0),
    "pp_interleave_num": Key(integer(1, LIMITS["pp_interleave_num"]), 1),
    "hidden_size": Key(integer(2, LIMITS["hidden_size"]), 64),
    "num_heads": Key(integer(1, LIMITS["num_heads"]), 4),
    "intermediate_size": Key(integer(1, LIMITS["intermediate_size"]), 176),
    "vocab_size": Key(integer(2, LIMITS["vocab_size"]), 256),
    "seq_length": Key(integer(2, LIMITS["seq_length"]), 64),
    "rms_norm_eps": Key(number(positive=True, maximum=1.0), 1e-5),
    "hidden_dropout": Key(number(0, below=1), 0.0),
    "attention_dropout": Key(number(0, below=1), 0.0),
    "rope_theta": Key(number(positive=True, maximum=1e12), 10000.0),
    "layers_path": Key(optional(F.layer_paths), None),
    "preset": Key(optional(string), None),
}

# MindFormers LlamaConfig keys that the built-in model does not use.
MODEL_CONFIG_NO_EFFECT = {
    "type": string, "batch_size": integer(1), "compute_dtype": string, "layernorm_compute_type": string,
    "softmax_compute_type": string, "rotary_dtype": string, "param_init_type": string,
    "embedding_init_type": string, "use_flash_attention": boolean, "use_past": boolean,
    "use_past_shard": boolean, "n_kv_heads": optional(integer(1)), "multiple_of": integer(1),
    "ffn_dim_multiplier": optional(number(positive=True)), "theta": number(positive=True),
    "scaling_factor": number(positive=True), "extend_method": string, "qkv_concat": boolean,
    "fine_grain_interleave": integer(1), "checkpoint_name_or_path": optional(anything),
    "bos_token_id": integer(), "eos_token_id": integer(), "pad_token_id": integer(),
    "ignore_token_id": integer(), "repetition_penalty": number(0), "max_decode_length": integer(1),
    "top_k": integer(0), "top_p": number(0), "do_sample": boolean, "is_dynamic": boolean,
    "use_rope_slice": boolean, "fused_rms_norm": boolean, "block_size": integer(1),
    "num_blocks": integer(1), "qkv_has_bias": boolean, "user_pretrained": anything,
    # the rest of LlamaConfig's arguments, and the extra ones the Llama-family research YAMLs pass to it
    "max_position_embedding": optional(integer(1)), "residual_dtype": optional(string), "attn_proj_has_bias": boolean,
    "parallel_config": optional(mapping), "moe_config": optional(mapping), "use_ring_attention": boolean,
    "use_attn_mask_compression": boolean, "use_eod_attn_mask_compression": boolean, "parallel_optimizer": boolean,
    "init_method_std": number(0), "quant_config": optional(mapping), "tie_word_embeddings": boolean,
    "llm_backend": anything, "input_sliced_sig": boolean, "rmsnorm_compute_2d": boolean, "chunk_prefill": boolean,
    "calculate_per_token_loss": boolean, "pipeline_stage": optional(mapping), "return_hidden_states": boolean,
    "emb_dropout_prob": number(0, below=1), "rotary_pct": number(positive=True, maximum=1.0),
    "rotary_emb_base": number(positive=True), "initializer_range": number(0), "compute_in_2d": boolean,
    "kv_channels": integer(1),
}

PARALLEL_KEYS = {
    "pipeline_stage": Key(integer(1, LIMITS["pipeline_stage"]), 1),
    "data_parallel": Key(integer(1, LIMITS["data_parallel"]), 1),  # swapkit train: FSDP2 over this many replicas
    "micro_batch_num": Key(optional(integer(1, LIMITS["micro_batch_num"])), None),  # swapkit train (default: P)
    "pipeline_schedule": Key(optional(choice("gpipe", "1f1b", "interleaved_1f1b")), None),  # swapkit's own key
}
PARALLEL_NO_EFFECT = {
    "model_parallel": integer(1), "context_parallel": integer(1),
    "expert_parallel": integer(1), "vocab_emb_dp": boolean,
    "use_seq_parallel": boolean, "gradient_aggregation_group": integer(1), "optimizer_shard": boolean,
    "micro_batch_interleave_num": integer(1), "seq_split_num": integer(1),
}

MINDFORMERS_RECOMPUTE_KEYS = frozenset({
    "recompute", "select_recompute", "select_comm_recompute",
    "select_recompute_exclude", "select_comm_recompute_exclude",
})
MEGATRON_RECOMPUTE_KEYS = frozenset({
    "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules",
    "recompute_activations", "distribute_saved_activations", "module_scopes",
})
RECOMPUTE_KEYS = {
    **{key: Key(anything, False) for key in sorted(MINDFORMERS_RECOMPUTE_KEYS)},
    "recompute_granularity": Key(optional(choice("full", "selective")), None),
    "recompute_method": Key(optional(choice("uniform", "block")), None),
    "recompute_num_layers": Key(optional(integer(1)), None),
    "recompute_modules": Key(optional(F.string_list), None),
    "recompute_activations": Key(boolean, False),
    "distribute_saved_activations": Key(boolean, False),
    "module_scopes": Key(optional(mapping), None),
    "use_reentrant": Key(boolean, False),
}
RECOMPUTE_NO_EFFECT = {
    "parallel_optimizer_comm_recompute": boolean,
    "mp_comm_recompute": boolean,
    "recompute_slice_activation": boolean,
}

SWAP_KEYS = {
    "swap": Key(boolean, False),
    "default_prefetch": Key(integer(1), 1),
    "layer_swap": Key(anything, None),
    "op_swap": Key(anything, None),
}

RUNTIME_KEYS = {
    "engine": Key(choice("auto", "cuda", "thread"), "auto"),
    "engine_options": Key(optional(mapping), None),
    "min_offload_bytes": Key(F.byte_count(0), 1024),
    "max_host_bytes": Key(optional(F.byte_count(1)), None),
    "skip_tail_offload": Key(boolean, True),
    "verify": Key(boolean, False),
    "offload_batch_bytes": Key(F.byte_count(0), 16 << 20),
    "native_save": Key(boolean, False),
}
ENGINE_OPTION_KEYS = {
    "latency_s": Key(number(0, maximum=LIMITS["latency_s"]), 0.0),
    "bandwidth_gbps": Key(optional(number(LIMITS["bandwidth_gbps"][0], maximum=LIMITS["bandwidth_gbps"][1])), None),
    "inline_bytes": Key(F.byte_count(0), 64 << 10),  # swapkit.engine.thread Note [Small copies run on the caller]
}

TRAIN_KEYS = {
    "steps": Key(integer(1, LIMITS["steps"]), 20),
    "batch_size": Key(integer(1, LIMITS["batch_size"]), 4),
    "gradient_accumulation_steps": Key(integer(1, LIMITS["gradient_accumulation_steps"]), 1),
    "lr": Key(number(positive=True, maximum=LIMITS["lr"]), 3e-3),
    "weight_decay": Key(number(0, maximum=LIMITS["weight_decay"]), 0.0),
    "grad_clip": Key(optional(number(positive=True, maximum=1e6)), 1.0),
    "dtype": Key(choice("fp32", "bf16", aliases={"float32": "fp32", "bfloat16": "bf16"}), "fp32"),
    "device": Key(choice("cpu", "cuda"), "cpu"),
    "seed": Key(integer(0, LIMITS["seed"]), 0),
    "save_dir": Key(optional(string), None),
    "save_interval": Key(optional(integer(1, LIMITS["steps"])), None),
    "resume": Key(boolean, False),
    "collective_timeout_s": Key(number(positive=True, maximum=86_400.0), 300.0),  # several ranks: a stuck peer fails, never hangs
    "gc_interval": Key(optional(integer(1, LIMITS["steps"])), None),  # swapkit.train.collector
}

# MindSpore `context` settings: none of them has a PyTorch eager equivalent.
CONTEXT_NO_EFFECT = {
    "memory_optimize_level": choice("O0", "O1"), "mode": anything, "device_target": string,
    "device_id": integer(0), "max_device_memory": string, "save_graphs": anything,
    "save_graphs_path": string, "max_call_depth": integer(1), "enable_graph_kernel": boolean,
    "runtime_num_threads": integer(1), "jit_config": mapping, "ascend_config": mapping,
    "mempool_block_size": string, "affinity_cpu_list": anything, "deterministic": string,
    "graph_kernel_flags": string, "jit_level": string, "infer_boost": string,
}


# Note [Keys written in the wrong section]
# A key of one section written in another (`layer_swap` at the top level, `recompute` under
# swap_config, `model_config` without `model:`) is an unknown key where it stands, and a
# did-you-mean among that section's keys finds a look-alike at best (`layer_scale`, a MindFormers
# trainer key). The unknown-key error therefore says which section the key belongs to. Only
# swapkit's own keys count: the MindFormers keys that have no effect are not offered as homes.
SECTIONS = {
    "": TOP_KEYS, "model": MODEL_KEYS, "model.model_config": MODEL_CONFIG_KEYS, "parallel_config": PARALLEL_KEYS,
    "recompute_config": RECOMPUTE_KEYS, "swap_config": SWAP_KEYS, "runtime": RUNTIME_KEYS,
    "runtime.engine_options": ENGINE_OPTION_KEYS, "train": TRAIN_KEYS,
}


def key_homes(key: object) -> tuple[str, ...]:
    """The sections whose keys include ``key`` (``"swap_config"``; ``""`` is the top level).

    Note [Keys written in the wrong section]
    """
    return tuple(path for path, keys in SECTIONS.items() if key in keys)
