"""Recall from the cold tier (cache/recall.py): the native op's page choice, its attention over the recalled entries
and its merge with the resident ones against naive float64 references written here (sharing no code with the
library), what the arena moves to the tier, speculative == autoregressive with recall, and the flags' errors."""

from __future__ import annotations

import math
from copy import deepcopy
from dataclasses import dataclass

import pytest
import torch

from sparsespec import kernels
from sparsespec.cache import KVArena, make_policy
from sparsespec.cache.recall import PAGE, Recall, bytes_per_entry, cold_tier, recall_for
from sparsespec.cache.retention import Retention
from sparsespec.cli import main
from sparsespec.errors import UserError
from sparsespec.generate import generate_tokens, prefill
from sparsespec.model import Transformer
from sparsespec.rope import Rope
from sparsespec.sampling import SamplingParams
from sparsespec.speculative import SpeculativeStats, draft_inflight_rows, speculative_tokens, target_inflight_rows

from conftest import random_state, tiny_config
from test_arena_reference import _naive_dequantize

CONFIG = tiny_config("llama", tie_word_embeddings=False)
STATE = random_state(CONFIG, seed=0, scale=1.0)
TARGET = Transformer(CONFIG, STATE, torch.float32)
_noise = torch.Generator().manual_seed(5)
DRAFT = Transformer(CONFIG, {k: v + 0.02 * v.std() * torch.randn(v.shape, generator=_noise) for k, v in STATE.items()},
                    torch.float32)


def ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, CONFIG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_arena(model, policy, positions="original", recall=Recall(2), max_inflight=1, retention=None):
    return KVArena(model.config, policy, dtype=model.dtype, max_tokens=1024, max_block=8, max_inflight=max_inflight,
                   positions=positions, retention=retention, recall=recall, key_offset=model.key_biases())


# ------------------------------------------------------------------------------------------ the pieces
@dataclass
class Tier:
    """A native cold tier with what the references need to know of it."""

    native: object
    key_offset: torch.Tensor | None  # [L, n_kv, hd]
    rank: int | None
    pages: int
    scale: float
    head_dim: int


