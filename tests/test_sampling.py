"""Sampling: parameter checks, the warped distribution against hand computation, χ² on draws, seeded runs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from conftest import tiny_model
from sparsespec.cache.arena import KVArena
from sparsespec.cache.policy import make_policy
from sparsespec.errors import ConfigError, user_message
from sparsespec.flags import PARAMETER_FLAGS
from sparsespec.serve.worker import SERVER_NAMES
from sparsespec.generate import generate_tokens
from sparsespec.sampling import SamplingParams, greedy_tokens, sample, warp


# ------------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.5), "{} must be 0 (greedy) or positive, got -0.5."),
        (dict(temperature=float("nan")), "{} must be 0 (greedy) or positive, got nan."),
        (dict(top_k=-1), "{} must be 0 (off) or a positive number of tokens, got -1."),
        (dict(top_p=0.0), "{} must be in (0, 1], got 0.0."),
        (dict(top_p=-0.2), "{} must be in (0, 1], got -0.2."),
        (dict(top_p=1.5), "{} must be in (0, 1], got 1.5."),
        (dict(top_p=float("nan")), "{} must be in (0, 1], got nan."),
    ],
)
def test_invalid_sampling_params_raise_user_error(kwargs, message):
    """The library names the parameter it was given; the command line and the server, what their users typed."""
    (param,) = kwargs
    with pytest.raises(ConfigError) as info:
        SamplingParams(**kwargs)
    assert str(info.value) == message.format(param) and info.value.params == (param,)
    assert user_message(info.value, PARAMETER_FLAGS) == message.format("--" + param.replace("_", "-"))
    assert user_message(info.value, SERVER_NAMES) == message.format(param)  # the request's field


def test_valid_sampling_params():
    assert SamplingParams().greedy
    assert SamplingParams(temperature=0.0, top_k=0, top_p=1.0).greedy
    params = SamplingParams(temperature=0.7, top_k=3, top_p=0.8)
    assert not params.greedy
    SamplingParams(temperature=1e-6, top_k=1, top_p=1e-9)  # extreme but legal


# ------------------------------------------------------------------------------------------ warp, by hand
def test_greedy_is_one_hot_on_argmax():
    logits = torch.tensor([0.3, -1.0, 2.5, 2.4, 0.0])
    probs = warp(logits, SamplingParams())
    assert probs.dtype == torch.float32
    assert torch.equal(probs, torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0]))


def test_greedy_is_one_hot_per_row():
    logits = torch.tensor([[0.3, -1.0, 2.5], [4.0, 1.0, 2.0]])
    probs = warp(logits, SamplingParams())
    assert torch.equal(probs, torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]))


def test_greedy_tokens_are_torch_argmax_rows():
    """The numpy argmax the decode loops use picks what torch.argmax picks: the first of tied maxima, past -inf
    entries (a cut draft vocabulary), on strided rows and on bfloat16 logits."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (6, 1000), generator=g).float()  # many ties
    logits[:, 700:] = -math.inf
    logits[2] = -math.inf
    logits[2, 999] = 0.0
    for rows in (logits, logits[:, ::3], logits[4:5], logits.bfloat16()):
        assert greedy_tokens(rows) == rows.argmax(dim=-1).tolist()


def test_greedy_ignores_top_k_and_top_p():
    logits = torch.tensor([0.3, -1.0, 2.5, 2.4])
    assert torch.equal(warp(logits, SamplingParams(top_k=2, top_p=0.1)), torch.tensor([0.0, 0.0, 1.0, 0.0]))


def test_temperature_only_is_softmax_of_scaled_logits():
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0])
    probs = warp(logits, SamplingParams(temperature=0.5))
    by_hand = [math.exp(x / 0.5) for x in logits.tolist()]
    assert probs.tolist() == pytest.approx([e / sum(by_hand) for e in by_hand], rel=1e-6)
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_top_k_keeps_exactly_k(k):
    logits = torch.tensor([0.1, 3.0, -2.0, 1.5, 0.7, 2.2, -0.4])
    probs = warp(logits, SamplingParams(temperature=1.0, top_k=k))
    kept = (probs > 0).nonzero().flatten().tolist()
    assert sorted(kept) == sorted(logits.topk(k).indices.tolist())
    assert len(kept) == k
    # The kept tokens keep their relative weights (softmax over the survivors).
    survivors = logits[kept]
    assert probs[kept].tolist() == pytest.approx(torch.softmax(survivors, dim=0).tolist(), rel=1e-6)


