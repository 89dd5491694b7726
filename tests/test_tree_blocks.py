"""Tree-shaped blocks (``KVArena.begin(parents=...)``, ``KVArena.commit_path``): the base of tree speculation.

Every row of a tree block must compute what the autoregressive step along its own path computes, bit for bit (its
logits, through the attention op and through the native pass), and committing any root-to-row path must leave the
arena exactly as those one-row steps leave it (entries, positions, scores, what was evicted), for every policy and
both position modes. The one-row steps are themselves checked against the naive decoder of
``test_arena_reference.py``; here random trees and random accepted paths are checked against them.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from sparsespec.cache import KVArena, make_policy

from conftest import tiny_config

# Skipped without the kernels, failed where they must build (conftest.py: native_kernels).
pytestmark = pytest.mark.usefixtures("native_kernels")

POLICIES = {
    "full": {}, "window": dict(budget=10), "streaming": dict(budget=10, sinks=2), "h2o": dict(budget=10, heavy=5),
    "hybrid": dict(budget=10, sinks=2, heavy=4), "hybrid-age": dict(budget=10, sinks=2, heavy=4),
    "hybrid-decay": dict(budget=10, sinks=2, heavy=4),
}
TREE_ROWS = 7


def _policy(name):
    spec = dict(POLICIES[name])
    return make_policy(name, spec.pop("budget", None), **spec)


def _random_tree(n_rows: int, rng: random.Random) -> list[int]:
    """Parents of ``n_rows`` rows: row 0 a root, each later row under a random earlier row or a root itself."""
    return [-1] + [rng.randrange(-1, i) for i in range(1, n_rows)]


def _path(parents: list[int], row: int) -> list[int]:
    path = []
    while row >= 0:
        path.append(row)
        row = parents[row]
    return path[::-1]


def _rows(config, n_rows, gen):
    """Per layer ``(q, k, v)`` of ``n_rows`` new rows, bfloat16-representable float32."""
    n_heads, n_kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    return [tuple((1.5 * torch.randn(heads, n_rows, hd, generator=gen)).bfloat16().float()
                  for heads in (n_heads, n_kv, n_kv)) for _ in range(config.num_hidden_layers)]


def _attend(arena: KVArena, rows, picked=None, **block) -> list[torch.Tensor]:
    """One block through every layer of ``arena`` (the rows ``picked`` of ``rows``, or all): the outputs per layer."""
    n_rows = rows[0][0].shape[1] if picked is None else len(picked)
    arena.begin(n_rows, **block)
    outs = []
    for layer, (q, k, v) in enumerate(rows):
        if picked is not None:
            q, k, v = (t[:, picked] for t in (q, k, v))
        outs.append(arena.attend(layer, q, k, v))
    arena.end()
    return outs


def _prepared(config, name, mode, gen, dtype=torch.float32):
    """An arena that has read a prompt and three one-row steps: a budgeted policy is evicting."""
    arena = KVArena(config, _policy(name), dtype=dtype, max_tokens=64, max_block=8, max_inflight=TREE_ROWS + 1,
                    positions=mode)
    for n_rows in (8, 5):
        _attend(arena, _rows(config, n_rows, gen), per_block=True)
        arena.commit(n_rows)
    for _ in range(3):
        _attend(arena, _rows(config, 1, gen))
        arena.commit(1)
    return arena


def _steps(arena: KVArena, rows, path: list[int]) -> list[torch.Tensor]:
    """The rows ``path`` of ``rows`` as one-row steps, each committed: each layer's output of the last step."""
    for row in path:
        outs = _attend(arena, rows, [row])
        arena.commit(1)
    return outs


def _assert_same_arena(got: KVArena, want: KVArena, what: str) -> None:
    n = want.n_committed
    assert (got.n_committed, got.next_position, got.evicted_tokens) == \
        (want.n_committed, want.next_position, want.evicted_tokens), what
    for field in ("positions", "keys", "values", "evicted_at") + \
            (("scores", "committed_scores") if want.policy.needs_scores else ()):
        assert torch.equal(got.buffer(field)[:, :, :n], want.buffer(field)[:, :, :n]), f"{what}: {field}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("mode", ["original", "in-cache"])
@pytest.mark.parametrize("name", list(POLICIES))
def test_every_tree_row_and_committed_path_equals_the_steps_along_it(name, mode, dtype):
    """Random trees over an evicting arena: each row's output in every layer equals the last of the one-row steps
    along its path, bit for bit; committing a random row's path leaves the arena as those steps leave it, and the
    step after it computes what the step after them computes."""
    config = tiny_config(num_attention_heads=6, num_key_value_heads=2, head_dim=32)
    gen = torch.Generator().manual_seed(7)
    rng = random.Random(f"{name}-{mode}")
    evicted_on_paths = 0
    for trial in range(4):
        arena = _prepared(config, name, mode, gen, dtype)
        before = copy.deepcopy(arena)
        parents = _random_tree(TREE_ROWS, rng)
        rows = _rows(config, TREE_ROWS, gen)
        outs = _attend(arena, rows, parents=parents)
        chains = []
        for row in range(TREE_ROWS):
            chain = copy.deepcopy(before)
            want = _steps(chain, rows, _path(parents, row))
            for layer, (got_layer, want_layer) in enumerate(zip(outs, want)):
                assert torch.equal(got_layer[row], want_layer[0]), f"trial {trial}, parents {parents}: row {row}, " \
                                                                    f"layer {layer}"
            evicted_on_paths += chain.evicted_tokens > before.evicted_tokens
            chains.append(chain)
        row = rng.randrange(TREE_ROWS)
        arena.commit_path(_path(parents, row))
        _assert_same_arena(arena, chains[row], f"trial {trial}, parents {parents}, path to row {row}")
        after = _rows(config, 1, gen)
        for got_layer, want_layer in zip(_steps(arena, after, [0]), _steps(chains[row], after, [0])):
            assert torch.equal(got_layer, want_layer), f"trial {trial}: the step after the path"
    assert (evicted_on_paths > 0) == (name != "full")  # the budgeted policies evicted along the paths


