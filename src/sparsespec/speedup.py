"""The speculative-decoding speed formulas (Leviathan et al. 2023): expected tokens per target pass and the gain
over autoregressive decoding, for per-token acceptance α, γ drafted tokens and draft/target cost ratio c.

Adaptive γ (``speculative.py``) chooses γ with them and the edge simulator (``edge/roofline.py``) predicts with them.
Torch-free.
"""

from __future__ import annotations

from .errors import UserError

# Draft proposals per round when a caller names none: 3, measured against 4 on the 0.5B -> 1.5B pair: as fast or
# faster on most short prompts (code, prose, chat) and on long prose:
# benchmarks/history/source-notes.md#default-gamma
DEFAULT_GAMMA = 3


def expected_tokens_per_pass(alpha: float, gamma: int) -> float:
    """Expected tokens per target pass with γ drafted tokens and per-token acceptance α (Leviathan et al. 2023).

    ``(1 − α^(γ+1)) / (1 − α)``; ``γ + 1`` at α = 1, and 1 at α = 0 or γ = 0.
    """
    check_alpha_gamma(alpha, gamma)
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speculative_speedup(alpha: float, gamma: int, c: float) -> float:
    """Wall-time gain over autoregressive decoding: ``(1 − α^(γ+1)) / ((1 − α)(γc + 1))``.

    ``c`` is the cost of one draft pass relative to one target pass (verification assumed to cost one target pass).
    """
    if c < 0:
        raise UserError("The draft/target cost ratio c must be >= 0.")
    return expected_tokens_per_pass(alpha, gamma) / (gamma * c + 1.0)


def best_gamma(alpha: float, c: float, max_gamma: int = 16) -> int:
    """The γ in ``0..max_gamma`` with the largest :func:`speculative_speedup` (the smallest on ties).

    0 means speculation does not pay (speedup never above 1).
    """
    if max_gamma < 0:
        raise UserError("max_gamma must be >= 0.")
    gains = [speculative_speedup(alpha, g, c) for g in range(max_gamma + 1)]
    best = max(gains)
    return next(g for g, gain in enumerate(gains) if gain >= best * (1 - 1e-12))


def check_alpha_gamma(alpha: float, gamma: int) -> None:
    """Raise :class:`UserError` unless α lies in [0, 1] and γ is a non-negative integer."""
    if not 0.0 <= alpha <= 1.0:
        raise UserError(f"Acceptance rate must lie in [0, 1], got {alpha}.")
    if int(gamma) != gamma or gamma < 0:
        raise UserError(f"γ (draft length) must be an integer >= 0, got {gamma}.")
