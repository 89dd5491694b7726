"""Property tests of the KV arena driven directly with random queries, keys and values (no model).

A run is a random sequence of operations on one arena:

* ``prefill``: one per-block chunk (``begin(T, per_block=True)``), then ``commit(T)`` or a rollback;
* ``decode``: one or more blocks of rows staged one after another (as a draft model or a verification pass
  does), then ``commit(m)`` for a random ``0 <= m <= rows in flight``.

After every operation the committed region must satisfy the cache contract (budget, sinks and window present,
unique and increasing positions), a rollback must restore it bitwise, and a partial commit must equal an arena
that was fed the same first ``m`` rows one at a time with ``commit(1)`` after each.
"""

from __future__ import annotations

import copy

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparsespec.cache.arena import NEVER, KVArena
from sparsespec.cache.policy import make_policy

from conftest import tiny_config

MAX_BLOCK = 6  # largest prefill chunk
MAX_INFLIGHT = 6  # most decode rows in flight before a commit
SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------- strategies
@st.composite
def policies(draw, names=("full", "window", "streaming", "h2o", "hybrid")):
    name = draw(st.sampled_from(names))
    if name == "full":
        return make_policy("full")
    sizes = {"window": draw(st.integers(1, 5))}
    if name in ("streaming", "hybrid"):
        sizes["sinks"] = draw(st.integers(0, 3))
    if name in ("h2o", "hybrid"):
        sizes["heavy"] = draw(st.integers(1, 5))
    return make_policy(name, **sizes)


prefill_ops = st.tuples(st.just("prefill"), st.integers(1, MAX_BLOCK), st.booleans())  # (kind, rows, rollback)


@st.composite
def decode_ops(draw):
    blocks = draw(st.lists(st.integers(1, MAX_INFLIGHT), min_size=1, max_size=3))
    while sum(blocks) > MAX_INFLIGHT:
        blocks.pop()
    if not blocks:
        blocks = [1]
    accept = draw(st.integers(0, sum(blocks)))
    return ("decode", blocks, accept)


operations = st.lists(st.one_of(prefill_ops, decode_ops(), decode_ops()), min_size=1, max_size=24)


# ------------------------------------------------------------------------------------------------- helpers
def _config(n_kv: int):
    return tiny_config(num_key_value_heads=n_kv, num_attention_heads=4)


def _arena(config, policy, mode, total_rows):
    return KVArena(
        config, policy, dtype=torch.float32, max_tokens=total_rows, max_block=MAX_BLOCK, max_inflight=MAX_INFLIGHT,
        positions=mode,
    )


def _rows(config, n_rows, gen):
    """Per layer ``(q, k, v)`` for ``n_rows`` new tokens; q and k scaled so attention is far from uniform."""
    n_heads, n_kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    out = []
    for _ in range(config.num_hidden_layers):
        q = 1.5 * torch.randn(n_heads, n_rows, hd, generator=gen)
        k = 1.5 * torch.randn(n_kv, n_rows, hd, generator=gen)
        v = torch.randn(n_kv, n_rows, hd, generator=gen)
        out.append((q, k, v))
    return out


def _slice_rows(rows, i, j):
    return [(q[:, i:j], k[:, i:j], v[:, i:j]) for q, k, v in rows]


def _feed(arena: KVArena, rows, per_block=False) -> list[torch.Tensor]:
    """Stage one block; return the attention output of every layer (``[T, n_heads * hd]`` each)."""
    arena.begin(rows[0][1].shape[1], per_block=per_block)
    outs = [arena.attend(layer, q, k, v) for layer, (q, k, v) in enumerate(rows)]
    arena.end()
    return outs


def _committed(arena: KVArena) -> dict:
    """A copy of the committed region, slot for slot, plus the counters."""
    n = arena.n_committed
    state = {
        "keys": arena.buffer("keys")[:, :, :n].clone(),
        "values": arena.buffer("values")[:, :, :n].clone(),
        "positions": arena.buffer("positions")[:, :, :n].clone(),
        "n_committed": n,
        "next_position": arena.next_position,
        "evicted_tokens": arena.evicted_tokens,
    }
    if arena.policy.needs_scores:
        state["scores"] = arena.buffer("scores")[:, :, :n].clone()
    return state


def _assert_bitwise_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if isinstance(a[name], torch.Tensor):
            assert torch.equal(a[name], b[name]), f"{what}: {name} differs"
        else:
            assert a[name] == b[name], f"{what}: {name} {a[name]} != {b[name]}"


