"""A complete decoding run — prompt in, tokens out, statistics kept — shared by the CLI and the benchmarks.

This is where user-level options (policy, budget, positions, draft, γ) turn into arenas and a token stream, and
where they are checked against the model (context length, budget, vocabularies).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .cache.arena import KVArena
from .cache.policy import CachePolicy, make_policy
from .errors import UserError
from .generate import generate_tokens
from .loading.load import LoadedModel
from .sampling import SamplingParams
from .speculative import (
    AdaptiveGamma,
    SpeculativeStats,
    check_same_vocabulary,
    draft_inflight_rows,
    speculative_tokens,
    target_inflight_rows,
    weight_cost_ratio,
)


@dataclass(frozen=True)
class CacheOptions:
    """How one model's KV cache is laid out: policy, position mode, prefill chunk."""

    policy: CachePolicy = field(default_factory=lambda: make_policy("full"))
    positions: str = "original"
    prefill_chunk: int = 512
    force_context: bool = False

    def __post_init__(self) -> None:
        if self.prefill_chunk < 1:
            raise UserError(f"--prefill-chunk must be at least 1 (got {self.prefill_chunk}).")


def check_fits_context(loaded: LoadedModel, cache: CacheOptions, total_tokens: int, what: str) -> None:
    """Raise :class:`UserError` when a run would show the model positions beyond its trained context.

    With ``in-cache`` positions and a budgeted policy, positions are ranks below budget + staging whatever the
    length (:func:`check_in_cache_ranks` checks those against the context).
    """
    context = loaded.config.max_position_embeddings
    budget = cache.policy.budget
    if budget is not None and cache.positions == "original" and budget > context and not cache.force_context:
        raise UserError(f"--budget {budget} exceeds the model's context of {context} tokens.")
    sees_true_positions = cache.policy.is_full or cache.positions == "original"
    if sees_true_positions and total_tokens > context and not cache.force_context:
        raise UserError(
            f"{what} ({total_tokens} tokens) exceeds {loaded.name}'s context of {context} tokens; "
            "shorten it, or use a budgeted policy with --positions in-cache (or --force-context)."
        )


def check_in_cache_ranks(loaded: LoadedModel, cache: CacheOptions, staging: int) -> None:
    """Raise :class:`UserError` when in-cache ranks would pass the model's trained context.

    A budgeted arena holds up to ``budget + staging`` entries (``staging``: the most rows staged at once, the
    prefill chunk or the rows in flight), and ``in-cache`` positions rank them ``0 … budget + staging − 1``.
    """
    budget = cache.policy.budget
    context = loaded.config.max_position_embeddings
    if cache.positions != "in-cache" or budget is None or cache.force_context or budget + staging <= context:
        return
    raise UserError(
        f"With --positions in-cache the ranks reach --budget {budget} + {staging} staged rows = {budget + staging}, "
        f"past {loaded.name}'s context of {context} tokens; lower --budget or the chunk (or --force-context)."
    )


def make_arena(loaded: LoadedModel, cache: CacheOptions, max_tokens: int, max_inflight: int) -> KVArena:
    """An arena for ``loaded`` that can hold a run of ``max_tokens`` tokens (only the full cache needs that).

    Raises :class:`UserError` when its in-cache ranks would pass the trained context (:func:`check_in_cache_ranks`).
    """
    max_block = min(cache.prefill_chunk, max_tokens)
    check_in_cache_ranks(loaded, cache, max(max_block, max_inflight))
    return KVArena(
        loaded.config,
        cache.policy,
        dtype=loaded.model.dtype,
        max_tokens=max_tokens,
        max_block=max_block,
        max_inflight=max_inflight,
        positions=cache.positions,
    )


