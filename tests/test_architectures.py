"""The architectures beyond Llama and Qwen2, each read from a GGUF file as llama.cpp's converter writes it.

- ``qwen3``: each query and key head RMS-normalised before RoPE (``attn_q_norm`` / ``attn_k_norm``), no q/k/v
  bias, the head size in ``attention.key_length`` (here 16, not hidden / heads = 8); q/k rows not permuted.
- ``phi3``: a Llama block stored fused: ``attn_qkv`` (q, k, v rows) and ``ffn_up`` (gate rows, then up rows); its
  ``attention.sliding_window`` bounds the context a run may use.

A tiny random model of each is written as a GGUF file (float32, or Q8_0 blocks for the native kernels) and read
back: against ``transformers`` on the same weights, native against dense, and speculative against autoregressive
decoding over evicting caches.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from conftest import random_state, tiny_config, write_gguf_model
from sparsespec.cache import KVArena, make_policy
from sparsespec.config import ModelConfig
from sparsespec.errors import UserError
from sparsespec.generate import generate_tokens
from sparsespec.loading.load import load_model
from sparsespec.model import Transformer
from sparsespec.sampling import SamplingParams
from sparsespec.speculative import SpeculativeStats, draft_inflight_rows, speculative_tokens, target_inflight_rows

CONFIGS = {
    "qwen3": tiny_config("qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         tie_word_embeddings=False, vocab_size=128),
    "phi3": tiny_config("phi3", tie_word_embeddings=False, vocab_size=128, attention_bias=False),
}
STATES = {arch: random_state(config, seed=7, scale=1.0) for arch, config in CONFIGS.items()}
REL_TOL = 1e-4

def transformers_model(config: ModelConfig, state: dict[str, torch.Tensor]):
    fields = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps, max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=False, attn_implementation="eager")
    if config.architecture == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(attention_bias=False, **fields))
    else:
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(
            pad_token_id=None, bos_token_id=None, eos_token_id=None, **fields))
    model = model.float().eval()
    result = model.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return model


def tokens(vocab: int, n: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def full_arena(config, n: int, dtype=torch.float32) -> KVArena:
    return KVArena(config, make_policy("full"), dtype=dtype, max_tokens=n, max_block=n)


def load(path, dtype=torch.float32, weights="dense"):
    return load_model(str(path), dtype, weights, tokenizer=False, weight_store=False)


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_gguf_logits_match_transformers(tmp_path, arch):
    config, state = CONFIGS[arch], STATES[arch]
    loaded = load(write_gguf_model(tmp_path / f"{arch}.gguf", config, state))
    got = loaded.config
    assert (got.architecture, got.head_dim, got.num_key_value_heads) == (arch, config.head_dim,
                                                                          config.num_key_value_heads)
    assert (got.qk_norm, got.fused_projections, got.attention_bias) == (arch == "qwen3", arch == "phi3", False)
    ids = tokens(config.vocab_size)
    with torch.no_grad():
        expected = transformers_model(config, state)(ids[None]).logits[0]
    logits = loaded.model.forward(ids, full_arena(config, len(ids)))
    assert (logits - expected).abs().max() <= REL_TOL * expected.abs().max()
    assert (expected[1:] - expected[:-1]).abs().max() > 1.0  # rows differ: positions matter


def test_qwen3_without_its_qk_norms_misses_transformers(tmp_path):
    """The q/k norms are what the Qwen3 test above checks: without them the logits are far off."""
    config, state = CONFIGS["qwen3"], STATES["qwen3"]
    loaded = load(write_gguf_model(tmp_path / "qwen3.gguf", config, state))
    ids = tokens(config.vocab_size)
    with torch.no_grad():
        expected = transformers_model(config, state)(ids[None]).logits[0]
    for layer in loaded.model.layers:
        layer.q_norm = layer.k_norm = None
    without = loaded.model.forward(ids, full_arena(config, len(ids)))
    assert (without - expected).abs().max() > 100 * REL_TOL * expected.abs().max()


def test_hf_configs_of_qwen3_and_phi3():
    qwen3 = ModelConfig.from_hf_dict(dict(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=40960, tie_word_embeddings=True, attention_bias=False, sliding_window=None,
        use_sliding_window=False))
    assert qwen3.architecture == "qwen3" and qwen3.qk_norm and not qwen3.attention_bias
    assert qwen3.head_dim == 128 != qwen3.hidden_size // qwen3.num_attention_heads
    assert qwen3.max_position_embeddings == 40960
    # Qwen3-0.6B's parameter count with the tied embedding counted once: the q/k norms are in it.
    assert qwen3.num_parameters() == 596_049_920
    phi3 = ModelConfig.from_hf_dict(dict(  # Phi-3-mini-4k-instruct's config.json
        model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, rope_theta=10000.0, rms_norm_eps=1e-5,
        max_position_embeddings=4096, original_max_position_embeddings=4096, sliding_window=2047,
        tie_word_embeddings=False, rope_scaling=None))
    assert phi3.fused_projections and not phi3.attention_bias and phi3.head_dim == 96
    assert phi3.max_position_embeddings == 2047  # the window bounds what full attention computes as trained
    assert phi3.num_parameters() == 3_821_079_552  # Phi-3-mini's 3.8B
    # A window a Qwen2 config names but does not use leaves the context alone.
    qwen2 = ModelConfig.from_hf_dict(dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, sliding_window=4096,
        use_sliding_window=False))
    assert qwen2.max_position_embeddings == 32768


def test_phi3_gguf_sliding_window_bounds_the_context(tmp_path):
    config = CONFIGS["phi3"]
    path = write_gguf_model(tmp_path / "phi3.gguf", config, STATES["phi3"], sliding_window=64)
    assert load(path).config.max_position_embeddings == 64


def test_unsupported_variants_are_refused(tmp_path):
    qwen3 = write_gguf_model(tmp_path / "partial.gguf", CONFIGS["qwen3"], STATES["qwen3"], rope_dims=8)
    with pytest.raises(UserError, match="rotates 8 of each head's 16 dimensions; sparsespec rotates whole heads"):
        load(qwen3)
    half = CONFIGS["phi3"].head_dim // 2
    longrope = write_gguf_model(tmp_path / "longrope.gguf", CONFIGS["phi3"], STATES["phi3"], tensors={
        "rope_factors_long.weight": np.ones(half, np.float32), "rope_factors_short.weight": np.ones(half, np.float32)})
    with pytest.raises(UserError, match="LongRoPE factors .* does not implement LongRoPE"):
        load(longrope)
    with pytest.raises(UserError, match="RoPE scaling 'longrope' is not supported"):
        ModelConfig.from_hf_dict(dict(model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                                      num_hidden_layers=32, num_attention_heads=32, rope_scaling=dict(
                                          type="longrope", short_factor=[1.0] * 48, long_factor=[1.0] * 48)))


@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_native_weights_close_to_dense(tmp_path, arch, dtype):
    """The file's Q8_0 blocks through the native kernels (8-bit activations) against the same file dequantized,
    in float32."""
    config = CONFIGS[arch]
    path = write_gguf_model(tmp_path / f"{arch}-q8.gguf", config, STATES[arch], matrix_type="Q8_0")
    native, dense = load(path, dtype, "native"), load(path)
    assert native.weights == "native"
    ids = tokens(config.vocab_size, 48, seed=3)
    got = native.model.forward(ids, full_arena(config, len(ids), dtype))
    expected = dense.model.forward(ids, full_arena(config, len(ids)))
    log_p, log_q = torch.log_softmax(expected, -1), torch.log_softmax(got, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
    assert kl < (0.01 if dtype == torch.float32 else 0.03), kl
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("matrix_type", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_float_matrices_run_natively_as_the_file_stores_them(tmp_path, arch, matrix_type):
    """A file of float matrices loads in the native format by default, its rows as the file stores them (nothing
    quantized, activations included), and gives the logits of the same file dequantized by ``gguf`` (the dense
    path) up to summation order."""
    config = CONFIGS[arch]
    path = write_gguf_model(tmp_path / f"{arch}-{matrix_type}.gguf", config, STATES[arch], matrix_type=matrix_type)
    native, dense = load(path, torch.float32, "auto"), load(path, torch.float32, "dense")
    assert native.weights == "native"
    assert {native.model.layers[0].qkv.types[0], native.model.lm_head.types[0]} == {dict(F32=0, F16=1, BF16=30)[
        matrix_type]}
    ids = tokens(config.vocab_size, 24, seed=3)
    got = native.model.forward(ids, full_arena(config, len(ids)))
    expected = dense.model.forward(ids, full_arena(config, len(ids)))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("positions", ["original", "in-cache"])
@pytest.mark.parametrize("name", ["h2o", "hybrid", "streaming"])
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_speculative_equals_autoregressive_over_an_evicting_cache(arch, name, positions):
    config, state = CONFIGS[arch], STATES[arch]
    target = Transformer(config, state, torch.float32)
    g = torch.Generator().manual_seed(5)
    draft = Transformer(config, {k: v + 0.15 * v.std() * torch.randn(v.shape, generator=g) for k, v in state.items()},
                        torch.float32)
    pol = make_policy(name, 12, **{"h2o": dict(heavy=6), "hybrid": dict(sinks=2, heavy=4), "streaming": dict(sinks=2)}[name])
    ids = tokens(config.vocab_size, 20).tolist()

    def arena(rows):
        return KVArena(config, pol, dtype=torch.float32, max_block=8, max_inflight=rows, positions=positions)

    expected = list(generate_tokens(target, arena(1), ids, max_new_tokens=96, sampling=SamplingParams(),
                                    prefill_chunk=8))
    stats = SpeculativeStats()
    t_cache = arena(target_inflight_rows(3))
    got = list(speculative_tokens(target, t_cache, draft, arena(draft_inflight_rows(3)), ids, max_new_tokens=96,
                                  sampling=SamplingParams(), gamma=3, prefill_chunk=8, stats=stats))
    assert got == expected
    assert len(set(expected)) > 5  # not one token repeated
    assert t_cache.evicted_tokens > 0 and 0 < stats.accepted < stats.drafted


@pytest.mark.usefixtures("native_kernels")
def test_weights_the_kernels_cannot_read_are_requantized_with_a_note(tmp_path, capsys):
    """A file of MXFP4 matrices (a block type the kernels do not read): --weights auto runs them re-quantized (the
    quantized format of the role) and says so in one line; --weights native is refused in one sentence."""
    path = write_gguf_model(tmp_path / "mxfp4.gguf", CONFIGS["phi3"], STATES["phi3"], matrix_type="MXFP4")
    loaded = load_model(str(path), torch.bfloat16, "auto", tokenizer=False, weight_store=False)
    assert loaded.weights == "int8" and all(linear.types == [8] for _, linear in loaded.model.linear_items())
    note = capsys.readouterr().err.strip().splitlines()
    assert len(note) == 1 and note[0].startswith("sparsespec: note: mxfp4.gguf has weights in MXFP4")
    assert loaded.weights in note[0]
    with pytest.raises(UserError, match="MXFP4, which the native kernels do not read; use weights int8, int4 or "
                                        "dense"):
        load_model(str(path), torch.bfloat16, "native", tokenizer=False, weight_store=False)


@pytest.mark.parametrize("window", [None, 4096])
def test_a_mistral_folder_is_a_llama_decoder(tmp_path, window):
    """A Mistral Hugging Face folder (model_type mistral; Mistral 7B v0.1 has a 4,096-token window, v0.2 on none)
    loads as the Llama decoder and gives transformers' Mistral logits; its window bounds the context."""
    import json
    from safetensors.torch import save_file

    config = tiny_config("llama", tie_word_embeddings=False, vocab_size=128)
    state = random_state(config, seed=4, scale=1.0)
    hf = dict(model_type="mistral", vocab_size=config.vocab_size, hidden_size=config.hidden_size,
              intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
              num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
              head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
              max_position_embeddings=32768, sliding_window=window, tie_word_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = load(tmp_path)
    assert loaded.config.architecture == "llama"
    assert loaded.config.max_position_embeddings == (window or 32768)
    reference = transformers.MistralForCausalLM(transformers.MistralConfig(
        **{k: v for k, v in hf.items() if k != "model_type"}, attn_implementation="eager")).float().eval()
    reference.load_state_dict(state, strict=True)
    ids = tokens(config.vocab_size)
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    logits = loaded.model.forward(ids, full_arena(loaded.config, len(ids)))
    assert (logits - expected).abs().max() <= REL_TOL * expected.abs().max()
