"""Speculative decoding is exact: same greedy tokens, same sampling distribution, same arenas as autoregressive."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

import sparsespec.speculative as speculative
from sparsespec.cache import KVArena, make_policy
from sparsespec.errors import UserError
from sparsespec.generate import generate_tokens, prefill
from sparsespec.model import Transformer
from sparsespec.sampling import SamplingParams, sample, warp
from sparsespec.speculative import (
    AdaptiveGamma,
    DraftWhileFaster,
    SpeculativeStats,
    check_same_vocabulary,
    draft_inflight_rows,
    speculative_tokens,
    target_inflight_rows,
)

from sparsespec.speedup import expected_tokens_per_pass

from conftest import random_state, tiny_config, tiny_model

POLICY_SPECS = {
    "full": dict(),
    "window": dict(budget=10),
    "streaming": dict(budget=10, sinks=2),
    "h2o": dict(budget=12, heavy=6),
    "hybrid": dict(budget=12, sinks=2, heavy=4),
    "hybrid-decay": dict(budget=12, sinks=2, heavy=4),
}


def policy(name):
    spec = dict(POLICY_SPECS[name])
    return make_policy(name, spec.pop("budget", None), **spec)


def arena(model, pol, positions, max_inflight, max_tokens=1024, chunk=8, kv_dtype="auto"):
    return KVArena(model.config, pol, dtype=model.dtype, max_tokens=max_tokens, max_block=chunk,
                   max_inflight=max_inflight, positions=positions, kv_dtype=kv_dtype,
                   key_offset=model.key_biases())


# Untied head and unit-scale weights: a tiny random model whose greedy text does not collapse into one token.
TARGET_CONFIG = tiny_config("llama", tie_word_embeddings=False)
TARGET_STATE = random_state(TARGET_CONFIG, seed=0, scale=1.0)


def _noisy_state(noise: float, seed: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + noise * v.std() * torch.randn(v.shape, generator=g) for k, v in TARGET_STATE.items()}


def noisy_copy(noise: float, seed: int = 5, weights: str = "dense") -> Transformer:
    """A draft that agrees with the target often but not always: the target's weights plus noise."""
    return Transformer(TARGET_CONFIG, _noisy_state(noise, seed), torch.float32, weights)


def prompt(n, vocab, seed=1):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def ar_tokens(model, pol, positions, ids, n, sampling=SamplingParams(), generator=None, kv_dtype="auto"):
    cache = arena(model, pol, positions, max_inflight=1, kv_dtype=kv_dtype)
    return list(generate_tokens(model, cache, ids, max_new_tokens=n, sampling=sampling, generator=generator,
                                prefill_chunk=8))


def spec_tokens(target, draft, pol, draft_pol, positions, ids, n, gamma, sampling=SamplingParams(),
                generator=None, stats=None, kv_dtype="auto", draft_kv_dtype="auto", sibling=False):
    cap = gamma if isinstance(gamma, int) else gamma.gamma_max
    t_cache = arena(target, pol, positions, target_inflight_rows(cap, sibling), kv_dtype=kv_dtype)
    d_cache = arena(draft, draft_pol, positions, draft_inflight_rows(cap), kv_dtype=draft_kv_dtype)
    out = list(speculative_tokens(target, t_cache, draft, d_cache, ids, max_new_tokens=n, sampling=sampling,
                                  gamma=gamma, generator=generator, prefill_chunk=8, stats=stats, sibling=sibling))
    return out, t_cache, d_cache


TARGET = Transformer(TARGET_CONFIG, TARGET_STATE, torch.float32)
DRAFT = noisy_copy(noise=0.01)


