"""The ``sparsespec generate`` command, in-process: user mistakes give exit code 2 and one clear sentence on
stderr, never a traceback; good runs print what they promise (streamed text, or one JSON object)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import random_state, tiny_config
from sparsespec.cli import main
from sparsespec.errors import UserError
from sparsespec.loading.load import load_model

PROMPT = "The capital of France is"
LONG_PROMPT = (
    "In the small harbour town the fishermen rose before dawn, mended their nets by lantern light, and argued "
    "about the weather, the price of herring, and whether the old lighthouse keeper would ever retire."
)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_user_error(result: tuple[int, str, str], *words: str) -> str:
    """Exit code 2, nothing on stdout, and one ``sparsespec: error:`` line on stderr that names ``words``."""
    code, out, err = result
    assert "Traceback" not in err
    assert code == 2, f"exit code {code}, stderr {err!r}"
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {err!r}"
    line = lines[0]
    assert line.startswith("sparsespec: error: ")
    for word in words:
        assert word.lower() in line.lower(), f"{word!r} not in {line!r}"
    return line


@pytest.fixture
def cached_smollm2(monkeypatch, smollm2_f32):
    """Make ``--model smollm2-135m --dtype float32`` reuse the session's loaded model (loading takes seconds);
    every other model reference is loaded for real."""
    import sparsespec.loading.load as load

    real_load = load.load_model

    def load_model(ref, dtype=torch.bfloat16, weights="dense", tokenizer=True, **options):
        if ref == "smollm2-135m" and dtype == torch.float32 and weights == "dense" and tokenizer:
            return smollm2_f32
        return real_load(ref, dtype, weights, tokenizer, **options)

    monkeypatch.setattr(load, "load_model", load_model)
    return smollm2_f32


# ------------------------------------------------------------------------------------------ files written here
def write_gguf(path: Path, arch: str = "llama", *, heads: int = 2, vocab: int = 16,
               shapes: dict[str, tuple[int, ...]] | None = None, types: dict[str, int] | None = None) -> Path:
    """A complete one-layer GGUF (hidden 8, GQA 2:1, float32 tensors) without tokenizer metadata; ``shapes`` and
    ``types`` (GGML type ids written as they are) replace those of the tensors they name."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(heads)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    rng = np.random.default_rng(0)
    tensors = {
        "token_embd.weight": (vocab, 8), "output_norm.weight": (8,),
        "blk.0.attn_norm.weight": (8,), "blk.0.ffn_norm.weight": (8,),
        "blk.0.attn_q.weight": (8, 8), "blk.0.attn_k.weight": (4, 8), "blk.0.attn_v.weight": (4, 8),
        "blk.0.attn_output.weight": (8, 8),
        "blk.0.ffn_gate.weight": (16, 8), "blk.0.ffn_up.weight": (16, 8), "blk.0.ffn_down.weight": (8, 16),
    } | (shapes or {})
    for name, shape in tensors.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32), raw_dtype=(types or {}).get(name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def word_tokenizer(words: list[str]):
    """A whitespace word-level fast tokenizer whose ids are the positions in ``words``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=words[0])


def write_hf_folder(folder: Path, **config_overrides) -> Path:
    """A tiny Llama as a Hugging Face folder: config.json, model.safetensors and a 97-word tokenizer."""
    from safetensors.torch import save_file

    config = tiny_config("llama")
    folder.mkdir(parents=True, exist_ok=True)
    save_file(random_state(config), str(folder / "model.safetensors"))
    hf = dict(
        model_type="llama", vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=True,
    )
    hf.update(config_overrides)
    (folder / "config.json").write_text(json.dumps(hf))
    word_tokenizer(["[UNK]"] + [f"w{i}" for i in range(1, config.vocab_size)]).save_pretrained(str(folder))
    return folder


# ------------------------------------------------------------------------------------------------ model errors
def test_unknown_model_name(capsys):
    assert_user_error(run_cli(capsys, "generate", "--model", "llama-9000", "--prompt", PROMPT),
                      "unknown model", "llama-9000", "smollm2-135m")


def test_missing_gguf_path(capsys, tmp_path):
    missing = tmp_path / "nowhere.gguf"
    assert_user_error(run_cli(capsys, "generate", "--model", str(missing), "--prompt", PROMPT),
                      str(missing), "does not exist")


def test_folder_without_config(capsys, tmp_path):
    assert_user_error(run_cli(capsys, "generate", "--model", str(tmp_path), "--prompt", PROMPT), "config.json")


def test_truncated_real_gguf(capsys, tmp_path, smollm2_path):
    """The first megabyte of SmolLM2: the metadata (the vocabulary alone is larger) is cut off."""
    truncated = tmp_path / "smollm2-head.gguf"
    with open(smollm2_path, "rb") as source:
        truncated.write_bytes(source.read(1_000_000))
    assert_user_error(run_cli(capsys, "generate", "--model", str(truncated), "--prompt", PROMPT),
                      str(truncated), "not a readable GGUF file", "truncated or corrupt")


@pytest.mark.parametrize("keep", ["half", "all-but-64-bytes", "header-only"])
def test_truncated_tiny_gguf(capsys, tmp_path, keep):
    """A complete GGUF cut inside its tensor data (or right after the magic)."""
    data = write_gguf(tmp_path / "full.gguf").read_bytes()
    size = {"half": len(data) // 2, "all-but-64-bytes": len(data) - 64, "header-only": 8}[keep]
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[:size])
    assert_user_error(run_cli(capsys, "generate", "--model", str(truncated), "--prompt", PROMPT),
                      "truncated or corrupt")


@pytest.mark.parametrize("content", [b"", b"GGUF", bytes(np.random.default_rng(0).integers(0, 256, 4096, np.uint8))],
                         ids=["empty", "magic-only", "random"])
def test_corrupt_gguf(capsys, tmp_path, content):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(content)
    assert_user_error(run_cli(capsys, "generate", "--model", str(corrupt), "--prompt", PROMPT),
                      "not a readable GGUF file")


@pytest.mark.parametrize("arch", ["gpt2", "mamba"])
def test_unsupported_gguf_architecture(capsys, tmp_path, arch):
    path = write_gguf(tmp_path / f"{arch}.gguf", arch)
    assert_user_error(run_cli(capsys, "generate", "--model", str(path), "--prompt", PROMPT),
                      "unsupported architecture", repr(arch), "llama", "qwen2")


def test_gguf_without_tokenizer(capsys, tmp_path):
    path = write_gguf(tmp_path / "no-tokenizer.gguf")
    assert_user_error(run_cli(capsys, "generate", "--model", str(path), "--prompt", PROMPT, "--dtype", "float32"),
                      "cannot build a tokenizer", str(path))


def test_hf_folder_with_unsupported_model_type(capsys, tmp_path):
    folder = write_hf_folder(tmp_path / "gpt2", model_type="gpt2")
    assert_user_error(run_cli(capsys, "generate", "--model", str(folder), "--prompt", "w1 w2"),
                      "unsupported architecture", "gpt2")


def test_gguf_with_zero_heads(capsys, tmp_path):
    path = write_gguf(tmp_path / "zero-heads.gguf", heads=0)
    assert_user_error(run_cli(capsys, "generate", "--model", str(path), "--prompt", PROMPT), "head")


@pytest.mark.parametrize("weights", ["dense", "native"])
@pytest.mark.parametrize(("damage", "says"), [
    (dict(shapes={"blk.0.attn_q.weight": (2, 4, 8)}), ("blk.0.attn_q.weight", "has 3 dimensions")),
    (dict(types={"blk.0.ffn_up.weight": 99}), ("blk.0.ffn_up.weight", "GGML type 99", "does not know")),
], ids=["3-d-tensor", "unknown-type"])
def test_gguf_with_a_tensor_the_loaders_cannot_take(capsys, tmp_path, damage, says, weights):
    path = write_gguf(tmp_path / "odd.gguf", **damage)
    assert_user_error(run_cli(capsys, "generate", "--model", str(path), "--prompt", PROMPT, "--weights", weights),
                      str(path), *says)


@pytest.mark.parametrize("activations", ["float", "int8"])
def test_the_activations_flag_applies_to_weights_quantized_from_floats(capsys, smollm2_path, activations):
    """``--weights int8`` (the file's weights as Q8_0 blocks) multiplies the activations ``--activations`` says."""
    code, out, err = run_cli(capsys, "generate", "--prompt", PROMPT, "-n", "2", "--json", "--weights", "int8",
                             "--activations", activations, "--ignore-eos")
    assert code == 0, err
    result = parse_json_output(out)
    assert result["weights"] == "int8" and result["activations"] == activations


def test_gguf_header_reader_agrees_with_the_gguf_package(tmp_path, smollm2_path):
    """The header-only reader (the simulator's and ``ppl``'s source of shapes) against ``gguf``'s full reader."""
    from sparsespec.loading.source import SkippedArray, open_gguf, read_gguf_header

    for path in (smollm2_path, write_gguf(tmp_path / "tiny.gguf")):
        metadata, names = read_gguf_header(path)
        reader = open_gguf(path)
        reference = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}  # reader's own
        assert set(metadata) == set(reference)
        for key, value in metadata.items():
            if isinstance(value, SkippedArray):
                assert len(value) == len(reference[key]), key
            else:
                assert value == reference[key], key
        assert names == {t.name for t in reader.tensors}
    assert len(read_gguf_header(smollm2_path)[0]["tokenizer.ggml.tokens"]) == 49152


@pytest.mark.parametrize("damage", ["empty", "magic-only", "random", "cut-in-metadata", "real-cut-in-vocabulary"])
def test_gguf_header_reader_rejects_damaged_files(tmp_path, smollm2_path, damage):
    from sparsespec.loading.source import read_gguf_header

    tiny = write_gguf(tmp_path / "tiny.gguf").read_bytes()
    content = {
        "empty": b"", "magic-only": b"GGUF",
        "random": bytes(np.random.default_rng(0).integers(0, 256, 4096, np.uint8)),
        "cut-in-metadata": tiny[:100],
        "real-cut-in-vocabulary": smollm2_path.read_bytes()[:1_000_000],
    }[damage]
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(content)
    with pytest.raises(UserError, match="not a readable GGUF file"):
        read_gguf_header(damaged)


@pytest.mark.parametrize(
    "overrides",
    [dict(num_attention_heads=0, head_dim=None), dict(vocab_size="ninety-seven")],
    ids=["zero-heads", "text-vocab-size"],
)
def test_hf_folder_with_bad_config_values(capsys, tmp_path, overrides):
    folder = write_hf_folder(tmp_path / "bad", **overrides)
    assert_user_error(run_cli(capsys, "generate", "--model", str(folder), "--prompt", "w1 w2"), "config")


def test_hf_folder_with_non_object_config(capsys, tmp_path):
    folder = write_hf_folder(tmp_path / "list")
    (folder / "config.json").write_text("[1, 2, 3]")
    assert_user_error(run_cli(capsys, "generate", "--model", str(folder), "--prompt", "w1 w2"), "config")


def test_hf_folder_whose_weights_contradict_config(capsys, tmp_path):
    folder = write_hf_folder(tmp_path / "mismatch", head_dim=16)  # the weights were made for head_dim 8
    assert_user_error(run_cli(capsys, "generate", "--model", str(folder), "--prompt", "w1 w2", "--dtype", "float32"),
                      "shape")


# ------------------------------------------------------------------------------------------------ prompt errors
@pytest.mark.parametrize("prompt_args", [[], ["--prompt", ""], ["--prompt", "  \n\t "]], ids=["none", "empty", "blank"])
def test_empty_prompt(capsys, prompt_args):
    assert_user_error(run_cli(capsys, "generate", *prompt_args), "prompt is empty")


def test_empty_prompt_file(capsys, tmp_path):
    empty = tmp_path / "prompt.txt"
    empty.write_text("\n")
    assert_user_error(run_cli(capsys, "generate", "--prompt-file", str(empty)), "prompt is empty")


def test_missing_prompt_file(capsys, tmp_path):
    missing = tmp_path / "prompt.txt"
    assert_user_error(run_cli(capsys, "generate", "--prompt-file", str(missing)),
                      "cannot read --prompt-file", str(missing), "no such file")


def test_prompt_file_not_utf8(capsys, tmp_path):
    binary = tmp_path / "prompt.bin"
    binary.write_bytes(b"\xff\xfe\x00caf\xe9\x80")
    assert_user_error(run_cli(capsys, "generate", "--prompt-file", str(binary)), "--prompt-file", "utf-8")


def test_prompt_plus_new_tokens_beyond_context(capsys, cached_smollm2):
    line = assert_user_error(
        run_cli(capsys, "generate", "--prompt", PROMPT, "--max-new-tokens", "9000", "--dtype", "float32"),
        "exceeds", "smollm2-135m", "context of 8192 tokens",
    )
    n_prompt = len(cached_smollm2.tokenizer.encode(PROMPT, add_special_tokens=True))
    assert f"({n_prompt + 9000} tokens)" in line


def test_budget_beyond_context(capsys, cached_smollm2):
    assert_user_error(
        run_cli(capsys, "generate", "--prompt", PROMPT, "--policy", "window", "--budget", "9000", "-n", "4",
                "--dtype", "float32"),
        "--budget 9000", "context of 8192",
    )


@pytest.mark.parametrize("budget", ["9000", "8190"])
def test_in_cache_ranks_beyond_context(capsys, cached_smollm2, budget):
    """In-cache ranks run up to budget + staged rows − 1: 8190 + the prompt's ~8 staged rows pass 8192 too."""
    assert_user_error(
        run_cli(capsys, "generate", "--prompt", PROMPT, "--policy", "window", "--budget", budget, "--positions",
                "in-cache", "-n", "4", "--dtype", "float32"),
        "--positions in-cache", f"--budget {budget}", "context of 8192",
    )


@pytest.mark.parametrize("value", ["0", "-5"])
def test_max_new_tokens_below_one(capsys, cached_smollm2, value):
    assert_user_error(run_cli(capsys, "generate", "--prompt", PROMPT, "-n", value, "--dtype", "float32"),
                      "--max-new-tokens", "at least 1")


# ------------------------------------------------------------------------------------------------ flag errors
# Rejected before any model is loaded.
INVALID_FLAGS = [
    (["--temperature", "-1"], ["--temperature", "-1.0"]),
    (["--top-p", "0"], ["--top-p", "(0, 1]", "0.0"]),
    (["--top-p", "1.5"], ["--top-p", "1.5"]),
    (["--top-k", "-3"], ["--top-k", "-3"]),
    (["--draft", "self", "--gamma", "0"], ["--gamma", "from 1 to 64", "got 0"]),
    (["--draft", "self", "--gamma", "1000000"], ["--gamma", "from 1 to 64", "got 1000000"]),
    (["--budget", "256", "--recall-pages", "100000"], ["--recall-pages", "from 1 to 1024", "got 100000"]),
    (["--budget", "256", "--recall-pages", "0"], ["--recall-pages", "from 1 to 1024", "got 0"]),
    (["--threads", "100000"], ["--threads", "from 1 to", "per core", "got 100000"]),
    (["--draft", "self", "--gamma", "many"], ["--gamma", "'many'"]),
    (["--policy", "hybrid", "--budget", "2"], ["budget of 2"]),
    (["--policy", "hybrid", "--budget", "5"], ["budget of 5", "heavy hitters"]),
    (["--policy", "lru", "--budget", "64"], ["unknown cache policy", "'lru'", "hybrid"]),
    (["--policy", "window"], ["'window'", "needs --budget"]),
    (["--policy", "window", "--window", "-4"], ["--window", "negative", "-4"]),
    (["--policy", "window", "--budget", "-8"], ["--budget", "negative"]),
    (["--policy", "streaming", "--budget", "16", "--heavy", "4"], ["keeps no heavy hitters"]),
    (["--policy", "hybrid", "--budget", "10", "--sinks", "4", "--heavy", "3", "--window", "2"],
     ["does not match --budget 10"]),
    (["--prefill-chunk", "0"], ["--prefill-chunk", "at least 1"]),
    (["--threads", "0"], ["--threads", "from 1 to", "got 0"]),
    # Flags that would do nothing in this combination.
    (["--gamma", "2"], ["--gamma", "nothing without --draft"]),
    (["--draft-budget", "16", "--draft-weights", "int4"], ["--draft-weights, --draft-budget", "without --draft"]),
    (["--draft-kv-dtype", "int8"], ["--draft-kv-dtype", "nothing without --draft"]),
    (["--draft-kv-recent", "8"], ["--draft-kv-recent", "nothing without --draft"]),
    (["--kv-recent", "8"], ["--kv-recent", "--kv-dtype auto", "drop it"]),
    (["--kv-dtype", "bf16", "--kv-recent", "0"], ["--kv-recent", "--kv-dtype bf16", "drop it"]),
    (["--kv-dtype", "int4", "--kv-recent", "-1"], ["--kv-recent", "0 or more"]),
    (["--draft", "self", "--draft-weights", "int4"], ["--draft self", "--draft-weights"]),
    (["--top-k", "5"], ["--top-k", "nothing without sampling", "temperature"]),
    (["--top-p", "0.9", "--seed", "3"], ["--top-p, --seed", "temperature 0"]),
    (["--positions", "in-cache"], ["--positions in-cache", "full cache"]),
    (["--prompt-file", "prompt.txt"], ["--prompt", "--prompt-file", "not both"]),
]


@pytest.mark.parametrize("flags, words", [pytest.param(f, w, id=" ".join(f)) for f, w in INVALID_FLAGS])
def test_invalid_flags(capsys, flags, words):
    """Rejected before any model is loaded (so also where no model is fetched)."""
    assert_user_error(run_cli(capsys, "generate", "--prompt", PROMPT, *flags), *words)


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--draft-budget", "2"], ["budget of 2"]),
        (["--draft-policy", "lru"], ["unknown cache policy", "'lru'"]),
        (["--draft-window", "-1", "--draft-budget", "16"], ["--draft-window", "negative"]),
    ],
    ids=["budget-2", "policy-lru", "window--1"],
)
def test_invalid_draft_cache_flags(capsys, cached_smollm2, flags, words):
    """The draft's cache flags (checked once the target is loaded)."""
    assert_user_error(
        run_cli(capsys, "generate", "--prompt", PROMPT, "--dtype", "float32", "--draft", "self", *flags), *words
    )


