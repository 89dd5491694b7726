"""Drafting from text already seen (``ngram.py``): the index against a naive scan, the drafter's choices, and
speculative decoding with n-gram proposals exact: greedy output equal to autoregressive decoding for every policy
and position mode (alone and beside a draft model), sampled output consistent with the exact autoregressive
distribution (χ²), the arenas left as autoregressive runs leave them."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from sparsespec import speculative
from sparsespec.cli import main
from sparsespec.engine import CacheOptions, DraftOptions, RunStats, Session
from sparsespec.errors import ConfigError, UserError
from sparsespec.ngram import NgramDrafter, NgramIndex, NgramOptions, SharedTexts
from sparsespec.sampling import SamplingParams, sample
from sparsespec.speculative import SpeculativeStats, draft_inflight_rows, speculative_tokens, target_inflight_rows

from test_speculative import (
    DRAFT, K_TOKENS, N_SAMPLES, POLICY_SPECS, SMALL_PROMPT, SMALL_TARGET, TARGET, VOCAB, ar_tokens, arena,
    chi_square_p, exact_ar_distribution, policy,
)


# ------------------------------------------------------------------------------------------------ the index
def naive_proposal(tokens: list[int], min_n: int, max_n: int, limit: int) -> list[int]:
    """The longest suffix (max_n down to min_n) with an earlier occurrence ending before the last token, and what
    followed its latest such occurrence."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1: end + 1] == suffix:
                return tokens[end + 1: end + 1 + limit]
    return []


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 3), (2, 5), (3, 3)])
def test_the_index_proposes_what_a_naive_scan_finds(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    for trial in range(20):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 120))]
        index = NgramIndex(min_n, max_n)
        for i, token in enumerate(tokens):
            index.append(token)
            limit = rng.randrange(1, 8)
            assert index.propose(limit) == naive_proposal(tokens[: i + 1], min_n, max_n, limit), (trial, i)


def test_the_index_copies_a_quoted_passage():
    text = list(range(100, 140))
    index = NgramIndex(2, 4, text + [7, 8] + text[:5])
    assert index.propose(6) == text[5:11]  # the passage goes on as it did
    assert NgramIndex(2, 4, [1, 2, 3]).propose(4) == []  # nothing repeats


def test_the_drafter_proposes_only_what_is_expected_to_pay():
    index = NgramIndex(1, 2, [1, 2, 3, 4, 5, 1, 2])
    drafter = NgramDrafter(index, NgramOptions(1, 2, 8), timed=False)
    assert index.match() == (2, 1)  # "1 2" ended at position 1
    # The prior for a 2-token match, α = 2/3, and rows at a quarter of a pass: two tokens pay most (1.41x).
    assert drafter.alpha(2) == pytest.approx(2 / 3) and drafter.propose() == [3, 4]
    for _ in range(10):
        drafter.update(2, 0)  # proposals from 2-token matches rejected at once
    assert drafter.alpha(2) < 0.1 and drafter.propose() == []
    assert drafter.alpha(1) == 0.5  # matches of another length keep their own record
    for _ in range(30):
        drafter._matched = (False, 2)  # a 2-token match in the own text
        drafter.update(5, 5)
    assert drafter.alpha(2) > 0.95 and drafter.propose() == [3, 4, 5, 1, 2]
    assert drafter.propose(model_gamma=3) == [3, 4, 5, 1, 2]  # a draft model at the prior α pays less
    timed = NgramDrafter(NgramIndex(1, 2, [1, 2, 3, 4, 5, 1, 2]), NgramOptions(1, 2, 8))
    for _ in range(5):  # a one-row pass 10 ms, each extra row 30 ms: no proposal pays at α 2/3
        timed.observe_pass(0.010, 1)
        timed.observe_pass(0.010 + 0.030 * 3, 4)
    assert timed.row_cost == pytest.approx(3.0) and timed.propose() == []


@pytest.mark.parametrize("options", [dict(min_n=0), dict(min_n=3, max_n=2), dict(max_n=65), dict(max_tokens=0),
                                     dict(max_tokens=65)])
def test_sizes_out_of_range_are_one_sentence(options):
    """Naming the parameters given (the command line names its flags: test_ngram_flag_mistakes_are_one_sentence)."""
    with pytest.raises(ConfigError) as info:
        NgramOptions(**options)
    assert set(options) <= set(info.value.params) and "--" not in str(info.value)


