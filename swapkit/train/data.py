"""Seeded synthetic tokens for ``swapkit train``: no download, learnable, a pure function of the step.

Note [Synthetic data]
The tokens follow a fixed random permutation of the vocabulary drawn from ``train.seed``:
``x[t+1] = successor[x[t]]``, each sequence from a random start. A model learns it within a few
dozen steps, so a decreasing loss says the loop works, and no download is needed. The batch of
(step, micro-batch) comes from a generator seeded by a hash of ``(seed, step, micro)`` alone: it
does not depend on what ran before, which is what makes a resumed run equal to an uninterrupted one.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class SyntheticTokens:
    """Seeded next-token data; Note [Synthetic data]."""

    seed: int
    batch_size: int
    seq_length: int
    vocab_size: int

    @cached_property
    def successor(self) -> torch.Tensor:
        return torch.randperm(self.vocab_size, generator=torch.Generator().manual_seed(self.seed))

    def batch(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets ``[batch_size, seq_length]`` of micro-batch ``micro`` of ``step``."""
        key = hashlib.blake2b(f"{self.seed}:{step}:{micro}".encode(), digest_size=8).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(key, "little"))
        tokens = torch.empty(self.batch_size, self.seq_length + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab_size, (self.batch_size,), generator=gen)
        for t in range(1, self.seq_length + 1):
            tokens[:, t] = self.successor[tokens[:, t - 1]]
        # Contiguous: a pipeline schedule splits them into micro-batches, and torch 2.11's stage checks a
        # micro-batch's strides against the contiguous ones it inferred (seen on an H100 host).
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
