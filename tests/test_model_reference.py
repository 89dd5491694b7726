"""The decoder against Hugging Face ``transformers`` on the same weights: logits, incremental decoding, greedy text.

Tiny random Llama, Qwen2, Qwen3 and Phi-3 models are rebuilt in ``transformers`` from the very state dict ours is built from;
SmolLM2-135M is read by both from the same GGUF file. Everything runs in float32, where the two implementations
agree up to summation order, so logits must match to 1e-4 of their largest magnitude and greedy decoding must
give the same tokens.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import GenerationConfig

from conftest import random_state, tiny_config
from sparsespec.cache.arena import KVArena
from sparsespec.cache.policy import make_policy
from sparsespec.generate import generate_tokens, prefill
from sparsespec.model import Transformer
from sparsespec.sampling import SamplingParams

REL_TOL = 1e-4  # max |ours - reference| <= REL_TOL * max |reference|


def assert_logits_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert ours.shape == reference.shape
    assert ours.dtype == torch.float32
    bound = REL_TOL * reference.abs().max().item()
    diff = (ours - reference).abs().max().item()
    assert diff <= bound, f"max abs logit difference {diff:.3g} exceeds {bound:.3g}"


def full_arena(config, max_tokens: int, max_block: int) -> KVArena:
    return KVArena(config, make_policy("full"), dtype=torch.float32, max_tokens=max_tokens, max_block=max_block)


# ------------------------------------------------------------------------------------------- tiny random models
def hf_reference(config, state: dict[str, torch.Tensor]):
    """A ``transformers`` model with the same shapes and weights as ``Transformer(config, state, float32)``."""
    fields = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps, max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings, hidden_act="silu", attn_implementation="eager",
    )
    if config.architecture == "llama":
        hf_config = transformers.LlamaConfig(attention_bias=config.attention_bias, mlp_bias=False, **fields)
        model = transformers.LlamaForCausalLM(hf_config)
    elif config.architecture == "qwen2":
        hf_config = transformers.Qwen2Config(**fields)
        model = transformers.Qwen2ForCausalLM(hf_config)
    elif config.architecture == "qwen3":
        hf_config = transformers.Qwen3Config(attention_bias=False, **fields)
        model = transformers.Qwen3ForCausalLM(hf_config)
    else:
        hf_config = transformers.Phi3Config(pad_token_id=None, bos_token_id=None, eos_token_id=None, **fields)
        model = transformers.Phi3ForCausalLM(hf_config)
    model = model.float().eval()
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys
    # Only a tied head may be absent from the state dict; transformers then shares the embedding.
    assert set(result.missing_keys) == ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    else:
        assert torch.equal(model.lm_head.weight, state["lm_head.weight"])
    if config.fused_projections:
        assert torch.equal(model.model.layers[0].mlp.gate_up_proj.weight, state["model.layers.0.mlp.gate_up_proj.weight"])
    elif config.attention_bias:
        layer = model.model.layers[0].self_attn
        assert torch.equal(layer.q_proj.bias, state["model.layers.0.self_attn.q_proj.bias"])
        assert torch.equal(layer.k_proj.bias, state["model.layers.0.self_attn.k_proj.bias"])
    else:
        assert model.model.layers[0].self_attn.q_proj.bias is None
    if config.qk_norm:
        assert torch.equal(model.model.layers[1].self_attn.k_norm.weight, state["model.layers.1.self_attn.k_norm.weight"])
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "phi3"])
def tiny_pair(request):
    """(our tiny model, the transformers model with the same weights) for each architecture."""
    config = tiny_config(request.param)
    state = random_state(config, seed=3)
    return Transformer(config, state, torch.float32), hf_reference(config, state)


def prompt_tokens(vocab: int, n: int = 21, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_tiny_configs_cover_every_head_layout():
    """Llama is tied and bias-free, Qwen2 untied with q/k/v bias, Qwen3 untied, bias-free, with q/k norms, Phi-3
    untied with fused projections: the fixtures test different code paths."""
    llama, qwen, qwen3, phi3 = (tiny_config(arch) for arch in ("llama", "qwen2", "qwen3", "phi3"))
    assert phi3.fused_projections and not (llama.fused_projections or qwen.fused_projections or qwen3.fused_projections)
    assert llama.tie_word_embeddings and not llama.attention_bias and not llama.qk_norm
    assert not qwen.tie_word_embeddings and qwen.attention_bias and not qwen.qk_norm
    assert not qwen3.tie_word_embeddings and not qwen3.attention_bias and qwen3.qk_norm
    assert llama.num_attention_heads != llama.num_key_value_heads  # grouped-query attention


def test_tiny_prefill_logits_match_transformers(tiny_pair):
    ours, reference = tiny_pair
    tokens = prompt_tokens(ours.config.vocab_size)
    with torch.no_grad():
        expected = reference(tokens[None]).logits[0]
    logits = ours.forward(tokens, full_arena(ours.config, len(tokens), len(tokens)))
    assert_logits_close(logits, expected)
    # The model is far from trivial: the rows differ, so a broken position encoding could not pass.
    assert (expected[1:] - expected[:-1]).abs().max() > 1.0


def test_tiny_last_only_is_the_last_row(tiny_pair):
    ours, reference = tiny_pair
    tokens = prompt_tokens(ours.config.vocab_size, seed=2)
    with torch.no_grad():
        expected = reference(tokens[None]).logits[0, -1:]
    logits = ours.forward(tokens, full_arena(ours.config, len(tokens), len(tokens)), last_only=True)
    assert_logits_close(logits, expected)


def test_tiny_incremental_decode_matches_full_sequence(tiny_pair):
    """Prefill 12 tokens, then feed the rest one at a time: every row equals transformers' full-sequence row."""
    ours, reference = tiny_pair
    tokens = prompt_tokens(ours.config.vocab_size, n=20, seed=4)
    with torch.no_grad():
        expected = reference(tokens[None]).logits[0]
    split = 12
    arena = full_arena(ours.config, len(tokens), split)
    first = ours.forward(tokens[:split], arena)
    arena.commit(split)
    assert_logits_close(first, expected[:split])
    for t in range(split, len(tokens)):
        row = ours.forward(tokens[t : t + 1], arena)
        arena.commit(1)
        assert_logits_close(row, expected[t : t + 1])