@dataclass
class RunStats:
    """What one generation run measured."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    kv_cache_bytes: int = 0
    evicted_tokens: int = 0
    speculative: SpeculativeStats | None = None
    final_gamma: int | None = None

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: new tokens over the time after the prompt was read (so a speculative first round's tokens
        come with that round's time)."""
        if not self.new_tokens or self.decode_seconds <= 0:
            return 0.0
        return self.new_tokens / self.decode_seconds

    def to_dict(self) -> dict:
        out = {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "prefill_seconds": round(self.prefill_seconds, 4),
            "decode_seconds": round(self.decode_seconds, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "kv_cache_bytes": self.kv_cache_bytes,
            "evicted_tokens": self.evicted_tokens,
        }
        if self.speculative is not None:
            s = self.speculative
            out.update(
                acceptance_rate=round(s.acceptance_rate, 4),
                tokens_per_target_pass=round(s.tokens_per_target_pass, 4),
                target_passes=s.target_passes,
                draft_target_cost_ratio=round(s.draft_target_cost_ratio, 4),
                gamma=self.final_gamma,
            )
        return out


@dataclass(frozen=True)
class DraftOptions:
    """The draft side of speculative decoding: a model (or the target itself), its cache, and γ."""

    model: LoadedModel
    cache: CacheOptions
    gamma: int | str = 4  # an integer ≥ 1 or "auto"
    is_self: bool = False


def parse_gamma(text: str) -> int | str:
    """``--gamma`` value: a positive integer or ``auto``."""
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise UserError(f"--gamma must be a positive integer or 'auto' (got {text!r}).") from None
    if value < 1:
        raise UserError(f"--gamma must be at least 1 (got {value}).")
    return value


def run_generation(
    target: LoadedModel,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    cache: CacheOptions,
    seed: int | None = None,
    eos_ids: set[int] | frozenset[int] = frozenset(),
    draft: DraftOptions | None = None,
    stats: RunStats | None = None,
) -> Iterator[int]:
    """Yield new token ids for ``prompt_ids``; ``stats`` is filled in as the run goes.

    Checks the inputs first (empty prompt, context length, γ, vocabularies) and raises :class:`UserError`.
    """
    if not prompt_ids:
        raise UserError("The prompt is empty; give some text to continue.")
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1 (got {max_new_tokens}).")
    total = len(prompt_ids) + max_new_tokens
    check_fits_context(target, cache, total, "The prompt plus --max-new-tokens")
    stats = stats if stats is not None else RunStats()
    stats.prompt_tokens = len(prompt_ids)
    generator = torch.Generator().manual_seed(seed if seed is not None else 0)
    started = time.perf_counter()
    prefilled_at = [started]

    def on_prefilled() -> None:
        prefilled_at[0] = time.perf_counter()
        stats.prefill_seconds = prefilled_at[0] - started

    if draft is None:
        arena = make_arena(target, cache, total, max_inflight=1)
        tokens = generate_tokens(
            target.model, arena, prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling,
            generator=generator, eos_ids=eos_ids, prefill_chunk=cache.prefill_chunk, on_prefilled=on_prefilled,
        )
        arenas = [arena]
    else:
        if not draft.is_self:
            check_same_vocabulary(
                target.tokenizer, draft.model.tokenizer, target.config.vocab_size, draft.model.config.vocab_size
            )
        check_fits_context(draft.model, draft.cache, total, "The prompt plus --max-new-tokens (for the draft)")
        gamma = draft.gamma
        if gamma == "auto":
            # Sampled text must not depend on timings: at temperature > 0, γ follows a cost ratio from weight bytes.
            fixed = None if sampling.greedy else weight_cost_ratio(target.model, draft.model.model)
            gamma = AdaptiveGamma(cost_ratio=fixed)
        gamma_cap = gamma.gamma_max if isinstance(gamma, AdaptiveGamma) else gamma
        target_arena = make_arena(target, cache, total, target_inflight_rows(gamma_cap))
        draft_arena = make_arena(draft.model, draft.cache, total, draft_inflight_rows(gamma_cap))
        stats.speculative = SpeculativeStats()
        tokens = speculative_tokens(
            target.model, target_arena, draft.model.model, draft_arena, prompt_ids,
            max_new_tokens=max_new_tokens, sampling=sampling, gamma=gamma, generator=generator,
            eos_ids=eos_ids, prefill_chunk=cache.prefill_chunk, stats=stats.speculative, on_prefilled=on_prefilled,
        )
        arenas = [target_arena, draft_arena]

    for token in tokens:
        stats.new_tokens += 1
        stats.decode_seconds = time.perf_counter() - prefilled_at[0]
        yield token
    stats.kv_cache_bytes = sum(a.nbytes for a in arenas)
    stats.evicted_tokens = arenas[0].evicted_tokens
    if draft is not None:
        stats.final_gamma = gamma.gamma if isinstance(gamma, AdaptiveGamma) else gamma
