"""Gemma 3: embeddings scaled by √hidden, q/k norms, norms after attention and after the MLP, a GELU(tanh)-gated MLP,
RMSNorm weights stored as ``1 + w``, and sliding-window layers (every sixth layer global) with their own RoPE base,
whose arena keeps exactly their window (``cache/layered.py``).

A tiny random model is written as a GGUF file laid out as llama.cpp's converter writes Gemma 3 and read back, and
saved by transformers as a Hugging Face folder and read back: against transformers on the same weights over more
tokens than the window, native against dense, speculative against autoregressive over evicting caches; the real
Gemma 3 270M file (when fetched) against transformers' own reading of it.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import transformers

from conftest import random_state, tiny_config, write_gguf_model
from sparsespec.cache import make_policy
from sparsespec.cache.layered import LayeredArena
from sparsespec.config import GLOBAL, SLIDING, ModelConfig
from sparsespec.engine import CacheOptions, make_arena
from sparsespec.errors import UserError
from sparsespec.generate import generate_tokens
from sparsespec.loading.fixtures import MODEL_FIXTURES
from sparsespec.loading.load import load_model
from sparsespec.sampling import SamplingParams
from sparsespec.speculative import SpeculativeStats, draft_inflight_rows, speculative_tokens, target_inflight_rows

WINDOW = 5
CONFIG = tiny_config(
    "gemma3", num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
    tie_word_embeddings=True, layer_types=tuple(GLOBAL if i == 5 else SLIDING for i in range(6)),
    sliding_window=WINDOW, local_rope_theta=10000.0, rope_theta=1000000.0)
STATE = random_state(CONFIG, seed=11, scale=1.0)
# Decoding tests read an untied head: a random tied one repeats the last token (its own embedding dominates).
UNTIED = replace(CONFIG, tie_word_embeddings=False)
UNTIED_STATE = random_state(UNTIED, seed=3, scale=1.0)
REL_TOL = 1e-4


def transformers_model(config: ModelConfig, state: dict[str, torch.Tensor], window: int = WINDOW):
    """transformers' Gemma 3 on the same weights (its norms hold ``w``, ours ``1 + w``)."""
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings, query_pre_attn_scalar=config.head_dim,
        sliding_window=window, layer_types=list(config.layer_types), tie_word_embeddings=True,
        rope_parameters={GLOBAL: dict(rope_type="default", rope_theta=config.rope_theta),
                         SLIDING: dict(rope_type="default", rope_theta=config.local_rope_theta)},
        attn_implementation="eager", pad_token_id=None, bos_token_id=None, eos_token_id=None))
    model = model.float().eval()
    hf_state = {name: t - 1 if name.endswith("norm.weight") else t for name, t in state.items()}
    result = model.load_state_dict(hf_state, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    return model


def tokens(n: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def load(path, dtype=torch.float32, weights="dense"):
    return load_model(str(path), dtype, weights, tokenizer=False, weight_store=False)


def arena(loaded, policy="full", budget=None, rows=1, block=8, positions="original", max_tokens=256, **options):
    cache = CacheOptions(policy=make_policy(policy, budget, **options), positions=positions, prefill_chunk=block)
    return make_arena(loaded, cache, max_tokens=max_tokens, max_inflight=rows)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return write_gguf_model(tmp_path_factory.mktemp("gemma3") / "gemma3.gguf", CONFIG, STATE)


@pytest.fixture(scope="module")
def untied_path(tmp_path_factory):
    return write_gguf_model(tmp_path_factory.mktemp("gemma3") / "untied.gguf", UNTIED, UNTIED_STATE)


@pytest.fixture(scope="module")
def expected_logits():
    """transformers' logits for 24 tokens (over four windows), and with every layer global."""
    ids = tokens()
    with torch.no_grad():
        windowed = transformers_model(CONFIG, STATE)(ids[None]).logits[0]
        unwindowed = transformers_model(CONFIG, STATE, window=4096)(ids[None]).logits[0]
    return ids, windowed, unwindowed


def test_gguf_config_as_llama_cpp_reads_it(gguf_path):
    got = load(gguf_path).config
    assert got.architecture == "gemma3" and got.qk_norm and got.gemma and got.tie_word_embeddings
    assert got.layer_types == CONFIG.layer_types and got.sliding_layers == (0, 1, 2, 3, 4)
    assert (got.sliding_window, got.local_rope_theta, got.rope_theta) == (WINDOW, 10000.0, 1000000.0)
    assert got.max_position_embeddings == CONFIG.max_position_embeddings  # the window is the layers', not the run's


@pytest.mark.parametrize("block", [1, 8, 24])
def test_gguf_logits_match_transformers(gguf_path, expected_logits, block):
    """Every prefill chunk size (rows of a chunk see their own windows) gives transformers' logits; without the
    windows they would differ."""
    ids, expected, unwindowed = expected_logits
    loaded = load(gguf_path)
    cache = arena(loaded, block=block)
    assert isinstance(cache, LayeredArena)
    rows = []
    for start in range(0, len(ids), block):
        rows.append(loaded.model.forward(ids[start:start + block], cache))
        cache.commit(len(ids[start:start + block]))
    logits = torch.cat(rows)
    assert (logits - expected).abs().max() <= REL_TOL * expected.abs().max()
    assert (unwindowed - expected)[WINDOW:].abs().max() > 100 * REL_TOL * expected.abs().max()
    assert cache.sliding_arena.evicted_tokens == len(ids) - (WINDOW - 1)  # the window layers kept their window
    assert cache.evicted_tokens == 0  # the full cache's global layer kept everything


def test_hf_folder_matches_transformers(tmp_path, expected_logits):
    """A folder transformers saved (its config's rope_parameters per layer kind, norms as ``w``) reads back to the
    same logits."""
    ids, expected, _ = expected_logits
    transformers_model(CONFIG, STATE).save_pretrained(tmp_path)
    loaded = load(tmp_path)
    assert loaded.config.layer_types == CONFIG.layer_types and loaded.config.local_rope_theta == 10000.0
    logits = loaded.model.forward(ids, arena(loaded, block=len(ids)))
    assert (logits - expected).abs().max() <= REL_TOL * expected.abs().max()


@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_weights_close_to_dense(tmp_path, dtype):
    path = write_gguf_model(tmp_path / "gemma3-q8.gguf", CONFIG, STATE, matrix_type="Q8_0")
    native, dense = load(path, dtype, "native"), load(path)
    assert native.weights == "native"
    ids = tokens(48, seed=3)
    got = native.model.forward(ids, arena(native, block=48))
    expected = dense.model.forward(ids, arena(dense, block=48))
    log_p, log_q = torch.log_softmax(expected, -1), torch.log_softmax(got.float(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
    assert kl < (0.01 if dtype == torch.float32 else 0.03), kl
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("positions", ["original", "in-cache"])
@pytest.mark.parametrize("name", ["h2o", "hybrid", "streaming"])
def test_speculative_equals_autoregressive_over_an_evicting_cache(untied_path, name, positions):
    """The draft (the target's weights plus noise) proposes, the target verifies: the same tokens as the target
    alone, with its global layer evicting down to a budget and its sliding layers to their windows."""
    target = load(untied_path)
    g = torch.Generator().manual_seed(5)
    noisy = {k: v + 0.15 * v.std() * torch.randn(v.shape, generator=g) for k, v in UNTIED_STATE.items()}
    draft = load(write_gguf_model(untied_path.parent / f"draft-{name}-{positions}.gguf", UNTIED, noisy))
    options = {"h2o": dict(heavy=6), "hybrid": dict(sinks=2, heavy=4), "streaming": dict(sinks=2)}[name]
    ids = tokens(20).tolist()
    expected = list(generate_tokens(target.model, arena(target, name, 12, 1, 8, positions, **options), ids,
                                    max_new_tokens=96, sampling=SamplingParams(), prefill_chunk=8))
    stats = SpeculativeStats()
    t_cache = arena(target, name, 12, target_inflight_rows(3), 8, positions, **options)
    d_cache = arena(draft, name, 12, draft_inflight_rows(3), 8, positions, **options)
    got = list(speculative_tokens(target.model, t_cache, draft.model, d_cache, ids, max_new_tokens=96,
                                  sampling=SamplingParams(), gamma=3, prefill_chunk=8, stats=stats))
    assert got == expected
    assert len(set(expected)) > 5  # not one token repeated
    assert t_cache.evicted_tokens > 0 and t_cache.sliding_arena.evicted_tokens > 0
    assert 0 < stats.accepted < stats.drafted


@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("positions", ["original", "in-cache"])
def test_a_tree_block_over_both_kinds_of_layer_equals_the_steps_along_each_path(tmp_path, positions):
    """Native weights (rows independent of one another), the global layer evicting to a budget and the sliding ones
    to their windows: each row of a tree block computes what the one-row steps along its path compute, bit for bit,
    and committing a path leaves both arenas as those steps leave them."""
    import copy

    gguf_file = write_gguf_model(tmp_path / "gemma3-q8.gguf", CONFIG, STATE, matrix_type="Q8_0")
    loaded = load(gguf_file, torch.float32, "native")
    model = loaded.model
    parents = [-1, 0, 0, 1, 2, 4]
    cache = arena(loaded, "hybrid", 12, len(parents) + 1, 8, positions, sinks=2, heavy=4)
    ids = tokens(20).tolist()
    for start in range(0, len(ids), 8):
        model.forward(torch.tensor(ids[start : start + 8]), cache, per_block=True, last_only=True)
        cache.commit(len(ids[start : start + 8]))
    before = copy.deepcopy(cache)
    block = tokens(len(parents), seed=9).tolist()
    logits = model.forward(torch.tensor(block), cache, parents=parents)
    chains = []
    for row in range(len(parents)):
        path = [row]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        chains.append(copy.deepcopy(before))
        for r in path:
            want = model.forward(torch.tensor([block[r]]), chains[-1])
            chains[-1].commit(1)
        assert torch.equal(logits[row], want[0]), f"row {row}"
    cache.commit_path([0, 2, 4, 5])
    for got, expected in ((cache.global_arena, chains[5].global_arena), (cache.sliding_arena, chains[5].sliding_arena)):
        n = expected.n_committed
        assert (got.n_committed, got.next_position) == (n, expected.next_position)
        assert torch.equal(got.buffer("positions")[..., :n], expected.buffer("positions")[..., :n])
        assert torch.equal(got.buffer("keys")[..., :n, :], expected.buffer("keys")[..., :n, :])
    assert cache.global_arena.evicted_tokens > 0 and cache.sliding_arena.evicted_tokens > 0
    step = torch.tensor([7])
    assert torch.equal(model.forward(step, cache), model.forward(step, chains[5]))


def test_budget_bounds_the_global_layers_and_windows_the_sliding_ones(untied_path):
    """A budget above the window: the sliding layers still hold window − 1 entries between rows, the global
    layer the budget; their bytes are sized so (not the budget for every layer)."""
    loaded = load(untied_path)
    cache = arena(loaded, "hybrid", 12, sinks=2, heavy=4)
    list(generate_tokens(loaded.model, cache, tokens(30).tolist(), max_new_tokens=10, sampling=SamplingParams(),
                         prefill_chunk=8))
    assert cache.global_arena.n_committed == 12 and cache.sliding_arena.n_committed == WINDOW - 1
    assert cache.sliding_arena.capacity == WINDOW - 1 + 8 and cache.global_arena.capacity == 12 + 8
    assert cache.nbytes == cache.global_arena.nbytes + cache.sliding_arena.nbytes


def test_kv_bytes_leave_the_windows_their_room(gguf_path):
    loaded = load(gguf_path)
    cache = CacheOptions(policy=make_policy("hybrid", 64), kv_bytes=40_000, prefill_chunk=8)
    sized = make_arena(loaded, cache, max_tokens=256, max_inflight=1)
    assert sized.nbytes <= 40_000 < sized.nbytes + 2 * 2 * 16 * 4  # one more global slot would not fit


def test_refusals():
    fields = dict(model_type="gemma3_text", vocab_size=262144, hidden_size=640, intermediate_size=2048,
                  num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512)
    config = ModelConfig.from_hf_dict(fields)  # Gemma 3 270M's shapes; layers from the default pattern
    assert config.sliding_layers == tuple(i for i in range(18) if (i + 1) % 6)
    assert config.num_parameters() == 268_098_176  # Gemma 3 270M
    with pytest.raises(UserError, match="final_logit_softcapping, which sparsespec does not implement"):
        ModelConfig.from_hf_dict(fields | dict(final_logit_softcapping=30.0))
    with pytest.raises(UserError, match="hidden_activation is 'gelu'; sparsespec's Gemma 3 runs gelu_pytorch_tanh"):
        ModelConfig.from_hf_dict(fields | dict(hidden_activation="gelu"))
    with pytest.raises(UserError, match="scales the sliding layers' RoPE"):
        ModelConfig.from_hf_dict(fields | dict(rope_parameters={
            SLIDING: dict(rope_type="linear", factor=2.0, rope_theta=1e4), GLOBAL: dict(rope_theta=1e6)}))
    with pytest.raises(UserError, match="layer_types must name"):
        ModelConfig.from_hf_dict(fields | dict(layer_types=["sliding_attention"] * 17))
    with pytest.raises(UserError, match="Unsupported architecture 'gemma2'"):
        ModelConfig.from_hf_dict(fields | dict(model_type="gemma2"))


GEMMA = MODEL_FIXTURES["gemma3-270m"]


@pytest.mark.model
@pytest.mark.skipif(not GEMMA.path.is_file() and not os.environ.get("CI"), reason="gemma3-270m not fetched")
def test_real_gemma3_270m_greedy_text_equals_transformers():
    """The real file in float32 dense weights: our greedy continuation of two prompts (one past the 512-token
    window) equals transformers' reading of the same file, token for token."""
    loaded = load_model("gemma3-270m", torch.float32, "dense", weight_store=False)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(GEMMA.path.parent), gguf_file=GEMMA.path.name, dtype=torch.float32).eval()
    story = " ".join(f"Day {i}: the ferry left the harbour at {i % 12 + 1} o'clock." for i in range(60))
    for prompt in ("The capital of France is", story + " The ferry on day 7 left at"):
        ids = loaded.tokenizer.encode(prompt)
        with torch.no_grad():
            expected = reference.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):]
        cache = arena(loaded, block=512, max_tokens=2048)
        got = list(generate_tokens(loaded.model, cache, ids, max_new_tokens=16, sampling=SamplingParams(),
                                   prefill_chunk=512))
        assert got == expected.tolist(), prompt[-40:]
    assert len(ids) > 2 * loaded.config.sliding_window and cache.sliding_arena.evicted_tokens > 0


def test_simulator_reads_a_sliding_layer_s_window_only():
    """At 8k entries the edge simulator's KV traffic is the global layer's 8k plus each sliding layer's window."""
    from sparsespec.edge.profile import load_profile
    from sparsespec.edge.roofline import forward_pass, kv_bytes_per_token

    device = load_profile("jetson-orin-nano-8gb")
    cost = forward_pass(CONFIG, device, tokens=1, kv_entries=8192, kv_in_sram=False)
    per_layer = kv_bytes_per_token(CONFIG) / CONFIG.num_hidden_layers
    assert cost.dram_bytes["kv"] == pytest.approx(((8192 + 5 * WINDOW) + 6) * per_layer)
    every_layer_global = forward_pass(replace(CONFIG, layer_types=()), device, tokens=1, kv_entries=8192,
                                      kv_in_sram=False)
    assert every_layer_global.dram_bytes["kv"] == pytest.approx(8193 * 6 * per_layer)
