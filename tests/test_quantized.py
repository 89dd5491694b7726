"""Quantized models: logits stay close to float32, speculative decoding stays exact, the weight store is exact.

The layer-level proof (each int8 / int4 linear holds GGUF's Q8_0 / Q4_1 blocks and multiplies as they dequantize) is in
``test_linear.py``; this file checks whole models.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from sparsespec import kernels
from sparsespec.cache import KVArena, make_policy
from sparsespec.generate import generate_tokens
from sparsespec.linear import QUANTIZED_TYPES, NativeLinear, auto_format, resolve_format
from sparsespec.loading.load import load_model
from sparsespec.loading.source import ModelSource
from sparsespec.loading.weight_store import source_store_key, weight_store_root
from sparsespec.loading.weights import weight_store_file
from sparsespec.model import Transformer
from sparsespec.sampling import SamplingParams
from sparsespec.speculative import SpeculativeStats, draft_inflight_rows, speculative_tokens, target_inflight_rows

from conftest import random_state, tiny_config, write_gguf_model

# ---------------------------------------------------------------------------------------------------- helpers


def full_logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    """``[T, vocab]`` float32 logits of one pass over ``ids`` through a full cache."""
    arena = KVArena(model.config, make_policy("full"), dtype=model.dtype, max_tokens=len(ids), max_block=len(ids),
                    max_inflight=1, positions="original")
    return model.forward(torch.tensor(ids), arena)


def mean_kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over rows of KL(softmax(reference) || softmax(other)), in nats."""
    p_log = torch.log_softmax(reference.double(), dim=-1)
    q_log = torch.log_softmax(other.double(), dim=-1)
    return float((p_log.exp() * (p_log - q_log)).sum(-1).mean())


def random_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# Untied heads (a tied random embedding makes the tiny llama's logits so large that every distribution is one-hot).
KL_CONFIGS = {
    "llama": tiny_config("llama", tie_word_embeddings=False, hidden_size=128, intermediate_size=256, head_dim=32),
    "qwen2": tiny_config("qwen2", hidden_size=128, intermediate_size=256, head_dim=32),
}


# ------------------------------------------------------------------------------------------------ formats, auto


def test_format_names_and_auto_rule():
    assert resolve_format("bf16") == "dense"
    assert resolve_format("auto", "draft") == auto_format("draft") == "int4"
    assert resolve_format("auto", "target") == auto_format("target") == "int8"
    with pytest.raises(ValueError):
        resolve_format("int3")
    with pytest.raises(ValueError):
        resolve_format("auto", "verifier")
    config = KL_CONFIGS["qwen2"]
    model = Transformer(config, random_state(config), torch.float32, "auto", role="draft")
    assert model.weights_format == "int4"
    assert all(linear.types == [QUANTIZED_TYPES["int4"]] for _, linear in model.linear_items())


def test_tied_dense_head_shares_the_embedding_in_every_dtype():
    """One copy of a tied table: the embedding reads the dense head's rows."""
    config = tiny_config("llama")
    for dtype in (torch.float32, torch.bfloat16):
        model = Transformer(config, random_state(config), dtype)
        assert isinstance(model.lm_head, NativeLinear) and model.embed.table is model.lm_head


# ------------------------------------------------------------------------------------------------- closeness


@pytest.mark.parametrize("arch", list(KL_CONFIGS))
def test_quantized_logits_stay_close_to_float32(arch):
    config = KL_CONFIGS[arch]
    state = random_state(config, seed=3)
    ids = random_ids(64, config.vocab_size)
    reference = full_logits(Transformer(config, state, torch.float32), ids)
    entropy = float(-(torch.softmax(reference, -1) * torch.log_softmax(reference, -1)).sum(-1).mean())
    assert entropy > 1.0  # spread-out distributions, so the KL divergence measures something
    kl = {
        (fmt, str(dtype)): mean_kl(reference, full_logits(Transformer(config, state, dtype, fmt), ids))
        for fmt in ("dense", "int8", "int4")
        for dtype in (torch.float32, torch.bfloat16)
        if (fmt, dtype) != ("dense", torch.float32)  # the reference itself
    }
    for dtype in ("torch.float32", "torch.bfloat16"):
        # Measured (both archs): bf16 dense ~6e-5, int8 ~1.5e-4, int4 (group 32) ~1e-2.
        assert kl[("dense", "torch.bfloat16")] < 1e-3
        assert kl[("int8", dtype)] < 2e-3
        assert kl[("int4", dtype)] < 0.1
        assert kl[("int8", dtype)] < kl[("int4", dtype)]


