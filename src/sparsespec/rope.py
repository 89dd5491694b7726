"""Rotary position embeddings (RoPE), Hugging Face "rotate half" layout, with the context-extending scalings of
:class:`~sparsespec.config.RopeScaling`.

The cache applies these, not the model, because in the ``in-cache`` position mode a key's position is its rank
inside the cache, known only at attention time. Every rotation, the native attention op's included, reads the cos/sin
tables made here, so a scaling changes the tables and nothing else.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig, RopeScaling

TABLE_LIMIT = 1 << 15  # positions covered by cached cos/sin tables (beyond: computed per call)


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """float32 ``[head_dim / 2]`` inverse frequencies, computed as transformers' ``ROPE_INIT_FUNCTIONS`` compute
    them (the same float32 operations in the same order), after dividing by ``scaling.freq_factors`` as llama.cpp
    does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if scaling is not None and scaling.kind == "yarn":
        return _yarn(head_dim, theta, scaling, exponents)
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    if scaling.freq_factors:
        inv_freq = inv_freq / torch.tensor(scaling.freq_factors)
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        return _llama3(inv_freq, scaling)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's rule (transformers' ``_compute_llama3_parameters``) on ``inv_freq: [head_dim / 2]``."""
    original = s.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = original / s.low_freq_factor, original / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(head_dim: int, theta: float, s: RopeScaling, exponents: torch.Tensor) -> torch.Tensor:
    """YaRN's blend (transformers' ``_compute_yarn_parameters``): ``[head_dim / 2]``."""

    def correction_dim(rotations: float) -> float:
        turns = s.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_share = 1 - ramp
    pos_freqs = theta ** exponents
    if s.freq_factors:
        pos_freqs = pos_freqs * torch.tensor(s.freq_factors)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    return interpolated * (1 - extrapolation_share) + extrapolated * extrapolation_share


class Rope:
    """Rotates ``[heads, tokens, head_dim]`` tensors by integer positions with base ``theta`` and ``scaling``."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> None:
        self.head_dim = head_dim
        self.inv_freq = inverse_frequencies(head_dim, theta, scaling)
        # YaRN scales cos and sin (so every query and key) by its attention factor; the other kinds' is 1.
        self.attention_factor = scaling.attention_factor if scaling is not None else 1.0
        self._cos = torch.empty(0, head_dim)
        self._sin = torch.empty(0, head_dim)

    @classmethod
    def for_model(cls, config: ModelConfig) -> "Rope":
        """The RoPE of the model ``config`` describes."""
        return cls(config.head_dim, config.rope_theta, config.rope_scaling)

    def tables(self, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables ``[>= upto, head_dim]`` in float32 (contiguous), grown by doubling."""
        if upto > self._cos.shape[0]:
            size = max(upto, 2 * self._cos.shape[0], 256)
            self._cos, self._sin = self._computed(torch.arange(size))
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
        if self.attention_factor == 1.0:
            return emb.cos(), emb.sin()
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x: [heads, tokens, head_dim]`` by ``positions: [tokens]`` or ``[heads, tokens]`` (int64)."""
        cos, sin = self.cos_sin(positions, x.dtype)
        half = self.head_dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

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
