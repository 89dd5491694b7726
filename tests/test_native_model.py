"""Models on native weights: SmolLM2-135M from its GGUF blocks against the dense float32 model, and exact
speculative decoding with native target and draft.

Native weights multiply 8-bit quantized activations (``--activations int8``), so logits differ from the dense
float32 model by the activations' rounding (the same rounding llama.cpp applies); the tests bound that difference on
real text and check that greedy text on the prompts below changes only at near-ties. With float activations (the
default for SmolLM2) only the float32 summation order differs. Speculative decoding on native weights equals
plain decoding, evicting caches included: each row's result is independent of the rows sharing the pass
(``kernels/csrc/qmatmul.h``), the attention op reads a verification row's slots in the order its autoregressive
step would find them (``kernels/csrc/attention.h``), and a commit lays the accepted rows out as one-row commits
would (``cache/arena.py``), so verification rows equal autoregressive steps bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from sparsespec import kernels
from sparsespec.cache import KVArena, make_policy
from sparsespec.generate import generate_tokens
from sparsespec.linear import NativeLinear
from sparsespec.model import Transformer
from sparsespec.sampling import SamplingParams
from sparsespec.speculative import SpeculativeStats, draft_inflight_rows, speculative_tokens, target_inflight_rows

from conftest import random_state, tiny_config

# Skipped without the kernels, failed where they must build (conftest.py: native_kernels).
pytestmark = pytest.mark.usefixtures("native_kernels")

PROMPTS = (
    "The three laws of thermodynamics are",
    "def fibonacci(n):",
    "The capital of France is",
)


@pytest.fixture(scope="module", params=["int8", "float"])
def smollm2_native(smollm2_path, request):
    from sparsespec.loading.load import load_model

    loaded = load_model("smollm2-135m", torch.float32, "native", activations=request.param)
    assert all(linear.float_activations == (request.param == "float") for _, linear in loaded.model.linear_items())
    return loaded


def full_arena(model, max_tokens=512, max_inflight=1, chunk=128, pol=None, positions="original"):
    return KVArena(model.config, pol or make_policy("full"), dtype=model.dtype, max_tokens=max_tokens,
                   max_block=chunk, max_inflight=max_inflight, positions=positions)


def test_native_model_holds_the_files_bytes(smollm2_native, smollm2_path):
    model = smollm2_native.model
    assert smollm2_native.weights == "native"
    assert isinstance(model.layers[0].qkv, NativeLinear)
    assert model.head_shares_embedding  # SmolLM2's tied head reads the Q8_0 embedding blocks
    file_bytes = smollm2_path.stat().st_size
    # the file's blocks (plus norms), nothing dense: within 5% of the file (measured +2.2%, see kernels/repack.py)
    assert 0.9 * file_bytes < model.weight_nbytes < 1.05 * file_bytes


def test_smollm2_native_logits_close_to_dense_float32(smollm2_native, smollm2_f32, capsys):
    text = (
        "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
        "it was the season of Darkness, it was the spring of hope, it was the winter of despair."
    )
    ids = torch.tensor(smollm2_f32.tokenizer.encode(text))
    native = smollm2_native.model.forward(ids, full_arena(smollm2_native.model))
    dense = smollm2_f32.model.forward(ids, full_arena(smollm2_f32.model))
    log_p, log_q = torch.log_softmax(dense, -1), torch.log_softmax(native, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
    max_abs = (native - dense).abs().max().item()
    with capsys.disabled():
        print(f"\nSmolLM2-135M native vs dense float32 over {len(ids)} tokens: KL {kl:.4f}, max |logit diff| "
              f"{max_abs:.3f} (logit scale {dense.abs().max().item():.1f})")
    # Measured: 8-bit activations KL 0.004, max |diff| 0.9 on logits of magnitude ~30; float activations 1e-9
    # and 2e-4 (float32 summation order alone).
    float_activations = smollm2_native.model.lm_head.float_activations
    assert kl < (1e-6 if float_activations else 0.01)
    assert max_abs < (1e-4 if float_activations else 0.1) * dense.abs().max().item()


@pytest.mark.parametrize("text", PROMPTS)
def test_smollm2_native_greedy_text_equals_dense_up_to_near_ties(smollm2_native, smollm2_f32, text):
    """Greedy text on native weights equals the dense float32 model's, or first differs where the dense model's
    two candidates are within the activations' rounding (a near-tie), never at a clear choice."""
    ids = smollm2_f32.tokenizer.encode(text)
    outs = []
    for loaded in (smollm2_native, smollm2_f32):
        outs.append(list(generate_tokens(loaded.model, full_arena(loaded.model), ids, max_new_tokens=16,
                                         sampling=SamplingParams())))
    native, dense = outs
    if native == dense:
        return
    at = next(i for i, (a, b) in enumerate(zip(native, dense)) if a != b)
    logits = smollm2_f32.model.forward(torch.tensor(ids + dense[:at]), full_arena(smollm2_f32.model))[-1]
    margin = (logits[dense[at]] - logits[native[at]]).item()
    assert 0 <= margin < 0.5, f"diverged at token {at} where the dense model preferred its token by {margin:.3f}"


