"""Speculative decoding: draft-then-verify with rejection sampling (Leviathan et al. 2023, Algorithm 1).

Notation as in the paper: ``p`` is the target's distribution, ``q`` the draft's. Each round:

1. the draft proposes γ tokens x₁…x_γ autoregressively, sampling from q (its rows stay in flight in its arena);
2. the target scores the pending token and all γ proposals in one forward pass, giving p₁…p_{γ+1};
3. xᵢ is accepted with probability min(1, p(xᵢ)/q(xᵢ)); at the first rejection a token is drawn from
   normalize(max(0, p − q)); if all γ pass, a bonus token is drawn from p_{γ+1};
4. both arenas commit the accepted rows and roll back the rest — scores and evictions included — so each equals
   the arena of an autoregressive run over the accepted text.

Because the target's arena replays evictions row by row (see ``cache/arena.py``), row i of the verification pass
sees exactly the cache that autoregressive step i would see, so the output follows the distribution that
autoregressive decoding with the same cache policy defines (and greedy output is identical token for token). That
is exact where a row's logits do not depend on how many rows the pass holds: every weight format runs the native
kernels, which compute each row on its own, with the native attention op (the tests prove it in float32 and
bfloat16).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

from .cache.arena import KVArena
from .errors import ConfigError, UserError
from .generate import prefill_steps
from .model import Transformer
from .ngram import NgramDrafter
from .passes import Program, forward_pass, run_alone
from .sampling import SamplingParams, greedy_tokens, sample, warp
from .speedup import speculative_speedup

GAMMA_MAX = 12
# DraftWhileFaster starts with plain steps for a draft whose pass reads at least this fraction of the target's
# weight bytes (a self-draft reads all of them): at γ = 3, even with free verification rows, that pays only above
# about 0.7 acceptance (a self-draft: never, where weights dominate), so its first drafting probe waits for the first
# stint's end.
STARTS_PLAIN_AT_COST = 0.5
# Of the accepted tokens a draft missed while the target decoded alone, the most it reads before drafting again
# (more, and it starts its cache afresh from the last of them).
CATCH_UP_TOKENS = 32


def draft_inflight_rows(gamma_max: int = GAMMA_MAX) -> int:
    """Rows a draft arena must hold in flight: a backlog of accepted tokens plus up to γ_max − 1 proposals."""
    return 2 * gamma_max + 2


def target_inflight_rows(gamma_max: int = GAMMA_MAX, sibling: bool = False) -> int:
    """Rows a target arena must hold in flight: the pending token plus up to γ_max proposals, and with ``sibling``
    the runner-up beside them as a tree block (which keeps every row's score snapshot: one row more)."""
    return gamma_max + 1 + (2 if sibling else 0)


def check_same_vocabulary(target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int) -> None:
    """Raise :class:`UserError` naming the first difference if draft and target do not share a vocabulary."""
    if target_vocab != draft_vocab:
        raise UserError(
            f"The draft's vocabulary has {draft_vocab} entries and the target's {target_vocab}; "
            "speculative decoding needs the same vocabulary."
        )
    if target_tokenizer is None or draft_tokenizer is None or target_tokenizer is draft_tokenizer:
        return
    target_ids, draft_ids = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target_ids != draft_ids:
        differing = sorted(set(target_ids.items()) ^ set(draft_ids.items()), key=lambda kv: kv[1])[0]
        raise UserError(
            f"Draft and target tokenizers differ (e.g. token {differing[0]!r} has id {differing[1]} in only one "
            "of them); speculative decoding needs the same vocabulary."
        )


class AdaptiveGamma:
    """Chooses γ each round from the observed acceptance and the measured costs, backing off to γ = 0 (the target
    decodes alone) as soon as drafting does not pay, and probing again later.

    Model: a round with γ proposals takes ``γ·d + t₁ + γ·r`` seconds and yields ``E(α, γ)`` tokens (the core's
    :func:`~sparsespec.speedup.expected_tokens_per_pass`), where ``d`` is the draft's time per proposal (everything
    the draft does, catch-up passes included), ``t₁`` a 1-row target pass and ``r`` the verification's cost per
    extra row; a plain step takes ``t₁`` per token. So γ gains :func:`~sparsespec.speedup.speculative_speedup` with
    the cost ratio ``c = (d + r) / t₁``, and γ = 0 is chosen when no γ ≥ 1 gains more than 1.

    Acceptance α is accepted / (accepted + rejections) with exponentially decaying counts (a weak prior of 0.5, so
    a draft that is never accepted is dropped after one or two rounds); the times are decaying averages. The second
    round is a plain step (γ = 0) that measures ``t₁``; one in every ``remeasure_every`` speculative rounds is
    another. After a back-off a probe round (γ = 1) runs after ``probe_every`` plain steps, the wait doubling after
    every probe that does not pay (up to ``max_probe_every``).

    ``cost_ratio``: a fixed ``c`` instead of measured times. Decisions then depend only on the accepted tokens, so
    sampled output is reproducible for a fixed seed (timings differ from run to run; see :func:`weight_cost_ratio`).
    """

    def __init__(
        self,
        initial: int = 4,
        gamma_max: int = GAMMA_MAX,
        decay: float = 0.7,
        probe_every: int = 8,
        max_probe_every: int = 64,
        remeasure_every: int = 16,
        cost_ratio: float | None = None,
    ):
        self.gamma = initial
        self.gamma_max = gamma_max
        self.decay = decay
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.remeasure_every = remeasure_every
        self.fixed_cost_ratio = cost_ratio
        self._accepted = 0.5  # prior: α = 0.5 until measured, weighing as one trial
        self._trials = 1.0
        self._draft_s: float | None = None  # per proposal
        self._single_s: float | None = None  # a 1-row target pass
        self._row_s: float | None = None  # verification cost per extra row
        self._verifications: list[tuple[float, int]] = []  # (seconds, proposals) of verifications before t₁ is known
        self._wait = probe_every  # plain steps before the next probe
        self._backed_off = False  # drafting did not pay: plain steps, with probes
        self._plain_steps = 0  # plain steps since the last back-off or probe
        self._speculative_rounds = 0

    @property
    def alpha(self) -> float:
        return self._accepted / self._trials

    @property
    def cost_ratio(self) -> float:
        """c = (d + r) / t₁ (the fixed one if given; 0.5 until measured)."""
        if self.fixed_cost_ratio is not None:
            return self.fixed_cost_ratio
        if self._draft_s is None or not self._single_s:
            return 0.5
        return (self._draft_s + max(self._row_s or 0.0, 0.0)) / self._single_s

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def best(self) -> tuple[int, float]:
        """The γ ≥ 1 with the largest modelled gain, and that gain."""
        alpha, c = self.alpha, self.cost_ratio
        g = max(range(1, self.gamma_max + 1), key=lambda g: speculative_speedup(alpha, g, c))
        return g, speculative_speedup(alpha, g, c)

    def skip_round(self) -> None:
        """A round this controller did not choose (an n-gram proposal took it): nothing to learn from it."""

    def update(self, drafted: int, accepted: int, draft_s: float, target_s: float) -> None:
        """Record one round: ``drafted`` proposals, ``accepted`` of them, the draft's seconds in the round (catch-up
        passes included) and the target pass's seconds; then choose the next round's γ."""
        if drafted:
            rejected = 1 if accepted < drafted else 0
            self._accepted = self.decay * self._accepted + accepted
            self._trials = self.decay * self._trials + accepted + rejected
            self._draft_s = self._average(self._draft_s, draft_s / drafted)
            self._verifications.append((target_s, drafted))
            self._speculative_rounds += 1
        else:
            self._single_s = self._average(self._single_s, target_s)
        if self._single_s is not None:  # extra-row costs of the verifications so far (t₁ known from now on)
            for seconds, rows in self._verifications:
                self._row_s = self._average(self._row_s, (seconds - self._single_s) / rows)
            self._verifications.clear()
        self.gamma = self._choose(drafted)

    def _choose(self, drafted: int) -> int:
        measuring = self.fixed_cost_ratio is None
        if measuring and self._single_s is None:
            return 0  # measure a plain step first
        g, gain = self.best()
        if gain > 1.0:
            self._backed_off, self._wait = False, self.probe_every
            if measuring and drafted and self._speculative_rounds % self.remeasure_every == 0:
                return 0  # t₁ drifts as the context grows
            return g
        if drafted and self._backed_off:  # a probe that did not pay: wait longer for the next
            self._wait = min(2 * self._wait, self.max_probe_every)
        if drafted or not self._backed_off:  # back off
            self._backed_off, self._plain_steps = True, 0
            return 0
        self._plain_steps += 1
        if self._backed_off and self._plain_steps >= self._wait:
            self._plain_steps = 0
            return 1
        return 0


class DraftWhileFaster:
    """Drafts ``gamma`` proposals a round while that decodes faster than the target alone, as measured: the time
    between the rounds (everything a round does: the draft's passes and catch-up, the verification, the commits)
    against the tokens they yield.

    It alternates a *probe* of each mode (``probe_rounds`` speculative rounds; ``plain_steps`` steps with γ = 0)
    and then runs the faster one for a *stint* of tokens, which grows while the same mode keeps winning (doubling,
    or ×4 when it won by more than ``clear_margin``; from ``first_stint`` up to ``max_stint``) and starts over when
    the other wins; the stint's last stretch is the winner's measurement at the next comparison. So where drafting
    does not pay it drafts only in its short probes (after a stint the draft reads only the last
    :data:`CATCH_UP_TOKENS` of the text it missed, into an emptied cache), and where it pays the target decodes alone
    only in the plain probes. The first round of a run is not measured (it warms the caches). Decisions depend on
    timings, so the engine uses this only for greedy decoding, where the output does not depend on them.

    ``start_drafting``: whether the run begins with the probes (else with a stint of plain steps, drafting probed
    after it: for a draft that reads as many weight bytes a pass as the target, :data:`STARTS_PLAIN_AT_COST`).
    ``clock``: seconds, monotonic (``time.perf_counter``; tests pass a simulated one).
    """

    def __init__(self, gamma: int, probe_rounds: int = 2, plain_steps: int = 6, first_stint: int = 256,
                 max_stint: int = 2048, clear_margin: float = 1.15, start_drafting: bool = True,
                 clock: Callable[[], float] = time.perf_counter):
        if gamma < 1:
            raise ConfigError("{gamma} must be at least 1 (got {value}).", value=gamma)
        self.gamma_max = gamma  # the γ of drafting rounds
        self.gamma = gamma if start_drafting else 0
        self.probe_rounds, self.plain_steps = probe_rounds, plain_steps
        self.first_stint, self.max_stint, self.clear_margin = first_stint, max_stint, clear_margin
        self._clock = clock
        self._last: float | None = None  # when the previous round ended
        self._window: list[tuple[int, float]] = []  # (tokens, seconds) of the current mode's recent rounds
        self._rates: dict[bool, float] = {}  # drafting? -> tokens per second, last measured
        self._probing = True  # measuring the current mode for a comparison (else: a stint)
        self._stint_left = 0
        self._stint = first_stint
        self._winner: bool | None = None
        if not start_drafting:  # a first stint of plain steps, as if they had won; drafting is probed after it
            self._probing, self._winner, self._stint_left = False, False, first_stint

    @property
    def drafting(self) -> bool:
        return self.gamma > 0

    def skip_round(self) -> None:
        """A round this controller did not choose (an n-gram proposal took it): not counted in either mode."""
        self._last = self._clock()

    def update(self, drafted: int, accepted: int, draft_s: float, target_s: float) -> None:
        """Record one round (``drafted`` proposals, ``accepted`` of them; the seconds are not used: the clock
        times whole rounds) and choose the next round's γ."""
        now = self._clock()
        last, self._last = self._last, now
        if last is None:
            return  # the run's first round: caches warming, not measured
        tokens = accepted + 1 if drafted else 1
        self._window.append((tokens, now - last))
        probe = self.probe_rounds if self.drafting else self.plain_steps
        del self._window[:-probe]  # the mode's latest rounds
        if self._probing:
            if len(self._window) >= probe:
                self._rates[self.drafting] = self._rate()
                self._probing = False
                if len(self._rates) == 2:
                    self._decide()
                else:
                    self._switch()  # the other mode's first probe
            return
        self._stint_left -= tokens
        if self._stint_left <= 0:  # the stint ends: its last rounds measure the winner; probe the other
            self._rates[self.drafting] = self._rate()
            self._switch()

    def _rate(self) -> float:
        tokens = sum(t for t, _ in self._window)
        seconds = sum(s for _, s in self._window)
        return tokens / seconds if seconds > 0 else float("inf")

    def _switch(self) -> None:
        """Probe the other mode next."""
        self.gamma = 0 if self.drafting else self.gamma_max
        self._window.clear()
        self._probing = True

    def _decide(self) -> None:
        """Both modes measured: run the faster for a stint (longer while the same mode keeps winning)."""
        winner = self._rates[True] > self._rates[False]
        margin = max(self._rates.values()) / max(min(self._rates.values()), 1e-12)
        growth = 4 if margin > self.clear_margin else 2
        self._stint = min(growth * self._stint, self.max_stint) if winner == self._winner else self.first_stint
        self._winner = winner
        self._stint_left = self._stint
        if self.drafting != winner:
            self.gamma = self.gamma_max if winner else 0
            self._window.clear()


def weight_cost_ratio(target: Transformer, draft: Transformer) -> float:
    """c from weight bytes: a draft pass over a target pass, for decoding bound by streaming the weights."""
    return draft.bytes_read_per_token() / target.bytes_read_per_token()


@dataclass
class SpeculativeStats:
    """Counters of one speculative run."""

    target_passes: int = 0
    draft_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    new_tokens: int = 0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    gammas: list[int] = field(default_factory=list)
    draft_restarts: int = 0  # times the draft emptied its cache to read only the end of what it missed
    # Text tokens those restarts dropped from the start of the draft's cache: it holds the text from this far on.
    draft_origin_shift: int = 0
    # Rounds whose proposals came from n-gram matches (ngram.py), and their share of drafted / accepted.
    ngram_rounds: int = 0
    ngram_drafted: int = 0
    ngram_accepted: int = 0
    # Of those, the proposals matched in other requests' text (a server's shared texts, ngram.SharedTexts).
    ngram_shared_drafted: int = 0
    ngram_shared_accepted: int = 0
    # Rounds that verified the draft's runner-up beside its chain (``sibling``), and how often it was the token.
    sibling_rounds: int = 0
    sibling_accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_pass(self) -> float:
        return self.new_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def draft_target_cost_ratio(self) -> float:
        """The draft's seconds per proposal over the target's seconds per pass: c of the speed formula.

        ``draft_seconds`` is everything the draft does (proposals and the catch-up passes after γ = 0 rounds), so
        c is what a proposal really costs.
        """
        return cost_ratio(self.draft_seconds, self.drafted, self.target_seconds, self.target_passes)


def cost_ratio(draft_seconds: float, drafted: int, target_seconds: float, target_passes: int) -> float:
    """Draft seconds per proposal over target seconds per pass (0 when either is unmeasured)."""
    if not drafted or not target_passes or target_seconds <= 0:
        return 0.0
    return (draft_seconds / drafted) / (target_seconds / target_passes)


def _accept(
    p: torch.Tensor, q: list[torch.Tensor], drafts: list[int], generator: torch.Generator | None
) -> tuple[int, int]:
    """Rejection sampling over one block. ``p: [γ+1, vocab]``, ``q``: γ tensors ``[vocab]``.

    Returns ``(accepted, next_token)``: how many proposals pass and the token that follows them (the correction
    drawn from normalize(max(0, p − q)) at the first rejection, or the bonus token from the last row of p).
    """
    for i, x in enumerate(drafts):
        if not bool(torch.rand((), generator=generator) < p[i, x] / q[i][x]):
            residual = (p[i] - q[i]).clamp_(min=0.0)
            total = residual.sum()
            return i, sample(residual / total if total > 0 else p[i], generator)
    return len(drafts), sample(p[len(drafts)], generator)


def _accept_greedy(target_logits: torch.Tensor, drafts: list[int]) -> tuple[int, int]:
    """:func:`_accept` for temperature 0, where p and q are one-hot: proposals pass while they equal the target's
    argmax, and the next token is the argmax of the first row that disagrees (or of the bonus row).

    ``target_logits: [γ+1, vocab]``, the rows that score the proposals and the bonus position.
    """
    choices = greedy_tokens(target_logits)
    accepted = next((i for i, (x, c) in enumerate(zip(drafts, choices)) if x != c), len(drafts))
    return accepted, choices[accepted]


def _takes_sibling(accepted: int, next_token: int, second: int | None) -> bool:
    """Whether the runner-up's row gives the token after ``next_token``: the chain's first proposal was rejected and
    the token that replaced it (the target's argmax, or its draw from the residual) is the runner-up ``second``."""
    return second is not None and accepted == 0 and next_token == second


def runner_up(scores: torch.Tensor, first: int) -> int:
    """The draft's most likely first token after ``first`` (``scores [vocab]``: its logits or probabilities): the
    sibling a tree round verifies beside the chain that starts with ``first``."""
    return int(scores.masked_fill(torch.arange(scores.shape[-1]) == first, -math.inf).argmax())


def speculative_tokens(target: Transformer, target_cache: KVArena, draft: Transformer, draft_cache: KVArena,
                       prompt_ids: list[int], **options) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` token ids decoded speculatively (:func:`speculative_steps` run alone)."""
    return run_alone(speculative_steps(target, target_cache, draft, draft_cache, prompt_ids, **options))


def speculative_steps(
    target: Transformer,
    target_cache: KVArena,
    draft: Transformer | None,
    draft_cache: KVArena | None,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    gamma: int | AdaptiveGamma | DraftWhileFaster | None,
    generator: torch.Generator | None = None,
    eos_ids: Iterable[int] = (),
    prefill_chunk: int = 512,
    stats: SpeculativeStats | None = None,
    on_prefilled: Callable[[], None] | None = None,
    ngram: NgramDrafter | None = None,
    sibling: bool = False,
) -> Program:
    """The program of speculative decoding: up to ``max_new_tokens`` new tokens (stops after an EOS id).

    ``gamma`` is a fixed number of proposals per round (≥ 1) or a controller that chooses each round's
    (:class:`AdaptiveGamma`, :class:`DraftWhileFaster`: ``.gamma``, ``.gamma_max``, ``update``). The arenas must allow
    :func:`target_inflight_rows` and :func:`draft_inflight_rows` rows in flight. ``draft`` may be the target
    itself (self-speculation) with its own arena. ``on_prefilled`` is called once the prompt is read (so callers
    can time decoding over the span that produces every new token).

    ``ngram`` (``ngram.py``): proposals from the text already seen, whose index holds the text up to the end of
    ``prompt_ids`` (the tokens generated are added to it); a round takes them whenever it expects them to pay (the
    draft model, if any, then sits the round out and reads its tokens later), and the draft model (``draft``,
    ``gamma``; None for n-gram drafting alone) the others. Their proposals are point masses, so rejection sampling
    stays exact.

    ``sibling``: a draft model's round also verifies the draft's runner-up for the first position (:func:`runner_up`)
    beside its chain, as a tree block (``KVArena.begin(parents=...)``) of one more row, where the target arena can
    run one (:func:`target_inflight_rows` with ``sibling``; no recall, no int4 window). The rounds accept what they
    would without it; only where the chain's first proposal is rejected and the token that replaces it (the
    target's argmax, or its draw from the residual) is the runner-up, the runner-up's row also gives the next token
    (the target's argmax or draw after it): one token more, and exactly the target's distribution.
    """
    if isinstance(gamma, int) and gamma < 1:
        raise ConfigError("{gamma} must be at least 1 (got {value}).", value=gamma)
    if draft is None and ngram is None:
        raise ValueError("speculative decoding needs a draft model or n-gram proposals")
    controlled = gamma is not None and not isinstance(gamma, int)
    gamma_cap = 0 if draft is None else gamma.gamma_max if controlled else gamma
    proposal_cap = max(gamma_cap, ngram.options.max_tokens if ngram is not None else 0)
    if target_cache.max_inflight < target_inflight_rows(proposal_cap):
        raise ValueError("the target arena cannot hold a verification block of this γ")
    if draft is not None and draft_cache.max_inflight < draft_inflight_rows(gamma_cap):
        raise ValueError("the draft arena cannot hold the rows this γ keeps in flight")
    stats = stats if stats is not None else SpeculativeStats()
    eos = set(eos_ids)
    *context, last = prompt_ids
    yield from prefill_steps(target, target_cache, context, prefill_chunk)
    if draft is not None:
        yield from prefill_steps(draft, draft_cache, context, prefill_chunk, draft=True)
    if on_prefilled is not None:
        on_prefilled()
    target_pending = [last]  # accepted tokens the target has not been fed yet
    draft_pending = [last]  # the same for the draft (two after a fully accepted round, more after γ = 0 rounds)
    generated = 0
    while generated < max_new_tokens:
        left = max_new_tokens - generated - 1
        g = 0 if draft is None else min(gamma.gamma if controlled else gamma, left)
        proposal = ngram.propose(g)[:left] if ngram is not None else []
        if proposal:
            g = 0  # the draft model sits this round out: the n-gram proposals are expected to pay more

        # 1. Draft γ proposals; they stay in flight in the draft's arena. A draft that sat out rounds (γ = 0)
        #    first reads the accepted tokens it missed, as prompt chunks; after more than CATCH_UP_TOKENS it empties
        #    its cache and reads only the last of them, as a text of its own (its cache need not match an
        #    autoregressive run's: the draft's choices change speed, never the output). That is its time too.
        started = time.perf_counter()
        catch_up_passes = 0
        if g and len(draft_pending) + g - 1 > draft_cache.max_inflight:
            backlog, draft_pending = draft_pending[:-1], draft_pending[-1:]
            if len(backlog) > CATCH_UP_TOKENS:
                stats.draft_origin_shift += draft_cache.next_position + len(backlog) - CATCH_UP_TOKENS
                draft_cache.reset()
                backlog = backlog[-CATCH_UP_TOKENS:]
                stats.draft_restarts += 1
            for start in range(0, len(backlog), draft_cache.max_block):
                chunk = backlog[start : start + draft_cache.max_block]
                yield forward_pass(draft, chunk, draft_cache, per_block=True, last_only=True, draft=True)
                draft_cache.commit(len(chunk))
                catch_up_passes += 1
        drafts: list[int] = []
        q: list[torch.Tensor] = []
        feed = draft_pending
        first_scores = None  # the draft's scores of the first position (its logits, or q when sampling)
        for _ in range(g):
            logits = (yield forward_pass(draft, feed, draft_cache, draft=True))[-1]
            if sampling.greedy:
                drafts.append(greedy_tokens(logits[None])[0])
            else:
                q.append(warp(logits, sampling))
                drafts.append(sample(q[-1], generator))
            if first_scores is None:
                first_scores = logits if sampling.greedy else q[0]
            feed = drafts[-1:]
        draft_fed = len(draft_pending) + g - 1 if g else 0
        draft_seconds = time.perf_counter() - started
        if proposal:  # point masses: q(x) = 1 for each proposed token
            drafts = proposal
            if not sampling.greedy:
                vocab = target.config.vocab_size
                q = [torch.nn.functional.one_hot(torch.tensor(x), vocab).float() for x in drafts]

        # 2. One target pass over the pending token(s) and all proposals (and the runner-up, as a tree: row 0 the
        #    pending token, rows 1..γ the chain, the last row the runner-up beside the chain's first proposal).
        started = time.perf_counter()
        rows, parents, second = target_pending + drafts, None, None
        if sibling and first_scores is not None and len(target_pending) == 1 and \
                target_cache.takes_tree(len(rows) + 1):
            second = runner_up(first_scores, drafts[0])
            parents = [-1] + list(range(len(drafts))) + [0]
            rows = rows + [second]
        logits = yield forward_pass(target, rows, target_cache, parents=parents)
        scoring = logits[len(target_pending) - 1 : len(target_pending) + len(drafts)]
        if sampling.greedy:
            accepted, next_token = _accept_greedy(scoring, drafts)
        else:
            accepted, next_token = _accept(warp(scoring, sampling), q, drafts, generator)
        # The token that replaced a rejected first proposal is the runner-up: its row gives the token after it.
        sibling_taken = _takes_sibling(accepted, next_token, second)
        after_sibling = None
        if sibling_taken and next_token not in eos:
            sibling_logits = logits[-1:]
            after_sibling = greedy_tokens(sibling_logits)[0] if sampling.greedy else sample(
                warp(sibling_logits, sampling)[0], generator)
        target_seconds = time.perf_counter() - started
        if ngram is not None:
            ngram.observe_pass(target_seconds, len(rows))
            if proposal:
                ngram.update(len(drafts), accepted)
            else:
                ngram.observe_model_round(g, accepted, draft_seconds)

        # 3. Commit what was accepted; roll back the rest. An accepted EOS ends the run, so the tokens after it
        # are neither yielded nor committed: the arenas then hold only the text this generator yielded.
        ends = next((i for i, x in enumerate(drafts[:accepted]) if x in eos), None)
        emitted = drafts[:accepted] + [next_token] if ends is None else drafts[: ends + 1]
        if after_sibling is not None:
            emitted.append(after_sibling)
        if parents is None:
            target_cache.commit(len(target_pending) + len(emitted) - 1)
        elif after_sibling is not None:
            target_cache.commit_path([0, len(rows) - 1])
        else:
            target_cache.commit_path(list(range(len(emitted))))
        target_pending = emitted[-1:]
        stream = draft_pending + emitted
        chain_kept = 0 if sibling_taken else len(emitted) - 1  # the draft's rows hold its chain, not the sibling
        kept = min(draft_fed, len(draft_pending) + chain_kept)
        if draft_fed:  # else the draft sat the round out: nothing in flight
            draft_cache.commit(kept)
        draft_pending = stream[kept:] if draft is not None else []

        stats.target_passes += 1
        stats.draft_passes += g + catch_up_passes
        stats.drafted += len(rows) - len(target_pending)
        stats.accepted += accepted + sibling_taken
        if second is not None:
            stats.sibling_rounds += 1
            stats.sibling_accepted += sibling_taken
        stats.draft_seconds += draft_seconds
        stats.target_seconds += target_seconds
        stats.gammas.append(len(drafts))
        if proposal:
            stats.ngram_rounds += 1
            stats.ngram_drafted += len(drafts)
            stats.ngram_accepted += accepted
            if ngram.from_shared:
                stats.ngram_shared_drafted += len(drafts)
                stats.ngram_shared_accepted += accepted
        if controlled:
            if proposal:
                gamma.skip_round()
            else:
                gamma.update(g, accepted, draft_seconds, target_seconds)

        for token in emitted:
            generated += 1
            stats.new_tokens += 1
            if ngram is not None:
                ngram.index.append(token)
            yield token
            if token in eos or generated >= max_new_tokens:
                return