def _by_position(arena: KVArena, layer: int, head: int) -> dict[int, tuple]:
    """Committed tokens of one layer/head keyed by position: (key, value, score or None)."""
    n = arena.n_committed
    out = {}
    for slot in range(n):
        p = int(arena.buffer("positions")[layer, head, slot])
        score = float(arena.buffer("scores")[layer, head, slot]) if arena.policy.needs_scores else None
        out[p] = (arena.buffer("keys")[layer, head, slot], arena.buffer("values")[layer, head, slot], score)
    return out


def _check_contract(arena: KVArena, before: dict, what: str) -> None:
    """Invariants of the committed region after a commit (``before``: the committed state before the operation)."""
    policy = arena.policy
    n = arena.n_committed
    assert arena.n_inflight == 0 and arena.n_visible == n
    if policy.budget is not None:
        assert n <= policy.budget, f"{what}: {n} committed slots exceed the budget {policy.budget}"
    else:
        assert n == arena.next_position, f"{what}: the full cache lost tokens"
    assert bool((arena.buffer("evicted_at")[:, :, :n] == NEVER).all()), f"{what}: a committed slot is marked evicted"
    seen = arena.next_position
    old_seen = before["next_position"]
    required = set(range(min(policy.sinks, seen))) | set(range(max(seen - policy.window, 0), seen))
    if policy.is_full:
        required = set(range(seen))
    n_layers, n_kv = arena.buffer("keys").shape[:2]
    for layer in range(n_layers):
        for head in range(n_kv):
            positions = arena.buffer("positions")[layer, head, :n].tolist()
            kept = set(positions)
            assert len(kept) == len(positions), f"{what}: duplicate positions {sorted(positions)}"
            assert all(0 <= p < seen for p in kept), f"{what}: positions {sorted(kept)} outside [0, {seen})"
            missing = required - kept
            assert not missing, f"{what}: layer {layer} head {head} lost protected positions {sorted(missing)}"
            old = set(before["positions"][layer, head].tolist())
            new = kept - old
            # Tokens committed by this operation are exactly the new positions [old_seen, seen), all later than
            # anything committed before; nothing that was evicted earlier comes back.
            assert all(p >= old_seen for p in new), f"{what}: positions {sorted(new)} reappeared"
            assert all(p > max(old, default=-1) for p in new)


def _assert_same_tokens(a: KVArena, b: KVArena, what: str) -> None:
    """Same committed tokens per layer/head (keys and values equal, scores close), whatever their slot order."""
    assert a.n_committed == b.n_committed, f"{what}: {a.n_committed} vs {b.n_committed} committed slots"
    assert a.next_position == b.next_position and a.evicted_tokens == b.evicted_tokens
    n_layers, n_kv = a.buffer("keys").shape[:2]
    for layer in range(n_layers):
        for head in range(n_kv):
            x, y = _by_position(a, layer, head), _by_position(b, layer, head)
            assert x.keys() == y.keys(), f"{what}: layer {layer} head {head} keeps {sorted(x)} vs {sorted(y)}"
            for p in x:
                assert torch.equal(x[p][0], y[p][0]), f"{what}: key at position {p} differs"
                assert torch.equal(x[p][1], y[p][1]), f"{what}: value at position {p} differs"
                if x[p][2] is not None:
                    assert abs(x[p][2] - y[p][2]) <= 1e-5 + 1e-5 * abs(y[p][2]), f"{what}: score at {p} differs"


