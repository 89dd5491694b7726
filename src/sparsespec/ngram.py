"""Drafting from text already seen (no draft model): prompt-lookup decoding.

The text so far (the prompt, the conversation before it, the tokens generated) is indexed by its n-grams. Each
round, the longest suffix of the text (``max_n`` tokens down to ``min_n``) that occurred before is looked up, and the
tokens that followed its most recent earlier occurrence are proposed. Code edits, answers that quote the prompt and
repetitive structure get long accepted runs for free; prose gets few matches, and then no proposal is made.

A proposal is a point mass: q(x) = 1 for the proposed token. Exact rejection sampling then accepts x with
probability p(x) and at a rejection samples from p with x removed (``speculative._accept`` with one-hot q), so the
output keeps the target's distribution; greedy decoding accepts while x is the target's argmax.

How many tokens to propose is chosen each round (:class:`NgramDrafter`): the acceptance of earlier proposals from
matches of the same length (decayed counts; a long match is more often copied on than a short one) and a
verification row's cost relative to a one-row pass give the expected speed-up of each length, and the best one is proposed only when that beats the target decoding alone, and beats the round a draft
model would make (its own measured acceptance and cost per proposal) where there is one.

A server's sessions may also draft from one another's text (:class:`SharedTexts`: the last requests' prompts and
answers, bounded in tokens, matched only within one ``cache_salt``), for greedy decoding only: there any proposal
leaves the output unchanged, while a sampled answer must stay a function of its seed and its own conversation.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .errors import ConfigError
from .speedup import speculative_speedup

# The shortest and longest suffixes looked up, and the most tokens one round may propose (n-gram drafting's
# defaults; --ngram-min, --ngram-max, --ngram-tokens).
DEFAULT_MIN_N, DEFAULT_MAX_N, DEFAULT_MAX_TOKENS = 2, 6, 16
MAX_N = 64  # the longest suffix the index may be asked to match
# A verification row's cost relative to a one-row pass, assumed until passes are timed (and always at temperature
# above 0, where choices must not depend on timings: sampled text stays a function of the seed).
DEFAULT_ROW_COST = 0.25
# Tokens of earlier requests a server keeps for drafting (``SharedTexts``; serve's --ngram-shared-tokens): each
# token indexes up to max_n - min_n + 1 n-grams, about a kilobyte with the defaults.
DEFAULT_SHARED_TOKENS = 16384
MAX_SHARED_TOKENS = 1 << 20


@dataclass(frozen=True)
class NgramOptions:
    """What n-gram drafting looks up and proposes (see the module's docstring)."""

    min_n: int = DEFAULT_MIN_N
    max_n: int = DEFAULT_MAX_N
    max_tokens: int = DEFAULT_MAX_TOKENS

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n <= MAX_N:
            raise ConfigError("n-gram sizes must satisfy 1 <= {min_n} <= {max_n} <= {most} (got {low} and {high}).",
                              most=MAX_N, low=self.min_n, high=self.max_n)
        if not 1 <= self.max_tokens <= 64:
            raise ConfigError("{max_tokens} must be from 1 to 64 (got {value}).", value=self.max_tokens)


class NgramIndex:
    """The n-grams of a growing token list, each mapped to where it last ended.

    ``propose(limit)`` returns the tokens that followed the most recent earlier occurrence of the text's longest
    matching suffix (``max_n`` tokens down to ``min_n``), at most ``limit`` of them; [] without a match. An n-gram
    ending at the text's last token is indexed only once the next token arrives, so a match always has a
    continuation.
    """

    def __init__(self, min_n: int = DEFAULT_MIN_N, max_n: int = DEFAULT_MAX_N, tokens=()):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens) -> None:
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        """Add a token (indexing the n-grams that end just before it)."""
        end = len(self.tokens) - 1  # the n-grams ending here get their continuation now
        self.tokens.append(int(token))
        for n in range(self.min_n, min(self.max_n, end + 1) + 1):
            self._last_end[tuple(self.tokens[end - n + 1 : end + 1])] = end

    def match(self) -> tuple[int, int]:
        """``(n, end)``: the longest suffix of the text seen before and where its latest earlier occurrence ended,
        or ``(0, -1)``."""
        text = self.tokens
        for n in range(min(self.max_n, len(text)), self.min_n - 1, -1):
            end = self._last_end.get(tuple(text[len(text) - n :]))
            if end is not None:
                return n, end
        return 0, -1

    def propose(self, limit: int) -> list[int]:
        n, end = self.match()
        return self.tokens[end + 1 : end + 1 + limit] if n else []


