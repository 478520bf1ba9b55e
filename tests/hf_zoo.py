"""Tiny random-config Hugging Face transformers models, built in-process (nothing downloaded).

Each entry says how to build the model, where its layers live, which sub-module of a layer is its
attention (an op pattern), and how to compute a loss on a small batch. Hidden sizes of 32, two
layers (two per stack for T5) and sequences of 8 keep every forward and backward in milliseconds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import transformers as tf
from torch import nn

SEQ, BATCH, VOCAB = 8, 2, 64
DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)


@dataclass(frozen=True)
class Family:
    """How to build, bind and train one model family."""

    build: Callable[[], nn.Module]
    layers: str | list[str]
    attention: str  # op pattern of the attention scope inside one layer
    forward: Callable[[nn.Module], Any]  # the model's output (``.loss``, ``.past_key_values``)
    num_layers: int = 2
    cache: bool = True  # the model returns a key/value cache by default (use_cache=True)


def _model(config_class: type, model_class: type, **kwargs: Any) -> nn.Module:
    config = config_class(**kwargs)
    config._attn_implementation = "eager"  # the same kernels in every run
    torch.manual_seed(0)
    return model_class(config).train()


def _tokens(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and a left-padding mask (row 1 starts with two pad positions)."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, :2] = 0
    return ids, mask


def causal_lm_loss(model: nn.Module) -> Any:
    ids, mask = _tokens()
    labels = ids.masked_fill(mask == 0, -100)
    return model(input_ids=ids, attention_mask=mask, labels=labels)


def masked_lm_loss(model: nn.Module) -> Any:
    ids, mask = _tokens()
    return model(input_ids=ids, attention_mask=mask, labels=ids)


def seq2seq_loss(model: nn.Module) -> Any:
    ids, mask = _tokens()
    labels, _ = _tokens(seed=1)
    return model(input_ids=ids, attention_mask=mask, labels=labels)


def image_loss(model: nn.Module) -> Any:
    pixels = torch.randn(BATCH, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    return model(pixel_values=pixels, labels=torch.tensor([0, 2]))


FAMILIES: dict[str, Family] = {
    "llama": Family(lambda: _model(tf.LlamaConfig, tf.LlamaForCausalLM, **DECODER), "model.layers", "self_attn",
                    causal_lm_loss),
    "mistral": Family(lambda: _model(tf.MistralConfig, tf.MistralForCausalLM, sliding_window=4, **DECODER),
                      "model.layers", "self_attn", causal_lm_loss),
    "qwen2": Family(lambda: _model(tf.Qwen2Config, tf.Qwen2ForCausalLM, **DECODER), "model.layers", "self_attn",
                    causal_lm_loss),
    "qwen3_moe": Family(lambda: _model(tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=32, **DECODER),
                        "model.layers", "self_attn", causal_lm_loss),
    "mixtral": Family(lambda: _model(tf.MixtralConfig, tf.MixtralForCausalLM, num_local_experts=4,
                                     num_experts_per_tok=2, **DECODER), "model.layers", "self_attn", causal_lm_loss),
    "gemma2": Family(lambda: _model(tf.Gemma2Config, tf.Gemma2ForCausalLM, head_dim=8, sliding_window=4, **DECODER),
                     "model.layers", "self_attn", causal_lm_loss),
    "qwen3": Family(lambda: _model(tf.Qwen3Config, tf.Qwen3ForCausalLM, head_dim=8, **DECODER), "model.layers",
                    "self_attn", causal_lm_loss),
    "phi3": Family(lambda: _model(tf.Phi3Config, tf.Phi3ForCausalLM, pad_token_id=0, eos_token_id=0, bos_token_id=0,
                                  **DECODER), "model.layers", "self_attn", causal_lm_loss),
    "gpt_neox": Family(lambda: _model(tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, vocab_size=VOCAB, hidden_size=32,
                                      num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
                       "gpt_neox.layers", "attention", causal_lm_loss),
    "gpt2": Family(lambda: _model(tf.GPT2Config, tf.GPT2LMHeadModel, vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                  n_positions=64, bos_token_id=0, eos_token_id=0),
                   "transformer.h", "attn", causal_lm_loss),
    "falcon": Family(lambda: _model(tf.FalconConfig, tf.FalconForCausalLM, vocab_size=VOCAB, hidden_size=32,
                                    num_hidden_layers=2, num_attention_heads=4), "transformer.h", "self_attention",
                     causal_lm_loss),
    "bert": Family(lambda: _model(tf.BertConfig, tf.BertForMaskedLM, vocab_size=VOCAB, hidden_size=32,
                                  num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
                   "bert.encoder.layer", "attention", masked_lm_loss, cache=False),
    "t5": Family(lambda: _model(tf.T5Config, tf.T5ForConditionalGeneration, vocab_size=VOCAB, d_model=32, d_kv=8,
                                d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0),
                 ["encoder.block", "decoder.block"], r"layer\.0", seq2seq_loss, num_layers=4),
    "vit": Family(lambda: _model(tf.ViTConfig, tf.ViTForImageClassification, image_size=16, patch_size=8,
                                 hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                 num_labels=3), "vit.layers", "attention", image_loss, cache=False),
}
