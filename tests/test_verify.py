"""Verify mode (``runtime.verify``): checksums of swapped storages, checked when they come back."""
from __future__ import annotations

import logging

import pytest
import torch

import swapkit
from swapkit.config.errors import ConfigError
from tests.toys import (
    ReadyWhenDone, assert_grads_equal, grads, install_engine, llama, llama_batch, llama_step, toy_config,
)

ATTENTION_SWAP = {"swap_config": {"swap": True, "op_swap": [
    {"op_name": "attention", "backward_prefetch": 1, "layers": [1]}]}}


def config(verify: bool) -> dict:
    return toy_config(4, **ATTENTION_SWAP, runtime={"min_offload_bytes": 0, "verify": verify})


class CorruptingEngine(ReadyWhenDone):
    """After the first device-to-host copy, one byte of its host buffer is overwritten (a reload race).
    Releases come exactly at their horizon, so the corrupted storage is always released and prefetched."""

    def __init__(self):
        super().__init__("cpu")
        self.offloads = 0

    def offload(self, src, dst):
        copy = super().offload(src, dst)
        self.offloads += 1
        if self.offloads == 1:
            self._submit(lambda: dst[:1].add_(1))  # runs after the copy: one FIFO queue
        return copy


def reference(batch):
    model = llama()
    loss = llama_step(model, batch)
    return loss, grads(model)


def test_verify_is_a_runtime_key_validated_as_a_bool():
    assert swapkit.load_config(config(True)).runtime.verify is True
    assert swapkit.load_config(toy_config(4)).runtime.verify is False
    with pytest.raises(ConfigError, match=r"runtime\.verify"):
        swapkit.load_config(toy_config(4, runtime={"verify": "yes"}))


def test_verify_checks_every_restored_storage_and_changes_nothing():
    batch = llama_batch()
    ref_loss, ref_grads = reference(batch)
    model = llama()
    session = swapkit.apply(model, config(True), layers="layers")
    install_engine(session, ReadyWhenDone("cpu"))  # released at the horizon, however slow the copy thread
    for _ in range(2):
        model.zero_grad()
        with session:
            loss = llama_step(model, batch)
        assert torch.equal(loss, ref_loss)
        assert_grads_equal(grads(model), ref_grads)
        stats = session.stats
        assert stats.verified_tensors == stats.prefetched_tensors > 0


def test_a_corrupted_host_copy_raises_naming_layer_op_and_step():
    batch = llama_batch()
    model = llama()
    session = swapkit.apply(model, config(True), layers="layers")
    install_engine(session, CorruptingEngine())
    with pytest.raises(RuntimeError, match=r"swapkit verify: .* saved in layer 1: attention during step 1 differ"):
        with session:
            llama_step(model, batch)


def test_without_verify_the_same_corruption_gives_wrong_gradients_silently():
    batch = llama_batch()
    _, ref_grads = reference(batch)
    model = llama()
    session = swapkit.apply(model, config(False), layers="layers")
    install_engine(session, CorruptingEngine())
    with session:
        llama_step(model, batch)
    assert session.stats.verified_tensors == 0
    assert any(not torch.equal(grads(model)[name], grad) for name, grad in ref_grads.items())


def test_verify_without_any_swap_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="swapkit"):
        swapkit.apply(llama(), toy_config(4, runtime={"verify": True}), layers="layers")
    assert "runtime.verify: true has no effect" in caplog.text


def test_every_runtime_setting_without_any_swap_is_warned_about_and_defaults_are_not(caplog):
    """Every runtime key tunes swapping; on a model where nothing is swapped a changed one did nothing,
    silently (only runtime.verify was warned about)."""
    runtime = {"min_offload_bytes": 0, "max_host_bytes": 1 << 20, "offload_batch_bytes": 0,
               "skip_tail_offload": False, "engine": "thread", "engine_options": {"latency_s": 0.001},
               "verify": False}  # the last one is its default: written out, it says nothing
    with caplog.at_level(logging.WARNING, logger="swapkit"):
        swapkit.apply(llama(), toy_config(4, runtime=runtime), layers="layers")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [f"runtime.{name}: {value} has no effect: swap_config swaps nothing on this model; set "
                      f"swap_config.swap: true with a layer_swap or op_swap, or drop runtime.{name}"
                      for name, value in (("engine", "'thread'"), ("engine_options.latency_s", "0.001"),
                                          ("min_offload_bytes", "0"), ("max_host_bytes", "1048576"),
                                          ("skip_tail_offload", "false"), ("offload_batch_bytes", "0"))]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="swapkit"):  # the same settings where a layer is swapped
        swapkit.apply(llama(), toy_config(4, runtime=runtime, swap_config={"swap": True, "layer_swap": [
            {"backward_prefetch": 1, "layers": [0]}]}), layers="layers")
    assert not [r for r in caplog.records if "has no effect" in r.getMessage()]