def test_tiny_chunked_prefill_then_decode_matches_full_sequence(tiny_pair):
    """``prefill`` in chunks of 5 (chunk boundaries mid-prompt), then one row: the full sequence's last row."""
    ours, reference = tiny_pair
    tokens = prompt_tokens(ours.config.vocab_size, n=23, seed=5)
    with torch.no_grad():
        expected = reference(tokens[None]).logits[0, -1:]
    arena = full_arena(ours.config, len(tokens), 5)
    prefill(ours, arena, tokens[:-1].tolist(), chunk=5)
    assert arena.n_committed == len(tokens) - 1
    logits = ours.forward(tokens[-1:], arena)
    assert_logits_close(logits, expected)


# ------------------------------------------------------------------------------------------------ SmolLM2-135M
@pytest.fixture(scope="module")
def smollm2_reference(smollm2_path):
    """transformers' own reading of the SmolLM2 GGUF (dequantized to float32), with EOS stopping switched off."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model.generation_config.eos_token_id = None
    return model


REAL_PROMPT = (
    "The Eiffel Tower was built for the 1889 World's Fair in Paris. At first many artists disliked it, but today"
)


def test_smollm2_config_matches_transformers(smollm2_f32, smollm2_reference):
    ours, theirs = smollm2_f32.config, smollm2_reference.config
    assert ours.architecture == "llama"
    assert ours.vocab_size == theirs.vocab_size
    assert ours.hidden_size == theirs.hidden_size
    assert ours.num_hidden_layers == theirs.num_hidden_layers
    assert ours.num_attention_heads == theirs.num_attention_heads
    assert ours.num_key_value_heads == theirs.num_key_value_heads
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    assert ours.max_position_embeddings == 8192
    assert ours.rope_theta == pytest.approx(theirs.rope_parameters["rope_theta"])


def test_smollm2_logits_match_transformers(smollm2_f32, smollm2_reference):
    ids = smollm2_f32.tokenizer.encode(REAL_PROMPT, add_special_tokens=True)
    assert len(ids) >= 20
    tokens = torch.tensor(ids)
    with torch.no_grad():
        expected = smollm2_reference(tokens[None]).logits[0]
    model = smollm2_f32.model
    arena = full_arena(model.config, len(ids), len(ids))
    assert_logits_close(model.forward(tokens, arena), expected)


def test_smollm2_incremental_decode_matches_transformers(smollm2_f32, smollm2_reference):
    ids = smollm2_f32.tokenizer.encode(REAL_PROMPT, add_special_tokens=True)
    tokens = torch.tensor(ids)
    with torch.no_grad():
        expected = smollm2_reference(tokens[None]).logits[0]
    model = smollm2_f32.model
    split = len(ids) - 4
    arena = full_arena(model.config, len(ids), split)
    assert_logits_close(model.forward(tokens[:split], arena, last_only=True), expected[split - 1 : split])
    arena.commit(split)
    for t in range(split, len(ids)):
        row = model.forward(tokens[t : t + 1], arena)
        arena.commit(1)
        assert_logits_close(row, expected[t : t + 1])


GREEDY_PROMPTS = {
    # Reaches an EOS after ~34 tokens when decoded greedily: neither side may stop there.
    "eos-inside": "The capital of France is Paris. The capital of Germany is",
    "code": "def is_prime(n: int) -> bool:",
    "story": "Once upon a time, in a quiet little village, there",
}
GREEDY_NEW_TOKENS = 64


@pytest.fixture(scope="module")
def transformers_greedy(smollm2_f32, smollm2_reference) -> dict[str, list[int]]:
    """transformers' greedy ``generate`` for every prompt, in one batch (the prompts are all 12 tokens long, so
    there is no padding and each row is computed as it would be alone)."""
    tokenizer = smollm2_f32.tokenizer
    ids = {name: tokenizer.encode(text, add_special_tokens=True) for name, text in GREEDY_PROMPTS.items()}
    assert {len(v) for v in ids.values()} == {12}
    inputs = torch.tensor(list(ids.values()))
    generation = GenerationConfig(
        do_sample=False, max_new_tokens=GREEDY_NEW_TOKENS, eos_token_id=None,
        pad_token_id=tokenizer.token_id("pad_token"),
    )
    with torch.no_grad():
        output = smollm2_reference.generate(
            inputs, attention_mask=torch.ones_like(inputs), generation_config=generation
        )
    assert output.shape == (len(ids), 12 + GREEDY_NEW_TOKENS), "transformers stopped early: EOS stopping is on"
    return {name: row[12:].tolist() for name, row in zip(ids, output)}


@pytest.mark.parametrize("name", GREEDY_PROMPTS)
def test_smollm2_greedy_64_tokens_equal_transformers_generate(smollm2_f32, transformers_greedy, name):
    ids = smollm2_f32.tokenizer.encode(GREEDY_PROMPTS[name], add_special_tokens=True)
    model = smollm2_f32.model
    arena = full_arena(model.config, len(ids) + GREEDY_NEW_TOKENS, len(ids))
    ours = list(generate_tokens(model, arena, ids, max_new_tokens=GREEDY_NEW_TOKENS, sampling=SamplingParams()))
    theirs = transformers_greedy[name]

    assert len(ours) == GREEDY_NEW_TOKENS
    first_difference = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    assert first_difference is None, (
        f"first difference at new token {first_difference}: ours {ours[first_difference]}, "
        f"transformers {theirs[first_difference]}"
    )
    if name == "eos-inside":
        eos = smollm2_f32.tokenizer.eos_token_id
        assert eos in ours[:-1], "the prompt no longer reaches EOS, so EOS handling goes untested"
