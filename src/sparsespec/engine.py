"""A complete decoding run — prompt in, tokens out, statistics kept — shared by the CLI and the benchmarks.

This is where user-level options (policy, budget, positions, draft, γ) turn into arenas and a token stream, and
where they are checked against the model (context length, budget, vocabularies).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Iterator

from .cache.arena import KVArena
from .cache.layered import LayeredArena, global_config, sliding_config, window_policy
from .cache.policy import CachePolicy, make_policy
from .cache.quant import BITS, check_kv_dtype, recent_window_for
from .cache.recall import recall_for, recalled_entries
from .cache.retention import retention_for
from .config import ModelConfig
from .errors import ConfigError, UserError
from .generate import decode_steps, prefill_steps
from .loading.load import LoadedModel
from .ngram import NgramDrafter, NgramIndex, NgramOptions, SharedTexts
from .passes import Pass, Program, run_alone
from .sampling import SamplingParams, seeded_generator
from .speculative import (
    AdaptiveGamma,
    STARTS_PLAIN_AT_COST,
    DraftWhileFaster,
    SpeculativeStats,
    check_same_vocabulary,
    draft_inflight_rows,
    speculative_steps,
    target_inflight_rows,
    weight_cost_ratio,
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
    # Quantized entries' full-precision window (``--kv-recent``; None: quant.RECENT_WINDOW's for kv_dtype).
    recent_window: int | None = None
    # Query-aware selection at each prompt's end (``--retention``: auto | query | off, cache/retention.py) and the
    # most prompt tokens it holds whole (``--retention-tokens``; None: retention.DEFAULT_MAX_HELD, or fewer where the
    # model's context minus the budget is less).
    retention: str = "auto"
    retention_tokens: int | None = None
    # Pages each decode row reads back from the cold tier of evicted entries (``--recall-pages``, cache/recall.py);
    # None: no cold tier.
    recall_pages: int | None = None

    def __post_init__(self) -> None:
        if self.prefill_chunk < 1:
            raise ConfigError("{prefill_chunk} must be at least 1 (got {value}).", value=self.prefill_chunk)
        check_kv_dtype(self.kv_dtype)
        if self.recent_window is not None:
            if self.kv_dtype not in BITS:
                raise ConfigError("{recent_window} keeps the newest int8 / int4 entries in full precision; with "
                                  "{kv_dtype} {value} every entry already is, so drop it.", value=self.kv_dtype)
            if self.recent_window < 0:
                raise ConfigError("{recent_window} must be 0 or more (got {value}).", value=self.recent_window)
        retention_for(self.retention, self.policy, self.retention_tokens)
        recall_for(self.recall_pages, self.policy)


def check_fits_context(loaded: LoadedModel, cache: CacheOptions, total_tokens: int, what: str) -> None:
    """Raise :class:`ConfigError` when a run would show the model positions beyond its trained context; ``what``
    names the tokens counted (``total_tokens``), as a template clause (``"The prompt plus {max_new_tokens}"``).

    With ``in-cache`` positions and a budgeted policy, positions are ranks below budget + staging whatever the
    length (:func:`check_in_cache_ranks` checks those against the context).
    """
    context = loaded.config.max_position_embeddings
    budget = cache.policy.budget
    if budget is not None and cache.positions == "original" and budget > context and not cache.force_context:
        raise ConfigError("{budget} {value} exceeds the model's context of {context} tokens.", value=budget,
                          context=context)
    sees_true_positions = cache.policy.is_full or cache.positions == "original"
    if sees_true_positions and total_tokens > context and not cache.force_context:
        raise ConfigError(
            what + " ({total_tokens} tokens) exceeds {model}'s context of {context} tokens; shorten it, or use a "
            "budgeted policy with {positions} in-cache (or {force_context}).", total_tokens=total_tokens,
            model=loaded.name, context=context,
        )


def check_in_cache_ranks(loaded: LoadedModel, cache: CacheOptions, staging: int) -> None:
    """Raise :class:`ConfigError` when in-cache ranks would pass the model's trained context.

    A budgeted arena holds up to ``budget + staging`` entries (``staging``: the most rows staged at once, the
    prefill chunk or the rows in flight), and ``in-cache`` positions rank them ``0 … budget + staging − 1``.
    """
    budget = cache.policy.budget
    context = loaded.config.max_position_embeddings
    if cache.positions != "in-cache" or budget is None or cache.force_context:
        return
    if budget + staging > context:
        raise ConfigError(
            "With {positions} in-cache the ranks reach {budget} {value} + {staging} staged rows = {ranks}, past "
            "{model}'s context of {context} tokens; lower {budget} or the chunk (or {force_context}).",
            value=budget, staging=staging, ranks=budget + staging, model=loaded.name, context=context)
    recalled = cache.policy.sinks + recalled_entries(cache.recall_pages) if cache.recall_pages else 0
    if recalled > context:
        raise ConfigError(
            "With {positions} in-cache the {pages} recalled pages take ranks up to {recalled}, past {model}'s "
            "context of {context} tokens; lower {recall_pages} (or {force_context}).", pages=cache.recall_pages,
            recalled=recalled, model=loaded.name, context=context)


def arena_staging(cache: CacheOptions, max_tokens: int, max_inflight: int) -> int:
    """Slots :func:`make_arena` adds to the budget (or to ``max_tokens`` for the full cache): the larger of the
    prefill chunk (at most ``max_tokens``) and the rows in flight."""
    return max(min(cache.prefill_chunk, max_tokens), max_inflight)


def sized_policy(name: str, sinks: int | None, config, dtype, kv_dtype: str, kv_bytes: int,
                 staging: int, max_inflight: int = 1, recent_window: int | None = None) -> CachePolicy:
    """The policy ``name`` whose arena (budget + ``staging`` slots, and the full-precision ring of
    ``recent_window`` positions, None: ``kv_dtype``'s default, for ``max_inflight`` rows in flight) takes at most
    ``kv_bytes`` bytes of keys and values in ``kv_dtype`` (the figure ``kv_cache_bytes`` reports): the most entries
    that fit, split by the policy's defaults (``sinks`` as given)."""
    if name == "full":
        raise ConfigError("{kv_bytes} sets a budget; the full cache has none (choose a budgeted {policy}).")
    recent_window = recent_window_for(kv_dtype, recent_window)
    budget = KVArena.budget_for_bytes(config, kv_dtype, dtype, kv_bytes, staging, max_inflight, recent_window)
    per_slot = KVArena.bytes_per_slot(config, kv_dtype, dtype) * config.num_hidden_layers * config.num_key_value_heads
    ring = KVArena.ring_slots(recent_window, max_inflight)
    beside = f" beside {ring} full-precision entries" if ring else ""
    where = ("{kv_bytes} {bytes} holds {slots} slots of {per_slot} bytes ({dtype_name} keys and values, all "
             "layers){beside}, {staging} of them staging")
    facts = dict(bytes=kv_bytes, slots=max(budget + staging, 0), per_slot=per_slot, dtype_name=kv_dtype,
                 beside=beside, staging=staging)
    if budget < 1:
        raise ConfigError(where + ": no room for a budget.", **facts)
    try:
        return make_policy(name, budget, sinks=sinks)
    except ConfigError as exc:
        raise exc.after(where + ", leaving a budget of {leaving}: ", leaving=budget, **facts) from None


def make_arena(loaded: LoadedModel, cache: CacheOptions, max_tokens: int, max_inflight: int,
               initial_tokens: int | None = None) -> KVArena | LayeredArena:
    """An arena for ``loaded`` (a :class:`LayeredArena` where it has sliding-window layers) that can hold a run of
    ``max_tokens`` tokens (only the full cache needs that; with ``initial_tokens`` it starts with that much room and
    grows), its budget sized to ``cache.kv_bytes`` when that is set (:func:`sized_policy`; sliding-window layers
    take their windows' bytes first, the global layers' budget what is left).

    Raises :class:`UserError` when its in-cache ranks would pass the trained context (:func:`check_in_cache_ranks`).
    """
    max_block = min(cache.prefill_chunk, max_tokens)
    staging = arena_staging(cache, max_tokens, max_inflight)
    policy = cache.policy
    if cache.kv_bytes is not None:
        config, kv_bytes = loaded.config, cache.kv_bytes
        if config.sliding_layers:
            kv_bytes -= KVArena.nbytes_for(sliding_config(config), cache.kv_dtype, loaded.model.dtype,
                                           window_policy(config).budget + staging, max_inflight, cache.recent_window)
            config = global_config(config)
        policy = sized_policy(policy.name, policy.sinks or None, config, loaded.model.dtype, cache.kv_dtype,
                              kv_bytes, staging, max_inflight, cache.recent_window)
    retention = retention_for(cache.retention, policy, cache.retention_tokens,
                              context=loaded.config.max_position_embeddings)
    # Held prompt tokens are ranked like staged ones: the ranks reach the budget plus the larger of the two.
    check_in_cache_ranks(loaded, replace(cache, policy=policy), max(staging, retention.max_held if retention else 0))

    key_offset = loaded.model.key_biases()
    options = dict(policy=policy, dtype=loaded.model.dtype, max_tokens=max_tokens, max_block=max_block,
                   max_inflight=max_inflight, positions=cache.positions, kv_dtype=cache.kv_dtype, key_offset=key_offset,
                   recent_window=cache.recent_window, retention=retention,
                   recall=recall_for(cache.recall_pages, policy), initial_tokens=initial_tokens)

    def arena(config: ModelConfig, **overrides) -> KVArena:
        chosen = options | overrides
        return KVArena(config, chosen.pop("policy"), **chosen)

    if loaded.config.sliding_layers:
        return LayeredArena(loaded.config, arena, key_offset=key_offset)
    return arena(loaded.config)


@dataclass
class RunStats:
    """What one generation run measured."""

    prompt_tokens: int = 0
    reused_tokens: int = 0  # leading prompt tokens resumed from a previous run's cache (not read again)
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    kv_cache_bytes: int = 0
    kv_peak_bytes: int = 0  # the most the KV buffers held during the run (retention holds whole prompts)
    evicted_tokens: int = 0
    cold_bytes: int = 0  # what the cold tier of evicted entries held at the end (recall), all arenas
    budget: int | None = None  # the target arena's budget (sized from --kv-bytes when that was given)
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
            "kv_peak_bytes": self.kv_peak_bytes,
            "evicted_tokens": self.evicted_tokens,
            "cold_bytes": self.cold_bytes,
        }
        if self.speculative is not None:
            s = self.speculative
            out.update(
                acceptance_rate=round(s.acceptance_rate, 4),
                tokens_per_target_pass=round(s.tokens_per_target_pass, 4),
                target_passes=s.target_passes,
                draft_target_cost_ratio=round(s.draft_target_cost_ratio, 4),
                gamma=self.final_gamma,
                drafted=s.drafted,
                accepted=s.accepted,
                ngram_rounds=s.ngram_rounds,
                ngram_drafted=s.ngram_drafted,
                ngram_accepted=s.ngram_accepted,
                sibling_rounds=s.sibling_rounds,
                sibling_accepted=s.sibling_accepted,
            )
        return out