def test_smollm2_quantized_kl_on_real_text(smollm2_path, smollm2_f32, capsys):
    """KL divergence of bf16 / int8 / int4 SmolLM2-135M from float32 on 256 tokens of text (reported)."""
    from sparsespec.loading.weights import load_gguf_state

    config, state = load_gguf_state(smollm2_path)
    try:
        from sparsespec.loading.fetch import corpus_text_path

        text = corpus_text_path("hamlet").read_text(encoding="utf-8", errors="replace")[5000:9000]
    except Exception:  # corpus not fetched: a fixed English passage
        text = (
            "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
            "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
            "it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had "
            "everything before us, we had nothing before us, we were all going direct to Heaven, we were all going "
            "direct the other way. In short, the period was so far like the present period, that some of its "
            "noisiest authorities insisted on its being received, for good or for evil, in the superlative degree "
            "of comparison only. There were a king with a large jaw and a queen with a plain face, on the throne "
            "of England; there were a king with a large jaw and a queen with a fair face, on the throne of France."
        )
    ids = smollm2_f32.tokenizer.encode(text)[:256]
    assert len(ids) >= 128
    reference = full_logits(smollm2_f32.model, ids)
    kl = {}
    for fmt in ("dense", "int8", "int4"):
        kl[fmt] = mean_kl(reference, full_logits(Transformer(config, state, torch.bfloat16, fmt), ids))
    with capsys.disabled():
        print(f"\nSmolLM2-135M KL(float32 || format) over {len(ids)} tokens: "
              + ", ".join(f"{'bf16' if k == 'dense' else k} {v:.4f}" for k, v in kl.items()))
    # Measured on Hamlet: bf16 0.001, int8 0.005, int4 0.07 (group 32; 0.48 with group 64).
    assert kl["dense"] < 0.01
    assert kl["int8"] < 0.03
    assert kl["int4"] < 0.25
    assert kl["dense"] < kl["int8"] < kl["int4"]


# --------------------------------------------------------------------------------------- speculative exactness

SPEC_CONFIG = tiny_config("llama", tie_word_embeddings=False)
SPEC_STATE = random_state(SPEC_CONFIG, seed=0, scale=1.0)


def _noisy_state(noise: float, seed: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + noise * v.std() * torch.randn(v.shape, generator=g) for k, v in SPEC_STATE.items()}


DRAFT_STATE = _noisy_state(0.01)


def _arena(model, pol, max_inflight):
    return KVArena(model.config, pol, dtype=model.dtype, max_tokens=1024, max_block=8, max_inflight=max_inflight,
                   positions="original")


