"""Shared fixtures: tiny random Llama / Qwen2 / Qwen3 / Phi-3 / Gemma 3 models built in-process, and the real SmolLM2
weights."""

from __future__ import annotations

import math
import os
import platform
import shutil
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from sparsespec.config import ModelConfig
from sparsespec.loading.fixtures import MODEL_FIXTURES
from sparsespec import kernels
from sparsespec.model import Block, Transformer

# One intra-op thread: the tests run thousands of tiny ops, for which a second thread only adds wake-up latency
# (badly so on a shared, loaded machine).
torch.set_num_threads(1)


def tiny_config(architecture: str = "llama", **overrides) -> ModelConfig:
    """A 2-layer GQA decoder small enough to run thousands of steps in a test."""
    fields = dict(
        architecture=architecture, vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6,
        max_position_embeddings=4096, tie_word_embeddings=architecture == "llama",
        attention_bias=architecture == "qwen2",
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def random_state(config: ModelConfig, seed: int = 0, scale: float = 0.5) -> dict[str, torch.Tensor]:
    """A Hugging Face-named float32 state dict with random weights (norm weights near 1: the factors the decoder
    multiplies by, so Gemma's are ``1 + w`` of its Hugging Face ``w``)."""
    g = torch.Generator().manual_seed(seed)
    h, i, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd

    def w(*shape):
        return torch.randn(*shape, generator=g) * scale / shape[-1] ** 0.5

    state = {"model.embed_tokens.weight": torch.randn(config.vocab_size, h, generator=g),
             "model.norm.weight": 1 + 0.1 * torch.randn(h, generator=g)}
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = w(config.vocab_size, h) * 4
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        state[p + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        state[p + "post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        for name, shape in (("q_proj", (q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, q))):
            state[p + f"self_attn.{name}.weight"] = w(*shape) * (3 if name in ("q_proj", "k_proj") else 1)
        if config.attention_bias:
            for name, size in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                state[p + f"self_attn.{name}.bias"] = 0.1 * torch.randn(size, generator=g)
        if config.qk_norm:
            for name in ("q_norm", "k_norm"):
                state[p + f"self_attn.{name}.weight"] = 1 + 0.3 * torch.randn(hd, generator=g)
        if config.gemma:
            for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                state[p + f"{name}.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        state[p + "mlp.gate_proj.weight"] = w(i, h)
        state[p + "mlp.up_proj.weight"] = w(i, h)
        state[p + "mlp.down_proj.weight"] = w(h, i)
        if config.fused_projections:  # Phi-3 names: the same weights, stored fused
            state[p + "self_attn.qkv_proj.weight"] = torch.cat(
                [state.pop(p + f"self_attn.{name}.weight") for name in ("q_proj", "k_proj", "v_proj")])
            state[p + "mlp.gate_up_proj.weight"] = torch.cat(
                [state.pop(p + f"mlp.{name}.weight") for name in ("gate_proj", "up_proj")])
    return state


# Hugging Face name (inside model.layers.{i}.) -> GGUF name (inside blk.{i}.), per architecture.
_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "mlp.down_proj.weight": "ffn_down.weight",
}
_GGUF_SPLIT_NAMES = _GGUF_LAYER_NAMES | {
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight"}
GGUF_LAYER_NAMES = {
    "llama": _GGUF_SPLIT_NAMES,
    "qwen3": _GGUF_SPLIT_NAMES | {"self_attn.q_norm.weight": "attn_q_norm.weight",
                                 "self_attn.k_norm.weight": "attn_k_norm.weight"},
    "phi3": _GGUF_LAYER_NAMES | {"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"},
    "gemma3": _GGUF_SPLIT_NAMES | {"self_attn.q_norm.weight": "attn_q_norm.weight",
                                  "self_attn.k_norm.weight": "attn_k_norm.weight",
                                  "post_attention_layernorm.weight": "post_attention_norm.weight",
                                  "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                                  "post_feedforward_layernorm.weight": "post_ffw_norm.weight"},
}


def write_gguf_model(path, config: ModelConfig, state: dict[str, torch.Tensor], matrix_type: str = "F32",
                     rope_dims: int | None = None, sliding_window: int | None = None, tensors=None,
                     keys: dict | None = None):
    """``state`` as a GGUF file of ``config.architecture`` (llama, qwen3, phi3 or gemma3), laid out as llama.cpp's
    converter writes them (``GGUF_LAYER_NAMES``; llama's q/k rows permuted into its rotary layout): every matrix in
    ``matrix_type`` (a GGML type name ``gguf`` quantizes to: F32, F16, BF16, Q8_0, …), norms in float32.
    ``rope_dims``: a ``rope.dimension_count``; ``sliding_window``: an ``attention.sliding_window``; ``tensors``:
    extra float32 tensors by GGUF name; ``keys``: extra ``<arch>.<key>`` metadata (str, int or float)."""
    import gguf
    from gguf.quants import quantize

    arch = config.architecture
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    if arch in ("qwen3", "gemma3"):
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if arch == "gemma3":  # every sixth layer global: what llama.cpp assumes of these files
        assert config.layer_types == tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                           for i in range(config.num_hidden_layers))
        sliding_window = config.sliding_window
    if rope_dims is not None:
        writer.add_rope_dimension_count(rope_dims)
    if sliding_window is not None:
        writer.add_sliding_window(sliding_window)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    for key, value in (keys or {}).items():
        add = writer.add_string if isinstance(value, str) else writer.add_uint32 if isinstance(value, int) \
            else writer.add_float32
        add(f"{arch}.{key}", value)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if "lm_head.weight" in state:  # else tied: the file has no output.weight
        names["lm_head.weight"] = "output.weight"
    for i in range(config.num_hidden_layers):
        names |= {f"model.layers.{i}.{hf}": f"blk.{i}.{name}" for hf, name in GGUF_LAYER_NAMES[arch].items()}
    assert set(names) == set(state)
    for hf, name in names.items():
        array = np.ascontiguousarray(state[hf].numpy(), dtype=np.float32)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_attention_heads if "attn_q" in name else config.num_key_value_heads
            array = np.ascontiguousarray(array.reshape(heads, 2, array.shape[0] // heads // 2, -1).swapaxes(1, 2)
                                         .reshape(array.shape))
        if matrix_type != "F32" and array.ndim == 2:
            kind = gguf.GGMLQuantizationType[matrix_type]
            writer.add_tensor(name, quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, array)
    for name, array in (tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@torch.inference_mode()
def forward_layer_by_layer(model: Transformer, blocks: list[Block]) -> list[torch.Tensor]:
    """:meth:`Transformer.forward_blocks` one native op at a time: the embedding, then per layer the norm, q/k/v, the
    q/k norms, the arena's attention op (``KVArena.attend``), the output projection with its skip, the norm, gate/up,
    the gated activation and down with its skip; the final norm and the head. The native pass runs the same ops in the
    same order with the same roundings, so the two agree bit for bit (``test_native_pass.py``, whose reference this
    is: each op is tested against torch and transformers); a test that watches each layer's q, k and v runs it."""
    cfg = model.config
    n_heads, n_kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    sizes = [block.tokens.shape[0] for block in blocks]
    for block, n_rows in zip(blocks, sizes):
        block.cache.begin(n_rows, per_block=block.per_block, parents=block.parents)
    scored = [1 if block.last_only else n for block, n in zip(blocks, sizes)]

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x.contiguous(), weight, cfg.rms_norm_eps)

    def skip(x: torch.Tensor, linear, inputs: torch.Tensor, post_norm: torch.Tensor | None) -> torch.Tensor:
        return linear(inputs, residual=x) if post_norm is None else x + norm(linear(inputs), post_norm)

    x = model.embed[torch.cat([block.tokens for block in blocks])]
    if model.embed_scale is not None:
        x = x * model.embed_scale
    for index, layer in enumerate(model.layers):
        attended = []
        for block, rows in zip(blocks, layer.qkv(norm(x, layer.attn_norm)).split(sizes)):
            n_rows = rows.shape[0]
            # [T, (n_heads + 2 n_kv) head_dim] -> q [n_heads, T, head_dim], k and v [n_kv, T, head_dim] (views)
            heads = rows.view(n_rows, n_heads + 2 * n_kv, hd).transpose(0, 1)
            q, k, v = heads[:n_heads], heads[n_heads : n_heads + n_kv], heads[n_heads + n_kv :]
            if layer.q_norm is not None:
                q = norm(q.reshape(-1, hd), layer.q_norm).view(n_heads, n_rows, hd)
                k = norm(k.reshape(-1, hd), layer.k_norm).view(n_kv, n_rows, hd)
            attended.append(block.cache.attend(index, q, k, v))
        x = skip(x, layer.o_proj, torch.cat(attended), layer.attn_post_norm)
        x = skip(x, layer.down, kernels.gated(layer.gate_up(norm(x, layer.mlp_norm)), gelu=cfg.gemma),
                 layer.mlp_post_norm)
    for block in blocks:
        block.cache.end()
    ends = torch.tensor(sizes).cumsum(0).tolist()
    x = torch.cat([x[end - rows : end] for end, rows in zip(ends, scored)])
    logits = model.lm_head(norm(x, model.norm)).float()
    if model.vocab_limit < cfg.vocab_size:
        logits = torch.nn.functional.pad(logits, (0, cfg.vocab_size - model.vocab_limit), value=-math.inf)
    return list(logits.split(scored))


@contextmanager
def layer_by_layer(model: Transformer):
    """Within the block, ``model`` runs its passes through :func:`forward_layer_by_layer`, bit for bit the native
    pass: so a test can watch each layer's q, k and v (``KVArena.attend``)."""
    model.forward_blocks = lambda blocks: forward_layer_by_layer(model, blocks)
    try:
        yield model
    finally:
        del model.forward_blocks


def rotate(x: torch.Tensor, positions: torch.Tensor, rope) -> torch.Tensor:
    """``x: [heads, tokens, head_dim]`` rotated by ``positions: [tokens]`` as the kernels rotate (``x * cos +
    rotate_half(x) * sin`` in ``x``'s dtype, with the rows ``rope.rows`` gives)."""
    cos, sin = rope.rows(0, int(positions.max()) + 1 if positions.numel() else 0)
    cos, sin = cos[positions].to(x.dtype), sin[positions].to(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def tiny_model(architecture: str = "llama", seed: int = 0, dtype=torch.float32, **overrides) -> Transformer:
    config = tiny_config(architecture, **overrides)
    return Transformer(config, random_state(config, seed), dtype)


def kernels_must_build() -> bool:
    """Whether a failed build of the native kernels fails the tests that need them: on x86-64 and AArch64 (the CPUs
    they are written for) under CI (``CI=true``) or with the C++ compiler torch builds with (``$CXX``, else ``c++``).
    Elsewhere they are skipped, as users without a compiler get one warning line and a one-sentence refusal from
    whatever needs the kernels."""
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        return False
    return os.environ.get("CI", "").lower() in ("true", "1") or shutil.which(os.environ.get("CXX", "c++")) is not None


# What the native_kernels fixture found (for the run's summary line): unset until a test asks for the kernels.
_native_outcome: dict[str, str] = {}


@pytest.fixture(scope="session")
def native_kernels():
    """The native kernels, for every test of the modules that test them (``pytestmark``): skipped where they
    cannot be built, a failure naming the build's error where they must be (:func:`kernels_must_build`)."""
    from sparsespec import kernels

    if kernels.available():
        _native_outcome["state"] = "built"
        return kernels
    reason = kernels.unavailable_reason()
    if kernels_must_build():
        _native_outcome["state"] = f"failed to build ({reason})"
        pytest.fail(f"the native kernels failed to build on a host that builds them: {reason}", pytrace=False)
    _native_outcome["state"] = f"not tested ({reason})"
    pytest.skip(f"native kernels unavailable here ({reason})")


# What a test needs, marked from the fixtures it takes (and, for the HTTP server and the modules that build the
# kernels themselves, its module), so that an inner loop can leave out what is slow to set up (README, "Tests").
NEEDS_FETCHED_WEIGHTS = {"smollm2_path", "smollm2_f32", "smollm2_default", "tiny_loaded"}
SERVER_MODULES = {"test_serve", "test_serve_guard"}
BUILDING_MODULES = {"test_kernel_build", "test_kernels_arm"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & NEEDS_FETCHED_WEIGHTS:
            item.add_marker(pytest.mark.model)
        module = item.module.__name__.rpartition(".")[2] if item.module is not None else ""
        if "native_kernels" in fixtures or module in BUILDING_MODULES:
            item.add_marker(pytest.mark.native)
        if module in SERVER_MODULES:
            item.add_marker(pytest.mark.server)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that built a KV cache and met the arena's refusal (its attention runs in the native kernels alone) is
    skipped where the kernels may be missing, as the native tests are; where they must build it stays a failure."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None and not kernels_must_build():
        from sparsespec.cache.arena import NEEDS_KERNELS

        if NEEDS_KERNELS in str(call.excinfo.value):
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1] or 0,
                               "Skipped: the KV cache needs the native kernels, unavailable here")


def pytest_terminal_summary(terminalreporter):
    """One line saying which instruction sets of the native kernels the run covered (the tests run every one the
    CPU runs; NEON also under qemu-aarch64, in test_kernels_arm.py), or why it covered none."""
    state = _native_outcome.get("state")
    if state is None:  # no test asked for the kernels
        return
    if state != "built":
        terminalreporter.write_line(f"native kernels: {state}")
        return
    from sparsespec import kernels

    ran = [name for name, isa in kernels.ISA_NAMES.items() if kernels.isa_available(isa)]
    lacks = [name for name in kernels.ISA_NAMES if name not in ran]
    qemu = any("test_kernels_arm.py::test_aarch64" in r.nodeid for r in terminalreporter.stats.get("passed", []))
    if qemu and "neon-dotprod" in lacks:
        ran.append("neon-dotprod under qemu-aarch64")
        lacks.remove("neon-dotprod")
    terminalreporter.write_line(f"native kernels: built; instruction sets covered (every one this CPU runs): "
                                f"{', '.join(ran)}; not covered: {', '.join(lacks) or 'none'}")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The fetched SmolLM2-135M GGUF (``sparsespec fetch smollm2-135m``); skipped locally if absent, fatal on CI."""
    path = MODEL_FIXTURES["smollm2-135m"].path
    if not path.is_file():
        if os.environ.get("CI"):
            pytest.fail("SmolLM2-135M is not fetched; .ci/run must run `sparsespec fetch smollm2-135m`.")
        pytest.skip("SmolLM2-135M not fetched (run `sparsespec fetch smollm2-135m`)")
    return path


@pytest.fixture(scope="session")
def smollm2_f32(smollm2_path):
    """Our SmolLM2-135M in float32, with its tokenizer."""
    from sparsespec.loading.load import load_model

    return load_model("smollm2-135m", torch.float32)


@pytest.fixture(scope="session")
def smollm2_default(smollm2_path, native_kernels):
    """SmolLM2 as `sparsespec generate` loads it by default: bfloat16, `--weights auto` (native for this file)."""
    from sparsespec.loading.load import load_model

    loaded = load_model("smollm2-135m", torch.bfloat16, "auto")
    assert loaded.weights == "native"
    return loaded


@pytest.fixture
def row_by_row(monkeypatch):
    """Counts, by arena, the layer calls that evicted between the rows of a multi-row block (a verification block
    that fills the budget): each such block counts once per layer, on whichever path it ran (the native pass or the
    native op)."""
    calls: dict[int, int] = {}
    from sparsespec.cache.arena import KVArena

    begin = KVArena.begin

    def spy(self, n_rows, per_block=False, parents=None):
        begin(self, n_rows, per_block, parents)
        if self.evicts_per_row:
            calls[id(self)] = calls.get(id(self), 0) + self.config.num_hidden_layers

    monkeypatch.setattr(KVArena, "begin", spy)
    return calls


@pytest.fixture(scope="module")
def tiny_loaded(smollm2_f32):
    """A 2-layer random model speaking SmolLM2's vocabulary: fast, and its chat template is SmolLM2's (the server's
    tests, where only the server's behaviour matters)."""
    from sparsespec.loading.load import LoadedModel

    model = tiny_model(vocab_size=len(smollm2_f32.tokenizer), max_position_embeddings=2048)
    return LoadedModel("tiny", None, model.config, model, smollm2_f32.tokenizer)