def random_tier(n_entries: int, rank: int | None, seed: int = 0, pages: int = 2):
    """A tier of 2 layers x 2 KV heads holding ``n_entries`` random entries (appended in three parts), and the
    entries' unrotated keys, values and positions ``[L, n, n_kv, hd]``."""
    g = torch.Generator().manual_seed(seed)
    L, n_kv, hd = 2, 2, 16
    offset = torch.randn(L, n_kv, hd, generator=g) * 4
    scale = 1 / math.sqrt(hd)
    tier = Tier(cold_tier(L, n_kv, hd, Rope.of(hd, 10000.0), scale, offset, rank, Recall(pages)), offset, rank, pages,
                scale, hd)
    keys = torch.randn(L, n_entries, n_kv, hd, generator=g) + offset[:, None]
    values = torch.randn(L, n_entries, n_kv, hd, generator=g)
    positions = torch.stack([torch.randperm(4 * n_entries, generator=g)[:n_entries] for _ in range(n_kv)], -1)
    positions = positions.expand(L, -1, -1).contiguous()
    cuts = [0, n_entries // 3, n_entries // 3 + 5, n_entries]
    for a, b in zip(cuts, cuts[1:]):
        tier.native.append(keys[:, a:b].contiguous(), values[:, a:b].contiguous(), positions[:, a:b].contiguous())
    return tier, keys, values, positions


def inverse_frequencies(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """RoPE's inverse frequencies in float32, as Hugging Face computes them."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def rotated64(keys: torch.Tensor, by: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """float64 RoPE ("rotate half") of ``keys [..., hd]`` by ``by [...]``."""
    angle = by.double()[..., None] * inv_freq.double()
    cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()
    half = keys.shape[-1] // 2
    return keys * cos + torch.cat((-keys[..., half:], keys[..., :half]), -1) * sin


def reference_row(tier: Tier, layer: int, query: torch.Tensor, theta: float = 10000.0):
    """float64 attention of ``query [n_kv, group, hd]`` over what the tier's row should recall: per KV head, the
    ``pages`` pages with the highest bound Σ_d max(q_d min_d, q_d max_d) (max over the group; ties: older page)
    over keys rotated by their positions (or the first rank), then the tail; the read keys rotated by their
    positions, or by the first rank plus their place in position order. Returns ``(out, lse, bounds, the keys the
    bounds are of [n_kv, n, hd])``."""
    packed, hd = tier.native.entries(layer), tier.head_dim
    n = packed.shape[0]
    params = packed[..., hd:].view(torch.float16).unflatten(-1, (2, -1, 2))  # key, value: [n, n_kv, groups, 2]
    raw = _naive_dequantize(packed[..., : hd // 2], params[..., 0, :, :], 4).double()
    if tier.key_offset is not None:
        raw = raw + tier.key_offset[layer].double()
    values = _naive_dequantize(packed[..., hd // 2 : hd], params[..., 1, :, :], 4).double().transpose(0, 1)
    positions = tier.native.positions(layer).T  # [n_kv, n]
    raw = raw.transpose(0, 1)  # [n_kv, n, hd]
    inv_freq = inverse_frequencies(hd, theta)
    keys = rotated64(raw, positions if tier.rank is None else torch.full_like(positions, tier.rank), inv_freq)
    q = query.double()
    n_pages = n // PAGE
    pages = keys[:, : n_pages * PAGE].unflatten(1, (n_pages, PAGE))  # [n_kv, pages, PAGE, hd]
    low, high = pages.amin(2), pages.amax(2)
    bounds = torch.maximum(q[:, :, None] * low[:, None], q[:, :, None] * high[:, None]).sum(-1).amax(1)
    out, lse = [], []
    for h in range(keys.shape[0]):
        order = sorted(range(n_pages), key=lambda p: (-float(bounds[h, p]), p))[: tier.pages]
        read = [p * PAGE + j for p in sorted(order) for j in range(PAGE)] + list(range(n_pages * PAGE, n))
        read_keys = keys[h, read]
        if tier.rank is not None:
            by_position = sorted(range(len(read)), key=lambda i: int(positions[h, read[i]]))
            ranks = torch.empty(len(read), dtype=torch.int64)
            ranks[by_position] = torch.arange(len(read)) + tier.rank
            read_keys = rotated64(raw[h, read], ranks, inv_freq)
        logits = q[h] @ read_keys.T * tier.scale
        out.append(torch.softmax(logits, -1) @ values[h, read])
        lse.append(torch.logsumexp(logits, -1))
    return torch.stack(out), torch.stack(lse), bounds, keys


def recalled_alone(tier: Tier, layer: int, query: torch.Tensor) -> torch.Tensor:
    """The row's attention over what it recalls, alone: the native tier's, merged into an empty resident part
    (log-sum-exp -inf; a merge with resident entries is checked on the arena's decode rows below). ``query`` is
    rotated already: the tier turns it by RoPE row 0, which leaves it as it is."""
    out = torch.zeros(query.numel())
    tier.native.recall_row(layer, query.contiguous(), 0, out,
                           torch.full((query.shape[0] * query.shape[1],), -math.inf))
    return out.view_as(query)


@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("rank", [None, 3], ids=["true-positions", "ranks"])
@pytest.mark.parametrize("n_entries", [5, 16, 75, 130])
def test_a_row_attends_to_the_pages_a_float64_reference_chooses(rank, n_entries):
    tier, keys, _, positions = random_tier(n_entries, rank)
    assert tier.native.count == n_entries
    query = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(9)) * 2
    for layer in range(2):
        assert torch.equal(tier.native.positions(layer), positions[layer])  # kept in the order they came
        ref_out, _, bounds, ref_keys = reference_row(tier, layer, query)
        out = recalled_alone(tier, layer, query)
        torch.testing.assert_close(out.double(), ref_out, atol=2e-4, rtol=2e-4)
        # The bounds bound: no key of a page, rotated as the summaries are, scores above its page's bound.
        n_pages = n_entries // PAGE
        assert tier.native.summaries(layer).shape == (n_pages, 2, 32)
        if n_pages:
            actual = torch.einsum("kgd,knd->kgn", query.double(), ref_keys[:, : n_pages * PAGE]).amax(1)
            assert (actual.unflatten(1, (n_pages, PAGE)).amax(-1) <= bounds + 1e-9).all()
        # The stored keys are the given ones to int4's rounding (a step of a group's range / 15).
        stored = reference_row(tier, layer, query)[3]
        expected = rotated64(keys[layer].transpose(0, 1).double(), positions[layer].T if rank is None else
                             torch.full_like(positions[layer].T, rank), inverse_frequencies(16))
        assert (stored - expected).abs().max() < 0.5


def test_the_tier_reports_the_bytes_it_holds():
    tier, *_ = random_tier(40, None)
    stored = tier.native.entries(0)[0, 0].nbytes + tier.native.positions(0)[0, 0].nbytes
    summary = tier.native.summaries(0)[0, 0].nbytes / PAGE
    assert bytes_per_entry(16) == stored + summary
    assert tier.native.nbytes == 40 * 2 * 2 * bytes_per_entry(16)
    tier.native.reset()
    assert tier.native.count == tier.native.nbytes == 0


@pytest.mark.usefixtures("native_kernels")
def test_a_copy_of_the_tier_is_its_own():
    tier, keys, values, positions = random_tier(20, None)
    copy = deepcopy(tier.native)
    tier.native.append(keys[:, :3].contiguous(), values[:, :3].contiguous(), positions[:, :3].contiguous())
    assert (copy.count, tier.native.count) == (20, 23)
    assert torch.equal(copy.entries(1), tier.native.entries(1)[:20])


@pytest.mark.usefixtures("native_kernels")
def test_the_tier_refuses_what_does_not_fit():
    tier, keys, values, positions = random_tier(20, None)
    with pytest.raises(RuntimeError, match="keys and values must be"):
        tier.native.append(keys[:1].contiguous(), values[:1].contiguous(), positions[:1].contiguous())
    with pytest.raises(RuntimeError, match="negative positions"):
        tier.native.append(keys[:, :2].contiguous(), values[:, :2].contiguous(), -positions[:, :2].contiguous() - 1)
    with pytest.raises(RuntimeError, match="outside the tier"):
        tier.native.recall_row(2, torch.zeros(2, 3, 16), 0, torch.zeros(96), torch.zeros(6))
    with pytest.raises(RuntimeError, match="8 inverse frequencies, not 3"):
        kernels.cold_tier(2, 2, 16, [0.0] * 3, 1.0, 0.25, None, -1, 2, PAGE)
    assert tier.native.count == 20


# ------------------------------------------------------------------------------------------- the arena
@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("positions", ["original", "in-cache"])
def test_recall_keeps_what_the_budget_keeps_and_stores_every_eviction(positions):
    policy = make_policy("hybrid", 20, sinks=2, heavy=9)
    with_recall = make_arena(TARGET, policy, positions)
    without = make_arena(TARGET, policy, positions, recall=None)
    tokens = ids(90)
    for arena in (with_recall, without):
        prefill(TARGET, arena, tokens[:60], 8)
        for token in tokens[60:]:
            TARGET.forward(torch.tensor([token]), arena)
            arena.commit(1)
    assert with_recall.evicted_tokens == without.evicted_tokens == 90 - 20
    assert with_recall.cold.count == with_recall.evicted_tokens
    for layer in range(CONFIG.num_hidden_layers):
        kept = with_recall.buffer("positions")[layer][:, : with_recall.n_committed]
        kept_without = without.buffer("positions")[layer][:, : without.n_committed]
        assert torch.equal(kept.sort().values, kept_without.sort().values)
        cold = with_recall.cold.positions(layer).T  # [n_kv, n]
        union = torch.cat((kept, cold), dim=-1).sort().values
        assert torch.equal(union, torch.arange(90).expand_as(union))  # every token is resident or cold, once


@pytest.mark.usefixtures("native_kernels")
def test_a_decode_row_attends_to_resident_and_recalled_entries():
    """One decode row's output in every layer equals float64 attention over the union of the resident entries
    (the row's own included) and what a float64 reference of the page choice recalls, the two merged by their
    log-sum-exps."""
    policy = make_policy("hybrid", 20, sinks=2, heavy=9)
    arena = make_arena(TARGET, policy, "original")
    prefill(TARGET, arena, ids(120), 8)
    n_heads, n_kv, hd = CONFIG.num_attention_heads, CONFIG.num_key_value_heads, CONFIG.head_dim
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, 1, hd, generator=g) for n in (n_heads, n_kv, n_kv))
    position = torch.tensor([arena.next_position])
    inv_freq = inverse_frequencies(hd, CONFIG.rope_theta)
    q_rot = rotated64(q.double(), position, inv_freq).view(n_kv, n_heads // n_kv, hd)
    expected = []
    for layer in range(CONFIG.num_hidden_layers):
        stop = arena.n_committed
        keys = torch.cat((arena.buffer("keys")[layer][:, :stop].double(), rotated64(k.double(), position, inv_freq)), 1)
        values = torch.cat((arena.buffer("values")[layer][:, :stop].double(), v.double()), 1)
        logits = torch.einsum("kgd,ksd->kgs", q_rot, keys) / math.sqrt(hd)
        resident = torch.einsum("kgs,ksd->kgd", torch.softmax(logits, -1), values)
        tier = Tier(arena.cold, TARGET.key_biases(), None, 2, 1 / math.sqrt(hd), hd)
        cold_out, cold_lse, _, _ = reference_row(tier, layer, q_rot.float(), CONFIG.rope_theta)
        total = torch.logaddexp(torch.logsumexp(logits, -1), cold_lse)
        expected.append((torch.logsumexp(logits, -1) - total).exp()[..., None] * resident
                        + (cold_lse - total).exp()[..., None] * cold_out)
    arena.begin(1)
    got = [arena.attend(layer, q, k, v) for layer in range(CONFIG.num_hidden_layers)]
    arena.end()
    arena.rollback()
    assert arena.cold.count > 4 * PAGE
    for layer in range(CONFIG.num_hidden_layers):
        torch.testing.assert_close(got[layer].view(n_kv, -1, hd).double(), expected[layer], atol=2e-4, rtol=2e-4)


@pytest.mark.usefixtures("native_kernels")
def test_a_commit_refuses_to_retire_a_corrupt_position():
    """An evicted slot whose position the tier's RoPE tables cannot hold is an error before the tier changes."""
    arena = make_arena(TARGET, make_policy("hybrid", 20, sinks=2, heavy=9))
    prefill(TARGET, arena, ids(40), 8)
    before = arena.cold.count
    arena.begin(1)
    n_heads, n_kv, hd = CONFIG.num_attention_heads, CONFIG.num_key_value_heads, CONFIG.head_dim
    for layer in range(CONFIG.num_hidden_layers):
        arena.attend(layer, torch.zeros(n_heads, 1, hd), torch.zeros(n_kv, 1, hd), torch.zeros(n_kv, 1, hd))
    arena.end()
    evicted = (arena.buffer("evicted_at")[0, 0] == 0).nonzero().flatten()
    assert len(evicted) == 1  # the row evicted one entry per head
    arena.buffer("positions")[0, 0, evicted[0]] = -5
    with pytest.raises(ValueError, match="holds position -5"):
        arena.commit(1)
    assert arena.cold.count == before


# ---------------------------------------------------------------------------------------------- exactness
@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("positions", ["original", "in-cache"])
def test_verification_rows_recall_what_one_row_steps_recall(positions):
    """A row-by-row block's rows, each seeing what the rows before it evicted (pending, not yet in the tier), give
    the outputs of one-row steps that commit as they go, bit for bit, and its commit leaves the same tier."""
    policy = make_policy("hybrid", 20, sinks=2, heavy=9)
    block, steps = (make_arena(TARGET, policy, positions, max_inflight=6) for _ in range(2))
    for arena in (block, steps):
        prefill(TARGET, arena, ids(70), 8)
    n_heads, n_kv, hd = CONFIG.num_attention_heads, CONFIG.num_key_value_heads, CONFIG.head_dim
    g = torch.Generator().manual_seed(7)
    layers = range(CONFIG.num_hidden_layers)
    q, k, v = ([torch.randn(n, 5, hd, generator=g) for _ in layers] for n in (n_heads, n_kv, n_kv))
    block.begin(5)
    together = [block.attend(layer, q[layer], k[layer], v[layer]) for layer in layers]
    block.end()
    block.commit(5)
    for i in range(5):
        steps.begin(1)
        for layer in layers:
            one = steps.attend(layer, q[layer][:, i : i + 1], k[layer][:, i : i + 1], v[layer][:, i : i + 1])
            assert torch.equal(one[0], together[layer][i]), (i, layer)
        steps.end()
        steps.commit(1)
    assert block.cold.count == steps.cold.count == block.evicted_tokens == 75 - 20
    for layer in layers:
        assert torch.equal(block.cold.entries(layer), steps.cold.entries(layer))
        assert torch.equal(block.cold.summaries(layer), steps.cold.summaries(layer))


@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize(("name", "positions", "retention"), [
    ("hybrid", "original", None), ("hybrid", "in-cache", None), ("h2o", "in-cache", None),
    ("streaming", "original", None), ("hybrid-decay", "in-cache", Retention(max_held=96, observation_rows=6)),
])
def test_greedy_speculative_equals_autoregressive_with_recall(name, positions, retention):
    sizes = {"sinks": 2, "heavy": 9} if name in ("hybrid", "hybrid-decay") else {"heavy": 9} if name == "h2o" else {}
    policy = make_policy(name, 20, **sizes)
    tokens = ids(100)
    run = dict(max_new_tokens=64, sampling=SamplingParams(), prefill_chunk=8)
    expected_arena = make_arena(TARGET, policy, positions, retention=retention)
    expected = list(generate_tokens(TARGET, expected_arena, tokens, **run))
    plain = list(generate_tokens(TARGET, make_arena(TARGET, policy, positions, recall=None, retention=retention),
                                 tokens, **run))
    assert plain != expected  # recall changed what was decoded
    for gamma in (1, 3, 5):
        target = make_arena(TARGET, policy, positions, max_inflight=target_inflight_rows(gamma), retention=retention)
        draft = make_arena(DRAFT, make_policy("hybrid", 12, sinks=2, heavy=5), positions,
                           max_inflight=draft_inflight_rows(gamma))
        stats = SpeculativeStats()
        got = list(speculative_tokens(TARGET, target, DRAFT, draft, tokens, gamma=gamma, stats=stats, **run))
        assert got == expected, gamma
        assert stats.accepted < stats.drafted  # rejections (and so rollbacks) happened
        assert target.cold.count == expected_arena.cold.count == target.evicted_tokens > 0


# --------------------------------------------------------------------------------------------- the flags
def test_recall_needs_pages_and_a_budget():
    assert recall_for(None, make_policy("hybrid", 64)) is None
    assert recall_for(4, make_policy("streaming", 64)) == Recall(4)
    with pytest.raises(UserError, match="from 1 to 1024"):
        recall_for(0, make_policy("hybrid", 64))
    with pytest.raises(UserError, match="the full cache evicts nothing"):
        recall_for(4, make_policy("full"))


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "--recall-pages", "4", "-p", "x"], "the full cache evicts nothing"),
    (["generate", "--budget", "64", "--recall-pages", "0", "-p", "x"], "from 1 to 1024 (got 0)"),
    (["generate", "--draft-recall-pages", "2", "-p", "x"], "--draft-recall-pages does nothing without --draft"),
    (["ppl", "--text", "corpus:hamlet", "--budget", "64", "--recall-pages", "4"], "only decode rows recall"),
])
def test_recall_flag_mistakes_are_one_sentence(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