# ----------------------------------------------------------------------------------------- draft vocabularies
def test_draft_with_other_vocabulary(capsys, tmp_path, cached_smollm2):
    draft = write_hf_folder(tmp_path / "tiny-draft")
    assert_user_error(
        run_cli(capsys, "generate", "--prompt", PROMPT, "-n", "4", "--dtype", "float32", "--draft", str(draft)),
        "vocabulary has 97 entries", "49152", "same vocabulary",
    )


def test_check_same_vocabulary_sizes():
    from sparsespec.speculative import check_same_vocabulary

    with pytest.raises(UserError, match="97 entries and the target's 49152"):
        check_same_vocabulary(None, None, 49152, 97)


def test_check_same_vocabulary_tokens():
    """Equal sizes, one token spelled differently: the message names it."""
    from sparsespec.speculative import check_same_vocabulary

    target = word_tokenizer(["<unk>", "alpha", "beta", "gamma"])
    draft = word_tokenizer(["<unk>", "alpha", "BETA", "gamma"])
    check_same_vocabulary(target, word_tokenizer(["<unk>", "alpha", "beta", "gamma"]), 4, 4)
    check_same_vocabulary(target, target, 4, 4)
    with pytest.raises(UserError) as info:
        check_same_vocabulary(target, draft, 4, 4)
    message = str(info.value)
    assert "id 2" in message and ("'beta'" in message or "'BETA'" in message)
    assert "\n" not in message