# ----------------------------------------------------------------------------------------------- exactness
def repetitive_prompt() -> list[int]:
    """A prompt whose passages repeat."""
    g = torch.Generator().manual_seed(3)
    passage = torch.randint(0, TARGET.config.vocab_size, (12,), generator=g).tolist()
    return passage + [5] + passage + [9] + passage[:4]


def hinted_index(ids: list[int], continuation: list[int], options: NgramOptions) -> NgramIndex:
    """An index that already holds the prompt's end followed by ``continuation`` with every seventh token changed:
    its proposals are right for runs of tokens and wrong now and then, as on text that quotes its prompt."""
    vocab = TARGET.config.vocab_size
    hint = [(t + 1) % vocab if i % 7 == 6 else t for i, t in enumerate(continuation)]
    return NgramIndex(options.min_n, options.max_n, ids[-options.max_n:] + hint + ids)


def ngram_tokens(pol, positions, ids, n, sampling=SamplingParams(), generator=None, draft=None, stats=None,
                 options=NgramOptions(1, 4, 8), hint=()):
    drafter = NgramDrafter(hinted_index(ids, list(hint), options), options, timed=False)
    rows = target_inflight_rows(max(options.max_tokens, 4))
    t_cache = arena(TARGET, pol, positions, rows)
    d_cache = arena(draft, pol, positions, draft_inflight_rows(4)) if draft is not None else None
    out = list(speculative_tokens(TARGET, t_cache, draft, d_cache, ids, max_new_tokens=n, sampling=sampling,
                                  gamma=4 if draft is not None else None, generator=generator, prefill_chunk=8,
                                  stats=stats, ngram=drafter))
    return out, t_cache


@pytest.mark.parametrize("positions", ["original", "in-cache"])
@pytest.mark.parametrize("name", list(POLICY_SPECS))
def test_greedy_decoding_with_ngram_proposals_equals_autoregressive(name, positions, row_by_row):
    pol = policy(name)
    if pol.is_full and positions == "in-cache":
        pytest.skip("the full cache has one position mode")
    ids = repetitive_prompt()
    expected = ar_tokens(TARGET, pol, positions, ids, 120)
    stats = SpeculativeStats()
    row_by_row.clear()
    out, t_cache = ngram_tokens(pol, positions, ids, 120, stats=stats, hint=expected)
    assert out == expected
    assert stats.ngram_rounds > 5 and 0 < stats.ngram_accepted < stats.ngram_drafted  # accepted and rejected
    if not pol.is_full:
        assert t_cache.evicted_tokens > 0 and row_by_row.get(id(t_cache), 0) > 0


@pytest.mark.parametrize("name", ["full", "hybrid"])
def test_ngram_proposals_beside_a_draft_model_keep_greedy_output(name):
    """Rounds taken by n-gram proposals and by the draft model alternate; the draft reads what it missed."""
    pol = policy(name)
    ids = repetitive_prompt()
    expected = ar_tokens(TARGET, pol, "original", ids, 120)
    stats = SpeculativeStats()
    out, _ = ngram_tokens(pol, "original", ids, 120, draft=DRAFT, stats=stats, hint=expected[:60])
    assert out == expected
    assert 0 < stats.ngram_rounds < stats.target_passes and stats.drafted > stats.ngram_drafted


def ngram_histogram(pol, sampling, rule=None):
    generator = torch.Generator().manual_seed(99)
    counts = dict.fromkeys(itertools.product(range(VOCAB), repeat=K_TOKENS), 0)
    stats = SpeculativeStats()
    for _ in range(N_SAMPLES):
        options = NgramOptions(1, 2, 2)
        drafter = NgramDrafter(NgramIndex(1, 2, SMALL_PROMPT), options, timed=False)
        cache = arena(SMALL_TARGET, pol, "original", target_inflight_rows(2))
        out = list(speculative_tokens(SMALL_TARGET, cache, None, None, SMALL_PROMPT, max_new_tokens=K_TOKENS,
                                      sampling=sampling, gamma=None, generator=generator, prefill_chunk=8,
                                      stats=stats, ngram=drafter))
        counts[tuple(out)] += 1
    assert stats.ngram_drafted >= N_SAMPLES  # every run made proposals, and some were rejected
    assert stats.ngram_accepted < stats.ngram_drafted
    return counts


