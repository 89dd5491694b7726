"""The native forward pass (one call runs every layer: ``kernels/csrc/model.h``) against the layer-by-layer pass
(``conftest.forward_layer_by_layer``) that calls the native ops one at a time: the same logits and the same arenas, bit for
bit, for every architecture, both dtypes, every policy, both position modes, quantized KV storage, prefill chunks,
verification blocks with partial commits and rollbacks, and several sequences in one pass.

The layer-by-layer pass is the reference here because its ops are each tested against torch and transformers
(``test_native_ops.py``, ``test_attention_native.py``, ``test_model_reference.py``); equality with it carries
every exactness guarantee over to the native pass.
"""

from __future__ import annotations

import pytest
import torch

from sparsespec.cache import KVArena, make_policy
from sparsespec.cache.layered import LayeredArena
from sparsespec.linear import NativeEmbedding, NativeLinear
from sparsespec.model import Block, Transformer

from conftest import forward_layer_by_layer, random_state, tiny_config

# Skipped without the kernels, failed where they must build (conftest.py: native_kernels).
pytestmark = pytest.mark.usefixtures("native_kernels")

GEMMA = dict(num_hidden_layers=6, layer_types=("sliding_attention",) * 5 + ("full_attention",), sliding_window=6,
             local_rope_theta=10000.0, head_dim=16, query_pre_attn_scalar=16)


def native_model(architecture: str, dtype: torch.dtype, ggml_type: int = 8, **overrides) -> Transformer:
    """A tiny random model of ``architecture`` on native weights (GGUF blocks of ``ggml_type``), its embedding kept
    in blocks as GGUF files are loaded."""
    config = tiny_config(architecture, **overrides)
    state = random_state(config, seed=3, scale=1.0)
    embed = NativeEmbedding(NativeLinear.from_float(state["model.embed_tokens.weight"], None, ggml_type), dtype)
    return Transformer(config, state, dtype, "native", linear_options={"ggml_type": ggml_type},
                       linears={"embed": embed})


def make_arena(model: Transformer, policy, positions="original", kv_dtype="auto", max_inflight=6):
    config = model.config

    def arena(cfg, **overrides):
        options = dict(policy=policy, dtype=model.dtype, max_tokens=256, max_block=8, max_inflight=max_inflight,
                       positions=positions, kv_dtype=kv_dtype, key_offset=None) | overrides
        return KVArena(cfg, options.pop("policy"), **options)

    if config.sliding_layers:
        return LayeredArena(config, arena)
    return arena(config)


def arena_state(arena) -> list[torch.Tensor]:
    """Every tensor an arena holds, for comparison."""
    arenas = arena._arenas if isinstance(arena, LayeredArena) else (arena,)
    out = []
    for a in arenas:
        out += a.buffers().values()
    return [t.clone() for t in out]


def script(model: Transformer, arenas: list, native: bool) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """A decoding session on each arena, passes shared between them: a prefill chunk (evicting once per block),
    single rows, a verification block committed in part, another rolled back; every pass's logits and the arenas'
    final state. ``native``: the native pass, else the layer-by-layer one."""
    if not native:
        model.forward_blocks = lambda blocks: forward_layer_by_layer(model, blocks)
    g = torch.Generator().manual_seed(11)
    vocab = model.config.vocab_size

    def run(rows: int, per_block: bool = False, last_only: bool = False) -> list[torch.Tensor]:
        blocks = [Block(torch.randint(0, vocab, (rows,), generator=g), arena, per_block, last_only)
                  for arena in arenas]
        return model.forward_blocks(blocks)

    outputs = []
    for chunk in range(3):  # 24 prompt tokens in per-block chunks of 8
        outputs += run(8, per_block=True, last_only=chunk < 2)
        for arena in arenas:
            arena.commit(8)
    for step in range(30):
        outputs += run(1)
        for arena in arenas:
            arena.commit(1)
        if step % 7 == 3:  # a verification block of 5 rows, 2 accepted
            outputs += run(5)
            for arena in arenas:
                arena.commit(2)
        if step % 9 == 5:  # one rejected entirely
            outputs += run(4)
            for arena in arenas:
                arena.rollback()
    return outputs, [arena_state(arena) for arena in arenas]


def assert_same_run(make_model, make_arenas):
    model_a, model_b = make_model(), make_model()
    native_out, native_state = script(model_a, make_arenas(model_a), native=True)
    layer_out, layer_state = script(model_b, make_arenas(model_b), native=False)
    assert len(native_out) == len(layer_out)
    for i, (a, b) in enumerate(zip(native_out, layer_out)):
        assert a.dtype == torch.float32 and torch.equal(a, b), f"pass {i} differs"
    for arena_a, arena_b in zip(native_state, layer_state):
        for a, b in zip(arena_a, arena_b):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("architecture,overrides", [
    ("llama", {}), ("qwen2", {}), ("qwen3", {}), ("phi3", {}), ("gemma3", GEMMA),
], ids=["llama", "qwen2-bias", "qwen3-qk-norm", "phi3-fused", "gemma3-sliding"])
def test_every_architecture_equals_the_layer_by_layer_pass(architecture, overrides, dtype):
    policy = make_policy("hybrid", 16, sinks=2, heavy=6)
    assert_same_run(lambda: native_model(architecture, dtype, **overrides),
                    lambda model: [make_arena(model, policy)])