# ---------------------------------------------------------------------------------------------------- good runs
JSON_KEYS = {"text", "new_tokens", "prompt_tokens", "tokens_per_s", "kv_cache_bytes", "evicted_tokens",
             "policy", "budget", "model"}


def parse_json_output(out: str) -> dict:
    lines = out.splitlines()
    assert len(lines) == 1, f"expected one JSON line, got {out!r}"
    return json.loads(lines[0])


def test_generate_json_loads_the_real_model(capsys, smollm2_path):
    """No cached model here: fixture name → GGUF → weights and tokenizer, as a user runs it."""
    code, out, err = run_cli(capsys, "generate", "--model", "smollm2-135m", "--prompt", PROMPT, "-n", "8",
                             "--json", "--dtype", "float32", "--threads", "2", "--ignore-eos")
    assert code == 0, err
    assert "Traceback" not in err
    result = parse_json_output(out)
    assert JSON_KEYS <= result.keys()
    assert result["new_tokens"] == 8
    assert result["prompt_tokens"] == 5
    assert isinstance(result["text"], str) and result["text"].strip()
    assert result["tokens_per_s"] > 0
    assert result["kv_cache_bytes"] > 0
    assert result["model"] == "smollm2-135m"
    # SmolLM2's weights multiply float activations by default (135M parameters).
    assert result["activations"] == "float"
    assert result["policy"] == "full" and result["budget"] is None and result["evicted_tokens"] == 0
    # The process's peak resident memory: at least the weights it holds (the file's blocks), at most the machine.
    assert smollm2_path.stat().st_size < result["peak_rss_bytes"] < 24 * 2**30
    assert result["load_seconds"] > 0 and result["prefill_seconds"] > 0