@pytest.mark.parametrize(
    "target_fmt,draft_fmt", [("int8", "int4"), ("int4", "int4"), ("dense", "int4"), ("int4", "dense"), ("int8", "int8")]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_speculative_equals_autoregressive_with_quantized_weights(target_fmt, draft_fmt, dtype, row_by_row):
    """Quantized target and/or draft (native blocks: a row's result never depends on the rows beside it), budgeted
    caches, float32 and bfloat16 compute: speculative == autoregressive, token for token."""
    target = Transformer(SPEC_CONFIG, SPEC_STATE, dtype, target_fmt)
    draft = Transformer(SPEC_CONFIG, DRAFT_STATE, dtype, draft_fmt)
    target_policy = make_policy("hybrid", 12, sinks=2, heavy=4)
    draft_policy = make_policy("streaming", 10, sinks=2)
    ids = random_ids(20, SPEC_CONFIG.vocab_size, seed=1)
    n = 160
    expected = list(generate_tokens(target, _arena(target, target_policy, 1), ids, max_new_tokens=n,
                                    sampling=SamplingParams(), prefill_chunk=8))
    stats = SpeculativeStats()
    row_by_row.clear()
    target_arena = _arena(target, target_policy, target_inflight_rows(4))
    got = list(speculative_tokens(
        target, target_arena, draft, _arena(draft, draft_policy, draft_inflight_rows(4)),
        ids, max_new_tokens=n, sampling=SamplingParams(), gamma=4, prefill_chunk=8, stats=stats,
    ))
    assert got == expected
    # The target's cache evicted, and did so inside verification blocks (the row-by-row path ran in its arena).
    assert target_arena.evicted_tokens >= len(ids) + n - target_policy.budget - target_inflight_rows(4)
    assert row_by_row.get(id(target_arena), 0) > 10
    # Both accept and reject paths ran.
    assert 10 < stats.accepted < stats.drafted - 10


# ----------------------------------------------------------------------------------------------- weight store


def _write_hf_folder(folder, config, state) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    fields = config.to_dict()
    fields["model_type"] = fields.pop("architecture")
    (folder / "config.json").write_text(json.dumps(fields))
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))


def _same_model(a: Transformer, b: Transformer) -> None:
    assert type(a.embed) is type(b.embed) and torch.equal(a.norm, b.norm)
    if isinstance(a.embed, torch.Tensor):  # else the table is the head's, compared below
        assert torch.equal(a.embed, b.embed)
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.attn_norm, lb.attn_norm) and torch.equal(la.mlp_norm, lb.mlp_norm)
    items_a, items_b = a.linear_items(), b.linear_items()
    assert [k for k, _ in items_a] == [k for k, _ in items_b]
    for (key, lin_a), (_, lin_b) in zip(items_a, items_b):
        assert type(lin_a) is type(lin_b), key
        ta, tb = lin_a.to_tensors(), lin_b.to_tensors()
        assert ta.keys() == tb.keys(), key
        for name in ta:
            assert ta[name].dtype == tb[name].dtype and torch.equal(ta[name], tb[name]), (key, name)
    assert a.weight_nbytes == b.weight_nbytes


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["dense", "int8", "int4"])
def test_weight_store_round_trip_is_exact(tmp_path, arch, dtype, fmt):
    config = tiny_config(arch)
    folder = tmp_path / "model"
    _write_hf_folder(folder, config, random_state(config, seed=4))
    cache = tmp_path / "tensors"
    uncached = load_model(str(folder), dtype, fmt, tokenizer=False, weight_store=False)
    first = load_model(str(folder), dtype, fmt, tokenizer=False, weight_store=cache)
    second = load_model(str(folder), dtype, fmt, tokenizer=False, weight_store=cache)
    assert (uncached.from_cache, first.from_cache, second.from_cache) == (False, False, True)
    assert second.config == uncached.config and second.weights == fmt
    _same_model(uncached.model, second.model)
    if config.tie_word_embeddings and fmt == "dense":  # still one copy of the tied table
        assert second.model.embed.table is second.model.lm_head
    ids = random_ids(24, config.vocab_size, seed=2)
    assert torch.equal(full_logits(uncached.model, ids), full_logits(second.model, ids))