@pytest.mark.sampling
@pytest.mark.parametrize("case", ["full-t1", "hybrid-top-p"])
def test_sampling_with_ngram_proposals_matches_the_autoregressive_distribution(case):
    from test_speculative import SAMPLING_CASES

    pol, sampling = SAMPLING_CASES[case]
    assert chi_square_p(ngram_histogram(pol, sampling), exact_ar_distribution(pol, sampling)) > 0.01


def _keep_the_rejected_token(p, q, drafts, generator):
    """Broken for point masses: after a rejection, samples from p itself (so the rejected token can come back)."""
    for i, x in enumerate(drafts):
        if not bool(torch.rand((), generator=generator) < p[i, x] / q[i][x]):
            return i, sample(p[i], generator)
    return len(drafts), sample(p[len(drafts)], generator)


@pytest.mark.slow  # shows the χ² test's power against a rule wrong for point masses
def test_a_wrong_rule_for_point_masses_is_caught(monkeypatch):
    from test_speculative import SAMPLING_CASES

    monkeypatch.setattr(speculative, "_accept", _keep_the_rejected_token)
    pol, sampling = SAMPLING_CASES["full-t1"]
    assert chi_square_p(ngram_histogram(pol, sampling), exact_ar_distribution(pol, sampling)) < 0.01


def naive_shared_match(texts: list[tuple[str | None, list[int]]], text: list[int], salt, min_n: int, max_n: int,
                       limit: int) -> tuple[int, list[int]]:
    """The longest suffix of ``text`` found in the texts of ``salt`` (newest text, then latest place, first)."""
    for n in range(min(max_n, len(text)), min_n - 1, -1):
        suffix = text[len(text) - n :]
        for owner, tokens in reversed(texts):
            if owner != salt:
                continue
            for end in range(len(tokens) - 2, n - 2, -1):
                if tokens[end - n + 1 : end + 1] == suffix:
                    return n, tokens[end + 1 : end + 1 + limit]
    return 0, []


@pytest.mark.parametrize("capacity", [40, 400])
def test_shared_texts_match_what_a_naive_scan_finds_within_their_capacity(capacity):
    rng = random.Random(capacity)
    shared = SharedTexts(capacity, 2, 5)
    kept: list[tuple[str | None, list[int]]] = []
    for _ in range(30):
        salt = rng.choice([None, "a", "b"])
        tokens = [rng.randrange(5) for _ in range(rng.randrange(3, 30))]
        shared.add(tokens, salt)
        kept.append((salt, tokens))
        while sum(len(t) for _, t in kept) > capacity:
            kept.pop(0)
        assert shared.tokens_held == sum(len(t) for _, t in kept) <= capacity
        for _ in range(5):
            text = [rng.randrange(5) for _ in range(rng.randrange(1, 8))]
            salt = rng.choice([None, "a", "b"])
            assert shared.match(text, salt, 6) == naive_shared_match(kept, text, salt, 2, 5, 6)


def test_shared_texts_are_matched_only_within_one_salt():
    shared = SharedTexts(100, 2, 4)
    shared.add([1, 2, 3, 4, 5], "alice")
    assert shared.match([9, 2, 3], "alice", 4) == (2, [4, 5])
    assert shared.match([9, 2, 3], "bob", 4) == (0, []) and shared.match([9, 2, 3], None, 4) == (0, [])
    with pytest.raises(UserError, match="from 1 to"):
        SharedTexts(0)


# ----------------------------------------------------------------------------------------- sessions, CLI
def test_a_conversation_drafts_from_its_earlier_turns(smollm2_default):
    """The second turn resumes the first: its index goes on from the first turn's text (and what it learned), so
    the list the first answer wrote is proposed again, and accepted."""
    session = Session(smollm2_default, CacheOptions(), DraftOptions(None, None, None, ngram=NgramOptions()),
                      capacity=2048)
    tokenizer = smollm2_default.tokenizer
    first = tokenizer.encode("The list of primes below thirty: 2, 3, 5, 7, 11, 13, 17, 19, 23, 29. Again:")
    answer = list(session.run(first, max_new_tokens=24, sampling=SamplingParams()))
    indexed = session._ngram.index
    assert indexed.tokens == first + answer
    stats = RunStats()
    second = first + answer + tokenizer.encode(" Once more, the same list:", add_special_tokens=False)
    list(session.run(second, max_new_tokens=24, sampling=SamplingParams(), stats=stats))
    assert stats.reused_tokens > 0 and session._ngram.index is indexed  # extended, not rebuilt
    assert stats.speculative.ngram_accepted > 0