def test_fetch_prepares_each_model_once(capsys, smollm2_path, tmp_path, monkeypatch):
    """``fetch`` leaves a fetched model ready for ``generate``'s defaults: its weights stored for this CPU and its
    tokenizer beside them, so that the next load builds nothing; a second fetch finds them and builds nothing."""
    from sparsespec.loading import weight_store

    monkeypatch.setenv("SPARSESPEC_WEIGHT_STORE", str(tmp_path / "tensors"))
    code, out, err = run_cli(capsys, "fetch", "smollm2-135m", "--quiet")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"smollm2-135m: {smollm2_path}" and lines[-1].startswith("smollm2-135m: prepared in ")
    [key] = (tmp_path / "tensors").iterdir()
    assert list(key.glob("bfloat16-*.safetensors")) and (key / "tokenizer" / "tokenizer.json").is_file()
    assert load_model("smollm2-135m", torch.bfloat16, "auto").from_cache
    code, out, err = run_cli(capsys, "fetch", "smollm2-135m", "--quiet")
    assert code == 0 and out.splitlines()[-1].startswith("smollm2-135m: already prepared in "), err
    assert not weight_store._mapping_threads  # the dropped model's move ended with it


def test_generate_holds_the_weights_move_until_its_first_token(capsys, smollm2_path, monkeypatch, tmp_path):
    """``generate`` pauses the move of the weights into huge pages from its start, lets it go on once the first
    piece of text is out (where fresh huge pages are quick), and never leaves it paused or held (a run that fails
    on a user mistake neither)."""
    from sparsespec.loading import huge_pages

    events = []
    pause, resume = huge_pages.pause_huge_page_moves, huge_pages.resume_huge_page_moves
    monkeypatch.setattr(huge_pages, "pause_huge_page_moves", lambda: events.append("pause") or pause())
    monkeypatch.setattr(huge_pages, "resume_huge_page_moves",
                        lambda: events.append(f"resume after {len(capsys.readouterr().out)} chars") or resume())
    code, out, err = run_cli(capsys, "generate", "--model", "smollm2-135m", "--prompt", PROMPT, "-n", "4",
                             "--threads", "2", "--ignore-eos")
    assert code == 0, err
    assert events[0] == "pause" and events[1] == "resume after 0 chars"  # before the first piece is written
    assert huge_pages._moves_may_run.is_set() and huge_pages._slow_moves_may_run.is_set()

    events.clear()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(60))
    assert_user_error(run_cli(capsys, "generate", "--model", str(broken), "--prompt", PROMPT), "broken.gguf")
    assert events[0] == "pause" and huge_pages._moves_may_run.is_set() and huge_pages._slow_moves_may_run.is_set()


