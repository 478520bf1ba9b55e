"""Small models and test doubles shared by the runtime tests."""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from swapkit.config.types import ModelConfig
from swapkit.engine import ThreadCopyEngine, make_pool
from swapkit.train.model import build_model, lm_loss

SMALL = ModelConfig(num_layers=4, hidden_size=32, num_heads=2, intermediate_size=64, vocab_size=64, seq_length=16)


class Block(nn.Module):
    """``sigmoid(lin(x))``: saves its input (for the weight grad) and the sigmoid output."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim, bias=False)
        self.act = nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x))


class ToyNet(nn.Module):
    def __init__(self, layers: int = 3, dim: int = 16, block: type = Block) -> None:
        super().__init__()
        self.layers = nn.ModuleList(block(dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def toy_config(layers: int, **sections) -> dict:
    return {"model": {"model_config": {"num_layers": layers}}, **sections}


def layer_swap(k: int, layers=True, **runtime) -> dict:
    return {"swap_config": {"swap": True, "layer_swap": [{"backward_prefetch": k, "layers": layers}]},
            "runtime": {"min_offload_bytes": 0, **runtime}}


class ReadyWhenDone(ThreadCopyEngine):
    """``ready`` waits for the copy: releases then happen exactly at their horizon (deterministic)."""

    def ready(self, copy) -> bool:
        self.wait(copy)
        return True


class GatedEngine(ThreadCopyEngine):
    """Copies block until ``gate`` is set: nothing is ready, every fetch is late. ``blocked`` is set
    when a caller starts waiting for a copy that has not finished (see :func:`open_gate_when_blocked`)."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.gate = threading.Event()
        self.blocked = threading.Event()

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.gate.wait(timeout=30)
        super()._copy(dst, src)

    def wait_done(self, copy) -> None:
        if not copy.done:
            self.blocked.set()
        super().wait_done(copy)


def open_gate_when_blocked(engine: GatedEngine, after_s: float) -> threading.Thread:
    """Open ``engine.gate`` ``after_s`` seconds after a caller first blocked on an unfinished copy.

    A timer started before backward is not enough on a loaded machine: if backward reaches its first
    fetch only after the timer fired, nothing waits (no late fetch) or the wait is shorter than
    ``after_s``. Counting from the moment a caller blocks, the wait lasts at least ``after_s``."""
    engine.blocked.clear()

    def open_gate() -> None:
        engine.blocked.wait(timeout=30)
        time.sleep(after_s)
        engine.gate.set()

    opener = threading.Thread(target=open_gate, name="open-gate", daemon=True)
    opener.start()
    return opener


def install_engine(session, engine) -> None:
    """Give a session a test engine (before its first ``with``)."""
    session.engine = engine
    session.pool = make_pool(engine, session.plan.runtime.max_host_bytes)


def synced_session(model: nn.Module, config: dict):
    """``swapkit.apply`` on the ``layers`` container with a :class:`ReadyWhenDone` engine."""
    import swapkit

    session = swapkit.apply(model, config, layers="layers")
    install_engine(session, ReadyWhenDone())
    return session


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_grads_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"gradient of {name} differs"


def llama(seed: int = 1, cfg: ModelConfig = SMALL):
    return build_model(cfg, seed=seed)


def llama_batch(seed: int = 0, cfg: ModelConfig = SMALL, batch: int = 2):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length), generator=gen)
    return tokens, targets


def llama_step(model: nn.Module, batch) -> torch.Tensor:
    tokens, targets = batch
    loss = lm_loss(model(tokens), targets)
    loss.backward()
    return loss.detach()


class FailsOnSecondCopy(ThreadCopyEngine):
    """The second storage copied to host fails (a host allocation error, say; inside its batch's job)."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.offloads = 0

    def offload(self, src, dst):
        self.offloads += 1
        if self.offloads == 2:
            return self._submit(lambda: (_ for _ in ()).throw(MemoryError("host copy failed")))
        return super().offload(src, dst)


def skip_without_cpp_toolchain(what: str) -> None:
    """Skip where this machine has no C++ compiler or ninja, which ``torch.utils.cpp_extension`` builds need."""
    import shutil

    if not any(shutil.which(name) for name in ("c++", "g++", "clang++")) or not shutil.which("ninja"):
        pytest.skip(f"{what} need a C++ compiler and ninja (torch.utils.cpp_extension)")


def require_native():
    """swapkit's C++ hooks (``runtime.native_save``), built; a skip only where this machine has no C++ compiler
    or ninja, a failed build fails the test."""
    from swapkit.runtime import native

    skip_without_cpp_toolchain("runtime.native_save's C++ hooks")
    return native.native_module()


def bench_module(name: str):
    """A module of ``benchmarks/`` (not a package: its scripts import each other by name)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)