class SharedTexts:
    """Earlier requests' text that a server's sessions draft from: the newest ``shared_ngram_tokens`` tokens (whole
    texts are dropped oldest first), each text kept with the ``cache_salt`` of the request that left it and matched
    only for requests with the same salt, so that a client cannot tell from the speed of its answers what a client
    with another salt wrote (as vLLM's prefix cache).

    ``match(text, salt, limit)`` gives ``(n, continuation)``: the longest suffix of ``text`` (``max_n`` down to
    ``min_n`` tokens) found in the stored texts of ``salt`` and up to ``limit`` tokens that followed its most recent
    occurrence, or ``(0, [])``.
    """

    def __init__(self, shared_ngram_tokens: int = DEFAULT_SHARED_TOKENS, min_n: int = DEFAULT_MIN_N,
                 max_n: int = DEFAULT_MAX_N):
        if not 1 <= shared_ngram_tokens <= MAX_SHARED_TOKENS:
            raise ConfigError("{shared_ngram_tokens} must be from 1 to {most} (got {value}).", most=MAX_SHARED_TOKENS,
                              value=shared_ngram_tokens)
        self.capacity, self.min_n, self.max_n = shared_ngram_tokens, min_n, max_n
        self._texts: OrderedDict[int, tuple[str | None, list[int]]] = OrderedDict()  # by age, oldest first
        self._next_id = 0
        self.tokens_held = 0
        # (salt, n-gram) -> (text id, index of the n-gram's last token in that text); a continuation always follows
        self._last_end: dict[tuple, tuple[int, int]] = {}

    def _ngrams(self, tokens: list[int]):
        """``(n-gram, end)`` of every n-gram that has a continuation in ``tokens``, in order."""
        for end in range(len(tokens) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                yield tuple(tokens[end - n + 1 : end + 1]), end

    def add(self, tokens, salt: str | None) -> None:
        """Keep ``tokens`` (its newest ``capacity`` at most) for later matches by requests with ``salt``."""
        tokens = [int(t) for t in tokens][-self.capacity :]
        if len(tokens) <= self.min_n:
            return
        text_id, self._next_id = self._next_id, self._next_id + 1
        self._texts[text_id] = (salt, tokens)
        self.tokens_held += len(tokens)
        for ngram, end in self._ngrams(tokens):
            self._last_end[(salt, ngram)] = (text_id, end)
        while self.tokens_held > self.capacity:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        text_id, (salt, tokens) = self._texts.popitem(last=False)
        self.tokens_held -= len(tokens)
        for ngram, _ in self._ngrams(tokens):
            key = (salt, ngram)
            if self._last_end.get(key, (None,))[0] == text_id:  # a newer text's occurrence stays
                del self._last_end[key]

    def match(self, text: list[int], salt: str | None, limit: int) -> tuple[int, list[int]]:
        for n in range(min(self.max_n, len(text)), self.min_n - 1, -1):
            hit = self._last_end.get((salt, tuple(text[len(text) - n :])))
            if hit is not None:
                text_id, end = hit
                return n, self._texts[text_id][1][end + 1 : end + 1 + limit]
        return 0, []


class _Acceptance:
    """Decayed acceptance counts: each round adds its accepted tokens and its first rejection (speculative
    decoding's per-token α); a prior of α = ``prior`` weighing as two trials."""

    def __init__(self, decay: float, prior: float = 0.5):
        self.decay, self.accepted, self.trials = decay, 2.0 * prior, 2.0

    def add(self, proposed: int, accepted: int) -> None:
        rejected = 1 if accepted < proposed else 0
        self.accepted = self.decay * self.accepted + accepted
        self.trials = self.decay * self.trials + accepted + rejected

    @property
    def alpha(self) -> float:
        return self.accepted / self.trials


class NgramDrafter:
    """n-gram proposals with their length chosen from measured acceptance and verification cost, against the round
    a draft model would make.

    ``propose(model_gamma)`` gives the tokens to verify this round ([] when they are not expected to pay more than
    the draft model's ``model_gamma`` proposals, or, at ``model_gamma`` 0, than a plain step); ``update(proposed,
    accepted)`` records an n-gram round's outcome, ``observe_model_round(proposed, accepted, seconds)`` a draft
    model's; ``observe_pass(seconds, rows)`` any target pass, from which a one-row pass ``t₁`` and the cost of each
    further row ``r`` are estimated (decaying averages). With ``timed`` False the row cost stays
    :data:`DEFAULT_ROW_COST` and a draft model's cost is ``model_cost`` (sampling: choices must not depend on
    timings).

    With ``shared`` set (a server's :class:`SharedTexts`) a longer match in other requests' text of the same
    ``salt`` is proposed from instead (``from_shared`` says where the last proposal came from); its acceptance is
    learned apart from the own text's.
    """

    def __init__(self, index: NgramIndex, options: NgramOptions = NgramOptions(), timed: bool = True,
                 decay: float = 0.8, model_cost: float = 0.5):
        self.index, self.options, self.timed, self.decay = index, options, timed, decay
        self.shared: SharedTexts | None = None
        self.salt: str | None = None
        # by (whether the match was in the shared texts, the length of the match proposed from)
        self._ngram: dict[tuple[bool, int], _Acceptance] = {}
        self._matched = (False, 0)  # the same of the last proposal
        self._model = _Acceptance(decay)
        self._model_cost = model_cost  # a draft model's seconds per proposal over t₁ (measured when timed)
        self._model_seconds: float | None = None  # per proposal
        self._single: float | None = None  # seconds of a one-row target pass
        self._rows: list[tuple[float, int]] = []  # multi-row passes waiting for t₁
        self._row: float | None = None  # seconds per row past the first

    def _record(self, matched: int, shared: bool = False) -> _Acceptance:
        """The acceptance record of matches of ``matched`` tokens (in the shared texts or the own); until measured,
        α = n / (n + 1): a longer match is more likely copied on, and trying it costs only verification rows."""
        key = (shared, matched)
        if key not in self._ngram:
            self._ngram[key] = _Acceptance(self.decay, prior=matched / (matched + 1))
        return self._ngram[key]

    def alpha(self, matched: int, shared: bool = False) -> float:
        """Acceptance of the tokens proposed from a match of ``matched`` tokens."""
        return self._record(matched, shared).alpha

    @property
    def from_shared(self) -> bool:
        """Whether the last proposal came from the shared texts."""
        return self._matched[0]

    @property
    def row_cost(self) -> float:
        """A verification row's cost over a one-row pass."""
        if not self.timed or self._single is None or self._row is None or self._single <= 0:
            return DEFAULT_ROW_COST
        return max(self._row, 0.0) / self._single

    def expected_speedup(self, length: int, matched: int, shared: bool = False) -> float:
        """Speed of a round proposing ``length`` tokens from a match of ``matched`` over a plain step's: the
        proposals cost nothing to make, only their rows in the verification pass."""
        return speculative_speedup(self.alpha(matched, shared), length, self.row_cost)

    def model_speedup(self, gamma: int) -> float:
        """The same for a draft model's round of ``gamma`` proposals (1 for a plain step)."""
        if gamma < 1:
            return 1.0
        cost = self._model_cost
        if self.timed and self._model_seconds is not None and self._single:
            cost = self._model_seconds / self._single
        return speculative_speedup(self._model.alpha, gamma, cost + self.row_cost)

    def propose(self, model_gamma: int = 0) -> list[int]:
        matched, end = self.index.match()
        limit = self.options.max_tokens
        candidates = self.index.tokens[end + 1 : end + 1 + limit] if matched else []
        shared = False
        if self.shared is not None:
            n, continuation = self.shared.match(self.index.tokens, self.salt, limit)
            if n > matched:
                matched, candidates, shared = n, continuation, True
        if not matched:
            return []
        gains = [self.expected_speedup(length, matched, shared) for length in range(1, len(candidates) + 1)]
        best = max(range(len(gains)), key=gains.__getitem__)
        if gains[best] <= 1.0 or gains[best] < self.model_speedup(model_gamma):
            return []
        self._matched = (shared, matched)
        return candidates[: best + 1]

    def follow(self, text: list[int]) -> None:
        """Index ``text`` from now on: the index goes on from what it holds when that begins ``text`` (a
        conversation's next turn), else it is built anew; what was learned of acceptance and costs stays."""
        held = self.index.tokens
        if len(held) <= len(text) and text[: len(held)] == held:
            self.index.extend(text[len(held):])
        else:
            self.index = NgramIndex(self.options.min_n, self.options.max_n, text)

    def forget(self) -> None:
        """Empty the index (another conversation begins); what was learned of acceptance and costs stays."""
        self.index = NgramIndex(self.options.min_n, self.options.max_n)

    def update(self, proposed: int, accepted: int) -> None:
        """The last proposal's outcome: ``accepted`` of its ``proposed`` tokens."""
        shared, matched = self._matched
        self._record(matched, shared).add(proposed, accepted)

    def observe_model_round(self, proposed: int, accepted: int, seconds: float) -> None:
        """A draft model's round: ``proposed`` tokens (0: none), ``accepted`` of them, its ``seconds``."""
        if not proposed:
            return
        self._model.add(proposed, accepted)
        per = seconds / proposed
        self._model_seconds = per if self._model_seconds is None else self.decay * self._model_seconds + (
            1 - self.decay) * per

    def observe_pass(self, seconds: float, rows: int) -> None:
        if not self.timed:
            return
        if rows == 1:
            self._single = seconds if self._single is None else self.decay * self._single + (1 - self.decay) * seconds
        else:
            self._rows.append((seconds, rows))
        if self._single is not None:
            for s, n in self._rows:
                per_row = (s - self._single) / (n - 1)
                self._row = per_row if self._row is None else self.decay * self._row + (1 - self.decay) * per_row
            self._rows.clear()