def test_top_k_at_least_vocab_is_no_filter():
    logits = torch.tensor([0.1, 3.0, -2.0])
    plain = warp(logits, SamplingParams(temperature=1.0))
    assert torch.allclose(warp(logits, SamplingParams(temperature=1.0, top_k=3)), plain)
    assert torch.allclose(warp(logits, SamplingParams(temperature=1.0, top_k=10)), plain)


# probs (0.5, 0.3, 0.15, 0.05) in a shuffled order: token 2 is the largest, then 0, 3, 1.
HAND_PROBS = torch.tensor([0.3, 0.05, 0.5, 0.15])


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.4, [2]),  # 0.5 alone reaches 0.4
        (0.75, [2, 0]),  # 0.5 < 0.75 <= 0.8
        (0.85, [2, 0, 3]),  # 0.8 < 0.85 <= 0.95
        (0.99, [2, 0, 3, 1]),  # needs everything
        (1e-6, [2]),  # the most likely token is always kept
    ],
)
def test_top_p_keeps_smallest_prefix_reaching_p(top_p, kept):
    probs = warp(HAND_PROBS.log(), SamplingParams(temperature=1.0, top_p=top_p))
    assert sorted((probs > 0).nonzero().flatten().tolist()) == sorted(kept)
    mass = HAND_PROBS[kept].sum()
    expected = torch.zeros(4)
    expected[kept] = HAND_PROBS[kept] / mass
    assert probs.tolist() == pytest.approx(expected.tolist(), abs=1e-6)


def test_top_p_applies_after_top_k_and_temperature():
    """Temperature 1 on probs (0.5, 0.3, 0.15, 0.05), top-k 3 renormalises to (0.526, 0.316, 0.158); top-p 0.8
    then needs the first two (0.526 < 0.8 <= 0.842)."""
    probs = warp(HAND_PROBS.log(), SamplingParams(temperature=1.0, top_k=3, top_p=0.8))
    assert probs.tolist() == pytest.approx([0.3 / 0.8, 0.0, 0.5 / 0.8, 0.0], abs=1e-6)


# ---------------------------------------------------------------------------------------------------- χ²
LOGITS = [1.2, 2.0, -0.3, 0.7, 1.9, -1.5, 0.1, 1.0]  # vocabulary of 8, no ties