def test_console_script_flushes_its_output_and_exit_code(smollm2_path):
    """The console script's fast exit (``cli.entry``) loses no output and keeps the exit status: a streamed run's
    text and summary, a --json object whole, a user mistake's sentence and status 2 (subprocesses, as a shell runs
    it)."""
    import subprocess
    import sys

    def entry(*argv: str) -> subprocess.CompletedProcess:
        code = f"import sys; sys.argv = ['sparsespec', *{list(argv)!r}]; from sparsespec.cli import entry; entry()"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)

    streamed = entry("generate", "-m", "smollm2-135m", "--prompt", PROMPT, "-n", "4", "--ignore-eos")
    assert streamed.returncode == 0 and streamed.stdout.strip(), streamed.stderr
    assert "[5 prompt tokens, 4 new tokens" in streamed.stderr
    as_json = entry("generate", "-m", "smollm2-135m", "--prompt", PROMPT, "-n", "4", "--ignore-eos", "--json")
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["new_tokens"] == 4
    mistake = entry("generate", "-m", "no-such-model", "--prompt", PROMPT)
    assert mistake.returncode == 2 and mistake.stderr.startswith("sparsespec: error: Unknown model 'no-such-model'")


_PLAIN_RUNS: dict[str, dict] = {}


def plain_greedy_json(capsys, prompt: str) -> dict:
    """``generate --json`` of 8 greedy tokens with the full cache (deterministic, so run once per prompt)."""
    if prompt not in _PLAIN_RUNS:
        code, out, err = run_cli(capsys, "generate", "--prompt", prompt, "-n", "8", "--dtype", "float32",
                                 "--ignore-eos", "--json")
        assert code == 0, err
        _PLAIN_RUNS[prompt] = parse_json_output(out)
    return _PLAIN_RUNS[prompt]


