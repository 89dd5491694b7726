"""What a calibration times: each function here builds one workload (a buffer, a GEMM, layer-shaped weights, a
probe model, one layer's attention) and returns its seconds or its rate. Deriving the profile's figures from these
timings is :mod:`.fits`' job; running them in order, :mod:`.measure`'s.

Torch, the native kernels and gguf are imported inside the functions, as they are needed.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

from ...config import ModelConfig
from ...errors import UserError
from .settings import ATTENTION_SHAPE, MIB


# --------------------------------------------------------------------------------------------------- timing
def time_calls(fn: Callable[[], Any], *, calls: int = 1, trials: int = 3, min_seconds: float = 0.0) -> list[float]:
    """Seconds per call of ``fn``: one value per trial of ``calls`` calls, after one warm-up call.

    Runs at least ``trials`` trials and keeps going until ``min_seconds`` have passed (at most 200 trials).
    """
    fn()
    out: list[float] = []
    started = time.perf_counter()
    while len(out) < trials or (time.perf_counter() - started < min_seconds and len(out) < 200):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls)
    return out


# ------------------------------------------------------------------------------------------------- kernels
def read_bandwidth(size_bytes: int, *, trials: int = 3, min_seconds: float = 0.05) -> float:
    """Bytes/s an fp32 ``sum`` reads from a buffer of ``size_bytes`` (best trial; the buffer is written first)."""
    import torch

    x = torch.ones(max(size_bytes // 4, 256), dtype=torch.float32)
    calls = max(1, int(16 * MIB // x.nbytes))
    times = time_calls(x.sum, calls=calls, trials=trials, min_seconds=min_seconds)
    return x.nbytes / min(times)


def matmul_flops(dtype_name: str, n: int, *, trials: int = 3, min_seconds: float = 0.05) -> float:
    """FLOP/s of an ``n × n`` by ``n × n`` matrix product (``2n³`` FLOPs) in ``bf16`` or ``fp32`` (best trial)."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    times = time_calls(lambda: torch.mm(a, b), trials=trials, min_seconds=min_seconds)
    return 2.0 * n**3 / min(times)


def stream_weights(
    total_bytes: int,
    shapes: tuple[tuple[int, int], ...],
    rows: int,
    *,
    trials: int = 3,
    min_seconds: float = 0.05,
) -> dict[str, float]:
    """Decode-style weight streaming: bf16 ``F.linear`` of 1 and of ``rows`` rows over layer-shaped weights.

    Builds as many layers of ``shapes`` as fill ``total_bytes`` and times one pass over all of them (median trial).
    Returns ``bytes``, ``parameters``, ``one_row_s``, ``rows_s`` and ``bytes_per_s`` (of the one-row pass).
    """
    import torch
    import torch.nn.functional as F

    per_layer = sum(o * i for o, i in shapes) * 2
    layers = max(1, math.ceil(total_bytes / per_layer))
    weights = [torch.full((o, i), 0.01, dtype=torch.bfloat16) for _ in range(layers) for o, i in shapes]
    params = sum(w.numel() for w in weights)
    inputs = {w.shape[1]: None for w in weights}

    def run(n_rows: int) -> Callable[[], None]:
        xs = {k: torch.full((n_rows, k), 0.5, dtype=torch.bfloat16) for k in inputs}

        def step() -> None:
            for w in weights:
                F.linear(xs[w.shape[1]], w)

        return step

    one = statistics.median(time_calls(run(1), trials=trials, min_seconds=min_seconds))
    many = statistics.median(time_calls(run(rows), trials=trials, min_seconds=min_seconds))
    return {
        "bytes": float(params * 2),
        "parameters": float(params),
        "one_row_s": one,
        "rows_s": many,
        "bytes_per_s": params * 2 / one,
    }


# Offsets of the float16 scales in each block type's GGUF block (ggml's block layouts): random codes, scales of 0.01.
_F16_SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
                      "Q5_K": (0, 2), "Q6_K": (208,)}