def expected_distribution(logits: list[float], temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The warped distribution from its definition, in float64 numpy: softmax(logits / T), zero outside the k
    largest, keep the smallest most-likely-first set whose mass reaches ``top_p``, renormalise."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    if top_k:
        p[order[top_k:]] = 0.0
        p /= p.sum()
    if top_p < 1:
        kept, mass = [], 0.0
        for index in order:
            if p[index] == 0 or mass >= top_p:
                break
            kept.append(index)
            mass += p[index]
        mask = np.zeros_like(p)
        mask[kept] = 1.0
        p = p * mask
        p /= p.sum()
    return p


def draw_counts(params: SamplingParams, n: int, seed: int) -> np.ndarray:
    probs = warp(torch.tensor(LOGITS), params)
    generator = torch.Generator().manual_seed(seed)
    counts = np.zeros(len(LOGITS), dtype=np.int64)
    for _ in range(n):
        counts[sample(probs, generator)] += 1
    return counts


def chi_square_p(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """χ² p-value on the support of ``expected_probs``; draws outside the support fail the test outright."""
    support = expected_probs > 0
    assert counts[~support].sum() == 0, f"draws outside the expected support: {counts}"
    n = counts.sum()
    return chisquare(counts[support], n * expected_probs[support]).pvalue


SAMPLES = 20_000

CASES = {
    "temperature-0.7": SamplingParams(temperature=0.7),
    "top-k-3": SamplingParams(temperature=1.0, top_k=3),
    "top-p-0.8": SamplingParams(temperature=1.0, top_p=0.8),
    "combined": SamplingParams(temperature=0.7, top_k=5, top_p=0.9),
    "hot-combined": SamplingParams(temperature=1.6, top_k=6, top_p=0.75),
}


@pytest.mark.parametrize("name", CASES)
def test_expected_distribution_support(name):
    """The hand-computed distributions filter what they should (so the χ² tests below are not vacuous)."""
    params = CASES[name]
    p = expected_distribution(LOGITS, params.temperature, params.top_k, params.top_p)
    support = int((p > 0).sum())
    assert {"temperature-0.7": 8, "top-k-3": 3, "top-p-0.8": 4, "combined": 4, "hot-combined": 4}[name] == support
    warped = warp(torch.tensor(LOGITS), params).double().numpy()
    assert np.allclose(warped, p, atol=1e-6)


@pytest.mark.parametrize("name", CASES)
def test_samples_follow_warped_distribution(name):
    params = CASES[name]
    counts = draw_counts(params, SAMPLES, seed=1234)
    p_value = chi_square_p(counts, expected_distribution(LOGITS, params.temperature, params.top_k, params.top_p))
    assert p_value > 1e-3, f"{name}: counts {counts.tolist()} reject the expected distribution (p={p_value:.2g})"


def test_chi_square_rejects_a_wrong_distribution():
    """Temperature 0.7 draws tested against temperature 1: the test must have the power to notice."""
    counts = draw_counts(SamplingParams(temperature=0.7), SAMPLES, seed=99)
    wrong = expected_distribution(LOGITS, 1.0, 0, 1.0)
    assert chi_square_p(counts, wrong) < 1e-6


def test_chi_square_rejects_top_p_off_by_one_token():
    """A top-p set one token too large (a common off-by-one) is told apart from the right one."""
    params = SamplingParams(temperature=1.0, top_p=0.8)
    right = expected_distribution(LOGITS, 1.0, 0, 0.8)
    n_kept = int((right > 0).sum())
    too_large = expected_distribution(LOGITS, 1.0, n_kept + 1, 1.0)
    counts = draw_counts(params, SAMPLES, seed=7)
    support = too_large > 0
    p_value = chisquare(counts[support], counts.sum() * too_large[support]).pvalue
    assert p_value < 1e-6


def test_greedy_sampling_is_deterministic_without_generator():
    probs = warp(torch.tensor(LOGITS), SamplingParams())
    assert {sample(probs, None) for _ in range(20)} == {int(np.argmax(LOGITS))}


# ------------------------------------------------------------------------------------------ reproducibility
# The tiny Qwen2 model has an untied, moderately scaled head: its next-token entropy is 1.5-3.8 nats, so
# temperature-1 runs really branch (the tied tiny Llama is nearly one-hot and would hide a seeding bug).
PROMPT = [3, 17, 42, 8, 61]


@pytest.fixture(scope="module")
def sampling_model():
    return tiny_model("qwen2", seed=5)


def sampled_run(model, seed: int, params: SamplingParams = SamplingParams(temperature=1.0), n: int = 16,
                eos_ids=()) -> list[int]:
    arena = KVArena(model.config, make_policy("full"), dtype=torch.float32, max_tokens=len(PROMPT) + n, max_block=8)
    generator = torch.Generator().manual_seed(seed)
    return list(generate_tokens(
        model, arena, PROMPT, max_new_tokens=n, sampling=params, generator=generator, eos_ids=eos_ids
    ))


def test_same_seed_same_tokens(sampling_model):
    first = sampled_run(sampling_model, seed=11)
    assert len(first) == 16
    assert sampled_run(sampling_model, seed=11) == first


def test_different_seeds_differ(sampling_model):
    runs = {tuple(sampled_run(sampling_model, seed)) for seed in (11, 12, 13)}
    assert len(runs) == 3
    # Temperature 1 really samples: no run is the greedy continuation.
    assert tuple(sampled_run(sampling_model, seed=0, params=SamplingParams())) not in runs


def test_greedy_run_ignores_the_seed(sampling_model):
    greedy = SamplingParams()
    assert sampled_run(sampling_model, seed=1, params=greedy) == sampled_run(sampling_model, seed=2, params=greedy)


def test_eos_stops_generation_after_yielding_it(sampling_model):
    tokens = sampled_run(sampling_model, seed=11)
    eos = tokens[5]
    stopped = sampled_run(sampling_model, seed=11, eos_ids={eos})
    assert stopped == tokens[: tokens.index(eos) + 1]