def test_sessions_draft_greedily_from_other_requests_text_of_their_salt(smollm2_default):
    """A second conversation asking what a first one asked drafts the first one's answer from the shared texts
    (greedy: the answer is plain decoding's); another salt, or sampling, never draws on them."""
    tokenizer = smollm2_default.tokenizer
    prompt = tokenizer.encode("The list of primes below thirty: 2, 3, 5, 7, 11, 13, 17, 19, 23, 29. Again:")
    plain = list(Session(smollm2_default, CacheOptions(), capacity=2048).run(prompt, max_new_tokens=24,
                                                                             sampling=SamplingParams()))
    shared = SharedTexts()

    def conversation(salt, sampling=SamplingParams()):
        session = Session(smollm2_default, CacheOptions(), DraftOptions(None, None, None, ngram=NgramOptions()),
                          capacity=2048)
        session.shared_texts, session.salt = shared, salt
        stats = RunStats()
        out = list(session.run(prompt, max_new_tokens=24, sampling=sampling, seed=1, stats=stats))
        return out, stats.speculative

    first, first_stats = conversation("alice")
    assert first == plain and first_stats.ngram_shared_drafted == 0 and shared.tokens_held == len(prompt) + len(first)
    second, second_stats = conversation("alice")
    assert second == plain and second_stats.ngram_shared_accepted > 0
    other, other_stats = conversation("bob")
    assert other == plain and other_stats.ngram_shared_drafted == 0
    _, sampled_stats = conversation("alice", SamplingParams(temperature=0.8))
    assert sampled_stats.ngram_shared_drafted == 0


def test_generate_with_ngram_drafts_equals_plain_decoding(capsys, smollm2_path):
    import json

    prompt = "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox"
    outs = []
    for flags in ([], ["--draft", "ngram"], ["--draft", "self", "--draft-budget", "32"],
                  ["--draft", "self", "--draft-budget", "32", "--draft-ngram", "off"]):
        assert main(["generate", "--prompt", prompt, "-n", "32", "--json", *flags]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert len({o["text"] for o in outs}) == 1
    assert outs[1]["draft"] == "ngram" and outs[1]["ngram_drafted"] > 0 and outs[1]["draft_ngram"]
    assert outs[3]["ngram_drafted"] == 0 and not outs[3]["draft_ngram"]


@pytest.mark.parametrize("flags,words", [
    (["--ngram-min", "2"], ["--ngram-min", "nothing without --draft"]),
    (["--draft", "ngram", "--draft-policy", "hybrid"], ["--draft-policy", "without a draft model"]),
    (["--draft", "ngram", "--gamma", "3"], ["--gamma", "without a draft model"]),
    (["--draft", "ngram", "--draft-ngram", "off"], ["drop --draft-ngram off"]),
    (["--draft", "self", "--draft-ngram", "off", "--ngram-tokens", "4"], ["--ngram-tokens", "n-gram drafting"]),
    (["--draft", "ngram", "--ngram-min", "4", "--ngram-max", "2"], ["--ngram-min <= --ngram-max", "4 and 2"]),
    (["--draft", "ngram", "--ngram-max", "100"], ["<= 64"]),
    (["--draft", "ngram", "--ngram-tokens", "0"], ["--ngram-tokens must be from 1 to 64"]),
    (["--draft-sibling"], ["--draft-sibling", "nothing without --draft"]),
    (["--draft", "ngram", "--draft-sibling"], ["--draft-sibling", "without a draft model"]),
])
def test_drafting_flag_mistakes_are_one_sentence(capsys, flags, words):
    assert main(["generate", "--prompt", "x", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("sparsespec: error: ")
    for word in words:
        assert word in err, err
