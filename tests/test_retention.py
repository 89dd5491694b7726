"""Query-aware retention (cache/retention.py): its scores against a float64 reference, the selection the arena makes,
the arena's memory around a hold, speculative == autoregressive with it, and the flags' errors."""

from __future__ import annotations

import math

import pytest
import torch

from sparsespec.cache import KVArena, make_policy
from sparsespec.cache.retention import Retention, retention_for
from sparsespec.cli import main
from sparsespec.errors import UserError
from sparsespec.generate import generate_tokens, prefill
from sparsespec.model import Transformer
from sparsespec.rope import Rope
from sparsespec.sampling import SamplingParams
from sparsespec.speculative import SpeculativeStats, draft_inflight_rows, speculative_tokens, target_inflight_rows

from conftest import layer_by_layer, random_state, rotate, tiny_config

CONFIG = tiny_config("llama", tie_word_embeddings=False)
STATE = random_state(CONFIG, seed=0, scale=1.0)
TARGET = Transformer(CONFIG, STATE, torch.float32)
# A draft that agrees with the target often but not always: the target's weights plus noise.
_noise = torch.Generator().manual_seed(5)
DRAFT = Transformer(CONFIG, {k: v + 0.02 * v.std() * torch.randn(v.shape, generator=_noise) for k, v in STATE.items()},
                    torch.float32)
RETENTION = Retention(max_held=96, observation_rows=6)


def ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, TARGET.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_arena(model, policy, positions="original", retention=RETENTION, max_inflight=1, chunk=8):
    return KVArena(model.config, policy, dtype=model.dtype, max_tokens=1024, max_block=chunk,
                   max_inflight=max_inflight, positions=positions, retention=retention,
                   key_offset=model.key_biases())


def kept_positions(arena: KVArena, layer: int) -> list[set[int]]:
    """Per KV head, the positions the arena holds in ``layer``."""
    held = arena.buffer("positions")[layer][:, : arena.n_committed]
    return [set(row.tolist()) for row in held]