def test_weight_store_is_invalidated_by_a_changed_source(tmp_path):
    config = tiny_config("qwen2")
    folder = tmp_path / "model"
    _write_hf_folder(folder, config, random_state(config, seed=4))
    cache = tmp_path / "tensors"
    first = load_model(str(folder), torch.float32, "int4", tokenizer=False, weight_store=cache)
    old_key_dirs = sorted(p.name for p in cache.iterdir())
    _write_hf_folder(folder, config, random_state(config, seed=5))  # new weights, same path
    st = (folder / "model.safetensors").stat()
    os.utime(folder / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    second = load_model(str(folder), torch.float32, "int4", tokenizer=False, weight_store=cache)
    assert not second.from_cache
    assert not torch.equal(first.model.embed, second.model.embed)
    fresh = load_model(str(folder), torch.float32, "int4", tokenizer=False, weight_store=False)
    _same_model(fresh.model, second.model)
    new_key_dirs = sorted(p.name for p in cache.iterdir())
    assert len(new_key_dirs) == 1 and new_key_dirs != old_key_dirs  # the stale entry was removed
    # Entries of sources that no longer exist go when the next entry is written.
    other = tmp_path / "other"
    _write_hf_folder(other, config, random_state(config, seed=6))
    load_model(str(other), torch.float32, "dense", tokenizer=False, weight_store=cache)
    assert len(list(cache.iterdir())) == 2
    shutil.rmtree(folder)
    _write_hf_folder(tmp_path / "third", config, random_state(config, seed=7))
    load_model(str(tmp_path / "third"), torch.float32, "dense", tokenizer=False, weight_store=cache)
    recorded = {json.loads((d / "source.json").read_text())["path"] for d in cache.iterdir()}
    assert recorded == {str(other.resolve()), str((tmp_path / "third").resolve())}


def test_damaged_cache_file_is_rebuilt(tmp_path):
    config = tiny_config("llama")
    folder = tmp_path / "model"
    _write_hf_folder(folder, config, random_state(config, seed=4))
    cache = tmp_path / "tensors"
    load_model(str(folder), torch.float32, "int8", tokenizer=False, weight_store=cache)
    (file,) = cache.glob("*/*.safetensors")
    file.write_bytes(file.read_bytes()[:1000])  # truncated
    again = load_model(str(folder), torch.float32, "int8", tokenizer=False, weight_store=cache)
    assert not again.from_cache
    _same_model(load_model(str(folder), torch.float32, "int8", tokenizer=False, weight_store=False).model, again.model)
    assert load_model(str(folder), torch.float32, "int8", tokenizer=False, weight_store=cache).from_cache


def test_cache_key_uses_a_matching_fetch_stamp(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    source = ModelSource("gguf", gguf, "m")
    stat_key = source_store_key(source)
    assert stat_key.startswith("stat-")
    st = gguf.stat()
    stamp = tmp_path / "m.gguf.sha256.json"
    stamp.write_text(json.dumps({"sha256": "ab" * 32, "size": st.st_size, "mtime_ns": st.st_mtime_ns}))
    assert source_store_key(source) == "sha256-" + "ab" * 32
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # the stamp no longer describes the file
    assert source_store_key(source).startswith("stat-") and source_store_key(source) != stat_key


def test_cache_file_names_and_switches(tmp_path, monkeypatch):
    source = ModelSource("gguf", tmp_path / "m.gguf", "m")
    (tmp_path / "m.gguf").write_bytes(b"x")
    root = tmp_path / "c"
    dense = weight_store_file(root, source, torch.bfloat16, "dense", {})
    assert dense.name == "bfloat16-dense-layout1-rows.safetensors"  # dense weights are native float rows
    assert weight_store_file(root, source, torch.float32, "int4", {}).name == "float32-int4-layout1-rows.safetensors"
    assert weight_store_file(root, source, torch.float32, "int8", {"unknown_option": 1}) is None
    monkeypatch.setenv("SPARSESPEC_WEIGHT_STORE", "off")
    assert weight_store_root(True) is None
    monkeypatch.setenv("SPARSESPEC_WEIGHT_STORE", str(tmp_path / "elsewhere"))
    assert weight_store_root(True) == tmp_path / "elsewhere"
    assert weight_store_root(False) is None and weight_store_root(root) == root
    monkeypatch.delenv("SPARSESPEC_WEIGHT_STORE")
    monkeypatch.setenv("SPARSESPEC_TENSOR_CACHE", "off")  # the variable's name before: a setting keeps its effect
    assert weight_store_root(True) is None


# ------------------------------------------------------------------------------------- native weights, stored repacked
def _native_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """Every tensor a native model holds, by name: norms, the embedding table's blocks, each linear's blocks."""
    out = {"norm": model.norm} | {f"embed.{k}": t for k, t in model.embed.table.to_tensors().items()}
    for i, layer in enumerate(model.layers):
        out |= {f"{i}.{f}": getattr(layer, f) for f in ("attn_norm", "mlp_norm", "q_norm", "k_norm")}
    for key, lin in model.linear_items():
        out |= {f"{key}.{k}": t for k, t in lin.to_tensors().items()}
    return out


@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("tied", [False, True])
def test_native_weights_are_stored_repacked_and_read_back_exactly(tmp_path, tied):
    """The first start repacks the GGUF's blocks and stores them; the second reads them back (no repacking): the
    same blocks bit for bit, the tied head reading the embedding's blocks again, the same logits."""
    from sparsespec.linear import NativeLinear, native_layout_tag

    config = tiny_config("qwen3", tie_word_embeddings=tied, vocab_size=128)
    path = write_gguf_model(tmp_path / "model.gguf", config, random_state(config, seed=6), matrix_type="Q8_0")
    cache = tmp_path / "tensors"
    uncached = load_model(str(path), torch.bfloat16, "native", tokenizer=False, weight_store=False)
    first = load_model(str(path), torch.bfloat16, "native", tokenizer=False, weight_store=cache)
    second = load_model(str(path), torch.bfloat16, "native", tokenizer=False, weight_store=cache)
    assert (uncached.from_cache, first.from_cache, second.from_cache) == (False, False, True)
    [stored] = cache.rglob("*.safetensors")
    assert stored.name == f"bfloat16-native-{native_layout_tag(kernels.tiles_preferred())}.safetensors"
    assert isinstance(second.model.layers[0].qkv, NativeLinear) and second.config == uncached.config
    expected, got = _native_tensors(uncached.model), _native_tensors(second.model)
    assert expected.keys() == got.keys()
    for name in expected:
        if expected[name] is None:
            assert got[name] is None, name
        else:
            assert got[name].dtype == expected[name].dtype and torch.equal(got[name], expected[name]), name
    assert second.model.head_shares_embedding == tied
    assert second.model.weight_nbytes == uncached.model.weight_nbytes
    ids = random_ids(24, config.vocab_size, seed=2)
    assert torch.equal(full_logits(uncached.model, ids), full_logits(second.model, ids))


@pytest.mark.usefixtures("native_kernels")
def test_a_prefetched_store_is_read_in_the_background_and_taken_by_the_load(tmp_path, monkeypatch):
    """The stored build a command prefetches is mapped on the background thread and taken by load_model (not mapped
    twice), its tensors 64-byte aligned views; a guess the load does not take is dropped; a store damaged under a
    prefetch is rebuilt."""
    import threading

    from sparsespec.loading import weight_store

    config = tiny_config("qwen3", vocab_size=128)
    path = write_gguf_model(tmp_path / "model.gguf", config, random_state(config, seed=4), matrix_type="Q8_0")
    monkeypatch.setenv("SPARSESPEC_WEIGHT_STORE", str(tmp_path / "tensors"))
    built = load_model(str(path), torch.bfloat16, "auto", tokenizer=False)
    reads = []
    read = weight_store.read_tensor_file
    monkeypatch.setattr(weight_store, "read_tensor_file",
                        lambda file: reads.append((file.name, threading.current_thread().name)) or read(file))
    weight_store.prefetch_stored_models([str(path), "no-such-model"], "bfloat16", [None, "auto"])
    loaded = load_model(str(path), torch.bfloat16, "auto", tokenizer=False)
    [stored] = (tmp_path / "tensors").rglob("*.safetensors")
    assert loaded.from_cache and reads == [(stored.name, "sparsespec prefetch")]
    tensors = [t for t in _native_tensors(loaded.model).values() if t is not None and t.numel()]
    assert all(t.data_ptr() % 64 == 0 for t in tensors)
    if os.path.exists("/proc/self/maps"):  # private anonymous memory (shared would be shmem: no huge pages)
        maps = [line.split() for line in open("/proc/self/maps")]
        for t in tensors:
            [perms] = [m[1] for m in maps if int(m[0].split("-")[0], 16) <= t.data_ptr() < int(m[0].split("-")[1], 16)]
            assert perms.endswith("p"), perms
    ids = random_ids(16, config.vocab_size, seed=1)
    expected = full_logits(built.model, ids)
    assert torch.equal(expected, full_logits(loaded.model, ids))

    weight_store.prefetch_stored_models([str(path)], "bfloat16", ["auto"])
    assert not load_model(str(path), torch.float32, "auto", tokenizer=False).from_cache  # another dtype
    assert not weight_store._prefetches  # the bfloat16 read it did not take is gone

    weight_store.wait_for_huge_page_moves()  # the models above run on the file until their pages have moved
    with open(stored, "r+b") as f:
        f.truncate(stored.stat().st_size - 100)
    weight_store.prefetch_stored_models([str(path)], "bfloat16", ["native"])
    rebuilt = load_model(str(path), torch.bfloat16, "auto", tokenizer=False)
    assert not rebuilt.from_cache and torch.equal(full_logits(rebuilt.model, ids), expected)


def test_info_lists_what_the_weight_store_holds(tmp_path, monkeypatch, capsys):
    """``sparsespec info`` names the cache's folder, each stored model's source and builds, and says when the
    cache is off."""
    from sparsespec.cli import main

    config = tiny_config("llama")
    path = write_gguf_model(tmp_path / "model.gguf", config, random_state(config, seed=2))
    monkeypatch.setenv("SPARSESPEC_WEIGHT_STORE", str(tmp_path / "tensors"))
    load_model(str(path), torch.float32, "dense", tokenizer=False)
    assert main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith(f"weight store: {tmp_path / 'tensors'}, 1 model, ")
    assert lines[-1].startswith(f"  {path.resolve()}: float32-dense-layout1-rows (") and lines[-1].endswith(" MB)")
    monkeypatch.setenv("SPARSESPEC_WEIGHT_STORE", "off")
    assert main(["info"]) == 0 and capsys.readouterr().out.splitlines()[-1] == \
        "weight store: off ($SPARSESPEC_WEIGHT_STORE)"


@pytest.mark.usefixtures("native_kernels")
def test_a_damaged_store_is_rebuilt_and_a_failed_write_warns(tmp_path, monkeypatch, capsys):
    """A truncated store is not used: the next start repacks and stores it again. A store that cannot be written
    (a full disk) leaves the model as built, with one warning line."""
    from sparsespec.loading import weights

    config = tiny_config("phi3", tie_word_embeddings=False, attention_bias=False, vocab_size=128)
    path = write_gguf_model(tmp_path / "model.gguf", config, random_state(config, seed=8), matrix_type="Q8_0")
    cache = tmp_path / "tensors"
    load_model(str(path), torch.float32, "native", tokenizer=False, weight_store=cache)
    [stored] = cache.rglob("*.safetensors")
    size = stored.stat().st_size
    with open(stored, "r+b") as f:
        f.truncate(size - 100)
    rebuilt = load_model(str(path), torch.float32, "native", tokenizer=False, weight_store=cache)
    assert not rebuilt.from_cache and stored.stat().st_size == size
    assert load_model(str(path), torch.float32, "native", tokenizer=False, weight_store=cache).from_cache

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(weights, "write_safetensors", disk_full)
    other = tmp_path / "other"
    capsys.readouterr()
    loaded = load_model(str(path), torch.float32, "native", tokenizer=False, weight_store=other)
    assert not loaded.from_cache and not list(other.rglob("*.safetensors"))
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("sparsespec: warning: could not store the built weights in ")
    ids = random_ids(16, config.vocab_size, seed=3)
    assert torch.equal(full_logits(loaded.model, ids), full_logits(rebuilt.model, ids))
