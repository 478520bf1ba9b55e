"""Tiny random Hugging Face models of every family swapkit has a preset for (nothing downloaded)."""
from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
               eos_token_id=2)
MOE = dict(DECODER, moe_intermediate_size=32, num_experts_per_tok=2)

#: model_type -> (config kwargs, layer container path or None to auto-detect, expected preset)
FAMILIES = {
    "llama": (DECODER, None, "llama"),
    "mistral": (DECODER, None, "mistral"),
    "qwen2": (DECODER, None, "qwen2"),
    "qwen3": (dict(DECODER, head_dim=8), None, "qwen3"),
    "qwen2_moe": (dict(MOE, num_experts=4, shared_expert_intermediate_size=32), None, "qwen2_moe"),
    "qwen3_moe": (dict(MOE, num_experts=4, head_dim=8), None, "qwen3_moe"),
    "mixtral": (dict(DECODER, num_local_experts=4, num_experts_per_tok=2), None, "mixtral"),
    "gemma2": (dict(DECODER, head_dim=8), None, "gemma2"),
    "gemma3_text": (dict(DECODER, head_dim=8), None, "gemma3"),
    "phi3": (DECODER, None, "phi3"),
    "gpt2": (dict(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64), None, "gpt2"),
    "gpt_neox": (dict(DECODER, num_key_value_heads=None), None, "gpt_neox"),
    "falcon": (dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=64), None, "falcon"),
    "bert": (dict(DECODER, num_key_value_heads=None), None, "bert"),
    "t5": (dict(d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4, vocab_size=64), "encoder.block", "t5"),
    "vit": (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16,
                 patch_size=4), None, "vit"),
}


def tiny_model(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random base model (``AutoModel``) of the family, in train mode, dropout off."""
    kwargs = {k: v for k, v in FAMILIES[model_type][0].items() if v is not None}
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                 "dropout_rate", "attention_dropout", "hidden_dropout", "hidden_dropout_prob"):
        if hasattr(config, name):
            setattr(config, name, 0.0)
    torch.manual_seed(seed)
    return transformers.AutoModel.from_config(config).train()


def inputs(model_type: str, seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    if model_type == "vit":
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=generator)}
    ids = torch.randint(0, 64, (2, 8), generator=generator)
    return {"input_ids": ids, "decoder_input_ids": ids} if model_type == "t5" else {"input_ids": ids}


def loss_of(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(**batch)
    hidden = out.last_hidden_state if model.config.model_type != "t5" else out.encoder_last_hidden_state
    return (hidden.float() ** 2).mean()