# --------------------------------------------------------------------------------------------- the property
@SETTINGS
@given(
    policy=policies(),
    mode=st.sampled_from(("original", "in-cache")),
    n_kv=st.sampled_from((1, 2)),
    ops=operations,
    seed=st.integers(0, 2**31 - 1),
)
def test_random_operations_keep_the_cache_contract(policy, mode, n_kv, ops, seed):
    config = _config(n_kv)
    gen = torch.Generator().manual_seed(seed)
    total_rows = sum(op[1] if op[0] == "prefill" else sum(op[1]) for op in ops)
    arena = _arena(config, policy, mode, total_rows)
    for index, op in enumerate(ops):
        what = f"op {index} {op}"
        before = _committed(arena)
        reference = copy.deepcopy(arena)  # the arena as it was before this operation
        if op[0] == "prefill":
            _, n_rows, rollback = op
            rows = _rows(config, n_rows, gen)
            blocks = [(rows, True)]
            _feed(arena, rows, per_block=True)
            accept = 0 if rollback else n_rows
        else:
            _, sizes, accept = op
            blocks = [(_rows(config, size, gen), False) for size in sizes]
            outs = [_feed(arena, rows) for rows, _ in blocks]
        arena.commit(accept)
        _check_contract(arena, before, what)

        if accept == 0:
            # Rollback: the committed region is restored bit for bit, and the arena behaves exactly like the
            # untouched copy when the same blocks are staged again.
            _assert_bitwise_equal(_committed(arena), before, f"{what} rollback")
            for rows, per_block in blocks:
                again, fresh = _feed(arena, rows, per_block), _feed(reference, rows, per_block)
                for x, y in zip(again, fresh):
                    assert torch.equal(x, y), f"{what}: output after rollback differs from the untouched arena"
            arena.rollback()
            _assert_bitwise_equal(_committed(arena), before, f"{what} second rollback")
        elif op[0] == "decode":
            # Partial (or full) commit of decode rows == feeding those rows one by one with commit(1) each.
            n_layers = config.num_hidden_layers
            flat = [  # per layer (q, k, v) of all staged rows, in order
                tuple(torch.cat([rows[layer][j] for rows, _ in blocks], dim=1) for j in range(3))
                for layer in range(n_layers)
            ]
            block_outs = [torch.cat([o[layer] for o in outs], dim=0) for layer in range(n_layers)]
            one_by_one = reference
            for i in range(accept):
                row_out = _feed(one_by_one, _slice_rows(flat, i, i + 1))
                one_by_one.commit(1)
                for layer in range(n_layers):
                    assert torch.allclose(row_out[layer][0], block_outs[layer][i], atol=1e-5, rtol=1e-5), (
                        f"{what}: row {i} of the block differs from autoregressive step {i} (layer {layer})"
                    )
            _assert_same_tokens(arena, one_by_one, f"{what} commit({accept})")


# ------------------------------------------------------------------------------------------ tie-breaking
@SETTINGS
@given(
    policy=policies(names=("h2o", "hybrid")),
    mode=st.sampled_from(("original", "in-cache")),
    chunks=st.lists(st.integers(1, MAX_BLOCK), min_size=1, max_size=4),
    decode_blocks=st.lists(st.integers(1, 3), min_size=1, max_size=12),
)
def test_tied_scores_evict_the_oldest(policy, mode, chunks, decode_blocks):
    """Only position 0 receives any attention: every other token scores exactly 0, so all evictions are ties.

    Queries and the key of position 0 point along the lowest RoPE frequency (it turns by at most ~0.05 rad over
    this run), so their logit is ~+250 while the zero keys give 0: exp(-250) is 0 in float32. Ties go to the
    oldest position, so the heavy-hitter slots must hold the newest candidates.
    """
    config = _config(2)
    n_heads, n_kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    total = sum(chunks) + sum(decode_blocks)
    arena = _arena(config, policy, mode, total)
    axis = torch.zeros(hd)
    axis[hd // 2 - 1] = 1.0  # the pair (hd/2 - 1, hd - 1) rotates slowest

    def rows(start, n_rows):
        q = (30.0 * axis).expand(n_heads, n_rows, hd).clone()
        k = torch.zeros(n_kv, n_rows, hd)
        if start == 0:
            k[:, 0] = 30.0 * axis
        v = torch.randn(n_kv, n_rows, hd)
        return [(q, k, v)] * config.num_hidden_layers

    def check(what):
        seen = arena.next_position
        fixed = set(range(min(policy.sinks, seen))) | {0}
        expected = fixed | set(range(max(seen - (policy.budget - len(fixed)), 0), seen))
        for layer in range(config.num_hidden_layers):
            for head in range(n_kv):
                kept = set(arena.buffer("positions")[layer, head, : arena.n_committed].tolist())
                assert kept == expected, f"{what}: keeps {sorted(kept)}, expected {sorted(expected)}"
                scores = arena.buffer("scores")[layer, head, : arena.n_committed]
                positions = arena.buffer("positions")[layer, head, : arena.n_committed]
                assert bool((scores[positions != 0] == 0).all()), "test setup: some token besides 0 got attention"

    at = 0
    for n_rows in chunks:
        _feed(arena, rows(at, n_rows), per_block=True)
        arena.commit(n_rows)
        at += n_rows
        check(f"after prefill chunk ending at {at}")
    for n_rows in decode_blocks:
        _feed(arena, rows(at, n_rows))
        arena.commit(n_rows)
        at += n_rows
        check(f"after decode block ending at {at}")