@pytest.mark.parametrize("positions", ["original", "in-cache"])
@pytest.mark.parametrize("name,sizes", [
    ("full", {}), ("window", dict(budget=12)), ("streaming", dict(budget=12, sinks=2)),
    ("h2o", dict(budget=12)), ("hybrid", dict(budget=14, sinks=2, heavy=5)),
    ("hybrid-age", dict(budget=14, sinks=2, heavy=5)), ("hybrid-decay", dict(budget=14, sinks=2, heavy=5)),
])
def test_every_policy_and_position_mode_equals_the_layer_by_layer_pass(name, sizes, positions):
    if name == "full" and positions == "in-cache":
        pytest.skip("the full cache has one position mode")
    sizes = dict(sizes)
    policy = make_policy(name, sizes.pop("budget", None), **sizes)
    assert_same_run(lambda: native_model("qwen2", torch.bfloat16),
                    lambda model: [make_arena(model, policy, positions)])


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "int4"])
def test_quantized_storage_equals_the_layer_by_layer_pass(kv_dtype):
    policy = make_policy("hybrid", 14, sinks=2, heavy=5)
    assert_same_run(lambda: native_model("llama", torch.bfloat16),
                    lambda model: [make_arena(model, policy, "in-cache", kv_dtype)])


def test_several_sequences_in_one_pass_equal_the_layer_by_layer_pass():
    """Three arenas (two policies) share every pass, as serving's Batch runs them; also with a draft's cut head
    and float activations (Q4_0 row layout)."""

    def arenas(model):
        return [make_arena(model, make_policy("full")), make_arena(model, make_policy("hybrid", 14, sinks=2, heavy=5)),
                make_arena(model, make_policy("window", 10), "in-cache")]

    assert_same_run(lambda: native_model("llama", torch.bfloat16), arenas)

    def cut_float_model():
        model = native_model("llama", torch.bfloat16, ggml_type=2)
        for _, linear in model.linear_items():
            linear.float_activations = True
        model.limit_vocabulary(40)
        return model

    assert_same_run(cut_float_model, arenas)


def test_a_dense_embedding_runs_natively():
    """A model whose projections are native but whose embedding is a dense table (a Hugging Face folder quantized
    to Q8_0) runs the native pass too."""
    assert_same_run(lambda: Transformer(tiny_config("llama"), random_state(tiny_config("llama"), 2), torch.float32,
                                        "native"),
                    lambda model: [make_arena(model, make_policy("h2o", 12))])


def test_the_pass_changes_with_the_weights():
    """Cutting the head or switching activations after a pass makes the next pass read the new weights."""
    model = native_model("llama", torch.float32)
    first = model.native_model()
    assert model.native_model() is first
    model.limit_vocabulary(50)
    cut = model.native_model()
    assert cut is not first
    logits = model.forward(torch.tensor([1, 2, 3]), make_arena(model, make_policy("full")))
    assert torch.isinf(logits[:, 50:]).all() and torch.isfinite(logits[:, :50]).all()


def test_bad_blocks_are_refused_with_a_clear_error():
    model = native_model("llama", torch.float32)
    arena = make_arena(model, make_policy("full"))
    native = model.native_model()
    arena.begin(2)
    passes, route = arena.native_pass()
    for tokens, message in [(torch.tensor([1, 500]), "outside the vocabulary"),
                            (torch.tensor([1, 2, 3]), "3 rows for a block of 2")]:
        with pytest.raises(RuntimeError, match=message):
            native.forward([(tokens, False, passes, route)], -1)
    for p, r, message in [(passes, route[:1], "route of another length"), (passes, [(1, 0), (0, 1)], "routed outside"),
                          (passes * 2, route, "in two blocks")]:
        with pytest.raises(RuntimeError, match=message):
            native.forward([(torch.tensor([1, 2]), False, p, r)], -1)
    with pytest.raises(RuntimeError, match="in two blocks"):
        native.forward([(torch.tensor([1, 2]), False, passes, route)] * 2, -1)
    with pytest.raises(RuntimeError, match="no blocks"):
        native.forward([], -1)
    arena.end()
    with pytest.raises(RuntimeError, match="the arena has no block open"):
        native.forward([(torch.tensor([1, 2]), False, passes, route)], -1)


@pytest.mark.parametrize("ggml_type", [12, 14], ids=["Q4_K", "Q6_K"])
def test_column_tiles_padded_past_the_inputs_equal_the_layer_by_layer_pass(ggml_type):
    """K-quant tiles whose rows are padded to 256 inputs (the Qwen files' layout on x86), in bfloat16."""
    from test_native_model import with_random_tiles

    def model():
        m = with_random_tiles(native_model("llama", torch.bfloat16, tie_word_embeddings=False), ggml_type)
        assert m.layers[0].qkv.padded_in == 256 > m.layers[0].qkv.in_features
        return m

    assert_same_run(model, lambda m: [make_arena(m, make_policy("hybrid", 14, sinks=2, heavy=5), "in-cache")])