def test_streaming_prints_the_same_text_as_json(capsys, cached_smollm2):
    text = plain_greedy_json(capsys, PROMPT)["text"]
    code, out, err = run_cli(capsys, "generate", "--prompt", PROMPT, "-n", "8", "--dtype", "float32", "--ignore-eos")
    assert code == 0, err
    assert out == text + "\n"
    assert err.splitlines() == [err.strip()]
    assert err.startswith("[5 prompt tokens, 8 new tokens, ") and err.rstrip().endswith("tok/s]")


def test_stop_string_ends_the_text(capsys, cached_smollm2):
    text = plain_greedy_json(capsys, PROMPT)["text"]
    stop = text.strip()[1:4]  # a piece from inside the continuation
    code, out, err = run_cli(capsys, "generate", "--prompt", PROMPT, "-n", "8", "--dtype", "float32",
                             "--ignore-eos", "--json", "--stop", stop)
    assert code == 0, err
    assert parse_json_output(out)["text"] == text[: text.index(stop)]


def test_hybrid_policy_json_reports_budget_and_evictions(capsys, cached_smollm2):
    code, out, err = run_cli(capsys, "generate", "--prompt", LONG_PROMPT, "-n", "8", "--dtype", "float32",
                             "--ignore-eos", "--json", "--policy", "hybrid", "--budget", "32")
    assert code == 0, err
    hybrid = parse_json_output(out)
    assert JSON_KEYS <= hybrid.keys()
    assert hybrid["policy"] == "hybrid" and hybrid["budget"] == 32 and hybrid["new_tokens"] == 8
    assert hybrid["prompt_tokens"] > 32
    # All tokens but the last generated one went through the cache; everything beyond the budget left it.
    assert hybrid["evicted_tokens"] == hybrid["prompt_tokens"] + 8 - 1 - 32

    full = plain_greedy_json(capsys, LONG_PROMPT)
    assert full["policy"] == "full" and full["evicted_tokens"] == 0
    assert hybrid["kv_cache_bytes"] < full["kv_cache_bytes"]


