"""RoPE scaling (linear, llama3, yarn; a GGUF's rope_freqs.weight) against transformers, and the refusals.

Tiny random Llamas are built from one Hugging Face config dictionary read by both sides (``ModelConfig.from_hf_dict``
and ``transformers.LlamaConfig``), with ``original_max_position_embeddings`` 64 and prompts of 224 tokens: with
head_dim 8 the four frequencies have wavelengths 6.3, 63, 628 and 6283 positions, so llama3 keeps the first, blends
the second and divides the last two, and YaRN's ramp spans the same range. Logits must match transformers float32
to 1e-4 of their largest magnitude through the native attention op in both position modes, while the unscaled RoPE
must miss by far more, so a scaling that is read but not applied fails.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
import transformers
from transformers import GenerationConfig

from conftest import random_state, tiny_config, write_gguf_model
from sparsespec.cache.arena import KVArena
from sparsespec.cache.policy import make_policy
from sparsespec.config import ModelConfig, RopeScaling
from sparsespec.errors import UserError
from sparsespec.generate import generate_tokens
from sparsespec.loading.load import load_model
from sparsespec.model import Transformer
from sparsespec.rope import Rope
from sparsespec.sampling import SamplingParams
from test_cli import assert_user_error, run_cli, write_hf_folder
from test_model_reference import REL_TOL, assert_logits_close

ORIGINAL = 64  # original_max_position_embeddings of every scaled config here
PROMPT_TOKENS = 224  # three and a half times ORIGINAL
# Weights for the greedy test: with conftest's scale 0.5 the tied embedding dominates and greedy decoding repeats
# one token. (Its attention is so sharp that the native op's float32 summation order alone moves logits by 1e-4.)
GREEDY_WEIGHT_SCALE = 2.0

SCALINGS = {
    # transformers 4's key and spelling, then transformers 5's
    "linear": {"rope_scaling": {"type": "linear", "factor": 4.0}},
    "llama3": {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                                   "rope_theta": 10000.0}},
    "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL}},
    "yarn-custom": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0,
                                        "original_max_position_embeddings": ORIGINAL, "attention_factor": 1.3,
                                        "truncate": False, "rope_theta": 10000.0}},
}


def hf_dict(**rope) -> dict:
    """The tiny Llama of ``conftest.tiny_config`` as a Hugging Face ``config.json`` dictionary, with ``rope``."""
    config = tiny_config("llama", max_position_embeddings=512)
    gemma_only = ("layer_types", "sliding_window", "local_rope_theta", "query_pre_attn_scalar")
    fields = {k: v for k, v in config.to_dict().items() if k not in ("architecture", "rope_scaling", *gemma_only)}
    return dict(fields, model_type="llama", **rope)


def transformers_llama(cfg: dict, state: dict[str, torch.Tensor]):
    """transformers' float32 Llama for the config dictionary ``cfg``, with the weights ``state``."""
    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields, attn_implementation="eager"))
    model = model.float().eval()
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    return model


