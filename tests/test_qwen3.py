"""Qwen3: each query and key head RMS-normalised before RoPE, no q/k/v bias, a head size that is not hidden / heads.

A tiny random Qwen3 is written as a GGUF file (float32, or Q8_0 blocks for the native kernels) the way llama.cpp's
converter writes one (architecture ``qwen3``, ``attention.key_length``, ``attn_q_norm`` / ``attn_k_norm``, q/k rows
not permuted) and read back: against ``transformers``' Qwen3 on the same weights, native against dense, and
speculative against autoregressive decoding over evicting caches.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from conftest import random_state, tiny_config
from sparsespec.cache import KVArena, make_policy
from sparsespec.config import ModelConfig
from sparsespec.errors import UserError
from sparsespec.generate import generate_tokens
from sparsespec.loading.load import load_model
from sparsespec.model import Transformer
from sparsespec.sampling import SamplingParams
from sparsespec.speculative import SpeculativeStats, draft_inflight_rows, speculative_tokens, target_inflight_rows

# head_dim 16 with hidden 32 and 4 heads: the file's key_length, not hidden / heads, gives the head size.
CONFIG = tiny_config("qwen3", hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, tie_word_embeddings=False, vocab_size=128)
STATE = random_state(CONFIG, seed=7, scale=1.0)
REL_TOL = 1e-4


def write_qwen3_gguf(path, config: ModelConfig, state: dict[str, torch.Tensor], q8: bool = False,
                     rope_dims: int | None = None):
    """``state`` as a qwen3 GGUF: float32 tensors, or with ``q8`` every matrix in Q8_0 blocks (norms stay float32).
    ``rope_dims``: a ``rope.dimension_count`` other than the head size (partial rotary)."""
    import gguf
    from gguf.quants import quantize

    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    if rope_dims is not None:
        writer.add_rope_dimension_count(rope_dims)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    for i in range(config.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        names |= {p + "input_layernorm.weight": b + "attn_norm.weight",
                  p + "post_attention_layernorm.weight": b + "ffn_norm.weight",
                  p + "self_attn.q_norm.weight": b + "attn_q_norm.weight",
                  p + "self_attn.k_norm.weight": b + "attn_k_norm.weight",
                  p + "self_attn.q_proj.weight": b + "attn_q.weight",
                  p + "self_attn.k_proj.weight": b + "attn_k.weight",
                  p + "self_attn.v_proj.weight": b + "attn_v.weight",
                  p + "self_attn.o_proj.weight": b + "attn_output.weight",
                  p + "mlp.gate_proj.weight": b + "ffn_gate.weight", p + "mlp.up_proj.weight": b + "ffn_up.weight",
                  p + "mlp.down_proj.weight": b + "ffn_down.weight"}
    assert set(names) == set(state)
    for hf, name in names.items():
        array = np.ascontiguousarray(state[hf].numpy(), dtype=np.float32)
        if q8 and array.ndim == 2:
            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def transformers_qwen3(config: ModelConfig, state: dict[str, torch.Tensor]):
    hf_config = transformers.Qwen3Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps, max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=False, attention_bias=False, attn_implementation="eager")
    model = transformers.Qwen3ForCausalLM(hf_config).float().eval()
    result = model.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return model


def tokens(n: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def full_arena(config, n: int) -> KVArena:
    return KVArena(config, make_policy("full"), dtype=torch.float32, max_tokens=n, max_block=n)


def test_qwen3_gguf_logits_match_transformers(tmp_path):
    path = write_qwen3_gguf(tmp_path / "qwen3.gguf", CONFIG, STATE)
    loaded = load_model(str(path), torch.float32, "dense", tokenizer=False, cache=False)
    # (rms_norm_eps comes back as the file's float32)
    assert loaded.config.architecture == "qwen3" and loaded.config.qk_norm and not loaded.config.attention_bias
    assert (loaded.config.head_dim, loaded.config.num_key_value_heads) == (CONFIG.head_dim, CONFIG.num_key_value_heads)
    ids = tokens()
    with torch.no_grad():
        expected = transformers_qwen3(CONFIG, STATE)(ids[None]).logits[0]
    logits = loaded.model.forward(ids, full_arena(CONFIG, len(ids)))
    assert (logits - expected).abs().max() <= REL_TOL * expected.abs().max()
    # The q/k norms matter: without them the logits are far off.
    for layer in loaded.model.layers:
        layer.q_norm = layer.k_norm = None
    without = loaded.model.forward(ids, full_arena(CONFIG, len(ids)))
    assert (without - expected).abs().max() > 100 * REL_TOL * expected.abs().max()


def test_qwen3_hf_config_reads_qk_norm_and_no_bias():
    config = ModelConfig.from_hf_dict(dict(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=40960, tie_word_embeddings=True, attention_bias=False))
    assert config.architecture == "qwen3" and config.qk_norm and not config.attention_bias
    assert config.head_dim == 128 != config.hidden_size // config.num_attention_heads
    # Qwen3-0.6B's published parameter count (0.6B with the tied embedding counted once): the q/k norms are in it.
    assert config.num_parameters() == 596_049_920


def test_partial_rotary_qwen3_gguf_is_refused(tmp_path):
    path = write_qwen3_gguf(tmp_path / "partial.gguf", CONFIG, STATE, rope_dims=CONFIG.head_dim // 2)
    with pytest.raises(UserError, match="rotates 8 of each head's 16 dimensions; sparsespec rotates whole heads"):
        load_model(str(path), torch.float32, "dense", tokenizer=False, cache=False)


@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3_native_weights_close_to_dense(tmp_path, dtype):
    """The file's Q8_0 blocks through the native kernels (8-bit activations) against the same file dequantized,
    in float32: the q/k norms run in the native path too."""
    path = write_qwen3_gguf(tmp_path / "qwen3-q8.gguf", CONFIG, STATE, q8=True)
    native = load_model(str(path), dtype, "native", tokenizer=False, cache=False)
    dense = load_model(str(path), torch.float32, "dense", tokenizer=False, cache=False)
    assert native.weights == "native" and native.model.layers[0].q_norm is not None
    ids = tokens(48, seed=3)
    arena = KVArena(CONFIG, make_policy("full"), dtype=dtype, max_tokens=len(ids), max_block=len(ids))
    got = native.model.forward(ids, arena)
    expected = dense.model.forward(ids, full_arena(CONFIG, len(ids)))
    log_p, log_q = torch.log_softmax(expected, -1), torch.log_softmax(got, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
    assert kl < (0.01 if dtype == torch.float32 else 0.03), kl
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("positions", ["original", "in-cache"])
@pytest.mark.parametrize("name", ["h2o", "hybrid", "streaming"])
def test_qwen3_speculative_equals_autoregressive_over_an_evicting_cache(name, positions):
    target = Transformer(CONFIG, STATE, torch.float32)
    g = torch.Generator().manual_seed(5)
    draft = Transformer(CONFIG, {k: v + 0.15 * v.std() * torch.randn(v.shape, generator=g) for k, v in STATE.items()},
                        torch.float32)
    pol = make_policy(name, 12, **{"h2o": dict(heavy=6), "hybrid": dict(sinks=2, heavy=4), "streaming": dict(sinks=2)}[name])
    ids = tokens(20).tolist()

    def arena(model, rows):
        return KVArena(CONFIG, pol, dtype=torch.float32, max_block=8, max_inflight=rows, positions=positions)

    ar = arena(target, 1)
    expected = list(generate_tokens(target, ar, ids, max_new_tokens=96, sampling=SamplingParams(), prefill_chunk=8))
    stats = SpeculativeStats()
    t_cache = arena(target, target_inflight_rows(3))
    got = list(speculative_tokens(target, t_cache, draft, arena(draft, draft_inflight_rows(3)), ids,
                                  max_new_tokens=96, sampling=SamplingParams(), gamma=3, prefill_chunk=8, stats=stats))
    assert got == expected
    assert len(set(expected)) > 5  # not one token repeated
    assert t_cache.evicted_tokens > 0 and 0 < stats.accepted < stats.drafted
