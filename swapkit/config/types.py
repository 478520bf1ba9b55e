"""Typed configuration: one frozen dataclass per YAML section.

The loader (:mod:`swapkit.config.loader`) is the only code that reads raw YAML; everything downstream
takes these dataclasses. Count values of ``recompute_config`` stay in the shape the user wrote
them (bool, list, grid, dict) because their meaning depends on the layout; they are validated and
normalized by :mod:`swapkit.plan.normalize`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Union

#: Megatron ``recompute_modules`` mapped to op patterns of the built-in model (DESIGN §6).
#: Models with other module names override it with ``recompute_config.module_scopes``.
BUILTIN_MODULE_SCOPES: Mapping[str, tuple[str, ...]] = {
    "core_attn": (r"attention\.flash_attention",),
    "layernorm": (r".*_norm",),
    "mlp": (r"feed_forward",),
}

#: The module names Megatron-Core accepts in ``recompute_modules``.
MEGATRON_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")


@dataclass(frozen=True)
class ModelConfig:
    """``model.model_config``: layer count and layout (MindFormers names) and built-in model sizes.

    ``num_layers`` may be ``None`` when a model is given to ``swapkit.apply`` (or ``swapkit plan --model``):
    it is then counted from the bound layer container. ``preset`` names a model family of
    :mod:`swapkit.plan.presets` (auto-detected for transformers models when not given).
    """

    num_layers: int | None = None
    offset: Any = 0
    pp_interleave_num: int = 1
    hidden_size: int = 64
    num_heads: int = 4
    intermediate_size: int = 176
    vocab_size: int = 256
    seq_length: int = 64
    rms_norm_eps: float = 1e-5
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    rope_theta: float = 10000.0
    layers_path: str | tuple[str, ...] | None = None  # one container or several, numbered in order
    preset: str | None = None


@dataclass(frozen=True)
class ParallelConfig:
    """``parallel_config``: the pipeline layout; ``swapkit train`` also runs ``pipeline_stage x data_parallel``
    ranks with ``micro_batch_num`` micro-batches (default ``pipeline_stage``) on ``pipeline_schedule``
    (default ``1f1b``, ``interleaved_1f1b`` when ``pp_interleave_num > 1``)."""

    pipeline_stage: int = 1
    data_parallel: int = 1
    micro_batch_num: int | None = None
    pipeline_schedule: str | None = None


@dataclass(frozen=True)
class MindFormersRecompute:
    """``recompute_config`` in MindFormers keys; values as written, see :mod:`swapkit.plan.normalize`."""

    recompute: Any = False
    select_recompute: Any = False
    select_comm_recompute: Any = False
    select_recompute_exclude: Any = False
    select_comm_recompute_exclude: Any = False
    use_reentrant: bool = False
    dialect: str = field(default="mindformers", init=False)


@dataclass(frozen=True)
class MegatronRecompute:
    """``recompute_config`` in the Megatron dialect (seeds 000 and 002)."""

    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_modules: tuple[str, ...] | None = None
    distribute_saved_activations: bool = False
    module_scopes: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: dict(BUILTIN_MODULE_SCOPES))
    use_reentrant: bool = False
    dialect: str = field(default="megatron", init=False)
    #: the keys written under recompute_config (``module_scopes.<module>`` for each mapped module), so an
    #: error names a key the user wrote, not a default (Note [Where a pattern was written])
    given: tuple[str, ...] = ()


RecomputeConfig = Union[MindFormersRecompute, MegatronRecompute]


@dataclass(frozen=True)
class SwapEntry:
    """One ``layer_swap`` / ``op_swap`` item: ``layers`` is ``True``/``False`` or layer indices."""

    backward_prefetch: int
    layers: bool | tuple[int, ...]
    op_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class SwapConfig:
    """``swap_config`` (MindFormers keys). ``None`` lists mean "not given" (default strategy)."""

    swap: bool = False
    default_prefetch: int = 1
    layer_swap: tuple[SwapEntry, ...] | None = None
    op_swap: tuple[SwapEntry, ...] | None = None


@dataclass(frozen=True)
class EngineOptions:
    """Thread-engine knobs: a slower link to emulate (fixed latency and bandwidth per copy), and the largest copy
    run on the calling thread while nothing is queued (``swapkit.engine.thread`` Note [Small copies run on the
    caller]; 0: every copy goes to the copy thread)."""

    latency_s: float = 0.0
    bandwidth_gbps: float | None = None
    inline_bytes: int = 64 << 10


@dataclass(frozen=True)
class RuntimeConfig:
    """``runtime``: swapkit's own knobs for the swap session."""

    engine: str = "auto"
    engine_options: EngineOptions = field(default_factory=EngineOptions)
    min_offload_bytes: int = 1024
    max_host_bytes: int | None = None
    skip_tail_offload: bool = True
    verify: bool = False  # checksum each swapped storage when offloaded, check it when restored
    offload_batch_bytes: int = 16 << 20  # bytes per batch of one scope's swapped storages; 0: one copy per storage
    native_save: bool = False  # keeps and new swaps served by C++ hooks (swapkit.runtime.native Note [The native save path])


@dataclass(frozen=True)
class TrainConfig:
    """``train``: the ``swapkit train`` loop."""

    steps: int = 20
    batch_size: int = 4
    gradient_accumulation_steps: int = 1
    lr: float = 3e-3
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0
    dtype: str = "fp32"
    device: str = "cpu"
    seed: int = 0
    save_dir: str | None = None
    save_interval: int | None = None
    resume: bool = False
    collective_timeout_s: float = 300.0
    gc_interval: int | None = None  # automatic garbage collection off, a full one every N steps


@dataclass(frozen=True)
class Config:
    """A validated swapkit config. Build it with :func:`swapkit.load_config`."""

    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    recompute: RecomputeConfig = field(default_factory=MindFormersRecompute)
    swap: SwapConfig = field(default_factory=SwapConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    #: key paths that were accepted but have no effect in PyTorch eager (MindSpore-only keys)
    no_effect: tuple[str, ...] = ()
    source: str | None = None
    #: settings that load but do less than written, one message each (logged once by ``load_config``)
    warnings: tuple[str, ...] = ()