@pytest.mark.parametrize("positions", ["original", "in-cache"])
@pytest.mark.parametrize("name", list(POLICY_SPECS))
def test_greedy_speculative_equals_autoregressive(native_kernels, name, positions, row_by_row):
    pol = policy(name)
    ids = prompt(20, TARGET.config.vocab_size)
    expected = ar_tokens(TARGET, pol, positions, ids, 256)
    row_by_row.clear()
    stats = SpeculativeStats()
    got, t_cache, _ = spec_tokens(TARGET, DRAFT, pol, make_policy("hybrid", 10, sinks=2, heavy=3), positions, ids,
                                  256, gamma=4, stats=stats)
    assert got == expected
    # The draft must be neither perfect nor useless, so both accept and reject paths ran.
    assert 10 < stats.accepted < stats.drafted - 10
    if name == "full":
        assert t_cache.evicted_tokens == 0 and id(t_cache) not in row_by_row
    else:
        # The target evicted, and did so inside verification blocks (the row-by-row path ran in its arena).
        assert t_cache.evicted_tokens >= len(ids) + 256 - pol.budget - target_inflight_rows(4)
        assert row_by_row.get(id(t_cache), 0) > 10


@pytest.mark.parametrize("positions", ["original", "in-cache"])
@pytest.mark.parametrize("name", ["full", "hybrid", "h2o"])
def test_greedy_speculative_equals_autoregressive_in_bfloat16_with_dense_weights(native_kernels, name, positions):
    """Dense weights are native float rows: a row's bfloat16 result never depends on the rows beside it, so the
    default dtype speculates exactly with unquantized weights too."""
    target = Transformer(TARGET_CONFIG, TARGET_STATE, torch.bfloat16)
    draft = Transformer(TARGET_CONFIG, _noisy_state(0.01), torch.bfloat16)
    pol = policy(name)
    ids = prompt(20, TARGET_CONFIG.vocab_size)
    expected = ar_tokens(target, pol, positions, ids, 160)
    stats = SpeculativeStats()
    got, t_cache, _ = spec_tokens(target, draft, pol, make_policy("hybrid", 10, sinks=2, heavy=3), positions, ids,
                                  160, gamma=4, stats=stats)
    assert got == expected
    assert 10 < stats.accepted < stats.drafted - 10
    assert t_cache.buffer("keys").dtype == torch.bfloat16 and (name == "full") == (t_cache.evicted_tokens == 0)


@pytest.mark.parametrize(("name", "kv_dtype", "draft_kv_dtype"),
                         [("full", "int8", "int4"), ("hybrid", "int4", "int8"), ("hybrid", "bf16", "int4")])
@pytest.mark.parametrize("positions", ["original", "in-cache"])
def test_greedy_speculative_equals_autoregressive_with_quantized_kv(native_kernels, name, positions, kv_dtype,
                                                                      draft_kv_dtype):
    """A row is quantized once, when it is written; the verification pass and autoregressive decoding read the
    same stored entries, so the quantized cache is one more cache definition that speculation reproduces."""
    pol = policy(name)
    ids = prompt(20, TARGET.config.vocab_size)
    expected = ar_tokens(TARGET, pol, positions, ids, 160, kv_dtype=kv_dtype)
    stats = SpeculativeStats()
    got, t_cache, d_cache = spec_tokens(TARGET, DRAFT, pol, make_policy("hybrid", 10, sinks=2, heavy=3), positions,
                                        ids, 160, gamma=4, stats=stats, kv_dtype=kv_dtype,
                                        draft_kv_dtype=draft_kv_dtype)
    assert got == expected
    assert 10 < stats.accepted < stats.drafted - 10
    stored = {"bf16": torch.bfloat16, "int8": torch.uint8, "int4": torch.uint8}
    assert t_cache.buffer("keys").dtype == stored[kv_dtype] and d_cache.buffer("keys").dtype == stored[draft_kv_dtype]


@pytest.mark.parametrize("positions", ["original", "in-cache"])
def test_self_speculation_with_sparse_draft_is_exact(positions):
    pol = policy("hybrid")
    ids = prompt(30, TARGET.config.vocab_size, seed=3)
    expected = ar_tokens(TARGET, pol, positions, ids, 256)
    got, _, _ = spec_tokens(TARGET, TARGET, pol, make_policy("streaming", 6, sinks=1), positions, ids, 256,
                            gamma=AdaptiveGamma())
    assert got == expected