def prompt(vocab: int, n: int = PROMPT_TOKENS, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def our_logits(config: ModelConfig, state, tokens: torch.Tensor, *, positions: str = "original") -> torch.Tensor:
    """``[T, vocab]`` logits of our float32 model on ``tokens`` with the full cache (prefill in chunks of 64)."""
    model = Transformer(config, state, torch.float32)
    arena = KVArena(config, make_policy("full"), dtype=torch.float32, max_tokens=len(tokens), max_block=64,
                    positions=positions)
    rows = []
    for first in range(0, len(tokens), 64):
        rows.append(model.forward(tokens[first: first + 64], arena))
        arena.commit(len(rows[-1]))
    return torch.cat(rows)


@pytest.fixture(scope="module", params=list(SCALINGS))
def scaled_pair(request):
    """(name, our config, state, transformers' logits on :func:`prompt`, transformers' model) for each scaling."""
    cfg = hf_dict(**SCALINGS[request.param])
    config = ModelConfig.from_hf_dict(cfg)
    state = random_state(config, seed=11)
    reference = transformers_llama(cfg, state)
    with torch.no_grad():
        expected = reference(prompt(config.vocab_size)[None]).logits[0]
    return request.param, config, state, expected, reference


@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("positions", ["original", "in-cache"])
def test_scaled_logits_match_transformers(scaled_pair, positions):
    """Every row, up to position 223, through the native op's tables, keys rotated when written (original) or at
    attention time (in-cache: the ranks of the full cache are the positions)."""
    _, config, state, expected, _ = scaled_pair
    logits = our_logits(config, state, prompt(config.vocab_size), positions=positions)
    assert_logits_close(logits, expected)


def test_unscaled_rope_misses_transformers_by_far(scaled_pair):
    """The same weights with RoPE as trained: far outside the tolerance, so the test above can fail."""
    _, config, state, expected, _ = scaled_pair
    assert config.rope_scaling is not None
    unscaled = our_logits(dataclasses.replace(config, rope_scaling=None), state, prompt(config.vocab_size))
    assert (unscaled - expected).abs().max() > 100 * REL_TOL * expected.abs().max()


def test_the_scaling_changes_the_tables(scaled_pair):
    """What the native op reads: the arena's cos/sin rows are the scaled ones (inverse frequencies times
    position, times YaRN's attention factor), within an ulp of transformers' float32 ones, and differ from the
    unscaled rows."""
    name, config, _, _, reference = scaled_pair
    rope = KVArena(config, make_policy("full"), dtype=torch.float32, max_tokens=8).rope
    cos, sin = rope.rows(0, PROMPT_TOKENS)
    rotary = reference.model.rotary_emb
    positions = torch.arange(PROMPT_TOKENS)[None]
    with torch.no_grad():
        their_cos, their_sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    assert torch.equal(torch.tensor(rope.inv_freq), rotary.inv_freq)
    torch.testing.assert_close(cos, their_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, their_sin[0], rtol=0, atol=1e-6)
    plain_cos, _ = Rope.of(config.head_dim, config.rope_theta).rows(0, PROMPT_TOKENS)
    assert (cos - plain_cos).abs().max() > 0.5
    later_cos, later_sin = rope.rows(PROMPT_TOKENS - 10, 10)  # rows from any position are the same rows
    assert torch.equal(later_cos, cos[-10:]) and torch.equal(later_sin, sin[-10:])
    assert rope.attention_factor == pytest.approx(rotary.attention_scaling)
    assert (rope.attention_factor != 1.0) == name.startswith("yarn")


@pytest.mark.parametrize("name", list(SCALINGS))
def test_scaled_greedy_equals_transformers_generate(name):
    """32 greedy tokens after the 224-token prompt (positions 224-255), token for token."""
    cfg = hf_dict(**SCALINGS[name])
    config = ModelConfig.from_hf_dict(cfg)
    state = random_state(config, seed=11, scale=GREEDY_WEIGHT_SCALE)
    reference = transformers_llama(cfg, state)
    ids = prompt(config.vocab_size).tolist()
    new = 32
    generation = GenerationConfig(do_sample=False, max_new_tokens=new, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        theirs = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    generation_config=generation)[0, len(ids):].tolist()
    model = Transformer(config, state, torch.float32)
    arena = KVArena(config, make_policy("full"), dtype=torch.float32, max_tokens=len(ids) + new, max_block=64)
    ours = list(generate_tokens(model, arena, ids, max_new_tokens=new, sampling=SamplingParams(), prefill_chunk=64))
    assert ours == theirs
    assert len(set(ours)) > 3  # not a constant run, which any position encoding could produce


def test_config_survives_the_weight_store_round_trip():
    """The weight store stores ``to_dict`` as JSON: the scaling (tuples included) comes back equal."""
    config = dataclasses.replace(tiny_config(), rope_scaling=RopeScaling("yarn", factor=4.0, attention_factor=1.2,
                                                                         original_max_position_embeddings=64,
                                                                         freq_factors=(1.0, 2.0, 3.0, 4.0)))
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert ModelConfig.from_dict(json.loads(json.dumps(tiny_config().to_dict()))) == tiny_config()


# ------------------------------------------------------------------------------------------------- GGUF files
# The tiny Llama's GGUF metadata, without RoPE scaling.
GGUF_META = {"general.architecture": "llama", "llama.embedding_length": 32, "llama.attention.head_count": 4,
             "llama.feed_forward_length": 64, "llama.block_count": 2, "llama.context_length": 512,
             "llama.attention.layer_norm_rms_epsilon": 1e-6, "llama.vocab_size": 97}


def llama3_rope_freqs(head_dim: int, theta: float, factor: float, low: float, high: float, original: int):
    """``rope_freqs.weight`` as llama.cpp's convert_hf_to_gguf.py writes it for a Llama 3.1 model."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_llama_gguf(path, config: ModelConfig, state: dict[str, torch.Tensor], rope_freqs=None, **keys):
    """A float32 llama GGUF of ``state`` with ``rope_freqs`` and the extra ``llama.<key>`` metadata ``keys`` (dots
    written as double underscores)."""
    return write_gguf_model(path, config, state, rope_dims=config.head_dim,
                            tensors=None if rope_freqs is None else {"rope_freqs.weight": rope_freqs},
                            keys={key.replace("__", "."): value for key, value in keys.items()})


def test_llama31_gguf_rope_freqs_match_transformers_llama3(tmp_path):
    """A Llama 3.1-style GGUF (architecture llama, no scaling key, a rope_freqs.weight tensor) loads with those
    divisors and gives transformers' llama3 logits; the same file without the tensor does not."""
    cfg = hf_dict(**SCALINGS["llama3"])
    scaled = ModelConfig.from_hf_dict(cfg)
    state = random_state(scaled, seed=11)
    freqs = llama3_rope_freqs(scaled.head_dim, scaled.rope_theta, 8.0, 1.0, 4.0, ORIGINAL)
    assert 1.0 in freqs and 8.0 in freqs and ((freqs > 1) & (freqs < 8)).any()  # all three branches
    path = write_llama_gguf(tmp_path / "llama31.gguf", scaled, state, rope_freqs=freqs)

    loaded = load_model(str(path), torch.float32, "dense", tokenizer=False, weight_store=False)
    assert loaded.config.rope_scaling == RopeScaling("none", freq_factors=tuple(freqs.tolist()))
    tokens = prompt(scaled.vocab_size)
    with torch.no_grad():
        expected = transformers_llama(cfg, state)(tokens[None]).logits[0]
    arena = KVArena(loaded.config, make_policy("full"), dtype=torch.float32, max_tokens=len(tokens),
                    max_block=len(tokens))
    assert_logits_close(loaded.model.forward(tokens, arena), expected)

    plain = write_llama_gguf(tmp_path / "plain.gguf", scaled, state)
    unscaled = load_model(str(plain), torch.float32, "dense", tokenizer=False, weight_store=False)
    assert unscaled.config.rope_scaling is None
    arena = KVArena(unscaled.config, make_policy("full"), dtype=torch.float32, max_tokens=len(tokens),
                    max_block=len(tokens))
    assert (unscaled.model.forward(tokens, arena) - expected).abs().max() > 100 * REL_TOL * expected.abs().max()


def test_gguf_linear_and_yarn_keys_match_the_hf_scalings(tmp_path):
    """llama.cpp's scaling keys give the configs the Hugging Face dictionaries give (llama.cpp's defaults: beta
    32 / 1, attention factor 0.1 ln(factor) + 1, bounds rounded outwards)."""
    config = tiny_config()
    state = random_state(config)
    linear = write_llama_gguf(tmp_path / "linear.gguf", config, state, rope__scaling__type="linear",
                              rope__scaling__factor=4.0)
    yarn = write_llama_gguf(tmp_path / "yarn.gguf", config, state, rope__scaling__type="yarn",
                            rope__scaling__factor=8.0, rope__scaling__original_context_length=ORIGINAL)
    from sparsespec.loading.source import read_gguf_config

    assert read_gguf_config(linear).rope_scaling == ModelConfig.from_hf_dict(hf_dict(**SCALINGS["linear"])).rope_scaling
    assert read_gguf_config(yarn).rope_scaling == ModelConfig.from_hf_dict(hf_dict(**SCALINGS["yarn"])).rope_scaling


def test_gguf_scaling_factor_without_type_is_linear_as_in_llama_cpp():
    assert ModelConfig.from_gguf_metadata(GGUF_META, set()).rope_scaling is None
    scaled = ModelConfig.from_gguf_metadata({**GGUF_META, "llama.rope.scaling.factor": 2.0}, set())
    assert scaled.rope_scaling == RopeScaling("linear", factor=2.0)
    assert ModelConfig.from_gguf_metadata({**GGUF_META, "llama.rope.scaling.factor": 1.0}, set()).rope_scaling is None


# --------------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("rope, words", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, ["'dynamic'", "not supported"]),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}},
     ["'longrope'", "not supported"]),
    ({"rope_parameters": {"rope_type": "proportional", "factor": 2.0}}, ["'proportional'", "not supported"]),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}}, ["llama3", "high_freq_factor"]),
    ({"rope_scaling": {"rope_type": "linear"}}, ["linear", "factor"]),
    ({"partial_rotary_factor": 0.5}, ["partial_rotary_factor"]),
], ids=["dynamic", "longrope", "proportional", "llama3-incomplete", "linear-without-factor", "partial-rotary"])
def test_hf_scalings_not_implemented_are_refused(rope, words):
    with pytest.raises(UserError) as error:
        ModelConfig.from_hf_dict(hf_dict(**rope))
    for word in words:
        assert word in str(error.value)


