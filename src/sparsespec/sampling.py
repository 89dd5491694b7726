"""Logits → probabilities (temperature, top-k, top-p) and sampling with an explicit ``torch.Generator``.

Temperature 0 means greedy: the warped distribution is one-hot on the argmax, and speculative verification with
one-hot distributions reduces to "accept iff argmax". The decode loops take the argmax directly
(:func:`next_token`, :func:`greedy_tokens`): a draw from a one-hot distribution over a large vocabulary costs far
more than an argmax, and numpy's argmax less than torch's:
benchmarks/history/source-notes.md#sampling-argmax
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into a distribution. ``top_k = 0`` and ``top_p = 1`` disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ConfigError("{temperature} must be 0 (greedy) or positive, got {value}.", value=self.temperature)
        if self.top_k < 0:
            raise ConfigError("{top_k} must be 0 (off) or a positive number of tokens, got {value}.", value=self.top_k)
        if not 0 < self.top_p <= 1:
            raise ConfigError("{top_p} must be in (0, 1], got {value}.", value=self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p (applied in that order, as Hugging Face does).

    Args:
        logits: ``[..., vocab]`` float32.

    Returns:
        ``[..., vocab]`` float32 probabilities summing to 1 over the last axis.
    """
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p  # the first token is always kept
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


SEED_RANGE = 2**63  # seeds are reduced modulo this: a generator takes a signed 64-bit value


def seeded_generator(seed: int | None) -> torch.Generator:
    """A generator seeded with ``seed`` (None: 0). Any integer is taken, reduced modulo :data:`SEED_RANGE`, so a
    seed of any size (a command-line flag, a request's ``seed`` field) names one stream and never overflows."""
    return torch.Generator().manual_seed((seed or 0) % SEED_RANGE)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from ``probs: [vocab]``."""
    return int(torch.multinomial(probs, 1, generator=generator))


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of ``logits: [rows, vocab]`` (the first index of the largest value, as
    ``torch.argmax``), through numpy on the CPU: torch's CPU argmax reads a row several times slower than numpy's,
    a cost paid on every row of every decode step:
    benchmarks/history/source-notes.md#sampling-numpy-argmax"""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1).tolist()
    return logits.detach().float().numpy().argmax(axis=-1).tolist()  # float(): a no-op on the float32 logits


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token id from ``logits: [vocab]``: the argmax when greedy, else a draw from :func:`warp`."""
    if params.greedy:
        return greedy_tokens(logits[None])[0]
    return sample(warp(logits, params), generator)
