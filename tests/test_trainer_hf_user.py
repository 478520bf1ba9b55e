"""A Hugging Face user's Trainer runs with swapkit: a model built by ``model_init``, and the checks of
what the Trainer does beyond plain training steps (evaluation, checkpoints, resuming)."""
from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it

import torch  # noqa: E402

from swapkit.integrations.transformers import attach  # noqa: E402
from tests.hf_models import DECODER  # noqa: E402
from tests.test_trainer import Tokens  # noqa: E402

LAYER_SWAP = {"swap_config": {"swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": True}]},
              "runtime": {"min_offload_bytes": 0}}


def tiny_llama() -> torch.nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER, use_cache=False))


def arguments(tmp_path, **extra) -> transformers.TrainingArguments:
    values = dict(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, logging_steps=1,
                  learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
                  dataloader_num_workers=0)
    return transformers.TrainingArguments(**{**values, **extra})


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_trainer_with_model_init_swaps_the_model_it_trains(tmp_path):
    """``Trainer(model_init=...)`` builds a new model in ``train()``: swapkit was applied to the one built in
    ``__init__`` only, so the trained model swapped nothing, and the warning blamed torch.compile."""
    plain = transformers.Trainer(model_init=tiny_llama, args=arguments(tmp_path / "plain"), train_dataset=Tokens())
    plain.train()
    trainer = transformers.Trainer(model_init=tiny_llama, args=arguments(tmp_path / "swap"), train_dataset=Tokens())
    first = trainer.model
    callback = attach(trainer, LAYER_SWAP)
    trainer.train()
    session = callback.session
    assert trainer.model is not first and session.model is trainer.model
    assert set(session.stats.offloaded_by_scope) == {"layer 0", "layer 1"} and session.stats.unused_swaps == []
    assert getattr(first, "_swapkit_applied", None) is None  # the model built in __init__ is restored
    assert_same_parameters(trainer.model, plain.model)  # bit-identical training with swap
    session.remove()