@pytest.mark.parametrize("positions", ["original", "in-cache"])
@pytest.mark.parametrize("name", ["full", "h2o", "hybrid", "streaming"])
def test_greedy_speculative_with_the_runner_up_beside_the_chain_equals_autoregressive(native_kernels, name, positions):
    """Tree rounds (``sibling``): a draft that often misses the first token, whose runner-up the target then takes
    from its own row; the tokens are the target's alone, over caches that evict."""
    pol = policy(name)
    ids = prompt(20, TARGET.config.vocab_size)
    expected = ar_tokens(TARGET, pol, positions, ids, 48)
    stats = SpeculativeStats()
    got, t_cache, _ = spec_tokens(TARGET, noisy_copy(noise=0.3), pol, pol, positions, ids, 48, gamma=3, stats=stats,
                                  sibling=True)
    assert got == expected
    assert stats.sibling_rounds > 0 and stats.sibling_accepted > 0
    assert t_cache.evicted_tokens > 0 or pol.is_full


def test_qwen2_target_with_random_draft():
    target = tiny_model("qwen2", seed=2)
    draft = tiny_model("qwen2", seed=9)  # unrelated weights: almost every proposal is rejected
    pol = policy("hybrid")
    ids = prompt(16, target.config.vocab_size, seed=4)
    expected = ar_tokens(target, pol, "original", ids, 256)
    got, _, _ = spec_tokens(target, draft, pol, policy("full"), "original", ids, 256, gamma=3)
    assert got == expected


def test_qwen2_quantized_keys_stored_without_their_bias_speculate_exactly(native_kernels):
    """In-cache positions with int4 / int8 keys on a model with key biases: keys are stored minus the bias (one
    more part of the cache's definition), and speculation reproduces autoregressive decoding."""
    target = tiny_model("qwen2", seed=2)
    pol = policy("hybrid")
    ids = prompt(16, target.config.vocab_size, seed=6)
    expected = ar_tokens(target, pol, "in-cache", ids, 160, kv_dtype="int4")
    stats = SpeculativeStats()
    got, t_cache, d_cache = spec_tokens(target, target, pol, make_policy("streaming", 6, sinks=1), "in-cache", ids,
                                        160, gamma=4, stats=stats, kv_dtype="int4", draft_kv_dtype="int8")
    assert got == expected
    assert 10 < stats.accepted < stats.drafted - 10
    assert "key_offset" in t_cache.buffers() and "key_offset" in d_cache.buffers()
    assert t_cache.evicted_tokens > 0


def committed_state(cache: KVArena):
    """Committed arena contents per (layer, head), slot by slot (the layout is part of the state)."""
    n = cache.n_committed
    state = {name: cache.buffer(name)[:, :, :n] for name in ("positions", "keys", "values")}
    if cache.policy.needs_scores:
        state["scores"] = cache.buffer("scores")[..., :n]
    return state


def ar_arena_after(model, pol, positions, tokens, n_prompt_context):
    """An arena fed like autoregressive decoding: prefill of the prompt context, then one row at a time."""
    cache = arena(model, pol, positions, max_inflight=1)
    prefill(model, cache, tokens[:n_prompt_context], 8)
    for token in tokens[n_prompt_context:]:
        model.forward(torch.tensor([token]), cache)
        cache.commit(1)
    return cache


