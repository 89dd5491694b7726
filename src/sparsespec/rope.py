"""Rotary position embeddings (RoPE), Hugging Face "rotate half" layout, with the context-extending scalings of
:class:`~sparsespec.config.RopeScaling`.

The cache applies these, not the model, because in the ``in-cache`` position mode a key's position is its rank
inside the cache, known only at attention time. A model's RoPE is its inverse frequencies and attention factor,
computed here once; the native arena and its cold tier make their cos/sin rows from them (``kernels/csrc/rope.h``,
:meth:`Rope.rows`), so a scaling changes the frequencies and nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import kernels
from .config import ModelConfig, RopeScaling


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


@dataclass(frozen=True)
class Rope:
    """A model's rotary embedding: the float32 inverse frequencies (``head_dim / 2`` of them) and the attention
    factor that scales every rotated vector (YaRN's; 1 for the other kinds)."""

    inv_freq: tuple[float, ...]
    attention_factor: float = 1.0

    @classmethod
    def for_model(cls, config: ModelConfig) -> "Rope":
        """The RoPE of the model ``config`` describes."""
        return cls.of(config.head_dim, config.rope_theta, config.rope_scaling)

    @classmethod
    def of(cls, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> "Rope":
        """The RoPE of heads of ``head_dim`` channels with base ``theta`` and ``scaling``."""
        return cls(tuple(inverse_frequencies(head_dim, theta, scaling).tolist()),
                   scaling.attention_factor if scaling is not None else 1.0)

    def rows(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos / sin ``[count, head_dim]``: the rotations by positions (or ranks) ``first ..
        first + count - 1`` as the kernels make and apply them (``kernels.rope_rows``)."""
        return kernels.rope_rows(self.inv_freq, self.attention_factor, first, count)