@pytest.mark.parametrize("name", ["hybrid", "full"])
def test_a_rolled_back_tree_leaves_the_arena_as_it_was(name):
    config = tiny_config()
    gen = torch.Generator().manual_seed(1)
    arena = _prepared(config, name, "original", gen)
    before = copy.deepcopy(arena)
    _attend(arena, _rows(config, TREE_ROWS, gen), parents=_random_tree(TREE_ROWS, random.Random(name)))
    arena.rollback()
    _assert_same_arena(arena, before, "after the rollback")
    after = _rows(config, 2, gen)
    for got_layer, want_layer in zip(_steps(arena, after, [0, 1]), _steps(before, after, [0, 1])):
        assert torch.equal(got_layer, want_layer)


@pytest.mark.parametrize("mode", ["original", "in-cache"])
def test_tree_rows_through_the_native_pass_equal_the_steps_along_them(smollm2_default, mode):
    """SmolLM2's native weights (a pass is one native call; its rows never depend on one another), a hybrid
    budget: each tree row's logits equal the last step's along its path, bit for bit, and so does the arena after
    the path is committed."""
    model = smollm2_default.model
    ids = smollm2_default.tokenizer.encode("The keeper of the lighthouse wrote in his log that the storm")
    arena = KVArena(model.config, make_policy("hybrid", 12, sinks=2, heavy=5), dtype=model.dtype, max_tokens=64,
                    max_block=8, max_inflight=TREE_ROWS + 1, positions=mode)
    for start in range(0, len(ids), 8):
        model.forward(torch.tensor(ids[start : start + 8]), arena, per_block=True, last_only=True)
        arena.commit(len(ids[start : start + 8]))
    before = copy.deepcopy(arena)
    parents = [-1, 0, 0, 1, 1, 2, -1]
    tokens = [11, 22, 33, 44, 55, 66, 77]
    logits = model.forward(torch.tensor(tokens), arena, parents=parents)
    chains = []
    for row in range(len(parents)):
        chains.append(copy.deepcopy(before))
        for token in (tokens[r] for r in _path(parents, row)):
            want = model.forward(torch.tensor([token]), chains[-1])
            chains[-1].commit(1)
        assert torch.equal(logits[row], want[0]), f"row {row}"
    arena.commit_path([0, 2, 5])
    _assert_same_arena(arena, chains[5], "path to row 5")
    assert arena.evicted_tokens > before.evicted_tokens


@pytest.mark.parametrize(("parents", "says"), [
    ([0, -1], "an earlier row or -1"),
    ([-1, 1], "an earlier row or -1"),
    ([-1], "an earlier row or -1"),  # one parent for two rows
], ids=["self-parent-of-root", "own-parent", "too-few"])
def test_a_tree_that_is_not_one_is_refused(parents, says):
    config = tiny_config()
    arena = _prepared(config, "hybrid", "original", torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=says):
        arena.begin(2, parents=parents)


def test_only_a_path_of_the_tree_is_committed():
    config = tiny_config()
    gen = torch.Generator().manual_seed(1)
    arena = _prepared(config, "hybrid", "original", gen)
    _attend(arena, _rows(config, 4, gen), parents=[-1, 0, 0, 1])
    for path in ([1], [0, 2, 3], [0, 3], [], [0, 9]):
        with pytest.raises(ValueError, match="not a path"):
            arena.commit_path(path)
    with pytest.raises(ValueError, match="commits a path"):
        arena.commit(2)
    with pytest.raises(ValueError, match="tree block is in flight"):
        arena.begin(1)
    arena.commit_path([0, 1, 3])
    assert arena.n_inflight == 0 and arena.next_position == 16 + 3


def test_the_native_code_refuses_a_tree_it_cannot_run():
    """Parents that are not a tree and paths off the tree's rows, given to the native arena directly: its ledger
    refuses them before any memory is touched."""
    from sparsespec import kernels

    cfg = tiny_config()
    arena = _prepared(cfg, "hybrid", "original", torch.Generator().manual_seed(2))
    q = torch.randn(cfg.num_attention_heads, 2, cfg.head_dim)
    k = torch.randn(cfg.num_key_value_heads, 2, cfg.head_dim)
    for parents in ([-1, 1], [-1], [0, -1], [-1, 5]):  # row 1 its own parent, too few, a later row, outside
        with pytest.raises(ValueError, match="parents name, for each of its 2 rows, an earlier row or -1"):
            arena.handle.begin(2, False, parents)
    arena.handle.begin(2, False, [-1, 0])
    kernels.arena_attention(arena.handle, 0, q, k, k)
    arena.handle.end()
    for path in ([1, 0], [1], [], [0, 7], [-3]):
        with pytest.raises(ValueError, match="is not a path from a root of the tree block"):
            arena.handle.commit_path(path)