@pytest.mark.parametrize("positions", ["original", "in-cache"])
@pytest.mark.parametrize("name", ["h2o", "hybrid", "streaming"])
def test_rollback_leaves_both_arenas_as_autoregressive_runs_would(name, positions):
    pol = policy(name)
    draft_pol = make_policy("hybrid", 9, sinks=1, heavy=3)
    ids = prompt(20, TARGET.config.vocab_size, seed=6)
    generator = torch.Generator().manual_seed(0)
    stats = SpeculativeStats()
    out, t_cache, d_cache = spec_tokens(TARGET, DRAFT, pol, draft_pol, positions, ids, 60, gamma=5,
                                        sampling=SamplingParams(temperature=1.0), generator=generator, stats=stats)
    assert 0 < stats.accepted < stats.drafted  # a mix of accepts and rejects
    text = ids + out
    for model, pol_, cache in ((TARGET, pol, t_cache), (DRAFT, draft_pol, d_cache)):
        fed = cache.next_position
        reference = ar_arena_after(model, pol_, positions, text[:fed], len(ids) - 1)
        assert cache.n_committed == reference.n_committed
        got, want = committed_state(cache), committed_state(reference)
        assert torch.equal(got["positions"], want["positions"])  # the same entries in the same slots
        for key in set(got) - {"positions"}:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------- sampling distribution
VOCAB = 4
K_TOKENS = 3
N_SAMPLES = 10_000
SMALL = tiny_config("llama", vocab_size=VOCAB, num_hidden_layers=1, hidden_size=16, intermediate_size=32)
SMALL_TARGET = Transformer(SMALL, random_state(SMALL, seed=11, scale=1.0), torch.float32)
SMALL_DRAFT = Transformer(SMALL, random_state(SMALL, seed=12, scale=1.0), torch.float32)
# A draft near the target, so that where the target rejects the draft's token its residual falls on the draft's
# runner-up now and then, but not always (at temperature 4 the residual spreads over several tokens).
_small_noise = torch.Generator().manual_seed(13)
SMALL_NEAR_DRAFT = Transformer(SMALL, {k: v + 1.0 * v.std() * torch.randn(v.shape, generator=_small_noise)
                                       for k, v in random_state(SMALL, seed=11, scale=1.0).items()}, torch.float32)
SMALL_PROMPT = [1, 3, 0, 2]
SAMPLING_CASES = {
    "full-t1": (make_policy("full"), SamplingParams(temperature=1.0)),
    # Temperature 1.5: at 1.0 the top-p filter leaves target and draft one-hot on the same token at the first step.
    "hybrid-top-p": (make_policy("hybrid", 3, sinks=1, heavy=1), SamplingParams(temperature=1.5, top_p=0.9)),
}
SIBLING_CASES = {
    "full-t4": (make_policy("full"), SamplingParams(temperature=4.0)),
    "hybrid-top-p": SAMPLING_CASES["hybrid-top-p"],
}


def exact_ar_distribution(pol, sampling):
    """P(x1, x2, x3) under autoregressive decoding with the policy, by enumerating every prefix."""
    probs = {}
    for seq in itertools.product(range(VOCAB), repeat=K_TOKENS):
        cache = arena(SMALL_TARGET, pol, "original", max_inflight=1)
        prefill(SMALL_TARGET, cache, SMALL_PROMPT[:-1], 8)
        p, feed = 1.0, SMALL_PROMPT[-1]
        for token in seq:
            logits = SMALL_TARGET.forward(torch.tensor([feed]), cache)[-1]
            cache.commit(1)
            p *= float(warp(logits, sampling)[token])
            feed = token
        probs[seq] = p
    return probs


def speculative_histogram(pol, sampling, sibling=False, stats=None, draft=SMALL_DRAFT):
    generator = torch.Generator().manual_seed(1234)
    counts = dict.fromkeys(itertools.product(range(VOCAB), repeat=K_TOKENS), 0)
    for _ in range(N_SAMPLES):
        out, _, _ = spec_tokens(SMALL_TARGET, draft, pol, pol, "original", SMALL_PROMPT, K_TOKENS, gamma=2,
                                sampling=sampling, generator=generator, sibling=sibling, stats=stats)
        counts[tuple(out)] += 1
    return counts


