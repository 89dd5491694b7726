"""The KV arena's memory: exactly the promised buffers, allocated once, never moved, and a flat process RSS."""

from __future__ import annotations

import copy
import gc

import psutil
import pytest
import torch

from sparsespec.cache.arena import NEVER, KVArena
from sparsespec.cache.policy import make_policy
from sparsespec.errors import UserError

from conftest import tiny_config, tiny_model

POLICIES = [("window", 24), ("streaming", 24), ("h2o", 24), ("hybrid", 24), ("full", None)]


def _buffers(arena: KVArena) -> dict[str, torch.Tensor]:
    names = ["keys", "values", "positions", "evicted_at"]
    if arena.policy.needs_scores:
        names += ["scores", "committed_scores", "row_scores"]
    return {name: arena.buffer(name) for name in names}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("max_block", "max_inflight"), [(1, 1), (8, 3), (2, 6)])
@pytest.mark.parametrize(("name", "budget"), POLICIES)
def test_buffers_have_the_promised_size(name, budget, max_block, max_inflight, dtype):
    config = tiny_config(num_hidden_layers=3, num_key_value_heads=2, head_dim=16)
    policy = make_policy(name, budget)
    max_tokens = 100
    arena = KVArena(config, policy, dtype=dtype, max_tokens=max_tokens, max_block=max_block, max_inflight=max_inflight)
    staging = max(max_block, max_inflight)
    capacity = (max_tokens if policy.is_full else budget) + staging
    n_layers, n_kv, hd = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    assert arena.capacity == capacity
    assert arena.buffer("keys").shape == (n_layers, n_kv, capacity, hd)
    assert arena.buffer("values").shape == (n_layers, n_kv, capacity, hd)
    assert arena.buffer("keys").dtype == arena.buffer("values").dtype == dtype
    itemsize = torch.tensor([], dtype=dtype).element_size()
    assert arena.nbytes == 2 * n_layers * n_kv * capacity * hd * itemsize
    # Bookkeeping per slot: int64 position + int32 eviction mark; with heavy hitters, float32 scores, the
    # committed copy, and one snapshot per in-flight row that a partial commit can end on.
    slots = n_layers * n_kv * capacity
    per_slot = 8 + 4 + ((2 + max_inflight - 1) * 4 if policy.needs_scores else 0)
    assert arena.metadata_nbytes == slots * per_slot
    for key, tensor in _buffers(arena).items():
        lead = (max_inflight - 1,) if key == "row_scores" else ()
        assert tensor.shape[: len(lead) + 3] == (*lead, n_layers, n_kv, capacity), key


