"""The native arena attention op (``kernels.arena_attention``) against the naive decoder, below the model, and what
the op alone does (threads, instruction sets, bitwise verification blocks, checked inputs).

The naive decoder of ``test_arena_reference.py`` is the op's one reference; there it runs beside whole models, here
beside arenas fed random rows through random operations (per-block prefill chunks, decode blocks with evictions
between rows, partial commits, rollbacks). The decoder reads every row after the arena has stored it, checks the
stored entries are its own (to the rounding of the arena's format), then runs its plain loops: after every block
each layer's outputs and heavy-hitter scores must match it to float32 rounding, and the positions the arena keeps
must be the decoder's, holding the same entries exactly; after every commit again. Inputs are bfloat16-representable,
so a bfloat16 arena stores exactly what it is given in the in-cache mode and the rounding of its rotation in the
original mode; the op widens every element to float32. int8 / int4 entries are checked through whole models in
``test_arena_reference.py``.
"""

from __future__ import annotations

import functools
import random
import zlib

import pytest
import torch

from sparsespec import kernels
from sparsespec.cache.arena import KVArena
from sparsespec.cache.policy import make_policy
from sparsespec.generate import generate_tokens
from sparsespec.sampling import SamplingParams
from sparsespec.speculative import SpeculativeStats, draft_inflight_rows, speculative_tokens, target_inflight_rows

from conftest import tiny_config
from test_arena_reference import NaiveDecoder, RecordedRows

# Skipped without the kernels, failed where they must build (conftest.py: native_kernels).
pytestmark = pytest.mark.usefixtures("native_kernels")

MAX_BLOCK = 5
MAX_INFLIGHT = 5
POLICIES = {
    "full": {},
    "window": dict(window=4),
    "streaming": dict(sinks=2, window=3),
    "h2o": dict(heavy=3, window=2),
    "hybrid": dict(sinks=1, heavy=3, window=2),
    "hybrid-age": dict(sinks=1, heavy=3, window=2),
    "hybrid-decay": dict(sinks=1, heavy=3, window=2),
}
ISAS = [isa for isa in (kernels.ISA_SCALAR, kernels.ISA_AVX2, kernels.ISA_AVX512) if kernels.isa_available(isa)]
NEVER = torch.iinfo(torch.int32).max


def _arena(config, name, mode, dtype, max_tokens, kv_dtype="auto", recent_window=0, **sizes):
    """``recent_window`` 0: quantized entries read from their codes alone (int4's default window of 32 would
    cover most of these short runs)."""
    policy = make_policy(name, **(sizes or POLICIES[name]))
    return KVArena(config, policy, dtype=dtype, max_tokens=max_tokens, max_block=MAX_BLOCK,
                   max_inflight=MAX_INFLIGHT, positions=mode, kv_dtype=kv_dtype, recent_window=recent_window)


def _rows(config, n_rows, gen, dtype):
    """Per layer ``(q, k, v)``: q float32, k and v in ``dtype``, all bfloat16-representable."""
    n_heads, n_kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    out = []
    for _ in range(config.num_hidden_layers):
        q = (1.5 * torch.randn(n_heads, n_rows, hd, generator=gen)).bfloat16().float()
        k = (1.5 * torch.randn(n_kv, n_rows, hd, generator=gen)).to(dtype)
        v = torch.randn(n_kv, n_rows, hd, generator=gen).to(dtype)
        out.append((q, k, v))
    return out


def _evictions(arena: KVArena) -> int:
    return int((arena.buffer("evicted_at") != NEVER).sum())