def test_json_statistics_describe_the_cache_when_a_stop_string_ends_the_run(capsys, cached_smollm2):
    """The run's statistics are filled in when it ends, and a stop string ends it before its last token: the JSON
    must still describe the cache that ran (and, with retention, the peak of its hold: with 4-token chunks the
    staging slots cannot take the prompt, so the arena grows to hold it)."""
    text = plain_greedy_json(capsys, LONG_PROMPT)["text"]
    stop = text.strip()[1:4]
    code, out, err = run_cli(capsys, "generate", "--prompt", LONG_PROMPT, "-n", "8", "--dtype", "float32",
                             "--ignore-eos", "--json", "--policy", "hybrid", "--budget", "16", "--stop", stop,
                             "--prefill-chunk", "4")
    assert code == 0, err
    result = parse_json_output(out)
    assert result["new_tokens"] < 8 and result["budget"] == 16
    assert result["evicted_tokens"] == result["prompt_tokens"] + result["new_tokens"] - 1 - 16
    assert 0 < result["kv_cache_bytes"] < result["kv_peak_bytes"]


def test_self_speculative_greedy_text_equals_plain_greedy(capsys, cached_smollm2):
    """Exact speculative decoding: with greedy sampling the draft cannot change the output."""
    plain = plain_greedy_json(capsys, LONG_PROMPT)
    code, out, err = run_cli(capsys, "generate", "--prompt", LONG_PROMPT, "-n", "8", "--dtype", "float32",
                             "--ignore-eos", "--json", "--draft", "self", "--gamma", "3", "--draft-budget", "16")
    assert code == 0, err
    speculative = parse_json_output(out)
    assert speculative["text"] == plain["text"]
    assert speculative["new_tokens"] == 8
    assert speculative["draft"] == "self" and speculative["gamma"] == 3
    assert speculative["draft_policy"] == "hybrid" and speculative["draft_budget"] == 16
    assert 0.0 <= speculative["acceptance_rate"] <= 1.0


# ------------------------------------------------------------------------------------ KV dtype and --kv-bytes
def test_parse_size_units():
    from sparsespec.flags import parse_size

    assert parse_size("4096") == 4096
    assert parse_size("28MiB") == 28 * 2**20
    assert parse_size("1.5 KiB") == 1536
    assert parse_size("2gib") == 2 * 2**30
    for bad in ("2MB", "1.5", "-3", "MiB", ""):
        with pytest.raises(UserError, match="--kv-bytes takes a size"):
            parse_size(bad)


def test_kv_dtype_choices_are_the_arenas():
    from sparsespec.cache.quant import KV_DTYPES
    from sparsespec.flags import KV_DTYPE_CHOICES

    assert KV_DTYPE_CHOICES == KV_DTYPES