@dataclass(frozen=True)
class DraftOptions:
    """The draft side of speculative decoding: a draft model (or the target itself) with its cache and γ, and
    proposals from n-gram matches in the text already seen (``ngram.py``); either may be absent (``model`` None:
    n-gram drafting alone; ``ngram`` None: the model alone)."""

    model: LoadedModel | None
    cache: CacheOptions | None
    gamma: int | str | None  # an integer ≥ 1 or "auto" (None without a model)
    is_self: bool = False
    # An integer γ drafts only while that is measured faster than the target alone (greedy decoding; sampled text
    # must not depend on timings): speculative.DraftWhileFaster.
    only_while_faster: bool = False
    ngram: NgramOptions | None = None
    # A draft model's rounds also verify its runner-up for the first token (speculative_steps' ``sibling``).
    sibling: bool = False


# The most draft tokens a round may propose: a verification pass stages γ + 1 rows in both arenas, and acceptance
# falls geometrically with γ, so rounds past a few dozen tokens only allocate.
MAX_GAMMA = 64


def parse_gamma(text: str) -> int | str:
    """``--gamma`` value: a positive integer or ``auto``."""
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise ConfigError("{gamma} must be a positive integer or 'auto' (got {value!r}).", value=text) from None
    if not 1 <= value <= MAX_GAMMA:
        raise ConfigError("{gamma} must be from 1 to {most} (got {value}).", most=MAX_GAMMA, value=value)
    return value


