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
from .cache.quant import check_kv_dtype
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
)


@dataclass(frozen=True)
class CacheOptions:
    """How one model's KV cache is laid out: policy, position mode, prefill chunk, storage dtype of the entries."""

    policy: CachePolicy = field(default_factory=lambda: make_policy("full"))
    positions: str = "original"
    prefill_chunk: int = 512
    force_context: bool = False
    kv_dtype: str = "auto"  # auto (the compute dtype) | bf16 | int8 | int4, see cache/quant.py
    # The arena's bytes (``--kv-bytes``): when set, make_arena sizes the budget of ``policy`` (its name and sinks
    # are what counts) to the most entries whose arena, staging slots included, fits; see sized_policy.
    kv_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.prefill_chunk < 1:
            raise UserError(f"--prefill-chunk must be at least 1 (got {self.prefill_chunk}).")
        check_kv_dtype(self.kv_dtype)


def check_fits_context(loaded: LoadedModel, cache: CacheOptions, total_tokens: int, what: str) -> None:
    """Raise :class:`UserError` when a run would show the model positions beyond its trained context.

    With ``in-cache`` positions and a budgeted policy positions stay below budget + staging, so any length works.
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


def arena_staging(cache: CacheOptions, max_tokens: int, max_inflight: int) -> int:
    """Slots :func:`make_arena` adds to the budget (or to ``max_tokens`` for the full cache): the larger of the
    prefill chunk (at most ``max_tokens``) and the rows in flight."""
    return max(min(cache.prefill_chunk, max_tokens), max_inflight)


def sized_policy(name: str, sinks: int | None, config, dtype, kv_dtype: str, kv_bytes: int,
                 staging: int) -> CachePolicy:
    """The policy ``name`` whose arena (budget + ``staging`` slots) takes at most ``kv_bytes`` bytes of keys and
    values in ``kv_dtype`` (the figure ``kv_cache_bytes`` reports): the most entries that fit, split by the policy's
    defaults (``sinks`` as given)."""
    if name == "full":
        raise UserError("--kv-bytes sets a budget; the full cache has none (choose a budgeted --policy).")
    budget = KVArena.budget_for_bytes(config, kv_dtype, dtype, kv_bytes, staging)
    per_slot = KVArena.bytes_per_slot(config, kv_dtype, dtype) * config.num_hidden_layers * config.num_key_value_heads
    where = (f"--kv-bytes {kv_bytes} holds {kv_bytes // per_slot} slots of {per_slot} bytes ({kv_dtype} keys and "
             f"values, all layers), {staging} of them staging")
    if budget < 1:
        raise UserError(f"{where}: no room for a budget.")
    try:
        return make_policy(name, budget, sinks=sinks)
    except UserError as exc:
        raise UserError(f"{where}, leaving a budget of {budget}: {exc}") from None


def make_arena(loaded: LoadedModel, cache: CacheOptions, max_tokens: int, max_inflight: int) -> KVArena:
    """An arena for ``loaded`` that can hold a run of ``max_tokens`` tokens (only the full cache needs that)."""
    policy = cache.policy
    if cache.kv_bytes is not None:
        policy = sized_policy(policy.name, policy.sinks or None, loaded.config, loaded.model.dtype, cache.kv_dtype,
                              cache.kv_bytes, arena_staging(cache, max_tokens, max_inflight))
    return KVArena(
        loaded.config,
        policy,
        dtype=loaded.model.dtype,
        max_tokens=max_tokens,
        max_block=min(cache.prefill_chunk, max_tokens),
        max_inflight=max_inflight,
        positions=cache.positions,
        kv_dtype=cache.kv_dtype,
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
    budget: int | None = None  # the target arena's budget (sized from --kv-bytes when that was given)
    speculative: SpeculativeStats | None = None
    final_gamma: int | None = None

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: new tokens after the first, over the time after the first token appeared."""
        if self.new_tokens <= 1 or self.decode_seconds <= 0:
            return 0.0
        return (self.new_tokens - 1) / self.decode_seconds

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

    if draft is None:
        arena = make_arena(target, cache, total, max_inflight=1)
        tokens = generate_tokens(
            target.model, arena, prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling,
            generator=generator, eos_ids=eos_ids, prefill_chunk=cache.prefill_chunk,
        )
        arenas = [arena]
    else:
        if not draft.is_self:
            check_same_vocabulary(
                target.tokenizer, draft.model.tokenizer, target.config.vocab_size, draft.model.config.vocab_size
            )
        check_fits_context(draft.model, draft.cache, total, "The prompt plus --max-new-tokens (for the draft)")
        gamma = AdaptiveGamma() if draft.gamma == "auto" else draft.gamma
        gamma_cap = gamma.gamma_max if isinstance(gamma, AdaptiveGamma) else gamma
        target_arena = make_arena(target, cache, total, target_inflight_rows(gamma_cap))
        draft_arena = make_arena(draft.model, draft.cache, total, draft_inflight_rows(gamma_cap))
        stats.speculative = SpeculativeStats()
        tokens = speculative_tokens(
            target.model, target_arena, draft.model.model, draft_arena, prompt_ids,
            max_new_tokens=max_new_tokens, sampling=sampling, gamma=gamma, generator=generator,
            eos_ids=eos_ids, prefill_chunk=cache.prefill_chunk, stats=stats.speculative,
        )
        arenas = [target_arena, draft_arena]

    started = time.perf_counter()
    first_token_at = None
    for token in tokens:
        now = time.perf_counter()
        if first_token_at is None:
            first_token_at = now
            stats.prefill_seconds = now - started
        stats.new_tokens += 1
        stats.decode_seconds = now - first_token_at
        yield token
    stats.kv_cache_bytes = sum(a.nbytes for a in arenas)
    stats.evicted_tokens = arenas[0].evicted_tokens
    stats.budget = arenas[0].policy.budget
    if draft is not None:
        stats.final_gamma = gamma.gamma if isinstance(gamma, AdaptiveGamma) else gamma