def chi_square_p(counts, probs):
    keys = [k for k in counts if probs[k] * N_SAMPLES >= 5]
    rest_observed = N_SAMPLES - sum(counts[k] for k in keys)
    rest_expected = N_SAMPLES - sum(probs[k] * N_SAMPLES for k in keys)
    observed = [counts[k] for k in keys] + [rest_observed]
    expected = [probs[k] * N_SAMPLES for k in keys] + [rest_expected]
    if rest_expected < 5:
        assert rest_observed <= 5  # outcomes (near) impossible under the target must (almost) never appear
        observed, expected = observed[:-1], expected[:-1]
        scale = sum(observed) / sum(expected)
        expected = [e * scale for e in expected]
    return chisquare(observed, expected).pvalue


@pytest.mark.sampling
@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_speculative_sampling_matches_autoregressive_distribution(case):
    pol, sampling = SAMPLING_CASES[case]
    assert chi_square_p(speculative_histogram(pol, sampling), exact_ar_distribution(pol, sampling)) > 0.01


@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("case", list(SIBLING_CASES))
def test_sampling_with_the_runner_up_beside_the_chain_matches_autoregressive_distribution(case):
    """Tree rounds (the draft's runner-up verified beside its chain, ``sibling``): the same χ² against exact
    enumeration, with the runner-up's row giving the next token in a share of the rounds."""
    pol, sampling = SIBLING_CASES[case]
    stats = SpeculativeStats()
    counts = speculative_histogram(pol, sampling, sibling=True, stats=stats, draft=SMALL_NEAR_DRAFT)
    assert chi_square_p(counts, exact_ar_distribution(pol, sampling)) > 0.01
    assert stats.sibling_rounds > 0 and stats.sibling_accepted > 100  # the runner-up's row was used, often


def _resample_from_p(p, q, drafts, generator):
    """Broken: after a rejection, draws from p instead of normalize(max(0, p − q))."""
    for i, x in enumerate(drafts):
        if not bool(torch.rand((), generator=generator) < p[i, x] / q[i][x]):
            return i, sample(p[i], generator)
    return len(drafts), sample(p[len(drafts)], generator)


def _bonus_from_last_draft_row(p, q, drafts, generator):
    """Broken: when every proposal passes, draws the bonus token from the last proposal's row of p (p_γ) instead
    of the row after it (p_{γ+1})."""
    for i, x in enumerate(drafts):
        if not bool(torch.rand((), generator=generator) < p[i, x] / q[i][x]):
            residual = (p[i] - q[i]).clamp_(min=0.0)
            return i, sample(residual / residual.sum() if residual.sum() > 0 else p[i], generator)
    return len(drafts), sample(p[len(drafts) - 1], generator)


@pytest.mark.slow  # shows the power of the χ² test above (that a wrong rule fails it), not a property of the code
@pytest.mark.parametrize("case,broken", [
    ("full-t1", _resample_from_p),
    ("hybrid-top-p", _resample_from_p),
    ("full-t1", _bonus_from_last_draft_row),
    ("hybrid-top-p", _bonus_from_last_draft_row),
], ids=["residual-full", "residual-hybrid-top-p", "bonus-full", "bonus-hybrid-top-p"])
def test_broken_acceptance_rule_is_caught(monkeypatch, case, broken):
    """A rule that is wrong after a rejection, or for the bonus token, biases the output: χ² sees it, for the full
    cache at temperature 1 and for a sparse target with top-p."""
    monkeypatch.setattr(speculative, "_accept", broken)
    pol, sampling = SAMPLING_CASES[case]
    assert chi_square_p(speculative_histogram(pol, sampling), exact_ar_distribution(pol, sampling)) < 0.01


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.slow  # shows the power of the χ² test above, not a property of the code
@pytest.mark.usefixtures("native_kernels")
def test_a_runner_up_taken_after_every_rejection_is_caught(monkeypatch):
    """A rule that follows the runner-up's row whenever the first proposal is rejected (not only when the target's
    replacement is the runner-up) biases the output: χ² sees it."""
    monkeypatch.setattr(speculative, "_takes_sibling", lambda accepted, token, second: second is not None and
                        accepted == 0)
    pol, sampling = SIBLING_CASES["full-t4"]
    counts = speculative_histogram(pol, sampling, sibling=True, draft=SMALL_NEAR_DRAFT)
    assert chi_square_p(counts, exact_ar_distribution(pol, sampling)) < 0.01


