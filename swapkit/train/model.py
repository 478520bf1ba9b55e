"""The built-in model: a small Llama-style decoder whose module tree mirrors MindFormers' Llama.

Each decoder layer has ``attention_norm``, ``attention`` (``wq``, ``wk``, ``wv``, ``wo``,
``flash_attention``), ``ffn_norm`` and ``feed_forward`` (``w1`` with ``activation.silu``, ``w2``,
``w3``, ``mul``). Linear layers expose a ``matmul`` op and norms a ``norm`` op as tiny
sub-modules, so operator-level patterns from MindFormers YAML (``feed_forward\\.w1\\.matmul``,
``.*\\.norm``) bind unchanged. Sizes come from ``model.model_config``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from swapkit.config.types import ModelConfig


class MatMul(nn.Module):
    """``x @ weight.T`` as its own scope (MindFormers' ``Linear.matmul``)."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)


class SiLU(nn.Module):
    """MindFormers' activation cell: the op lives in the ``silu`` child."""

    def __init__(self) -> None:
        super().__init__()
        self.silu = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.silu(x)


class Linear(nn.Module):
    """A bias-free linear layer whose weight stays here and whose math runs in ``matmul``."""

    def __init__(self, in_features: int, out_features: int, activation: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.matmul = MatMul()
        self.activation = SiLU() if activation else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.weight)
        return self.activation(y) if self.activation is not None else y


class RMSNormOp(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.norm = RMSNormOp(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.weight)


class FlashAttention(nn.Module):
    """Causal scaled-dot-product attention (the fused kernel on CUDA)."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)


class Mul(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * b


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of each head (GPT-NeoX layout); ``cos``/``sin`` are ``[S, D/2]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        dim = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.wq, self.wk, self.wv, self.wo = (Linear(dim, dim) for _ in range(4))
        self.flash_attention = FlashAttention(cfg.attention_dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        heads = (batch, seq, self.num_heads, dim // self.num_heads)
        q, k, v = (proj(x).view(heads).transpose(1, 2) for proj in (self.wq, self.wk, self.wv))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.flash_attention(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, dim))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = Linear(cfg.hidden_size, cfg.intermediate_size, activation=True)
        self.w3 = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.w2 = Linear(cfg.intermediate_size, cfg.hidden_size)
        self.mul = Mul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.mul(self.w1(x), self.w3(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.feed_forward = FeedForward(cfg)
        self.hidden_dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.hidden_dropout(self.attention(self.attention_norm(h), cos, sin))
        return h + self.hidden_dropout(self.feed_forward(self.ffn_norm(h)))


class LlamaModel(nn.Module):
    """Token ids ``[B, S]`` -> logits ``[B, S, vocab]``. The layer container is ``layers``."""

    layers_path = "layers"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        on_meta = torch.get_default_device().type == "meta"  # build_model's (Note [A meta model loads no Dynamo])
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size) if on_meta else None  # None: nn.Embedding's own init
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm_out = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if on_meta:
            cos, sin = torch.empty(rotary_shape(cfg)), torch.empty(rotary_shape(cfg))
        else:
            cos, sin = rotary_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def reset_parameters(self, seed: int) -> None:
        """Deterministic init (normal, std 0.02; residual outputs scaled by depth like GPT-2)."""
        gen = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_out.weight"):
                nn.init.ones_(param)
                continue
            std = 0.02 / math.sqrt(2 * self.config.num_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
            with torch.no_grad():
                param.copy_(torch.randn(param.shape, generator=gen) * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.lm_head(self.norm_out(h))


# Note [A meta model loads no Dynamo]
# A model built on the meta device (``swapkit plan``, and the op-pattern check ``swapkit train`` runs before
# it starts several ranks) needs shapes, not values. But ``nn.Embedding``'s ``normal_`` init and the rotary
# tables' ``torch.arange`` on a meta tensor run through ``torch._refs``, which imports ``torch._dynamo``:
# about 1.5 s of the launching parent's time, which Note [Pipelining loads where a stage runs] keeps out of it.
# So on meta the embedding gets an empty weight and the tables empty buffers of their shape. A real build is
# unchanged: it draws the same numbers from the global generator, and ``reset_parameters`` then sets every weight.
def rotary_shape(cfg: ModelConfig) -> tuple[int, int]:
    """The shape of each rotary table: positions x half the head dimension."""
    return cfg.seq_length, (cfg.hidden_size // cfg.num_heads + 1) // 2


def rotary_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    head_dim = cfg.hidden_size // cfg.num_heads
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(cfg.seq_length, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def build_model(cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu") -> LlamaModel:
    """Build the built-in model with deterministic weights (on ``meta`` no memory is used)."""
    with torch.device(device):
        model = LlamaModel(cfg)
    if str(device) != "meta":
        model.reset_parameters(seed)
    return model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