def test_generate_kv_bytes_sizes_the_arena(capsys, cached_smollm2):
    """The budget follows from the bytes: kv_cache_bytes (budget + staging slots) fits them, one slot more would
    not, and the cache really evicts at that budget."""
    code, out, err = run_cli(capsys, "generate", "--prompt", LONG_PROMPT, "-n", "8", "--dtype", "float32",
                             "--ignore-eos", "--json", "--kv-dtype", "int8", "--kv-bytes", "1MiB")
    assert code == 0, err
    result = parse_json_output(out)
    cfg = cached_smollm2.config
    slot = cfg.num_hidden_layers * cfg.num_key_value_heads * 2 * (cfg.head_dim + cfg.head_dim // 32 * 4)
    staging = result["prompt_tokens"] + 8  # the whole run is shorter than one prefill chunk
    assert result["kv_dtype"] == "int8" and result["policy"] == "hybrid"
    assert result["kv_cache_bytes"] == (result["budget"] + staging) * slot
    assert 2**20 - slot < result["kv_cache_bytes"] <= 2**20
    assert result["evicted_tokens"] == result["prompt_tokens"] + 8 - 1 - result["budget"] > 0


@pytest.mark.parametrize(("flags", "words"), [
    (["--kv-bytes", "1MiB", "--budget", "32"], ("--kv-bytes", "--budget")),
    (["--kv-bytes", "1MiB", "--policy", "full"], ("--kv-bytes", "full")),
    (["--kv-bytes", "20KiB", "--kv-dtype", "int4"], ("--kv-bytes", "budget")),
    (["--kv-bytes", "1e6"], ("--kv-bytes", "size")),
])
def test_generate_kv_bytes_mistakes(capsys, flags, words):
    assert_user_error(run_cli(capsys, "generate", "--prompt", PROMPT, *flags), *words)


def test_ppl_kv_bytes_reports_the_arena_it_ran(capsys, cached_smollm2):
    code, out, err = run_cli(capsys, "ppl", "--text", "corpus:hamlet", "--max-tokens", "48", "--dtype", "float32",
                             "--kv-dtype", "int4", "--kv-bytes", "1600KiB", "--policy", "streaming", "--json",
                             "--quiet")
    assert code == 0, err
    result = parse_json_output(out)
    cfg = cached_smollm2.config
    heads = cfg.num_hidden_layers * cfg.num_key_value_heads
    slot = heads * 2 * (cfg.head_dim // 2 + cfg.head_dim // 16 * 4)
    ring = heads * 32 * 2 * cfg.head_dim * 4  # int4's 32 most recent entries in float32 as well
    assert result["kv_dtype"] == "int4" and result["chunk"] == 1
    assert result["kv_cache_bytes"] == (result["budget"] + 1) * slot + ring  # one staging slot at chunk 1
    assert 1600 * 2**10 - slot < result["kv_cache_bytes"] <= 1600 * 2**10
    assert result["cache"] == f"streaming(sinks=4, heavy=0, window={result['budget'] - 4})"
    assert result["evicted_tokens"] == 47 - result["budget"] > 0


def test_ppl_kv_recent_sets_the_full_precision_window_and_its_bytes(capsys, cached_smollm2):
    """--kv-recent 0: int4 codes alone, every byte buys entries; --kv-recent 8: a ring of 8 float32 entries takes
    its bytes from the budget and changes what attention reads."""
    results = {}
    for recent in ("0", "8"):
        code, out, err = run_cli(capsys, "ppl", "--text", "corpus:hamlet", "--max-tokens", "160", "--dtype",
                                 "float32", "--kv-dtype", "int4", "--kv-recent", recent, "--kv-bytes", "700KiB", "--policy",
                                 "streaming", "--json", "--quiet")
        assert code == 0, err
        results[recent] = parse_json_output(out)
    cfg = cached_smollm2.config
    heads = cfg.num_hidden_layers * cfg.num_key_value_heads
    slot = heads * 2 * (cfg.head_dim // 2 + cfg.head_dim // 16 * 4)
    plain, windowed = results["0"], results["8"]
    assert plain["kv_recent"] == 0 and plain["kv_cache_bytes"] == (plain["budget"] + 1) * slot
    assert windowed["kv_recent"] == 8
    assert windowed["kv_cache_bytes"] == (windowed["budget"] + 1) * slot + heads * 8 * 2 * cfg.head_dim * 4
    assert 700 * 2**10 - slot < windowed["kv_cache_bytes"] <= 700 * 2**10
    assert windowed["budget"] < plain["budget"] and windowed["evicted_tokens"] > plain["evicted_tokens"] > 0
    assert windowed["ppl"] != plain["ppl"]


def test_simulate_kv_bytes_gives_the_budget(capsys, smollm2_path):
    from sparsespec.edge.roofline import kv_bytes_per_token
    from sparsespec.flags import DEFAULT_GAMMA
    from sparsespec.loading.source import read_config, resolve_model

    code, out, err = run_cli(capsys, "simulate", "--model", "smollm2-135m", "--kv-dtype", "int4", "--kv-bytes",
                             "3MiB", "--json")
    assert code == 0, err
    report = json.loads(out)
    per_token = kv_bytes_per_token(read_config(resolve_model("smollm2-135m")), "int4")
    slots = int(3 * 2**20 // per_token)
    assert report["settings"]["budget"] == slots - 1
    assert report["settings"]["combined_budget"] == slots - (DEFAULT_GAMMA + 1)  # γ + 1 rows in flight
    assert report["settings"]["budget_source"] == "from --kv-bytes"


def test_a_seed_of_any_size_is_reduced_as_the_server_reduces_it(capsys, cached_smollm2):
    """A seed beyond 64 bits samples the stream of that seed modulo 2^63 (the server's rule), not a traceback."""
    big = 10**30
    texts = []
    for seed in (big, big % 2**63):
        code, out, err = run_cli(capsys, "generate", "--prompt", PROMPT, "-n", "6", "--temperature", "0.8",
                                 "--seed", str(seed), "--json")
        assert code == 0, err
        texts.append(json.loads(out)["text"])
    assert texts[0] == texts[1]


def test_a_gguf_that_can_no_longer_be_read_is_refused_even_when_prepared(tmp_path, monkeypatch, smollm2_path):
    """Resolving a model opens its file each time, so a stored preparation never stands in for a file that is gone
    unreadable or replaced by something else."""
    from sparsespec.loading.source import resolve_model

    copy = tmp_path / "model.gguf"
    copy.write_bytes(smollm2_path.read_bytes()[:4096])
    assert resolve_model(str(copy)).path == copy
    real_open = open

    def refusing_open(path, *args, **kwargs):
        if str(path) == str(copy):
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", refusing_open)
    with pytest.raises(UserError, match="cannot be read .Permission denied"):
        resolve_model(str(copy))
    monkeypatch.undo()
    copy.write_bytes(b"PK\x03\x04" + bytes(4092))
    with pytest.raises(UserError, match="does not start with GGUF's magic number"):
        resolve_model(str(copy))
