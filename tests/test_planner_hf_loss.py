"""``swapkit plan --budget --model hf:...`` measures the step the model is trained with: its language-model loss."""
from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from swapkit.load import load_config  # noqa: E402
from swapkit.planner.sources import source_from_spec  # noqa: E402

SIZES = {
    "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=64, max_position_embeddings=64),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64),  # GPT2LMHeadModel
    "bert": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64),
}


@pytest.mark.parametrize("model_type", sorted(SIZES))
def test_the_planned_step_is_the_language_model_loss(model_type, tmp_path):
    """GPT-2's causal LM is ``GPT2LMHeadModel``: the planner did not recognise it as a model with an LM head
    and measured the mean square of its logits instead of its loss, so its saved bytes were not those of the
    training step (the emitted plan ran above its predicted peak)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": model_type, **SIZES[model_type]}))
    config = load_config({"model": {"model_config": {"seq_length": 8}}, "train": {"batch_size": 2}})
    source = source_from_spec(f"hf:{path}", config, None)
    model, batch = source.factory().train(), source.batch(1)
    torch.manual_seed(0)  # the same dropout masks
    loss = source.loss(model, batch)
    torch.manual_seed(0)
    expected = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
    assert torch.equal(loss, expected)
