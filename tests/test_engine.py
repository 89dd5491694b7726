"""Loading from a Hugging Face folder, streaming text with stop strings, and budgeted vs full caches on real weights."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from sparsespec.cache import KVArena, make_policy
from sparsespec.engine import CacheOptions, RunStats, run_generation
from sparsespec.generate import stream_text
from sparsespec.loading.source import resolve_model
from sparsespec.loading.weights import load_state
from sparsespec.model import Transformer
from sparsespec.sampling import SamplingParams

from conftest import random_state, tiny_config


def test_hugging_face_folder_loads_the_same_model(tmp_path):
    config = tiny_config("qwen2")
    state = random_state(config, seed=3)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "rope_theta": config.rope_theta, "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings, "tie_word_embeddings": False,
    }))
    source = resolve_model(str(tmp_path))
    loaded_config, loaded_state = load_state(source)
    assert loaded_config == config
    tokens = torch.tensor([5, 17, 3, 42, 8])
    outputs = []
    for model in (Transformer(config, state, torch.float32), Transformer(loaded_config, loaded_state, torch.float32)):
        cache = KVArena(config, make_policy("full"), dtype=torch.float32, max_tokens=8, max_block=8)
        outputs.append(model.forward(tokens, cache))
    assert torch.equal(outputs[0], outputs[1])


class CharTokenizer:
    """Token id = character code: enough to exercise streaming and stop strings."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def test_stream_text_stops_before_a_stop_string_split_across_tokens():
    tokens = [ord(c) for c in "Hello world. STOP here"]
    pieces = list(stream_text(iter(tokens), CharTokenizer(), stop_strings=["STOP"]))
    assert "".join(pieces) == "Hello world. "


def test_stream_text_ends_at_eos_and_emits_held_back_text():
    tokens = [ord(c) for c in "abcST"] + [0] + [ord("x")]
    assert "".join(stream_text(iter(tokens), CharTokenizer(), stop_strings=["STOP"], eos_ids={0})) == "abcST"


def test_smollm2_budget_larger_than_the_run_equals_full_cache(smollm2_f32):
    """policy=full and a hybrid cache that never needs to evict are the same model: same greedy tokens."""
    ids = smollm2_f32.tokenizer.encode("Once upon a time, in a small village by the sea,")
    outputs = []
    for cache in (CacheOptions(), CacheOptions(make_policy("hybrid", 256))):
        stats = RunStats()
        outputs.append(list(run_generation(smollm2_f32, ids, max_new_tokens=48, sampling=SamplingParams(),
                                           cache=cache, stats=stats)))
        assert stats.evicted_tokens == 0
    assert outputs[0] == outputs[1]


def test_smollm2_self_speculation_is_exact(smollm2_f32):
    """Greedy self-speculation (draft = same weights, tiny streaming cache) over a sparse target == autoregressive."""
    from sparsespec.engine import DraftOptions

    ids = smollm2_f32.tokenizer.encode("def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n")
    target_cache = CacheOptions(make_policy("hybrid", 48), "original", prefill_chunk=16)
    draft = DraftOptions(smollm2_f32, CacheOptions(make_policy("streaming", 16)), gamma=4, is_self=True)
    plain = list(run_generation(smollm2_f32, ids, max_new_tokens=256, sampling=SamplingParams(), cache=target_cache))
    stats = RunStats()
    speculative = list(run_generation(smollm2_f32, ids, max_new_tokens=256, sampling=SamplingParams(),
                                      cache=target_cache, draft=draft, stats=stats))
    assert speculative == plain
    assert stats.evicted_tokens > 0 and 0 < stats.speculative.acceptance_rate < 1
