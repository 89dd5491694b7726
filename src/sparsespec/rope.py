"""Rotary position embeddings (RoPE), Hugging Face "rotate half" layout.

The cache applies these, not the model, because in the ``in-cache`` position mode a key's position is its rank
inside the cache, known only at attention time.
"""

from __future__ import annotations

import torch

TABLE_LIMIT = 1 << 15  # positions covered by cached cos/sin tables (beyond: computed per call)


class Rope:
    """Rotates ``[heads, tokens, head_dim]`` tensors by integer positions with base ``theta``."""

    def __init__(self, head_dim: int, theta: float) -> None:
        self.head_dim = head_dim
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self._cos = torch.empty(0, head_dim)
        self._sin = torch.empty(0, head_dim)

    def tables(self, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables ``[>= upto, head_dim]`` in float32 (contiguous), grown by doubling."""
        if upto > self._cos.shape[0]:
            size = max(upto, 2 * self._cos.shape[0], 256)
            freqs = torch.arange(size, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos, self._sin = emb.cos(), emb.sin()
        return self._cos, self._sin

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x: [heads, tokens, head_dim]`` by ``positions: [tokens]`` or ``[heads, tokens]`` (int64)."""
        highest = int(positions.max()) + 1 if positions.numel() else 0
        if highest <= TABLE_LIMIT:
            cos_table, sin_table = self.tables(highest)
            cos, sin = cos_table[positions], sin_table[positions]
        else:  # very long runs with true positions: compute, so memory stays bounded
            freqs = positions.float()[..., None] * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        half = self.head_dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