# A conversation's full cache (Session with a capacity) starts with room for this many tokens and doubles as it
# fills: 12 MiB for Qwen2.5-0.5B in bfloat16, where the model's whole context would be 384 MiB (per serve slot).
CONVERSATION_CACHE_START = 1024


class Session:
    """Arenas kept from one run to the next, so that a prompt extending the text they hold resumes from them.

    After a run the arenas hold the start of that run's text: its prompt and the tokens it yielded, except the
    last yielded token, which is never fed back (with a draft, the two arenas may stop at different points). A
    later prompt that begins with everything the arenas hold, and goes on past it, is fed from there on (prefix
    reuse: the next turn of a chat reads only the new messages); any other prompt starts from empty arenas.

    With the full cache a resumed run equals a fresh run over the whole prompt (up to floating-point rounding of
    the prefill's chunking). With a budget the two differ once anything has been evicted: the resumed cache
    evicted token by token as the previous answers were decoded, a fresh run evicts once per prefill chunk.

    ``capacity`` bounds the full cache (e.g. the model's context) so that the arenas outlive one run: it starts
    with room for :data:`CONVERSATION_CACHE_START` tokens and doubles as the conversation fills it (``KVArena``'s
    ``initial_tokens``), so a short chat holds a short cache. Without it the arenas are sized for each run. A run
    that needs more than the full cache may hold starts from new, larger arenas.
    """

    def __init__(
        self,
        target: LoadedModel,
        cache: CacheOptions,
        draft: DraftOptions | None = None,
        *,
        capacity: int | None = None,
    ) -> None:
        if draft is not None and draft.model is not None and not draft.is_self:
            check_same_vocabulary(
                target.tokenizer, draft.model.tokenizer, target.config.vocab_size, draft.model.config.vocab_size
            )
        self.target = target
        self.cache = cache
        self.draft = draft
        self.capacity = capacity
        self.arenas: list[KVArena] = []  # the target's, then the draft's
        self._text: list[int] = []  # the text; each arena holds its tokens [origin, origin + arena.next_position)
        self._origins: list[int] = []  # per arena: 0, except a draft that restarted from the end of what it missed
        # n-gram proposals (ngram.py): their index of the text, and what they learned of acceptance and costs
        self._ngram: NgramDrafter | None = None
        # Other sessions' text that greedy runs also draft from (a server's, ngram.SharedTexts), and the salt of the
        # request running: each run leaves its text there under that salt, and matches only text of that salt.
        self.shared_texts: SharedTexts | None = None
        self.salt: str | None = None

    @property
    def _gamma_cap(self) -> int:
        """The most tokens a round proposes: the draft model's γ (its largest with ``auto``), or n-gram proposals'."""
        gamma = self.draft.gamma
        model = 0 if self.draft.model is None else AdaptiveGamma().gamma_max if gamma == "auto" else gamma
        return max(model, self.draft.ngram.max_tokens if self.draft.ngram is not None else 0)

    @property
    def _drafts_with_a_model(self) -> bool:
        return self.draft is not None and self.draft.model is not None

    @property
    def held_tokens(self) -> int:
        """Tokens of text the arenas hold and a later prompt can skip (0 when there is nothing to resume from)."""
        if not self.arenas:
            return 0
        held = max(origin + arena.next_position for origin, arena in zip(self._origins, self.arenas))
        return held if held <= len(self._text) else 0

    @property
    def kv_cache_bytes(self) -> int:
        return sum(arena.nbytes for arena in self.arenas)

    @property
    def evicted_tokens(self) -> int:
        """Tokens the target's arena has evicted since it was last empty (per layer and head)."""
        return self.arenas[0].evicted_tokens if self.arenas else 0

    def reusable(self, prompt_ids: list[int]) -> int:
        """How many leading tokens of ``prompt_ids`` the arenas hold already (0: a run starts from empty arenas)."""
        held = self.held_tokens
        if held == 0 or held >= len(prompt_ids) or self._text[:held] != list(prompt_ids[:held]):
            return 0
        return held

    def reset(self) -> None:
        """Forget the text: the next run starts from empty arenas."""
        for arena in self.arenas:
            arena.reset()
        self._origins = [0] * len(self.arenas)
        self._text = []
        if self._ngram is not None:
            self._ngram.forget()

    def _share(self, text: list[int], reuse: int) -> None:
        """Leave a finished run's text in the shared texts: what it read and wrote past what it resumed from (with
        the n-gram before, so that matches across the seam are kept)."""
        if self.shared_texts is not None and self._ngram is not None:
            self.shared_texts.add(text[max(reuse - self._ngram.options.max_n, 0) :], self.salt)

    def _models(self) -> list[LoadedModel]:
        return [self.target, self.draft.model] if self._drafts_with_a_model else [self.target]

    def _prepare_arenas(self, total: int) -> None:
        """Arenas that can take a run of ``total`` tokens, keeping the current ones when they can."""
        caches = [self.cache, self.draft.cache] if self._drafts_with_a_model else [self.cache]
        fits = all(
            (not arena.policy.is_full or arena.max_tokens >= total)
            and arena.max_block >= min(self.cache.prefill_chunk, total)
            for arena in self.arenas
        )
        if self.arenas and fits:
            return
        size = max(self.capacity or 0, total)
        if self.draft is None:
            inflight = [1]
        else:
            inflight = [target_inflight_rows(self._gamma_cap, self.draft.sibling),
                        draft_inflight_rows(self._gamma_cap)]
        self.arenas = []  # free the old buffers before allocating new ones
        start = None if self.capacity is None else CONVERSATION_CACHE_START
        self.arenas = [
            make_arena(loaded, cache, size, rows, initial_tokens=start)
            for loaded, cache, rows in zip(self._models(), caches, inflight)
        ]
        self._origins = [0] * len(self.arenas)
        self._text = []

    def run(self, prompt_ids: list[int], **options) -> Iterator[int]:
        """Yield new token ids for ``prompt_ids`` (:meth:`steps` run alone, with the same options)."""
        return run_alone(self.steps(prompt_ids, **options))

    def steps(
        self,
        prompt_ids: list[int],
        *,
        max_new_tokens: int,
        sampling: SamplingParams,
        seed: int | None = None,
        eos_ids: set[int] | frozenset[int] = frozenset(),
        stats: RunStats | None = None,
    ) -> Program:
        """The decoding program (``passes.py``) of ``prompt_ids``, resuming from the arenas where they hold its start.

        Checks the inputs first (empty prompt, context length) and raises :class:`UserError`; ``stats`` is filled
        in as the run goes. Closed where it yields a token, the arenas stay consistent for the next run to resume
        from; ended anywhere else (an error, or closed while it waits for a pass), the next run starts afresh.
        """
        if not prompt_ids:
            raise UserError("The prompt is empty; give some text to continue.")
        if max_new_tokens < 1:
            raise ConfigError("{max_new_tokens} must be at least 1 (got {value}).", value=max_new_tokens)
        total = len(prompt_ids) + max_new_tokens
        check_fits_context(self.target, self.cache, total, "The prompt plus {max_new_tokens}")
        if self._drafts_with_a_model:
            check_fits_context(
                self.draft.model, self.draft.cache, total, "The prompt plus {max_new_tokens} (for the draft)"
            )
        stats = stats if stats is not None else RunStats()
        stats.prompt_tokens = len(prompt_ids)
        generator = seeded_generator(seed)

        self._prepare_arenas(total)
        reuse = self.reusable(prompt_ids)
        if reuse == 0:
            self.reset()
        stats.reused_tokens = reuse
        evicted_before = self.evicted_tokens
        for arena in self.arenas:  # this run's peak
            arena.restart_peak()
        started = time.perf_counter()
        prefilled_at = [started]

        def on_prefilled() -> None:
            prefilled_at[0] = time.perf_counter()
            stats.prefill_seconds = prefilled_at[0] - started

        text = self._text = list(prompt_ids)
        at_token = False
        tokens = None
        try:
            for index, (arena, loaded) in enumerate(zip(self.arenas, self._models())):  # a draft's may lag
                held = self._origins[index] + arena.next_position
                yield from prefill_steps(loaded.model, arena, text[held : reuse],
                                         self.cache.prefill_chunk, draft=index > 0)
            tokens = self._tokens(text[reuse:], max_new_tokens, sampling, generator, eos_ids, stats, on_prefilled)
            reply = None
            while True:
                try:
                    item = tokens.send(reply)
                except StopIteration:
                    self._share(text, reuse)
                    return
                if isinstance(item, Pass):
                    reply = yield item
                    continue
                reply = None
                stats.new_tokens += 1
                stats.decode_seconds = time.perf_counter() - prefilled_at[0]
                text.append(item)
                at_token = True
                yield item
                at_token = False
        except GeneratorExit:
            if not at_token:  # closed while waiting for a pass: an arena may hold rows in flight
                self._text = []
            else:
                self._share(text, reuse)
            raise
        except BaseException:  # an error or Ctrl-C inside a pass may leave an arena mid-block: never resume from it
            self._text = []
            raise
        finally:
            if tokens is not None:
                tokens.close()
            if stats.speculative is not None and self._drafts_with_a_model:  # a draft that restarted holds the
                self._origins[1] += stats.speculative.draft_origin_shift  # text from a later token on
            stats.kv_cache_bytes = self.kv_cache_bytes
            stats.kv_peak_bytes = sum(arena.peak_nbytes for arena in self.arenas)
            stats.evicted_tokens = self.evicted_tokens - evicted_before
            stats.cold_bytes = sum(arena.cold.nbytes for arena in self.arenas if arena.cold is not None)
            stats.budget = self.arenas[0].policy.budget

    def _tokens(self, suffix, max_new_tokens, sampling, generator, eos_ids, stats: RunStats,
                on_prefilled) -> Program:
        """The decoding program over the arenas, fed the prompt's ``suffix`` that they do not hold yet."""
        chunk = self.cache.prefill_chunk
        if self.draft is None:
            yield from decode_steps(
                self.target.model, self.arenas[0], suffix, max_new_tokens=max_new_tokens, sampling=sampling,
                generator=generator, eos_ids=eos_ids, prefill_chunk=chunk, on_prefilled=on_prefilled,
            )
            return
        gamma = self.draft.gamma
        draft_model = self.draft.model.model if self.draft.model is not None else None
        if draft_model is None:
            gamma = None
        elif gamma == "auto":
            # Sampled text must not depend on timings: at temperature > 0, γ follows a cost ratio from weight bytes.
            fixed = None if sampling.greedy else weight_cost_ratio(self.target.model, draft_model)
            gamma = AdaptiveGamma(cost_ratio=fixed)
        elif self.draft.only_while_faster and sampling.greedy:
            cost = weight_cost_ratio(self.target.model, draft_model)
            gamma = DraftWhileFaster(gamma, start_drafting=cost < STARTS_PLAIN_AT_COST)
        ngram = None
        if self.draft.ngram is not None:  # the whole text: a conversation's earlier turns too
            if self._ngram is None:
                model_cost = 0.5 if draft_model is None else weight_cost_ratio(self.target.model, draft_model)
                options = self.draft.ngram
                self._ngram = NgramDrafter(NgramIndex(options.min_n, options.max_n), options, model_cost=model_cost)
            ngram = self._ngram
            ngram.timed = sampling.greedy  # sampled text must not depend on timings
            # ... nor on other conversations: only greedy runs, whose output no proposal changes, draft from them
            ngram.shared, ngram.salt = (self.shared_texts if sampling.greedy else None), self.salt
            ngram.follow(self._text)
        stats.speculative = SpeculativeStats()
        try:
            yield from speculative_steps(
                self.target.model, self.arenas[0], draft_model, self.arenas[1] if draft_model is not None else None,
                suffix, max_new_tokens=max_new_tokens, sampling=sampling, gamma=gamma, generator=generator,
                eos_ids=eos_ids, prefill_chunk=chunk, stats=stats.speculative, on_prefilled=on_prefilled,
                ngram=ngram, sibling=self.draft.sibling,
            )
        finally:
            stats.final_gamma = gamma if gamma is None or isinstance(gamma, int) else gamma.gamma


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
    """Yield new token ids for ``prompt_ids`` from fresh arenas; ``stats`` is filled in as the run goes.

    Checks the inputs first (empty prompt, context length, γ, vocabularies) and raises :class:`UserError`.
    """
    yield from Session(target, cache, draft).run(
        prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, eos_ids=eos_ids, stats=stats
    )