# ---------------------------------------------------------------------------------------------- the scores
def _reference_selection(model, policy, tokens, rows, pool):
    """Per layer and KV head, the positions a float64 observation window keeps: every row attends to the whole
    prompt (a full cache), the last ``rows`` rows' attention is summed, pooled and ranked (ties: the newer stays);
    sinks and window stay."""
    captured = []
    original = KVArena.attend

    def record(self, layer, q, k, v):
        captured.append((layer, q.detach().clone(), k.detach().clone()))
        return original(self, layer, q, k, v)

    full = make_arena(model, make_policy("full"), retention=None, chunk=len(tokens))
    KVArena.attend = record
    try:
        with layer_by_layer(model):
            model.forward(torch.tensor(tokens), full)
    finally:
        KVArena.attend = original
    cfg = model.config
    rope = Rope.for_model(cfg)
    n_kv, group = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    positions = torch.arange(len(tokens))
    kept = []
    for layer, q, k in captured:
        q = rotate(q.double(), positions, rope)[:, -rows:].reshape(n_kv, group, rows, -1)
        k = rotate(k.double(), positions, rope)
        logits = torch.matmul(q, k.transpose(-1, -2)[:, None]) / math.sqrt(cfg.head_dim)
        causal = positions[None, :] <= positions[-rows:, None]
        attention = torch.softmax(logits.masked_fill(~causal, -math.inf), dim=-1).sum(dim=(1, 2))  # [n_kv, S]
        pooled = torch.nn.functional.max_pool1d(attention[:, None], pool, stride=1, padding=pool // 2)[:, 0]
        heads = []
        for h in range(n_kv):
            protected = {p for p in range(len(tokens)) if p < policy.sinks or p >= len(tokens) - policy.window}
            ranked = sorted((p for p in range(len(tokens)) if p not in protected), key=lambda p: (-pooled[h, p], -p))
            heads.append(protected | set(ranked[: policy.budget - len(protected)]))
        kept.append(heads)
    return kept


@pytest.mark.usefixtures("native_kernels")
def test_the_arena_keeps_what_a_float64_observation_window_chooses():
    policy = make_policy("hybrid", 20, sinks=2, heavy=10)
    tokens = ids(70)
    arena = make_arena(TARGET, policy)
    prefill(TARGET, arena, tokens, chunk=8)
    expected = _reference_selection(TARGET, policy, tokens, RETENTION.observation_rows, RETENTION.pool)
    for layer in range(TARGET.config.num_hidden_layers):
        assert kept_positions(arena, layer) == expected[layer]
    # Query-aware: the heavy part is not what the prompt's accumulated attention would have kept.
    plain = make_arena(TARGET, policy, retention=None)
    prefill(TARGET, plain, tokens, chunk=8)
    assert any(kept_positions(plain, layer) != expected[layer] for layer in range(TARGET.config.num_hidden_layers))


@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("positions", ["original", "in-cache"])
def test_a_later_prompt_chooses_among_entries_out_of_position_order_as_a_float64_window_would(positions):
    """A conversation's second prompt: after decoding's evictions and compactions the entries kept so far sit out of
    position order, and the new prompt is held beside them. The window must rank and pool them by position: its
    choice equals a float64 window's over the same stored entries and new rows."""
    policy = make_policy("hybrid", 20, sinks=2, heavy=10)
    arena = make_arena(TARGET, policy, positions=positions)
    prefill(TARGET, arena, ids(40), chunk=8)
    for token in ids(12, seed=2):  # decode steps: each evicts one entry and fills its hole
        TARGET.forward(torch.tensor([token]), arena)
        arena.commit(1)
    held = arena.buffer("positions")[0][:, : arena.n_committed]
    assert any(not torch.equal(row.sort().values, row) for row in held)  # out of position order
    before, rows = {}, {}
    begin, attend = arena.begin, arena.attend

    def spy_begin(n_rows, per_block=False, parents=None):
        begin(n_rows, per_block, parents)
        if arena.block_mode == "select":  # the window: what it chooses among, as stored
            start = arena.n_committed + arena.n_inflight  # the window's first slot, and its first position below
            before.update(start=start, first_position=arena.next_position + arena.n_inflight,
                          positions=arena.buffer("positions")[:, :, :start].clone(),
                          keys=arena.buffer("keys")[:, :, :start].clone(),
                          alive=arena.buffer("evicted_at")[:, :, :start] == torch.iinfo(torch.int32).max)

    def spy_attend(layer, q, k, v):
        if arena.block_mode == "select":
            rows[layer] = (q.clone(), k.clone())
        return attend(layer, q, k, v)

    arena.begin, arena.attend = spy_begin, spy_attend
    with layer_by_layer(TARGET):
        prefill(TARGET, arena, ids(30, seed=3), chunk=8)
    assert rows, "the second prompt ended with a selection"
    cfg = TARGET.config
    rope = Rope.for_model(cfg)
    n_kv, group = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    for layer, (q, k) in rows.items():
        n_rows = q.shape[1]
        new_positions = torch.arange(n_rows) + before["first_position"]
        for h in range(n_kv):
            alive = before["alive"][layer, h]
            old_positions = before["positions"][layer, h][alive]
            old_keys = before["keys"][layer, h][alive].double()
            n_old = len(old_positions)
            if positions == "original":  # stored rotated; new rows and queries by their true positions
                new_keys = rotate(k[h : h + 1].double(), new_positions, rope)[0]
                queries = rotate(q[h * group : (h + 1) * group].double(), new_positions, rope)
            else:  # every key and query by its rank among the visible entries, in position order
                ranks = old_positions.argsort().argsort()
                old_keys = rotate(old_keys[None], ranks, rope)[0]
                new_keys = rotate(k[h : h + 1].double(), torch.arange(n_rows) + n_old, rope)[0]
                queries = rotate(q[h * group : (h + 1) * group].double(), torch.arange(n_rows) + n_old, rope)
            keys = torch.cat((old_keys, new_keys))
            key_positions = torch.cat((old_positions, new_positions))
            logits = torch.matmul(queries, keys.T) / math.sqrt(cfg.head_dim)  # [group, rows, entries]
            seen = key_positions[None, :] <= new_positions[:, None]
            attention = torch.softmax(logits.masked_fill(~seen, -math.inf), dim=-1).sum(dim=(0, 1))
            order = key_positions.argsort()
            by_position = attention[order]
            pooled_in_order = torch.nn.functional.max_pool1d(by_position[None, None], RETENTION.pool, stride=1,
                                                             padding=RETENTION.pool // 2)[0, 0]
            pooled = {int(key_positions[order[i]]): float(pooled_in_order[i]) for i in range(len(order))}
            newest = int(new_positions[-1])
            protected = {p for p in pooled if p < policy.sinks or p > newest - policy.window}
            ranked = sorted((p for p in pooled if p not in protected), key=lambda p: (-pooled[p], -p))
            expected = protected | set(ranked[: policy.budget - len(protected)])
            assert kept_positions(arena, layer)[h] == expected, f"layer {layer}, KV head {h}"


def test_a_hold_grows_the_arena_for_the_prompt_and_returns_it_to_the_budget():
    policy = make_policy("h2o", 24, heavy=12)
    arena = make_arena(TARGET, policy)
    steady = arena.nbytes
    tokens = ids(150)
    prefill(TARGET, arena, tokens, chunk=8)
    # 150 - 96 tokens were evicted chunk by chunk; the last 96 were held whole, then cut to the budget.
    assert arena.n_committed == policy.budget and arena.next_position == 150
    assert arena.evicted_tokens == 150 - policy.budget
    assert arena.nbytes == steady and arena.capacity == policy.budget + 8
    assert arena.peak_nbytes > 3 * steady
    # Entries' scores are the window's attention: each kept entry's score is positive, and decoding goes on.
    assert (arena.buffer("scores")[..., : arena.n_committed] > 0).all()
    out = list(generate_tokens(TARGET, arena, ids(5, seed=3), max_new_tokens=20, sampling=SamplingParams(),
                               prefill_chunk=8))
    assert len(out) == 20 and arena.n_committed == policy.budget


def test_a_prompt_within_the_budget_is_not_held():
    arena = make_arena(TARGET, make_policy("hybrid", 64, sinks=2, heavy=20))
    prefill(TARGET, arena, ids(40), chunk=8)
    assert arena.peak_nbytes == arena.nbytes and arena.evicted_tokens == 0 and arena.n_committed == 40


def test_an_error_inside_a_hold_empties_the_arena_and_frees_the_room(monkeypatch):
    arena = make_arena(TARGET, make_policy("hybrid", 20, sinks=2, heavy=9))
    steady = arena.capacity
    calls = [0]
    original = KVArena.end

    def failing(self, *args):  # the third chunk's rows have entered the arena when the error comes
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("interrupted")
        return original(self, *args)

    monkeypatch.setattr(KVArena, "end", failing)
    with pytest.raises(RuntimeError):
        prefill(TARGET, arena, ids(60), chunk=8)
    assert arena.capacity == steady and arena.n_committed == 0 and arena.next_position == 0


# ---------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("positions", ["original", "in-cache"])
@pytest.mark.parametrize("name", ["h2o", "hybrid", "hybrid-decay", "hybrid-age"])
def test_greedy_speculative_equals_autoregressive_with_retention(name, positions):
    policy = make_policy(name, 20, **({} if name == "h2o" else {"sinks": 2}), heavy=9)
    draft_policy = make_policy("hybrid", 12, sinks=2, heavy=5)
    tokens = ids(120)
    expected_arena = make_arena(TARGET, policy, positions)
    expected = list(generate_tokens(TARGET, expected_arena, tokens, max_new_tokens=96, sampling=SamplingParams(),
                                    prefill_chunk=8))
    for gamma in (1, 3, 5):
        target = make_arena(TARGET, policy, positions, max_inflight=target_inflight_rows(gamma))
        draft = make_arena(DRAFT, draft_policy, positions, max_inflight=draft_inflight_rows(gamma))
        stats = SpeculativeStats()
        got = list(speculative_tokens(TARGET, target, DRAFT, draft, tokens, max_new_tokens=96,
                                      sampling=SamplingParams(), gamma=gamma, prefill_chunk=8, stats=stats))
        assert got == expected, gamma
        assert target.peak_nbytes > target.nbytes and draft.peak_nbytes > draft.nbytes  # both held the prompt
        assert stats.accepted < stats.drafted  # rejections (and so rollbacks) happened
        assert target.evicted_tokens == expected_arena.evicted_tokens


# --------------------------------------------------------------------------------------------- the flags
def test_retention_modes_and_policies():
    hybrid = make_policy("hybrid", 64)
    assert retention_for("auto", hybrid).max_held == 16384
    assert retention_for("auto", hybrid, context=4096).max_held == 4096 - 64
    assert retention_for("query", hybrid, 500).max_held == 500
    assert retention_for("off", hybrid) is None
    assert retention_for("auto", make_policy("streaming", 64)) is None
    assert retention_for("auto", make_policy("full")) is None
    with pytest.raises(UserError, match="keeps no heavy hitters"):
        retention_for("query", make_policy("window", 64))
    with pytest.raises(UserError, match="does nothing without retention"):
        retention_for("off", hybrid, 500)
    with pytest.raises(UserError, match="at least the 32-row observation window"):
        retention_for("query", hybrid, 8)


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "--policy", "streaming", "--budget", "64", "--retention", "query", "-p", "x"],
     "keeps no heavy hitters"),
    (["generate", "--retention", "query", "-p", "x"], "keeps every token"),
    (["generate", "--budget", "64", "--retention", "off", "--retention-tokens", "100", "-p", "x"],
     "does nothing without retention"),
    (["generate", "--draft-retention", "off", "-p", "x"], "--draft-retention does nothing without --draft"),
    (["ppl", "--text", "corpus:hamlet", "--budget", "64", "--retention", "query"], "no prompt end"),
])
def test_retention_flag_mistakes_are_one_sentence(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