def test_gamma_below_one_is_rejected():
    with pytest.raises(UserError, match="at least 1"):
        spec_tokens(TARGET, DRAFT, policy("full"), policy("full"), "original", [1, 2, 3], 4, gamma=0)


def test_vocabulary_mismatch_is_rejected():
    with pytest.raises(UserError, match="vocabulary has 50 entries and the target's 97"):
        check_same_vocabulary(None, None, 97, 50)


def test_expected_tokens_formula():
    assert expected_tokens_per_pass(0.0, 4) == 1.0
    assert expected_tokens_per_pass(1.0, 4) == 5.0
    assert expected_tokens_per_pass(0.5, 2) == pytest.approx(1.75)


def simulated_decode(gamma: AdaptiveGamma, n_tokens: int, alpha: float, draft_s: float, row_s: float = 0.0,
                     single_s: float = 1.0, seed: int = 0) -> tuple[float, list[int]]:
    """Drive ``gamma`` through a fake decode of ``n_tokens``: each proposal passes with probability ``alpha``; a round
    with γ proposals takes γ·draft_s + single_s + γ·row_s seconds. Returns the total seconds and the γ of each round.
    """
    rng = torch.Generator().manual_seed(seed)
    seconds, produced, gammas = 0.0, 0, []
    while produced < n_tokens:
        g = gamma.gamma
        accepted = 0
        while accepted < g and float(torch.rand((), generator=rng)) < alpha:
            accepted += 1
        target_s = single_s + g * row_s
        seconds += g * draft_s + target_s
        produced += accepted + 1
        gammas.append(g)
        gamma.update(g, accepted, g * draft_s, target_s)
    return seconds, gammas


def test_adaptive_gamma_backs_off_when_drafting_does_not_pay():
    """A useless draft (nothing accepted, a proposal costing 0.4 of a target pass): after the first round and the
    plain step that measures the target, γ = 0; probes come back with growing gaps; a 64-token answer costs at most
    5% more than decoding without a draft."""
    gamma = AdaptiveGamma()
    seconds, gammas = simulated_decode(gamma, 64, alpha=0.0, draft_s=0.4)
    assert gammas[:3] == [4, 0, 0]
    probes = [i for i, g in enumerate(gammas) if g and i > 0]
    assert all(gammas[i] == 1 for i in probes) and len(probes) >= 2
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # the wait doubles after each failed probe
    assert seconds <= 1.05 * 64  # 64 plain steps take 64 s


def test_adaptive_gamma_backs_off_when_verification_rows_are_dear():
    """Proposals are accepted but each extra verification row costs as much as a pass (the int4 multi-row kernel at
    its worst): speculation does not pay, so γ goes to 0; a cheap draft with cheap rows keeps speculating."""
    seconds, gammas = simulated_decode(AdaptiveGamma(), 64, alpha=0.6, draft_s=0.1, row_s=1.0)
    assert set(gammas[2:]) <= {0, 1} and gammas[2:].count(0) > 0.8 * len(gammas[2:])  # after round 1 and t₁
    assert seconds <= 1.1 * 64
    seconds, gammas = simulated_decode(AdaptiveGamma(), 64, alpha=0.8, draft_s=0.05, row_s=0.02)
    assert seconds < 64 / 1.8 and sum(g >= 2 for g in gammas) > 0.8 * len(gammas)


def test_adaptive_gamma_probes_and_resumes_when_the_draft_recovers():
    gamma = AdaptiveGamma()
    simulated_decode(gamma, 30, alpha=0.0, draft_s=0.1)
    assert gamma.gamma in (0, 1)
    _, gammas = simulated_decode(gamma, 200, alpha=0.95, draft_s=0.1)
    assert gammas[-1] >= 3  # a probe saw the acceptance come back and speculation resumed


