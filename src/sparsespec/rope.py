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
        self._typed: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables ``[>= upto, head_dim]`` in float32 (contiguous), grown by doubling."""
        if upto > self._cos.shape[0]:
            size = max(upto, 2 * self._cos.shape[0], 256)
            freqs = torch.arange(size, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos, self._sin = emb.cos(), emb.sin()
            self._typed = {}
        return self._cos, self._sin

    def table_rows(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """float32 cos/sin ``[P, head_dim]`` covering positions ``[first, first + count)``, and the position of their
        row 0: the cached tables (row 0 = position 0) while they reach, else rows for these positions alone, computed
        as :meth:`rotate` computes them."""
        if first + count <= TABLE_LIMIT:
            cos, sin = self.tables(first + count)
            return cos, sin, 0
        cos, sin = self._computed(torch.arange(first, first + count))
        return cos, sin, first

    def _computed(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos/sin ``[..., head_dim]`` for ``positions`` past the cached tables, computed for them alone
        (memory stays bounded in very long runs)."""
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def _tables_in(self, upto: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`tables` rounded to ``dtype`` once (the values :meth:`rotate` multiplies by)."""
        cos, sin = self.tables(upto)
        if dtype not in self._typed:
            self._typed[dtype] = (cos.to(dtype), sin.to(dtype))
        return self._typed[dtype]

    def rotate_range(self, x: torch.Tensor, first: int) -> torch.Tensor:
        """``rotate(x, arange(first, first + T))`` for ``x: [heads, T, head_dim]``, from slices of the tables (the
        decode step's few-op path: no index, no max, no dtype conversion)."""
        count = x.shape[-2]
        if first + count > TABLE_LIMIT:
            return self.rotate(x, torch.arange(first, first + count))
        cos, sin = self._tables_in(first + count, x.dtype)
        cos, sin = cos[first : first + count], sin[first : first + count]
        half = self.head_dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x: [heads, tokens, head_dim]`` by ``positions: [tokens]`` or ``[heads, tokens]`` (int64)."""
        cos, sin = self.cos_sin(positions, x.dtype)
        half = self.head_dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`rotate` (a rotation by ``-positions``), to within the rounding of ``x``'s dtype."""
        cos, sin = self.cos_sin(positions, x.dtype)
        half = self.head_dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos - rotated * sin

    def cos_sin(self, positions: torch.Tensor,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[..., head_dim]`` of ``positions`` (>= 0) in ``dtype``: rows of the tables while they reach."""
        highest = int(positions.max()) + 1 if positions.numel() else 0
        if highest <= TABLE_LIMIT:
            cos_table, sin_table = self.tables(highest)
            cos, sin = cos_table[positions], sin_table[positions]
        else:
            cos, sin = self._computed(positions)
        return cos.to(dtype), sin.to(dtype)