@pytest.mark.parametrize("mode", ["original", "in-cache"])
@pytest.mark.parametrize(("name", "budget"), POLICIES)
def test_buffers_never_move(name, budget, mode):
    """Prefill chunks, decode steps and verification blocks with partial commits and rollbacks: same storage."""
    model = tiny_model(num_hidden_layers=1)
    chunk, max_inflight = 8, 4
    n_tokens = 1500
    arena = KVArena(
        model.config, make_policy(name, budget), dtype=torch.float32, max_tokens=n_tokens + 64, max_block=chunk,
        max_inflight=max_inflight, positions=mode,
    )
    buffers = _buffers(arena)
    pointers = {name: (t.data_ptr(), t.shape, t.stride()) for name, t in buffers.items()}
    gen = torch.Generator().manual_seed(0)
    stream = torch.randint(0, model.config.vocab_size, (n_tokens + 64,), generator=gen)

    def check(what):
        now = _buffers(arena)
        for key, t in now.items():
            assert (t.data_ptr(), t.shape, t.stride()) == pointers[key], f"{what}: {key} moved or changed shape"

    at = 0
    for _ in range(5):  # prompt: 5 prefill chunks
        model.forward(stream[at : at + chunk], arena, per_block=True)
        arena.commit(chunk)
        at += chunk
        check(f"prefill at {at}")
    step = 0
    while at < n_tokens:
        if step % 10 == 0:  # a verification block, partly accepted
            n_rows = 1 + step % max_inflight
            model.forward(stream[at : at + n_rows], arena)
            accept = (step // 10) % (n_rows + 1)
            arena.commit(accept)
            at += accept
        else:
            model.forward(stream[at : at + 1], arena)
            arena.commit(1)
            at += 1
        step += 1
        check(f"step {step}")
    if budget is not None:
        assert arena.n_committed == budget


@pytest.mark.parametrize("mode", ["original", "in-cache"])
def test_rss_stays_flat_over_20k_tokens(mode):
    """20 000 decode steps with a hybrid budget: process RSS after a 2 000-token warm-up grows by at most
    max(2 %, 4 MiB).

    Why that allowance: the KV memory is preallocated, so the only legitimate movement is allocator noise
    (glibc arenas, torch's CPU allocator and Python free lists hand memory back and forth by a few MiB). A leak of
    one KV row per token in this model (4 KV heads x 64 dims x K and V x 4 bytes = 2 KiB per token and layer)
    would add ~35 MiB over the 18 000 measured tokens, far outside the allowance.

    The RoPE rows grow with nothing either: the ``original`` mode makes each block's rows for its own positions,
    the ``in-cache`` mode keeps rows for the ranks its slots can take.
    """
    model = tiny_model(num_hidden_layers=1, hidden_size=64, num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    n_tokens, warmup = 20_000, 2_000
    arena = KVArena(model.config, make_policy("hybrid", 64), dtype=torch.float32, max_block=16, positions=mode)
    kv_pointer = arena.buffer("keys").data_ptr()
    gen = torch.Generator().manual_seed(0)
    stream = torch.randint(0, model.config.vocab_size, (n_tokens,), generator=gen).tolist()
    process = psutil.Process()

    prompt = stream[:32]
    for start in range(0, len(prompt), 16):
        model.forward(torch.tensor(prompt[start : start + 16]), arena, per_block=True)
        arena.commit(16)
    samples = []
    for i, token in enumerate(stream[32:], start=32):
        model.forward(torch.tensor([token]), arena)
        arena.commit(1)
        if i == warmup:
            gc.collect()
            baseline = process.memory_info().rss
        elif i > warmup and i % 2_000 == 0:
            samples.append(process.memory_info().rss)
    gc.collect()
    samples.append(process.memory_info().rss)

    assert arena.n_committed == 64 and arena.next_position == n_tokens
    assert arena.buffer("keys").data_ptr() == kv_pointer
    allowance = max(0.02 * baseline, 4 * 2**20)
    growth = max(samples) - baseline
    trace = ", ".join(f"{(s - baseline) / 2**20:+.2f}" for s in samples)
    assert growth <= allowance, f"RSS grew by {growth / 2**20:.2f} MiB (allowed {allowance / 2**20:.2f}); MiB: {trace}"


@pytest.mark.usefixtures("native_kernels")
def test_a_full_cache_that_grows_equals_one_sized_at_once(smollm2_default):
    """A full cache started small (``initial_tokens``) doubles as commits fill it, and a run through it, prefill,
    decode and speculation, equals the run through a cache of all ``max_tokens`` at once, bit for bit."""
    from sparsespec.generate import generate_tokens
    from sparsespec.sampling import SamplingParams
    from sparsespec.speculative import draft_inflight_rows, speculative_tokens, target_inflight_rows

    model = smollm2_default.model
    ids = smollm2_default.tokenizer.encode("The keeper of the lighthouse wrote in his log that the storm " * 4)
    greedy = dict(max_new_tokens=40, sampling=SamplingParams(), prefill_chunk=8)

    def arena(inflight: int, initial: int | None) -> KVArena:
        return KVArena(model.config, make_policy("full"), dtype=model.dtype, max_tokens=200, max_block=8,
                       max_inflight=inflight, initial_tokens=initial)

    sized = arena(1, None)
    expected = list(generate_tokens(model, sized, ids, **greedy))
    growing = arena(1, 16)
    start = growing.capacity
    assert list(generate_tokens(model, growing, ids, **greedy)) == expected
    assert start < growing.capacity < sized.capacity  # it grew, to less than the whole (len(ids) + 40 < 200)
    assert growing.nbytes < sized.nbytes and growing.n_committed == sized.n_committed
    target, draft = arena(target_inflight_rows(3), 16), arena(draft_inflight_rows(3), 16)
    assert list(speculative_tokens(model, target, model, draft, ids, gamma=3, **greedy)) == expected
    assert target.capacity > start


def test_a_full_cache_stops_growing_at_max_tokens():
    model = tiny_model()
    arena = KVArena(model.config, make_policy("full"), dtype=torch.float32, max_tokens=40, max_block=8,
                    initial_tokens=8)
    capacities = []
    for _ in range(6):
        model.forward(torch.arange(8), arena, per_block=True, last_only=True)
        arena.commit(8)
        capacities.append(arena.capacity)
    assert capacities == [16, 32, 32, 48, 48, 48]  # 8 + 8 staging, doubled when full, capped at 40 + 8
    with pytest.raises(UserError, match="The KV cache holds 48 tokens"):
        arena.begin(1)


# ------------------------------------------------------------------------------ the native arena's own memory
def _fed(kv_dtype: str = "int4", recall: bool = False, retention: bool = False) -> KVArena:
    """A budgeted arena after 40 tokens of a tiny model, its entries quantized, (``recall``) its evictions in a cold
    tier, and (``retention``) able to hold a prompt."""
    from sparsespec.cache.recall import Recall
    from sparsespec.cache.retention import Retention

    model = tiny_model(num_hidden_layers=2)
    arena = KVArena(model.config, make_policy("hybrid", 16, sinks=2), dtype=torch.float32, max_block=8,
                    max_inflight=4, positions="in-cache", kv_dtype=kv_dtype,
                    recall=Recall(2) if recall else None, retention=Retention() if retention else None)
    for at in range(0, 40, 8):
        model.forward(torch.arange(at, at + 8) % model.config.vocab_size, arena, per_block=True)
        arena.commit(8)
    return arena


def test_a_hold_grows_the_arena_keeping_the_committed_slots_and_old_views_keep_the_old_memory():
    arena = _fed(retention=True)
    n, steady = arena.n_committed, arena.capacity
    before = {name: t.clone() for name, t in arena.buffers().items()}
    old_keys = arena.buffer("keys")
    with arena.hold(steady + 5):  # more rows than the arena has slots: it grows to hold them all
        assert arena.capacity == n + steady + 5 and arena.peak_nbytes == arena.nbytes
        after = arena.buffers()
        for name in ("keys", "values", "key_params", "value_params", "positions", "scores", "committed_scores"):
            assert after[name].shape[2] == arena.capacity, name
            assert torch.equal(after[name][:, :, :n], before[name][:, :, :n]), name
        assert torch.equal(after["recent_keys"], before["recent_keys"])
        assert torch.equal(after["recent_values"], before["recent_values"])
        assert bool((after["evicted_at"] == NEVER).all())
        assert old_keys.data_ptr() != after["keys"].data_ptr()
        assert torch.equal(old_keys, before["keys"])  # the view still reads the memory it was made over
    # Left before its rows came: emptied, and back to its steady size (its peak remembered).
    assert (arena.capacity, arena.n_committed) == (steady, 0) and arena.peak_nbytes > arena.nbytes


def test_a_deep_copy_owns_its_memory_and_its_cold_tier():
    arena = _fed(recall=True)
    assert arena.cold.count > 0
    twin = copy.deepcopy(arena)
    assert twin.cold is not arena.cold and twin.cold.count == arena.cold.count
    for name, tensor in arena.buffers().items():
        other = twin.buffer(name)
        assert other.data_ptr() != tensor.data_ptr() and torch.equal(other, tensor), name
    twin.buffer("positions").fill_(-1)
    twin.reset()
    assert twin.cold.count == 0 and arena.cold.count > 0
    assert int(arena.buffer("positions").min()) >= 0


@pytest.mark.parametrize(("layout", "says"), [
    (dict(head_dim=7), "heads of an even size from 2 to 256, not 7"),
    (dict(capacity=0), "an arena of no slots"),
    (dict(code_bits=3, code_group=4), "codes of 8 or 4 bits"),
    (dict(code_bits=4, code_group=5), "quantization groups that divide"),
    (dict(recent_window=4, recent_slots=4), "a full-precision window needs quantized entries"),
    (dict(code_bits=4, code_group=8, recent_window=4, recent_slots=2), "a ring of at least its positions"),
    (dict(key_offset=torch.zeros(1, 2, 8)), "a key offset needs quantized keys"),
    (dict(code_bits=8, code_group=8, key_offset=torch.zeros(2, 2, 8)), "key_offset must be float32 \\[1, 2, 8\\]"),
    (dict(heavy=2), "heavy hitters needs scores"),
    (dict(row_score_rows=2), "score snapshots need scores"),
    (dict(capacity=-1), "sizes and counts from 0"),
    (dict(inv_freq=[1.0] * 3), "4 inverse frequencies, not 3"),
    (dict(attention_factor=0.0), "attention factor must be positive"),
    (dict(budget=15, staging=2), "a budget of 15 and a staging of 2 in 16 slots"),
    (dict(staging=0), "a staging of 0 rows"),
    (dict(pool=2, budget=8), "retention needs a budget and heavy-hitter scores"),
    (dict(inv_freq=[1.0, float("nan"), 1.0, 1.0]), "inverse frequencies must be finite"),
], ids=["odd-head", "no-slots", "3-bit", "group", "window-of-floats", "short-ring", "offset-of-floats",
        "offset-shape", "heavy-without-scores", "snapshots-without-scores", "negative", "rope-of-other-heads",
        "rope-factor-0", "budget-past-slots", "no-staging", "retention-without-scores", "rope-nan"])
def test_a_layout_the_arena_cannot_hold_is_refused(native_kernels, layout, says):
    from sparsespec import kernels

    args = dict(n_layers=1, n_kv=2, head_dim=8, capacity=16, inv_freq=[1.0] * 4) | layout
    with pytest.raises(RuntimeError, match=says):
        kernels.native_arena(**args)


def test_a_hold_the_arena_cannot_take_is_refused_and_changes_nothing():
    arena = _fed(retention=True)
    n, steady = arena.n_committed, arena.capacity
    for n_tokens, window, error, says in [(0, 1, RuntimeError, "a hold of 0 rows"),
                                          (4, 5, ValueError, "cannot end with an observation window of 5"),
                                          (2**31 - 1, 4, ValueError, "does not fit an arena")]:
        with pytest.raises(error, match=says):
            arena.handle.hold(n_tokens, window)
    with pytest.raises(ValueError, match="no hold is open"):
        arena.handle.release_hold()
    arena.begin(1)
    with pytest.raises(ValueError, match="a committed arena with no hold open"):
        arena.handle.hold(8, 4)
    arena.end()
    arena.rollback()
    arena.handle.hold(8, 4)
    with pytest.raises(ValueError, match="no hold open"):
        arena.handle.hold(8, 4)
    with pytest.raises(ValueError, match="a hold takes per-block chunks of its 8 remaining rows"):
        arena.begin(1)
    arena.handle.release_hold()
    assert (arena.capacity, arena.n_committed, arena.n_inflight) == (steady, 0, 0) and n > 0