def native_tiny(seed=0, noise=0.0, ggml_type=8):
    """A tiny random model with every projection quantized to GGUF blocks (``NativeLinear.from_float``)."""
    config = tiny_config("llama", tie_word_embeddings=False)
    state = random_state(config, seed=0, scale=1.0)
    if noise:
        g = torch.Generator().manual_seed(seed)
        state = {k: v + noise * v.std() * torch.randn(v.shape, generator=g) for k, v in state.items()}
    return Transformer(config, state, torch.float32, "native", linear_options={"ggml_type": ggml_type})


def with_random_tiles(model, ggml_type=12):
    """``model`` with every projection and the head replaced by random ``ggml_type`` blocks in 16-column tiles
    (``gguf`` cannot quantize floats to the K-quants; the Qwen targets load their Q4_K / Q6_K this way on x86)."""
    from test_kernels import random_blocks

    from sparsespec.kernels.repack import pack

    def tiled(linear: NativeLinear, seed: int) -> NativeLinear:
        k = -(-linear.in_features // 256) * 256
        raw = random_blocks(ggml_type, linear.out_features, k, seed=seed)
        kind, blob, _ = pack(ggml_type, raw, k, tiles=True)
        return NativeLinear([(kind, torch.from_numpy(blob.reshape(-1)), linear.out_features)], linear.in_features, k)

    seed = 0
    for layer in model.layers:
        for name in ("qkv", "o_proj", "gate_up", "down"):
            seed += 1
            setattr(layer, name, tiled(getattr(layer, name), seed))
    model.lm_head = tiled(model.lm_head, seed + 1)
    return model


@pytest.mark.parametrize("float_activations", [False, True], ids=["int8", "float"])
@pytest.mark.parametrize("name,spec,dtype", [
    ("full", {}, torch.bfloat16), ("full", {}, torch.float32),
    ("hybrid", dict(budget=12, sinks=2, heavy=4), torch.float32), ("window", dict(budget=10), torch.float32),
])
def test_native_speculative_equals_autoregressive(name, spec, dtype, float_activations):
    target = native_tiny()
    draft = native_tiny(seed=5, noise=0.05, ggml_type=2)  # Q4_0 draft
    for model in (target, draft):
        for _, linear in model.linear_items():
            linear.float_activations = float_activations
        model.dtype = dtype
        model.embed = model.embed.to(dtype)
        model.norm = model.norm.to(dtype)
        for layer in model.layers:
            layer.attn_norm, layer.mlp_norm = layer.attn_norm.to(dtype), layer.mlp_norm.to(dtype)
    spec = dict(spec)
    pol = make_policy(name, spec.pop("budget", None), **spec) if spec else make_policy(name)
    ids = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    ar = list(generate_tokens(target, full_arena(target, pol=pol, chunk=8), ids, max_new_tokens=40,
                              sampling=SamplingParams(), prefill_chunk=8))
    t_cache = full_arena(target, pol=pol, chunk=8, max_inflight=target_inflight_rows(4))
    d_cache = full_arena(draft, pol=make_policy("full"), chunk=8, max_inflight=draft_inflight_rows(4))
    spec_out = list(speculative_tokens(target, t_cache, draft, d_cache, ids, max_new_tokens=40,
                                       sampling=SamplingParams(), gamma=4, prefill_chunk=8))
    assert spec_out == ar
    if name != "full":
        assert t_cache.evicted_tokens > 0


@pytest.mark.parametrize("ggml_type", [12, 14], ids=["Q4_K", "Q6_K"])
def test_tiled_target_verifies_every_row_as_its_autoregressive_step(ggml_type):
    """A target in column tiles (bfloat16, full cache) drafting for itself: every draft is the target's own
    single-row step, so every token is accepted exactly when each row of the 5-row verification pass equals the
    single-row step bit for bit; the output equals plain decoding."""
    model = with_random_tiles(native_tiny(), ggml_type)
    assert model.layers[0].qkv.types == [ggml_type + 100]
    model.dtype = torch.bfloat16
    model.embed, model.norm = model.embed.to(torch.bfloat16), model.norm.to(torch.bfloat16)
    for layer in model.layers:
        layer.attn_norm, layer.mlp_norm = layer.attn_norm.to(torch.bfloat16), layer.mlp_norm.to(torch.bfloat16)
    ids = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    ar = list(generate_tokens(model, full_arena(model, chunk=8), ids, max_new_tokens=40, sampling=SamplingParams(),
                              prefill_chunk=8))
    stats = SpeculativeStats()
    out = list(speculative_tokens(model, full_arena(model, chunk=8, max_inflight=target_inflight_rows(4)), model,
                                  full_arena(model, chunk=8, max_inflight=draft_inflight_rows(4)), ids,
                                  max_new_tokens=40, sampling=SamplingParams(), gamma=4, prefill_chunk=8,
                                  stats=stats))
    assert out == ar
    assert stats.accepted == stats.drafted > 0


def test_default_smollm2_multiplies_float_activations_and_larger_models_quantize_them(smollm2_default):
    from sparsespec.activations import FLOAT_ACTIVATIONS_MAX_PARAMETERS, float_activations_chosen

    assert smollm2_default.model.projection_parameters() <= FLOAT_ACTIVATIONS_MAX_PARAMETERS
    assert all(linear.float_activations for _, linear in smollm2_default.model.linear_items())
    assert not float_activations_chosen("auto", FLOAT_ACTIVATIONS_MAX_PARAMETERS + 1)
    assert float_activations_chosen("float", FLOAT_ACTIVATIONS_MAX_PARAMETERS + 1)
    assert not float_activations_chosen("int8", 1)


def test_a_draft_cut_to_fewer_ids_keeps_its_float_activations():
    draft = native_tiny()
    for _, linear in draft.linear_items():
        linear.float_activations = True
    draft.limit_vocabulary(40)
    assert draft.lm_head.out_features == 40 and draft.lm_head.float_activations


def test_draft_with_a_limited_vocabulary_keeps_speculation_exact():
    """A draft scoring only the first ids (q = 0 elsewhere) reads fewer head rows and greedy speculative output
    still equals autoregressive decoding, including tokens the draft can never propose."""
    target = native_tiny()
    draft = native_tiny(seed=5, noise=0.05)
    full_head_bytes = draft.lm_head.nbytes
    draft.limit_vocabulary(40)
    assert draft.lm_head.out_features == 40 and draft.lm_head.nbytes < full_head_bytes / 2
    ids = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = draft.forward(torch.tensor(ids), full_arena(draft, chunk=32))
    assert torch.isinf(logits[:, 40:]).all() and torch.isfinite(logits[:, :40]).all()
    ar = list(generate_tokens(target, full_arena(target, chunk=8), ids, max_new_tokens=40, sampling=SamplingParams(),
                              prefill_chunk=8))
    t_cache = full_arena(target, chunk=8, max_inflight=target_inflight_rows(4))
    d_cache = full_arena(draft, chunk=8, max_inflight=draft_inflight_rows(4))
    out = list(speculative_tokens(target, t_cache, draft, d_cache, ids, max_new_tokens=40,
                                  sampling=SamplingParams(), gamma=4, prefill_chunk=8))
    assert out == ar
    assert any(t >= 40 for t in ar)  # the target still emits ids the draft cannot propose


DEFAULT_CONFIG_POLICIES = {
    "full": {}, "window": dict(budget=24), "streaming": dict(budget=24, sinks=4),
    "h2o": dict(budget=24, heavy=12), "hybrid": dict(budget=24, sinks=4, heavy=10),
    "hybrid-age": dict(budget=24, sinks=4, heavy=10), "hybrid-decay": dict(budget=24, sinks=4, heavy=10),
}


@pytest.mark.parametrize("mode", ["original", "in-cache"])
@pytest.mark.parametrize("name", list(DEFAULT_CONFIG_POLICIES))
def test_default_configuration_speculative_equals_autoregressive(smollm2_default, monkeypatch, name, mode):
    """The default configuration (bfloat16, native weights, native attention), every policy, both position modes,
    γ = 1 to 5: greedy self-speculation equals plain decoding token for token. Every row of a verification pass
    equals its autoregressive step bit for bit: the kernels' rows never depend on the rows beside them, the
    attention op reads a verification row's slots in the order the step would find them, and a commit lays the
    accepted rows out as one-row commits would (``cache/arena.py``)."""
    loaded = smollm2_default
    model = loaded.model
    ids = loaded.tokenizer.encode("The keeper of the lighthouse wrote in his log that the storm")
    spec = dict(DEFAULT_CONFIG_POLICIES[name])
    target_policy = make_policy(name, spec.pop("budget", None), **spec)
    draft_policy = make_policy("streaming", 12, sinks=2)
    positions = mode if not target_policy.is_full else "original"
    targets, laid_out = [], []  # the target's commits of two or more rows that moved an accepted row
    commit = KVArena.commit

    def spy(self, n_rows):
        first_slot, first_position = self.n_committed, self.next_position
        commit(self, n_rows)
        if n_rows >= 2 and any(self is t for t in targets):
            accepted = torch.arange(first_position, first_position + n_rows)
            kept = self.buffer("positions")[..., : self.n_committed]  # [L, n_kv, survivors]
            slot, row = (kept[..., :, None] == accepted).nonzero(as_tuple=True)[-2:]
            if bool((slot != first_slot + row).any()):
                laid_out.append(n_rows)

    monkeypatch.setattr(KVArena, "commit", spy)

    def arena(policy, inflight):
        return KVArena(model.config, policy, dtype=model.dtype, max_tokens=128, max_block=8, max_inflight=inflight,
                       positions=positions)

    expected = list(generate_tokens(model, arena(target_policy, 1), ids, max_new_tokens=48,
                                    sampling=SamplingParams(), prefill_chunk=8))
    for gamma in range(1, 6):
        stats = SpeculativeStats()
        target_cache = arena(target_policy, target_inflight_rows(gamma))
        targets.append(target_cache)
        got = list(speculative_tokens(model, target_cache, model, arena(draft_policy, draft_inflight_rows(gamma)),
                                      ids, max_new_tokens=48, sampling=SamplingParams(), gamma=gamma,
                                      prefill_chunk=8, stats=stats))
        assert got == expected, f"gamma {gamma}"
        assert 0 < stats.accepted < stats.drafted
        assert target_cache.evicted_tokens > 0 or target_policy.is_full
    assert bool(laid_out) != target_policy.is_full


@pytest.mark.model
@pytest.mark.skipif(not kernels.tiles_preferred(), reason="no column tiles on this CPU (the row layout loads anyway)")
def test_float_activations_read_a_tiled_file_in_the_row_layout(monkeypatch, tmp_path):
    """Gemma 3 270M's Q4_K / Q6_K / Q5_0 weights load as column tiles here, which float activations do not read:
    an explicit ``float`` loads the row layout at once, and ``auto`` choosing float for a model it found tiled
    loads it again in rows; each layout is stored under its own name."""
    import os

    import sparsespec.activations
    from sparsespec.loading.fixtures import MODEL_FIXTURES
    from sparsespec.loading.load import load_model

    if not MODEL_FIXTURES["gemma3-270m"].path.is_file():
        if os.environ.get("CI"):
            pytest.fail("Gemma 3 270M is not fetched; .ci/run must run `sparsespec fetch gemma3-270m`.")
        pytest.skip("gemma3-270m not fetched (run `sparsespec fetch gemma3-270m`)")

    def kinds(loaded):
        return {kind for _, linear in loaded.model.linear_items() for kind in linear.types}

    tiled = {112, 114, 106}  # kernels/repack.py TILED_TYPES
    by_default = load_model("gemma3-270m", torch.bfloat16, "native", tokenizer=False, weight_store=tmp_path)
    assert kinds(by_default) & tiled and not by_default.model.lm_head.float_activations  # 268M parameters: int8
    monkeypatch.setattr(sparsespec.activations, "FLOAT_ACTIVATIONS_MAX_PARAMETERS", 10**9)
    chosen = load_model("gemma3-270m", torch.bfloat16, "native", tokenizer=False, weight_store=tmp_path)
    assert not kinds(chosen) & tiled and all(linear.float_activations for _, linear in chosen.model.linear_items())
    assert sorted(p.name.split("-")[-1] for p in tmp_path.rglob("*.safetensors")) == ["rows.safetensors",
                                                                                    "tiles.safetensors"]
    explicit = load_model("gemma3-270m", torch.bfloat16, "native", tokenizer=False, weight_store=tmp_path,
                          activations="float")
    assert explicit.from_cache and not kinds(explicit) & tiled and explicit.model.lm_head.float_activations
    ids = torch.arange(3, 40)
    logits = [m.model.forward(ids, full_arena(m.model)) for m in (by_default, chosen)]
    assert torch.allclose(logits[0].float(), logits[1].float(), atol=0.1 * logits[0].abs().max().item())