class FakeClock:
    """``time.perf_counter`` stand-in whose every reading advances by a random step: timings that differ from run
    to run as wall-clock ones do."""

    def __init__(self, seed: int) -> None:
        self.now, self.rng = 0.0, torch.Generator().manual_seed(seed)

    def perf_counter(self) -> float:
        self.now += 0.001 + 0.2 * float(torch.rand((), generator=self.rng))
        return self.now


def test_sampled_output_with_auto_gamma_is_reproducible(monkeypatch):
    """``--gamma auto`` at temperature 1: the same seed gives the same text whatever the timings, because γ then
    follows acceptance and the weight-bytes cost ratio. The same run with timing-driven γ under the same two clocks
    gives two γ schedules and two texts, so the clocks do matter."""
    from sparsespec.engine import CacheOptions, DraftOptions, RunStats, run_generation
    from sparsespec.loading.load import LoadedModel

    # An int8 draft streams a quarter of the float32 target's bytes: speculating pays in the byte cost model.
    small_draft = noisy_copy(0.01, weights="int8")
    target = LoadedModel("target", None, TARGET_CONFIG, TARGET, None)
    draft = DraftOptions(LoadedModel("draft", None, TARGET_CONFIG, small_draft, None), CacheOptions(), "auto")
    ids = prompt(20, TARGET_CONFIG.vocab_size, seed=8)
    sampling = SamplingParams(temperature=1.0)

    def run(clock_seed: int) -> tuple[list[int], list[int]]:
        monkeypatch.setattr(speculative, "time", FakeClock(clock_seed))
        stats = RunStats()
        out = list(run_generation(target, ids, max_new_tokens=96, sampling=sampling, cache=CacheOptions(), seed=3,
                                  draft=draft, stats=stats))
        return out, stats.speculative.gammas

    (out_1, gammas_1), (out_2, gammas_2) = run(1), run(2)
    assert out_1 == out_2 and gammas_1 == gammas_2
    assert sum(g >= 1 for g in gammas_1) > len(gammas_1) / 2  # it did speculate

    def timed_run(clock_seed: int) -> tuple[list[int], list[int]]:
        monkeypatch.setattr(speculative, "time", FakeClock(clock_seed))
        stats = SpeculativeStats()
        out, _, _ = spec_tokens(TARGET, small_draft, policy("full"), policy("full"),
                                "original", ids, 96, gamma=AdaptiveGamma(), sampling=sampling,
                                generator=torch.Generator().manual_seed(3), stats=stats)
        return out, stats.gammas

    (out_1, gammas_1), (out_2, gammas_2) = timed_run(1), timed_run(2)
    assert gammas_1 != gammas_2 and out_1 != out_2


def test_adaptive_gamma_follows_acceptance():
    gamma = AdaptiveGamma(initial=4)
    for _ in range(30):
        gamma.update(gamma.gamma, gamma.gamma, 0.01, 0.1)  # everything accepted, cheap draft
    assert gamma.gamma >= 6
    for _ in range(30):
        drafted = max(gamma.gamma, 1)
        gamma.update(drafted, 0, 0.05, 0.1)  # nothing accepted
    assert gamma.gamma in (0, 1)