@pytest.mark.parametrize("keys, words", [
    ({"rope.scaling.type": "longrope"}, ["'longrope'", "not supported"]),
    ({"rope.scaling.type": "ntk-by-parts"}, ["'ntk-by-parts'", "not supported"]),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}, ["original_context_length"]),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 64,
      "rope.scaling.yarn_log_multiplier": 0.1}, ["yarn_log_multiplier"]),
], ids=["longrope", "unknown", "yarn-without-context", "yarn-log-multiplier"])
def test_gguf_scalings_not_implemented_are_refused(keys, words):
    with pytest.raises(UserError) as error:
        ModelConfig.from_gguf_metadata({**GGUF_META, **{f"llama.{k}": v for k, v in keys.items()}}, set())
    for word in words:
        assert word in str(error.value)


def test_gguf_rope_freqs_of_the_wrong_length_are_refused():
    with pytest.raises(UserError, match="3 RoPE frequency factors for head_dim 8; it needs 4"):
        ModelConfig.from_gguf_metadata(GGUF_META, {"rope_freqs.weight"}, rope_freqs=(1.0, 2.0, 4.0))


def test_unknown_architectures_are_refused():
    with pytest.raises(UserError, match="Unsupported architecture 'gemma3'"):
        ModelConfig.from_hf_dict(dict(hf_dict(), model_type="gemma3"))
    with pytest.raises(UserError, match="Unsupported architecture 'llama4'"):
        ModelConfig.from_gguf_metadata({"general.architecture": "llama4"}, set())