class Reference:
    """The naive decoder beside one arena, from the arena's next position on (``max_tokens`` more at most): it takes
    every block's rows after the arena, checks what the arena did with them, and follows the arena's commits."""

    def __init__(self, arena: KVArena, max_tokens: int):
        policy = arena.policy
        self.arena = arena
        self.naive = NaiveDecoder(arena.config, {}, sinks=policy.sinks, heavy=policy.heavy, window=policy.window,
                                  budget=policy.budget, mode=arena.positions_mode,
                                  max_tokens=arena.next_position + max_tokens, stored_rows=RecordedRows(arena),
                                  age=policy.age_normalised, decay=policy.score_decay)
        self.naive.length = arena.next_position
        self.committed = self.naive.snapshot()
        self.after_row = []  # the decoder's state after each in-flight row (None inside a prefill chunk)

    def block(self, rows, per_block: bool, what: str) -> tuple[list[torch.Tensor], int]:
        """Stage one block of ``rows`` (:func:`_rows`) in the arena, then in the decoder (a prefill chunk at once,
        other blocks row by row, each row an autoregressive step); compare. Returns the arena's outputs, layer by
        layer, and the evictions it made."""
        arena, naive = self.arena, self.naive
        n_rows = rows[0][0].shape[1]
        evicted_before = _evictions(arena)
        arena.begin(n_rows, per_block=per_block)
        outs = [arena.attend(layer, q, k, v) for layer, (q, k, v) in enumerate(rows)]
        arena.end()
        expected = [[] for _ in rows]
        for span in [slice(0, n_rows)] if per_block else [slice(i, i + 1) for i in range(n_rows)]:
            for layer, (q, k, v) in enumerate(rows):
                expected[layer].append(naive._attention(layer, q[:, span].transpose(0, 1),
                                                        k[:, span].float().transpose(0, 1),
                                                        v[:, span].float().transpose(0, 1), per_block))
            naive.length += span.stop - span.start
            self.after_row += [None] * (span.stop - span.start - 1) + [naive.snapshot()]
        for layer, out in enumerate(outs):
            torch.testing.assert_close(out, torch.cat(expected[layer]), rtol=1e-5, atol=1e-5,
                                       msg=f"{what}, layer {layer}: output")
        self.check(what)
        return outs, _evictions(arena) - evicted_before

    def commit(self, n_rows: int, what: str) -> None:
        """Commit the first ``n_rows`` in-flight rows in the arena and the decoder's state after them; compare."""
        self.arena.commit(n_rows)
        if n_rows:
            self.committed = self.after_row[n_rows - 1]
        self.naive.restore(self.committed)
        self.after_row = []
        self.check(f"{what}, after commit({n_rows})")

    def check(self, what: str) -> None:
        """In every layer and KV head, the arena's live entries (committed and in flight) are the decoder's kept
        positions, holding its entries exactly and its scores to float32 rounding."""
        arena, naive = self.arena, self.naive
        end = arena.n_committed + arena.n_inflight
        buffers = arena.buffers()
        for layer in range(arena.config.num_hidden_layers):
            for head in range(arena.config.num_key_value_heads):
                live = (buffers["evicted_at"][layer, head, :end] == NEVER).nonzero().flatten()
                positions = buffers["positions"][layer, head, live]
                order = positions.argsort()
                kept = naive.kept[layer, head].nonzero().flatten()
                where = f"{what}, layer {layer} head {head}"
                assert torch.equal(positions[order], kept), f"{where}: keeps {positions[order].tolist()}, " \
                                                            f"expected {kept.tolist()}"
                assert torch.equal(buffers["keys"][layer, head, live].float(), naive.k[layer, head, positions]), where
                assert torch.equal(buffers["values"][layer, head, live].float(), naive.v[layer, head, positions]), where
                if arena.policy.needs_scores:
                    torch.testing.assert_close(buffers["scores"][layer, head, live],
                                               naive.scores[layer, head, positions], rtol=1e-5, atol=1e-6,
                                               msg=f"{where}: scores")