class SimulatedClock:
    """The seconds a :class:`DraftWhileFaster` reads: advanced by the simulated rounds."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def paying_decode(controller: DraftWhileFaster, clock: SimulatedClock, n_tokens: int, round_s: float,
                  round_tokens: int, plain_s: float = 1.0) -> tuple[float, int]:
    """Drive ``controller`` through ``n_tokens``: a speculative round takes ``round_s`` seconds for
    ``round_tokens`` tokens, a plain step ``plain_s`` for one. Returns the seconds and the tokens drafted rounds
    gave."""
    started, produced, drafted_tokens = clock.now, 0, 0
    while produced < n_tokens:
        g = controller.gamma
        tokens = round_tokens if g else 1
        clock.now += round_s if g else plain_s
        controller.update(g, tokens - 1 if g else 0, 0.0, 0.0)
        produced += tokens
        drafted_tokens += tokens if g else 0
    return clock.now - started, drafted_tokens


def test_draft_while_faster_stops_drafting_that_is_slower():
    """Rounds of 3 tokens in 4 s against plain steps of 1 s (drafting at 0.75x): over 2,000 tokens the controller
    drafts only in its probes, and the run takes at most 2% longer than the target alone."""
    clock = SimulatedClock()
    seconds, drafted = paying_decode(DraftWhileFaster(3, clock=clock), clock, 2000, round_s=4.0, round_tokens=3)
    assert drafted < 0.05 * 2000
    assert seconds <= 1.02 * 2000


def test_draft_while_faster_keeps_drafting_that_pays():
    """Rounds of 3 tokens in 2 s (1.5x the target alone): nearly every token comes from drafting rounds, at most 2%
    slower than drafting throughout."""
    clock = SimulatedClock()
    seconds, drafted = paying_decode(DraftWhileFaster(3, clock=clock), clock, 2000, round_s=2.0, round_tokens=3)
    assert drafted > 0.95 * 2000
    assert seconds <= 1.02 * 2000 * 2.0 / 3


def test_draft_while_faster_resumes_when_drafting_starts_to_pay():
    """After 500 tokens where drafting clearly did not pay (a plain stint grown to 1,024 tokens), drafting that pays
    is found at the next probe and kept."""
    clock = SimulatedClock()
    controller = DraftWhileFaster(3, clock=clock)
    paying_decode(controller, clock, 500, round_s=4.0, round_tokens=3)
    assert controller.gamma == 0
    _, drafted = paying_decode(controller, clock, 2000, round_s=1.5, round_tokens=3)
    assert drafted > 0.5 * 2000 and controller.gamma == 3


def test_draft_while_faster_changes_speed_not_tokens():
    """Greedy output with the controller switching between drafting and plain steps (a clock under which drafting
    looks slow, then fast) equals autoregressive decoding, over evicting caches; after its long plain stints the
    draft empties its cache and reads only the last tokens it missed."""
    pol = policy("hybrid")
    ids = prompt(20, TARGET.config.vocab_size)
    expected = ar_tokens(TARGET, pol, "original", ids, 300)
    clock = SimulatedClock()
    controller = DraftWhileFaster(3, probe_rounds=2, plain_steps=3, first_stint=8, clock=clock)
    original_update = controller.update

    def update(drafted, accepted, draft_s, target_s):  # drafting costs 5 s a round for its first 60 rounds, then 1 s
        clock.now += (5.0 if len(stats.gammas) < 60 else 1.0) if drafted else 1.0
        original_update(drafted, accepted, draft_s, target_s)

    controller.update = update
    stats = SpeculativeStats()
    t_cache = arena(TARGET, pol, "original", target_inflight_rows(3))
    d_cache = arena(DRAFT, make_policy("streaming", 10, sinks=2), "original", draft_inflight_rows(3))
    got = list(speculative_tokens(TARGET, t_cache, DRAFT, d_cache, ids, max_new_tokens=300,
                                  sampling=SamplingParams(), gamma=controller, prefill_chunk=8, stats=stats))
    assert got == expected
    assert 0 in stats.gammas and 3 in stats.gammas
    switches = sum(a != b for a, b in zip(stats.gammas, stats.gammas[1:]))
    assert switches >= 3 and t_cache.evicted_tokens > 0 and stats.draft_restarts > 0


def test_draft_while_faster_can_start_plain():
    """A draft as dear as the target (a self-draft) starts with plain steps; drafting is probed only after the first
    stint, and kept when it pays."""
    clock = SimulatedClock()
    controller = DraftWhileFaster(3, start_drafting=False, clock=clock)
    gammas = []
    for _ in range(300):
        gammas.append(controller.gamma)
        clock.now += 1.0 if controller.gamma else 1.0  # drafting: 3 tokens a second against 1
        controller.update(controller.gamma, 2 if controller.gamma else 0, 0.0, 0.0)
    first_draft = gammas.index(3)
    assert first_draft > controller.first_stint and gammas[-1] == 3