def test_cli_refuses_a_dynamic_scaling_in_one_sentence(capsys, tmp_path):
    folder = write_hf_folder(tmp_path / "dynamic", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert_user_error(run_cli(capsys, "generate", "--model", str(folder), "--prompt", "w1 w2"), "'dynamic'")


def test_cli_refuses_a_longrope_gguf_in_one_sentence(capsys, tmp_path):
    config = tiny_config()
    path = write_llama_gguf(tmp_path / "longrope.gguf", config, random_state(config),
                            rope__scaling__type="longrope")
    assert_user_error(run_cli(capsys, "generate", "--model", str(path), "--prompt", "w1 w2"), "'longrope'")


@pytest.mark.parametrize("first", [0, 40_000, 3_000_000])
def test_rope_rows_are_float32_angles_correctly_rounded(first):
    """The rows every rotation reads: the float32 angle (position times inverse frequency, rounded to float32, as
    transformers computes it), its cos and sin from float64 rounded once, times the attention factor; from any first
    position (a block far into a run gets rows for its own positions)."""
    rope = Rope.of(64, 500000.0, RopeScaling("yarn", factor=4.0, attention_factor=1.2,
                                               original_max_position_embeddings=64))
    cos, sin = rope.rows(first, 300)
    angles = (torch.arange(first, first + 300, dtype=torch.float32)[:, None] * torch.tensor(rope.inv_freq)).double()
    angles = torch.cat((angles, angles), dim=-1)
    assert torch.equal(cos, (angles.cos().float() * rope.attention_factor).float())
    assert torch.equal(sin, (angles.sin().float() * rope.attention_factor).float())