def random_native_weight(kind: str, out_features: int, in_features: int, seed: int = 0):
    """A weight of GGUF block type ``kind`` with random codes, in the kernels' layout: ``(kernel type, repacked
    bytes, padded in_features, the file's bytes)``."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType

    from ... import kernels
    from ...kernels.repack import BLOCK_TYPES, pack

    ggml_type = int(GGMLQuantizationType[kind])
    _, block, block_bytes = BLOCK_TYPES[ggml_type]
    if in_features % block:
        raise UserError(f"A {kind} weight needs inputs in whole blocks of {block}, got {in_features}.")
    raw = np.random.default_rng(seed).integers(0, 256, (out_features, in_features // block, block_bytes), np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    for offset in _F16_SCALE_OFFSETS[kind]:
        raw[..., offset:offset + 2] = scale
    kernel_type, packed, padded = pack(ggml_type, raw.reshape(out_features, -1), in_features,
                                       kernels.tiles_preferred())
    return kernel_type, torch.from_numpy(packed.reshape(-1)), padded, raw.size


def in_engine_memory(blobs: list):
    """Copies of the byte tensors ``blobs`` in one mapping of the memory the engine's weights stream from
    (:func:`~sparsespec.loading.huge_pages.anonymous_memory`: huge pages), each 64-byte aligned; their rates are
    the engine's (decoding runs faster from it than from one allocation per tensor:
    benchmarks/history/decode.md#weights-in-huge-pages-native-decoding-10-20-faster-2026-12-05-evening)."""
    import torch

    from ...loading.huge_pages import anonymous_memory

    offsets, end = [], 0
    for blob in blobs:
        offsets.append(end)
        end += -(-blob.numel() // 64) * 64
    memory = anonymous_memory(end)
    copies = []
    for blob, offset in zip(blobs, offsets):
        copy = torch.frombuffer(memory, dtype=torch.uint8, count=blob.numel(), offset=offset)
        copy.copy_(blob)
        copies.append(copy)
    return copies


def time_native_streaming(kind: str, total_bytes: int, shapes: tuple[tuple[int, int], ...], rows: int, *,
                          trials: int = 3, min_seconds: float = 0.05) -> dict[str, Any]:
    """The native kernels' matmul over as many layers of ``shapes`` as make ``total_bytes`` of weights of GGUF
    type ``kind`` (random blocks): one pass on one row (median trial), and the extra time of ``rows`` rows.

    Returns ``bytes_per_s`` (the file's bytes of the pass over its one-row time), ``extra_row_bytes_per_s`` (the
    same bytes over the extra time per extra row; None when ``rows`` rows took no longer), ``working_set_bytes``
    and the timings.
    """
    import torch

    from ... import kernels

    layer = [random_native_weight(kind, n, k, seed=i) for i, (n, k) in enumerate(shapes)]
    layer_bytes = sum(w[3] for w in layer)
    layers = max(1, round(total_bytes / layer_bytes))
    weights = [(kt, blob, padded, n) for _ in range(layers) for (kt, blob, padded, _), (n, _k) in zip(layer, shapes)]
    copies = in_engine_memory([blob for _, blob, _, _ in weights])
    weights = [(kt, copy, padded, n) for (kt, _, padded, n), copy in zip(weights, copies)]

    def run(n_rows: int) -> Callable[[], None]:
        xs = {padded: torch.full((n_rows, padded), 0.5, dtype=torch.bfloat16) for _, _, padded, _ in weights}

        def step() -> None:
            for kernel_type, blob, padded, n in weights:
                kernels.gguf_linear(xs[padded], [blob], [kernel_type], [n], padded)

        return step

    one, many = run(1), run(rows)
    seconds = statistics.median(time_calls(one, trials=trials, min_seconds=min_seconds))
    # The extra rows add little to a pass that streams from DRAM: one-row and many-row passes alternate, and the
    # median of their paired differences is kept, so that a drift of the machine's speed cancels.
    many()
    differences = []
    started = time.perf_counter()
    while len(differences) < 2 * trials or (time.perf_counter() - started < 2 * min_seconds and len(differences) < 200):
        t0 = time.perf_counter()
        one()
        t1 = time.perf_counter()
        many()
        differences.append(time.perf_counter() - t1 - (t1 - t0))
    extra = statistics.median(differences) / (rows - 1)
    total = layers * layer_bytes
    return {
        "bytes_per_s": total / seconds,
        "extra_row_bytes_per_s": total / extra if extra > 0 else None,
        "working_set_bytes": total,
        "one_row_s": seconds,
        "extra_row_s": extra,
    }


def kv_residency(
    l3_bytes: int, fractions: tuple[float, ...], stream_bytes: int, *, trials: int = 3
) -> dict[str, float]:
    """Share of a buffer of ``f × l3_bytes`` still cached after ``stream_bytes`` of other data were read.

    This is what happens to a KV cache between two decode steps while the weights stream through the same cache.
    Per fraction: 1 when re-reading the buffer after the stream is as fast as reading it hot, 0 when it is as slow
    as reading the stream's first bytes (evicted by the rest of the stream) — best trial of each.
    """
    import torch

    big = torch.ones(max(stream_bytes // 4, 256), dtype=torch.float32)
    out: dict[str, float] = {}
    for f in fractions:
        n = max(int(l3_bytes * f) // 4, 256)
        buf = torch.ones(n, dtype=torch.float32)
        head = big[:n]
        hot = min(time_calls(buf.sum, trials=trials * 2))
        after, cold = [], []
        for _ in range(trials * 2):
            big.sum()
            t0 = time.perf_counter()
            buf.sum()
            after.append(time.perf_counter() - t0)
            big.sum()
            t0 = time.perf_counter()
            head.sum()
            cold.append(time.perf_counter() - t0)
        slow, kept = min(cold), min(after)
        share = (slow - kept) / (slow - hot) if slow > hot else 0.0
        out[f"{f:.4g}"] = max(0.0, min(1.0, share))
    return out


# ----------------------------------------------------------------------------------------- engine timings
def probe_config(layers: int, shape: tuple[int, int, int, int, int] = (128, 256, 4, 2, 32),
                 vocab: int = 512) -> ModelConfig:
    """A random decoder of ``shape`` (hidden, MLP width, query heads, KV heads, head width) and a small vocabulary."""
    hidden, intermediate, heads, kv_heads, head_dim = shape
    return ModelConfig(
        architecture="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=1 << 20, tie_word_embeddings=True,
        attention_bias=False,
    )


def random_state(config: ModelConfig, seed: int = 0) -> dict:
    """A Hugging Face-named state dict of random bf16 weights for ``config``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h, i, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(torch.bfloat16)

    ones = torch.ones(h, dtype=torch.bfloat16)
    state = {"model.embed_tokens.weight": w(config.vocab_size, h), "model.norm.weight": ones}
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        state[p + "input_layernorm.weight"] = ones
        state[p + "post_attention_layernorm.weight"] = ones
        for name, shape in (("q_proj", (q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, q))):
            state[p + f"self_attn.{name}.weight"] = w(*shape)
        state[p + "mlp.gate_proj.weight"] = w(i, h)
        state[p + "mlp.up_proj.weight"] = w(i, h)
        state[p + "mlp.down_proj.weight"] = w(h, i)
    return state


def probe_parts(shape: tuple[int, int, int, int, int]) -> dict[str, tuple[int, int]]:
    """A probe layer's projections of ``shape`` (hidden, MLP width, query heads, KV heads, head width), as
    ``{name: (out_features, in_features)}``."""
    h, i, heads, kv_heads, hd = shape
    q, kv = heads * hd, kv_heads * hd
    return {"qkv": (q + 2 * kv, h), "o_proj": (h, q), "gate_up": (2 * i, h), "down": (h, i)}


def file_bytes(kind: str, out_features: int, in_features: int) -> float:
    """Bytes of an ``out_features × in_features`` weight of GGUF block type ``kind`` in the file."""
    from gguf import GGMLQuantizationType

    from ...kernels.repack import BLOCK_TYPES

    _, block, block_bytes = BLOCK_TYPES[int(GGMLQuantizationType[kind])]
    return out_features * in_features / block * block_bytes


def native_probe_model(shape: tuple[int, int, int, int, int], kind: str, total_bytes: int):
    """A :class:`Transformer` of ``shape`` with as many layers as make ``total_bytes`` of random native weights of
    GGUF type ``kind`` (the file's bytes; at least 2 layers; one layer's blocks copied into every layer, so each
    streams its own memory) and a random Q8_0 head over a 512-entry vocabulary."""
    import torch

    from ...linear import NativeLinear
    from ...model import Transformer

    h = shape[0]
    parts = probe_parts(shape)
    blocks = {part: random_native_weight(kind, n, k, seed=j) for j, (part, (n, k)) in enumerate(parts.items())}
    layers = max(2, math.ceil(total_bytes / sum(block[3] for block in blocks.values())))
    config = probe_config(layers, shape)
    linears: dict[str, object] = {}
    copies = iter(in_engine_memory([blob for _ in range(layers) for _, blob, _, _ in blocks.values()]))
    for layer in range(layers):
        for part, (kernel_type, _, padded, _) in blocks.items():
            n, k = parts[part]
            linears[f"layers.{layer}.{part}"] = NativeLinear([(kernel_type, next(copies), n)], k, padded)
    kernel_type, blob, padded, _ = random_native_weight("Q8_0", config.vocab_size, h)
    linears["lm_head"] = NativeLinear([(kernel_type, blob, config.vocab_size)], h, padded)
    ones = torch.ones(h, dtype=torch.bfloat16)
    state = {"model.embed_tokens.weight": torch.randn(config.vocab_size, h).to(torch.bfloat16) / h**0.5,
             "model.norm.weight": ones}
    for layer in range(layers):
        state[f"model.layers.{layer}.input_layernorm.weight"] = ones
        state[f"model.layers.{layer}.post_attention_layernorm.weight"] = ones
    return Transformer(config, state, torch.bfloat16, "native", linears=linears)


def linears_pass(model, rows: int) -> Callable[[], None]:
    """A pass that calls every projection of ``model`` once, in model order, on ``rows`` rows and does nothing else:
    the weights' streaming alone, as in a decode step; as a call."""
    import torch

    items = [linear for _, linear in model.linear_items()]
    xs = {lin.in_features: torch.full((rows, lin.in_features), 0.5, dtype=torch.bfloat16) for lin in items}

    def step() -> None:
        for lin in items:
            lin(xs[lin.in_features])

    return step


def _arena(model, policy, max_tokens: int, max_inflight: int):
    import torch

    from ...cache.arena import KVArena

    return KVArena(model.config, policy, dtype=torch.bfloat16, max_tokens=max_tokens, max_block=64,
                   max_inflight=max_inflight)


def decode_steps(model, policy, context: int, steps: int) -> Callable[[], None]:
    """The engine's decode loop (forward, commit, greedy sampling) after a ``context``-token prompt, as a call that
    runs its next step (at most ``steps`` calls)."""
    from ...generate import generate_tokens
    from ...sampling import SamplingParams

    arena = _arena(model, policy, context + steps + 4, 1)
    prompt = [(7 * i + 3) % model.config.vocab_size for i in range(context + 1)]
    tokens = generate_tokens(model, arena, prompt, max_new_tokens=steps + 2, sampling=SamplingParams(),
                             prefill_chunk=64)
    next(tokens)  # the prompt's pass
    return lambda: next(tokens)


def decode_step_seconds(model, policy, context: int, steps: int) -> float:
    """Seconds of the median step of the engine's decode loop (forward, commit, greedy sampling)."""
    step = decode_steps(model, policy, context, steps)
    return statistics.median(time_calls(step, trials=steps - 1))


def block_pass(model, policy, context: int, rows: int) -> Callable[[], None]:
    """A ``rows``-row pass (forward, greedy choice of every row, rollback) over ``context`` tokens, as a greedy
    verification pass does it, as a call."""
    import torch

    from ...generate import prefill

    arena = _arena(model, policy, context + rows + 2, rows + 1)
    prefill(model, arena, [(5 * i + 1) % model.config.vocab_size for i in range(context)], 64)
    block = torch.tensor([(3 * i + 2) % model.config.vocab_size for i in range(rows)])

    def step() -> None:
        model.forward(block, arena).argmax(dim=-1).tolist()
        arena.commit(0)

    return step


def paired_seconds(calls: dict[str, Callable[[], Any]], trials: int) -> dict[str, list[float]]:
    """Seconds of every call, the calls made in turn ``trials`` times: entry ``i`` of each list comes from the same
    turn, so that differences between calls taken turn by turn leave the machine's drift out."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(trials):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    return times


def median_difference(a: list[float], b: list[float]) -> float:
    """The median of ``a[i] − b[i]``: how much longer ``a`` took than ``b`` in the same turn."""
    return statistics.median(x - y for x, y in zip(a, b))


def sampling_seconds(vocab: int, *, trials: int = 5, min_seconds: float = 0.05) -> float:
    """Seconds to turn one row of float32 logits over ``vocab`` entries into the greedy token (median trial)."""
    import torch

    from ...sampling import SamplingParams, next_token

    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams()
    return statistics.median(time_calls(lambda: next_token(logits, greedy, None), trials=trials,
                                        min_seconds=min_seconds))


def attention_step(entries: int, rows: int, *, evicting: bool, shape: tuple[int, int, int] = ATTENTION_SHAPE,
                   kv_dtype: str = "auto") -> Callable[[], None]:
    """One layer of :meth:`KVArena.attend` for ``rows`` rows over ``entries`` cached entries, as a call to time
    (rolled back after each call), keys and values at ``kv_dtype`` (``auto``: bfloat16, the compute dtype).

    ``evicting``: a hybrid cache of budget ``entries``, filled past it, so every row evicts; else the full cache.
    """
    import torch

    from ...cache.arena import KVArena
    from ...cache.policy import make_policy

    heads, kv_heads, hd = shape
    config = ModelConfig(
        architecture="llama", vocab_size=16, hidden_size=heads * hd, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hd, rope_theta=10000.0, rms_norm_eps=1e-6,
        max_position_embeddings=1 << 20, tie_word_embeddings=True, attention_bias=False,
    )
    policy = make_policy("hybrid", entries) if evicting else make_policy("full")
    fill = entries + 64 if evicting else entries
    arena = KVArena(config, policy, dtype=torch.bfloat16, max_tokens=fill + rows + 2, max_block=64,
                    max_inflight=rows + 1, kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(0)

    def rnd(h: int, n: int) -> torch.Tensor:
        return torch.randn(h, n, hd, generator=g).to(torch.bfloat16)

    left = fill
    while left:
        n = min(64, left)
        arena.begin(n, per_block=True)
        arena.attend(0, rnd(heads, n), rnd(kv_heads, n), rnd(kv_heads, n))
        arena.end()
        arena.commit(n)
        left -= n
    q, k, v = rnd(heads, rows), rnd(kv_heads, rows), rnd(kv_heads, rows)

    def step() -> None:
        arena.begin(rows)
        arena.attend(0, q, k, v)
        arena.end()
        arena.commit(0)

    return step


def cold_pair_seconds(small: Callable[[], Any], large: Callable[[], Any], flush, trials: int) -> tuple[float, float]:
    """Seconds of ``small`` and ``large`` after reading ``flush`` (a tensor larger than the caches, as a decode
    step's weights pass between two visits of a layer's cache): the median of each, the two called in turn so that
    the machine's drift falls on both alike, and the median of their paired differences added to the small one."""
    small()
    large()
    first, differences = [], []
    for _ in range(trials):
        flush.sum()
        t0 = time.perf_counter()
        small()
        t1 = time.perf_counter()
        flush.sum()
        t2 = time.perf_counter()
        large()
        differences.append(time.perf_counter() - t2 - (t1 - t0))
        first.append(t1 - t0)
    base = statistics.median(first)
    return base, base + statistics.median(differences)