def _run(config, name, mode, dtype, seed, n_ops=14, kv_dtype="auto"):
    """A random run against the naive decoder; returns (evictions between rows of one block, other evictions)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    total = n_ops * MAX_INFLIGHT + MAX_BLOCK
    ref = Reference(_arena(config, name, mode, dtype, total, kv_dtype), total)
    evictions = {"within": 0, "other": 0}
    for step in range(n_ops):
        if step == 0 or rng.random() < 0.3:  # a per-block prefill chunk, committed or rolled back
            rows = _rows(config, rng.randint(1, MAX_BLOCK), gen, dtype)
            evictions["other"] += ref.block(rows, True, f"step {step} (prefill)")[1]
            accept = 0 if rng.random() < 0.2 else ref.arena.n_inflight
        else:  # draft-like single rows and verification blocks, then a random partial commit
            left = MAX_INFLIGHT
            while left and rng.random() < 0.8:
                n_rows = rng.randint(1, left)
                left -= n_rows
                _, made = ref.block(_rows(config, n_rows, gen, dtype), False, f"step {step} (decode)")
                evictions["within" if n_rows > 1 else "other"] += made
            accept = rng.randint(0, ref.arena.n_inflight)
        ref.commit(accept, f"step {step}")
    return evictions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("mode", ["original", "in-cache"])
@pytest.mark.parametrize("name", list(POLICIES))
def test_native_attention_matches_the_naive_decoder(name, mode, dtype):
    config = tiny_config(num_attention_heads=6, num_key_value_heads=2, head_dim=32)
    evictions = _run(config, name, mode, dtype, seed=zlib.crc32(f"{name} {mode}".encode()))
    if name != "full":  # the run exercised what it claims to
        assert evictions["within"] > 0 and evictions["other"] > 0


@pytest.mark.parametrize("mode", ["original", "in-cache"])
def test_native_attention_reads_bf16_entries_of_a_float32_arena(mode):
    """``kv_dtype="bf16"`` under float32 compute: the op stores float32 rows rounded to bfloat16 and reads that
    store as it is, as the naive decoder does over the same entries."""
    config = tiny_config(num_attention_heads=6, num_key_value_heads=2, head_dim=32)
    evictions = _run(config, "hybrid", mode, torch.float32, seed=11, kv_dtype="bf16")
    assert evictions["within"] > 0 and evictions["other"] > 0


@pytest.mark.parametrize("mode", ["original", "in-cache"])
@pytest.mark.parametrize("name", ["hybrid", "streaming"])
def test_a_window_over_every_position_reads_as_the_unquantized_arena_bitwise(name, mode):
    """With every position in the window the op reads nothing from the codes: its outputs, scores and evictions
    are the float arena's, bit for bit; with no window they are not (the int4 codes are read)."""
    config = tiny_config(num_attention_heads=6, num_key_value_heads=2, head_dim=32)
    gen = torch.Generator().manual_seed(23)
    blocks = [_rows(config, n, gen, torch.float32) for n in (5, 5, 3, 1, 1, 4)]
    arenas = [_arena(config, name, mode, torch.float32, 64, kv, recent_window=w)
              for kv, w in (("auto", 0), ("int4", 64), ("int4", 0))]
    outs = [[], [], []]
    for rows in blocks:
        for arena, out in zip(arenas, outs):
            arena.begin(rows[0][0].shape[1], per_block=True)
            out.extend(arena.attend(layer, q, k, v) for layer, (q, k, v) in enumerate(rows))
            arena.end()
            arena.commit(arena.n_inflight)
    (plain, out_plain), (windowed, out_windowed), (_, out_codes) = zip(arenas, outs)
    assert all(torch.equal(a, b) for a, b in zip(out_plain, out_windowed))
    assert not all(torch.equal(a, b) for a, b in zip(out_plain, out_codes))
    assert torch.equal(plain.buffer("evicted_at"), windowed.buffer("evicted_at")) and plain.evicted_tokens > 0
    if plain.policy.needs_scores:
        assert torch.equal(plain.buffer("scores"), windowed.buffer("scores"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_far_positions_match_the_naive_decoder(dtype):
    """True positions far into a run: the arena makes RoPE rows for each block's positions alone (a table offset)
    and must store and attend as the naive decoder, whose tables reach every position."""
    config = tiny_config(num_attention_heads=6, num_key_value_heads=2, head_dim=32)
    arena = _arena(config, "hybrid", "original", dtype, 64)
    start = 40_000
    arena.handle.assume(0, start)
    ref = Reference(arena, 64)
    gen = torch.Generator().manual_seed(5)
    for step in range(4):
        ref.block(_rows(config, 3, gen, dtype), False, f"block {step}")
        ref.commit(3, f"block {step}")
    assert arena.next_position == start + 12 and arena.evicted_tokens > 0


@pytest.mark.parametrize("kv_dtype", ["auto", "bf16", "int8", "int4"])
@pytest.mark.parametrize("name", ["hybrid", "hybrid-age", "hybrid-decay"])
def test_arenas_attend_through_the_native_op_for_every_kv_dtype_and_ranking(monkeypatch, kv_dtype, name):
    """An arena of any KV dtype and either heavy-hitter ranking calls the op once per layer and block (the tests
    against the naive decoder prove what it computes)."""
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    real = kernels.arena_attention
    monkeypatch.setattr(kernels, "arena_attention", counting)
    config = tiny_config(num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    arena = KVArena(config, make_policy(name, sinks=1, heavy=3, window=2), dtype=torch.float32,
                    max_block=MAX_BLOCK, max_inflight=MAX_INFLIGHT, kv_dtype=kv_dtype)
    gen = torch.Generator().manual_seed(2)
    for n_rows in (MAX_BLOCK, 1, 3):
        arena.begin(n_rows)
        for layer, (q, k, v) in enumerate(_rows(config, n_rows, gen, torch.float32)):
            assert arena.attend(layer, q, k, v).shape == (n_rows, 4 * 32)
        arena.end()
        arena.commit(n_rows)
    assert len(calls) == 3 * config.num_hidden_layers
    assert arena.evicted_tokens > 0


@pytest.mark.parametrize("isa", ISAS, ids=[kernels.isa_name(i) for i in ISAS])
@pytest.mark.parametrize("name,mode", [("hybrid", "in-cache"), ("h2o", "original"), ("streaming", "in-cache")])
def test_every_instruction_set_matches_the_naive_decoder(monkeypatch, isa, name, mode):
    monkeypatch.setattr(kernels, "arena_attention", functools.partial(kernels.arena_attention, isa=isa))
    config = tiny_config(num_attention_heads=4, num_key_value_heads=2, head_dim=40)  # 40: vector body + tail
    _run(config, name, mode, torch.bfloat16, seed=7, n_ops=8)


@pytest.mark.parametrize("mode", ["original", "in-cache"])
@pytest.mark.parametrize(("name", "kv_dtype", "recent_window"),
                         [(name, "auto", 0) for name in POLICIES] + [("hybrid", "int8", 0), ("hybrid", "int4", 0),
                                                                    ("hybrid", "int4", 3)])
@pytest.mark.parametrize("accepted", [MAX_INFLIGHT, 2])
def test_verification_block_equals_autoregressive_steps_bitwise(name, mode, kv_dtype, recent_window, accepted):
    """A verification block's rows compute exactly what one-row steps, each committed, compute: the same output
    bits, and after committing ``accepted`` rows the same arena, slot for slot (the layout, so the order in which
    later rows add their terms). With a full-precision window a block row reads its block's rows where a step
    reads the ring."""
    config = tiny_config(num_attention_heads=6, num_key_value_heads=2, head_dim=32)
    gen = torch.Generator().manual_seed(3)
    prompt = _rows(config, MAX_BLOCK, gen, torch.bfloat16)
    block = _rows(config, MAX_INFLIGHT, gen, torch.bfloat16)
    arenas = [_arena(config, name, mode, torch.bfloat16, 64, kv_dtype, recent_window=recent_window)
              for _ in range(2)]
    for arena in arenas:
        for _ in range(3):
            arena.begin(MAX_BLOCK, per_block=True)
            for layer, (q, k, v) in enumerate(prompt):
                arena.attend(layer, q, k, v)
            arena.end()
            arena.commit(MAX_BLOCK)
    whole, steps = arenas
    whole.begin(MAX_INFLIGHT)
    outs_whole = [whole.attend(layer, q, k, v) for layer, (q, k, v) in enumerate(block)]
    whole.end()
    evicted_in_block = int((whole.buffer("evicted_at")[..., :whole.n_committed + accepted] < accepted).sum())
    whole.commit(accepted)
    outs_steps = [[] for _ in block]
    for i in range(MAX_INFLIGHT):
        steps.begin(1)
        for layer, (q, k, v) in enumerate(block):
            outs_steps[layer].append(steps.attend(layer, q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1]))
        steps.end()
        steps.commit(1)
        if i + 1 == accepted:
            assert whole.n_committed == steps.n_committed
            n = steps.n_committed
            for field in ("keys", "values", "positions") + (("scores",) if steps.policy.needs_scores else ()):
                assert torch.equal(whole.buffer(field)[:, :, :n], steps.buffer(field)[:, :, :n]), field
    for layer in range(config.num_hidden_layers):
        assert torch.equal(outs_whole[layer], torch.cat(outs_steps[layer])), f"layer {layer}: outputs"
    # The block evicted, so its accepted rows had to be placed where the steps put theirs.
    assert name == "full" or evicted_in_block > 0


@pytest.mark.parametrize("name,mode", [("full", "original"), ("hybrid", "in-cache")])
def test_long_cache_spans_chunks_and_threads(name, mode):
    """Hundreds of slots (several of the op's 256-slot chunks): as the naive decoder, and bitwise the same with one
    or two threads."""
    config = tiny_config(num_attention_heads=6, num_key_value_heads=2, head_dim=64)
    sizes = dict(sinks=4, heavy=300, window=300) if name == "hybrid" else {}
    gen = torch.Generator().manual_seed(5)
    chunk = 64
    results = []
    for threads in (1, 2):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            arena = KVArena(config, make_policy(name, **sizes), dtype=torch.bfloat16, max_tokens=800,
                            max_block=chunk, max_inflight=MAX_INFLIGHT, positions=mode)
            ref = Reference(arena, 800)
            gen.manual_seed(5)
            for step in range(11):
                ref.block(_rows(config, chunk, gen, torch.bfloat16), True, f"chunk {step}")
                ref.commit(chunk, f"chunk {step}")
            outs = []
            for step in range(3):
                outs += ref.block(_rows(config, 3, gen, torch.bfloat16), False, f"block {step}")[0]
                ref.commit(3, f"block {step}")
            results.append((outs, arena.buffer("evicted_at").clone(), arena.n_committed))
        finally:
            torch.set_num_threads(previous)
    assert results[0][2] > 2 * 256  # the cache spans three chunks
    for a, b in zip(results[0][0], results[1][0]):
        assert torch.equal(a, b)
    assert torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("mode", ["original", "in-cache"])
def test_smollm2_greedy_speculative_equals_autoregressive_on_the_native_op(smollm2_f32, mode):
    """SmolLM2 (float32) drafting for itself through a smaller cache: verification blocks evict between rows."""
    model, tokenizer = smollm2_f32.model, smollm2_f32.tokenizer
    ids = tokenizer.encode("The keeper of the lighthouse wrote in his log every night, and")
    target_policy, draft_policy = make_policy("hybrid", 24, sinks=2), make_policy("hybrid", 12, sinks=2)

    def arena(policy, inflight):
        return KVArena(model.config, policy, dtype=model.dtype, max_block=8, max_inflight=inflight, positions=mode)

    greedy = SamplingParams()
    expected = list(generate_tokens(model, arena(target_policy, 1), ids, max_new_tokens=32, sampling=greedy,
                                    prefill_chunk=8))
    stats = SpeculativeStats()
    target_cache = arena(target_policy, target_inflight_rows(4))
    got = list(speculative_tokens(model, target_cache, model,
                                  arena(draft_policy, draft_inflight_rows(4)), ids, max_new_tokens=32,
                                  sampling=greedy, gamma=4, prefill_chunk=8, stats=stats))
    assert got == expected
    assert 0 < stats.accepted < stats.drafted  # verification both accepted and rejected proposals
    assert target_cache.evicted_tokens > 16  # the target's cache evicted throughout


@pytest.mark.parametrize("n_kv", [2, 4])
def test_threads_on_different_heads_and_rows_keep_apart(n_kv):
    """Two threads each taking whole KV heads through long prefill blocks whose rows cross the op's 256-slot
    chunks: a head running ahead of another, at a row with more chunks, must not touch the other's buffers.
    Every block is compared with the naive decoder."""
    config = tiny_config(num_attention_heads=2 * n_kv, num_key_value_heads=n_kv, head_dim=16)
    sizes = dict(sinks=4, heavy=300, window=300)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        arena = KVArena(config, make_policy("hybrid", **sizes), dtype=torch.bfloat16, max_tokens=1400, max_block=200,
                        max_inflight=MAX_INFLIGHT, positions="in-cache")
        ref = Reference(arena, 1400)
        gen = torch.Generator().manual_seed(41)
        for step in range(7):
            _, evicted = ref.block(_rows(config, 200, gen, torch.bfloat16), True, f"block {step}")
            ref.commit(200, f"block {step}")
    finally:
        torch.set_num_threads(previous)
    assert evicted > 0 and arena.n_committed > 2 * 256


@pytest.mark.parametrize("name,mode", [("hybrid", "in-cache"), ("h2o", "original")])
def test_two_kv_heads_on_three_threads_run_by_chunks_match_the_naive_decoder(name, mode):
    """Qwen's 2 KV heads on 3 threads: the heads do not share the threads evenly and there are more threads than
    heads, so the op spreads every step over (head, chunk) items, the threads meeting after each
    (``csrc/attention.cpp``'s by-chunks schedule). Random blocks against the naive decoder, then prefill blocks
    across several 256-slot chunks and verification blocks evicting between rows, against it too; the arena ends
    bit for bit as one thread (by whole heads) leaves it."""
    config = tiny_config(num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    sizes = dict(sinks=4, heavy=300, window=300) if name == "hybrid" else dict(heavy=300, window=300)
    states = []
    previous = torch.get_num_threads()
    for threads in (3, 1):
        torch.set_num_threads(threads)
        try:
            if threads == 3:
                evictions = _run(config, name, mode, torch.bfloat16, seed=zlib.crc32(f"chunks {name}".encode()))
                assert evictions["within"] > 0 and evictions["other"] > 0
            arena = KVArena(config, make_policy(name, **sizes), dtype=torch.bfloat16, max_tokens=800, max_block=64,
                            max_inflight=MAX_INFLIGHT, positions=mode)
            ref = Reference(arena, 800)
            gen = torch.Generator().manual_seed(9)
            for step in range(11):
                ref.block(_rows(config, 64, gen, torch.bfloat16), True, f"chunk {step}")
                ref.commit(64, f"chunk {step}")
            within = 0
            for step in range(3):
                within += ref.block(_rows(config, 3, gen, torch.bfloat16), False, f"block {step}")[1]
                ref.commit(3, f"block {step}")
        finally:
            torch.set_num_threads(previous)
        assert arena.n_committed > 2 * 256 and within > 0
        states.append(tuple(arena.buffer(name).clone() for name in ("keys", "evicted_at", "scores")))
    for by_chunks, by_heads in zip(*states):
        assert torch.equal(by_chunks, by_heads)


def _op_args(n_kv=2, group=2, head_dim=8, committed=8, n_rows=2, code_bits=0, recent_window=0, **overrides):
    """The arena, block and rows of a valid :func:`kernels.arena_attention` call (:func:`_attend` makes it): a
    one-layer arena whose first ``committed`` slots hold positions 0, 1, ... (alive, random scores), ``n_rows`` rows
    entering after them in the in-cache mode with a hybrid policy whose budget makes every row evict; ``overrides``
    replace any of them. With ``code_bits``, one group of codes per head vector. What the block's rows do is the
    arena's ledger's to decide (``csrc/ledger.h``), from these counts."""
    gen = torch.Generator().manual_seed(0)
    cap = committed + n_rows + 2
    args = dict(
        q=torch.randn(n_kv * group, n_rows, head_dim, generator=gen),
        k=torch.randn(n_kv, n_rows, head_dim, generator=gen), v=torch.randn(n_kv, n_rows, head_dim, generator=gen),
        capacity=cap, positions=torch.arange(cap).repeat(1, n_kv, 1),
        evicted_at=torch.full((1, n_kv, cap), NEVER, dtype=torch.int32),
        scores=torch.rand(1, n_kv, cap, generator=gen), in_cache=True, layer=0, committed=committed,
        budget=committed - 2, sinks=1, heavy=3, window=1, scale=0.35, code_bits=code_bits, recent_window=recent_window,
    )
    args.update(overrides)
    return args


def _attend(args: dict) -> tuple[torch.Tensor, object]:
    """:func:`kernels.arena_attention` on :func:`_op_args`: the native arena (checked as it is made) with the
    contents ``args`` give, then the block's pass over layer ``layer``; the output and the arena as it left it."""
    a = dict(args)
    head_dim, code_bits, recent_window = a["q"].shape[-1], a.pop("code_bits"), a.pop("recent_window")
    arena = kernels.native_arena(
        n_layers=1, n_kv=a["k"].shape[0], head_dim=head_dim, capacity=a.pop("capacity"), code_bits=code_bits,
        code_group=head_dim if code_bits else 0, scores=True, recent_window=recent_window,
        recent_slots=recent_window, sinks=a.pop("sinks"), heavy=a.pop("heavy"), window=a.pop("window"),
        age_normalised=a.pop("age_normalised", False), scale=a.pop("scale"),
        inv_freq=[0.0] * (head_dim // 2),  # RoPE that rotates nothing
        budget=a.pop("budget"), staging=a["q"].shape[1], in_cache=a.pop("in_cache"))
    for name in ("positions", "evicted_at", "scores"):
        arena.buffer(name).copy_(a.pop(name))
    committed = a.pop("committed")
    arena.assume(committed, committed)
    arena.begin(a["q"].shape[1], False, None)
    return kernels.arena_attention(arena, a.pop("layer"), a.pop("q"), a.pop("k"), a.pop("v")), arena


def test_the_checks_pass_the_valid_calls_the_tests_below_break():
    out, arena = _attend(_op_args())
    assert out.shape == (2, 4 * 8) and torch.isfinite(out).all()
    assert set(arena.buffer("evicted_at").unique().tolist()) == {0, 1, NEVER}  # both rows evicted
    windowed, _ = _attend(_op_args(committed=4, code_bits=4, recent_window=8, in_cache=False))
    assert torch.isfinite(windowed).all()


@pytest.mark.parametrize(("args", "says"), [
    (lambda: _op_args(n_kv=0), "no KV heads"),  # q.size(0) % n_kv: a division by zero
    (lambda: _op_args(group=0), "0 query heads for 2 KV heads"),
    (lambda: _op_args(head_dim=0), "heads of an even size from 2 to 256, not 0"),
], ids=["no-kv-heads", "no-query-heads", "head-dim-0"])
def test_integers_the_op_would_misuse_are_errors(args, says):
    with pytest.raises(RuntimeError, match=says):
        _attend(args())


@pytest.mark.parametrize("position", [-1, 100])
@pytest.mark.parametrize("reader", ["ranks", "window"])
def test_a_slot_outside_the_rows_positions_is_an_error(reader, position):
    """A committed slot whose position is negative or above the attending row's: the in-cache ranks would set a
    bit outside their bitmap, the full-precision window read outside its ring or block."""
    if reader == "ranks":
        args = _op_args()
    else:  # original positions, int4 codes with a window of 8 positions (row 0 at position 4 reads from -3 up)
        args = _op_args(committed=4, code_bits=4, recent_window=8, in_cache=False)
    args["positions"][0, 1, 2] = position
    with pytest.raises(RuntimeError, match=f"slot 2 of KV head 1 holds position {position}, outside"):
        _attend(args)


@pytest.mark.parametrize("age_normalised", [False, True])
def test_a_nan_heavy_hitter_score_is_an_error(age_normalised):
    """NaN breaks the order the eviction's nth_element needs (undefined behaviour); the op says so instead."""
    args = _op_args(age_normalised=age_normalised)
    args["scores"][0, 0, 3] = float("nan")
    with pytest.raises(RuntimeError, match="score of slot 3 of KV head 0 is NaN"):
        _attend(args)


def test_a_commit_the_arena_cannot_make_is_refused_and_changes_nothing():
    """The native arena checks a commit against its own counts (rows in flight, an open block, a partial commit of a
    prefill chunk) before it touches memory, and a KV head whose entries disagree with the count (its eviction marks
    written through a view) instead of compacting past its buffers."""
    config = tiny_config()
    policy = make_policy("hybrid", 3, sinks=1, heavy=1)
    arena = KVArena(config, policy, dtype=torch.float32, max_block=4, max_inflight=3)
    gen = torch.Generator().manual_seed(0)

    def block(n_rows, per_block=False):
        arena.begin(n_rows, per_block)
        for layer, (q, k, v) in enumerate(_rows(config, n_rows, gen, torch.float32)):
            arena.attend(layer, q, k, v)

    with pytest.raises(ValueError, match="cannot commit 3 of 0 in-flight rows"):
        arena.commit(3)
    block(4, per_block=True)
    with pytest.raises(ValueError, match="commit inside an open block"):
        arena.commit(4)
    arena.end()
    with pytest.raises(ValueError, match="only the first max_inflight rows"):
        arena.commit(2)
    assert (arena.n_committed, arena.n_inflight) == (0, 4)
    arena.commit(4)
    assert arena.n_committed == 3 and arena.evicted_tokens == 1
    block(2)
    arena.end()
    alive = (arena.buffer("evicted_at")[0, 1, :5] == NEVER).nonzero().flatten()
    arena.buffer("evicted_at")[0, 1, alive[0]] = 0  # KV head 1 of layer 0 now says row 0 evicted one more
    with pytest.raises(RuntimeError, match="keeps another number of entries than"):
        arena.commit(2)
