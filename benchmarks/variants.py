"""The variants a benchmark compares, and a runner that owns one model copy per variant.

A variant is either a swapkit config (``recompute_config`` / ``swap_config`` sections in the YAML
layout, applied with :func:`swapkit.apply`), the plain model (``sections=None``), or a peer
context manager (``save_on_cpu``, torchtune's ``OffloadActivations``) on CUDA.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch

import swapkit
from swapkit.runtime.stats import SwapStats

from common import Setup, fresh_model, timed_step

BASELINE = "baseline (no swapkit)"
ACCOUNTING = "session, nothing configured"
LAYER_SWAP = "swap layer (every layer)"
LAYER_SWAP_VERIFY = "swap layer (every layer) + verify"
FULL_RECOMPUTE = "recompute full"


@dataclass(frozen=True)
class Variant:
    """One way of running the step.

    Args:
        name: row label.
        sections: swapkit config sections; ``None`` runs without swapkit.
        runtime: overrides of the ``runtime`` section (engine options of the sweep).
        peer: makes a non-swapkit peer's context manager, once per runner (forward inside it,
            backward after).
        note: what the row means, printed under the table.
    """

    name: str
    sections: dict[str, Any] | None = None
    runtime: dict[str, Any] | None = None
    peer: Callable[[], ContextManager] | None = None
    note: str = ""


def layer_swap(prefetch: int) -> dict[str, Any]:
    return {"swap": True, "layer_swap": [{"backward_prefetch": prefetch, "layers": True}]}


def main_variants(setup: Setup, prefetch: int) -> list[Variant]:
    """Baseline, swap (default / op / layer), recompute (full / core_attn / mlp / MindFormers select),
    swap + recompute."""
    layers = list(range(setup.model.num_layers))
    megatron = {"recompute_granularity": "selective"}
    ops = {"swap": True, "op_swap": [{"op_name": ["attention", "feed_forward"], "backward_prefetch": prefetch,
                                      "layers": True}]}
    both = {"recompute_config": {"recompute": False, "select_recompute": {"feed_forward": layers}},
            "swap_config": layer_swap(prefetch)}
    return [
        Variant(BASELINE, note="plain model, no hooks: the time reference; its memory figure is the "
                               "'session, nothing configured' row (a session that keeps every tensor)"),
        Variant(ACCOUNTING, {}, note="swapkit hooks installed, nothing swapped or recomputed: accounting only"),
        Variant("swap default (flash_attention)", {"swap_config": {"swap": True}},
                note="MindFormers default strategy: op .*\\.flash_attention, default_prefetch 1"),
        Variant("swap op attention+feed_forward", {"swap_config": ops}),
        Variant(LAYER_SWAP, {"swap_config": layer_swap(prefetch)}),
        Variant(LAYER_SWAP_VERIFY, {"swap_config": layer_swap(prefetch)}, {"verify": True},
                note="runtime.verify: true, a checksum of every swapped storage at release and at first use"),
        Variant(FULL_RECOMPUTE, {"recompute_config": {"recompute": True}}, note="MindFormers recompute: true"),
        Variant("recompute selective core_attn", {"recompute_config": {**megatron, "recompute_modules": ["core_attn"]}},
                note="Megatron dialect"),
        Variant("recompute selective mlp", {"recompute_config": {**megatron, "recompute_modules": ["mlp"]}},
                note="Megatron dialect"),
        Variant("recompute select silu+mul (MindFormers)", {"recompute_config": {"select_recompute": True}},
                note="MindFormers default select_recompute patterns; their outputs are rebuilt by recipes"),
        Variant("swap layer + recompute feed_forward", both,
                note="swap mode, select_recompute {feed_forward: [every layer index]}"),
    ]


def cuda_peers() -> list[Variant]:
    """``save_on_cpu(pin_memory=True)`` and, when importable, torchtune's ``OffloadActivations``
    (:func:`missing_peers` says why one is left out)."""
    peers = [Variant("peer: torch save_on_cpu(pin_memory=True)",
                     peer=lambda: torch.autograd.graph.save_on_cpu(pin_memory=True),
                     note="PyTorch's built-in offload of every saved tensor, synchronous copies")]
    try:
        from torchtune.training import OffloadActivations
    except ImportError:
        return peers
    peers.append(Variant("peer: torchtune OffloadActivations", peer=OffloadActivations,
                         note="torchtune's stream-overlapped offload of every saved tensor"))
    return peers


def missing_peers() -> list[str]:
    """One note per CUDA peer that cannot run here, for the results and stderr."""
    try:
        from torchtune.training import OffloadActivations  # noqa: F401
    except ImportError as err:
        return [f"peer torchtune OffloadActivations skipped: torchtune is not importable ({err}); "
                "`pip install torchtune` to compare with it"]
    return []


def sweep_variants(prefetches: list[int], runtime: dict[str, Any]) -> list[Variant]:
    """Layer swap at each prefetch distance, ``runtime`` selecting the (throttled) engine."""
    return [Variant(f"swap layer, backward_prefetch {k}", {"swap_config": layer_swap(k)}, runtime)
            for k in prefetches]


# Note [A step's CUDA peak]
# Every variant keeps its own model copy on the device for the whole run, so the allocator's
# ``max_memory_allocated`` during one variant's step also counts every other variant's parameters and
# gradients (the 12 copies of benchmarks/configs/gpu.yaml hold about 15 GiB of parameters alone, and its
# baseline step peaked at 33 GiB with 4 GiB of activations, measured on an H100). A
# step's CUDA peak is therefore ``max_memory_allocated`` minus what was allocated when the step
# began: the activations, the prefetched buffers, what recompute re-materializes and the gradients.
# The previous step's gradients are freed before that reading (``timed_step`` would free them only
# inside the step, and the rise would then come out short by up to the model's gradient bytes).


@dataclass
class Sample:
    """One timed step of one variant."""

    seconds: float
    cpu_seconds: float  # the calling thread's CPU time (time.thread_time)
    stats: SwapStats | None
    cuda_peak_bytes: int | None  # Note [A step's CUDA peak]


@dataclass
class Runner:
    """A variant bound to its own model copy (identical weights: same seed)."""

    variant: Variant
    setup: Setup
    model: torch.nn.Module = field(init=False)
    session: swapkit.SwapSession | None = field(init=False, default=None)
    samples: list[Sample] = field(init=False, default_factory=list)
    _peer: ContextManager | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.model = fresh_model(self.setup)
        if self.variant.sections is not None:
            config = self.setup.swapkit_config(self.variant.sections, self.variant.runtime)
            self.session = swapkit.apply(self.model, config, layers="layers")
        if self.variant.peer is not None:
            self._peer = self.variant.peer()  # made once and re-entered every step, as torchtune does

    def context(self) -> ContextManager:
        if self.session is not None:
            return self.session
        return self._peer if self._peer is not None else contextlib.nullcontext()

    @property
    def backward_inside(self) -> bool:
        return self.variant.peer is None

    def step(self, batch: tuple[torch.Tensor, torch.Tensor], record: bool = True) -> Sample:
        """Run one timed step; ``record`` keeps the sample (warm-up steps pass ``False``)."""
        cuda = self.setup.device.type == "cuda"
        if cuda:  # Note [A step's CUDA peak]
            self.model.zero_grad(set_to_none=True)  # the step's own zero_grad would free them after the reading
            torch.cuda.reset_peak_memory_stats(self.setup.device)
            resident = torch.cuda.memory_allocated(self.setup.device)
        seconds, cpu_seconds = timed_step(self.model, batch, self.context, self.backward_inside)
        peak = torch.cuda.max_memory_allocated(self.setup.device) - resident if cuda else None
        sample = Sample(seconds, cpu_seconds, self.session.stats if self.session is not None else None, peak)
        if record:
            self.samples.append(sample)
        return sample

    def close(self) -> None:
        if self.session is not None:
            self.session.remove()
