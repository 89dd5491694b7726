"""The arena's decode attention (the native op), per KV dtype, and its effective bandwidth.

The arena's decode attention (one row, or a verification block) through the native op, and its effective bandwidth.

Builds a KV arena with a model's shapes (SmolLM2-135M: 30 layers, 9 query heads, 3 KV heads, head_dim 64; or
qwen2.5-coder-1.5b: 28 layers, 12 query heads, 2 KV heads, head_dim 128) holding ``n`` random entries stored in
each of ``--kv-dtypes``, then times decode steps (``begin(rows)``, ``attend`` in every layer, ``end``,
``commit(rows)``; ``--rows`` above 1 times a verification block of that many rows). Prints one JSON line per
(entries, KV dtype, rows): milliseconds per step for all layers; microseconds per layer in the attention op itself
(``attend``, which also stores the new rows and recalls, so its time includes those); and the effective GB/s of the
KV bytes a step must read (keys and values of every visible entry, once) over the op's own time.

    python benchmarks/bench_attention.py --entries 1024,8192,16384 --threads 2
    python benchmarks/bench_attention.py --policy hybrid --budget 1024 --entries 16384   # in-cache positions
    python benchmarks/bench_attention.py --shapes qwen2.5-coder-1.5b --policy hybrid --budget 1024 --entries 16384 \
        --kv-dtypes bf16,int8,int4
    python benchmarks/bench_attention.py --shapes qwen2.5-coder-1.5b --policy hybrid --budget 1024 --entries 8192 \
        --rows 1,5   # a γ = 4 verification block against one row
    python benchmarks/bench_attention.py --shapes qwen2.5-coder-0.5b --policy hybrid --budget 1024 \
        --entries 4096,16384 --recall-pages 0,8   # with recall from a cold tier of the evicted rest

With ``--recall-pages`` a budgeted arena also keeps a cold tier (``cache/recall.py``) holding the ``entries -
budget`` tokens it has evicted (random, as the resident ones), and every row recalls that many pages of it (0: no
cold tier); the step's time includes the recall.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch

from common import emit, machine, results_dir

from sparsespec import kernels
from sparsespec.cache.arena import KVArena
from sparsespec.cache.policy import POLICIES, make_policy
from sparsespec.cache.quant import BITS, bytes_per_vector
from sparsespec.cache.recall import Recall
from sparsespec.config import ModelConfig

SHAPES = {
    "smollm2-135m": dict(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         hidden_size=576, attention_bias=False),
    "qwen2.5-coder-0.5b": dict(num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                               hidden_size=896, attention_bias=True),
    "qwen2.5-coder-1.5b": dict(num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                               hidden_size=1536, attention_bias=True),
}


def make_config(shapes: dict) -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=49152, intermediate_size=1536, rope_theta=100000.0, rms_norm_eps=1e-5,
        max_position_embeddings=1 << 20, tie_word_embeddings=True, **shapes,
    )


def filled_arena(config: ModelConfig, policy_name: str, budget: int | None, entries: int, steps: int,
                 kv_dtype: str, rows: int = 1, recent_window: int | None = None, recall_pages: int = 0) -> KVArena:
    """An arena as after ``entries`` tokens of text: random KV stored in ``kv_dtype``; the full cache keeps them all,
    a budgeted one its budget (4 sinks and the most recent tokens) with random scores. Shapes with key biases (the
    Qwen2 models) get a random key bias, which quantized keys are stored without in the in-cache mode. Quantized
    entries keep ``recent_window`` (None: the dtype's default) positions in full precision, the ring filled with the
    newest rows (quantized entries are random codes: the op's time does not depend on their values).
    ``recall_pages``: a cold tier holding the evicted ``entries - budget`` tokens (0: none)."""
    policy = make_policy(policy_name, budget)
    positions = "original" if policy.is_full else "in-cache"
    gen = torch.Generator().manual_seed(0)
    key_bias = None
    if config.attention_bias:
        key_bias = torch.randn(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, generator=gen)
    arena = KVArena(config, policy, dtype=torch.bfloat16, max_tokens=entries + steps, max_block=rows,
                    positions=positions, kv_dtype=kv_dtype, key_offset=key_bias, recent_window=recent_window,
                    recall=Recall(recall_pages) if recall_pages else None)
    kept = entries if policy.is_full else min(policy.budget, entries)
    shape = (config.num_key_value_heads, kept, config.head_dim)
    newest = min(arena.recent_slots, kept - min(4, kept))  # rows of the window, the last slots
    ring = (torch.arange(newest) + entries - newest) % max(arena.recent_slots, 1)
    for layer in range(config.num_hidden_layers):
        k, v = torch.randn(shape, generator=gen).bfloat16(), torch.randn(shape, generator=gen).bfloat16()
        store(arena, "key", layer, k, gen)
        store(arena, "value", layer, v, gen)
        if newest:
            arena.buffer("recent_keys")[layer][:, ring] = k[:, kept - newest :]
            arena.buffer("recent_values")[layer][:, ring] = v[:, kept - newest :]
    recent = torch.arange(entries - (kept - min(4, kept)), entries)
    arena.buffer("positions")[:, :, :kept] = torch.cat((torch.arange(min(4, kept)), recent))
    if policy.needs_scores:
        scores = arena.buffer("scores")
        scores[:, :, :kept] = torch.rand(scores[:, :, :kept].shape, generator=gen)
        arena.buffer("committed_scores").copy_(scores)
    arena.n_committed = kept
    arena.next_position = entries
    if recall_pages and entries > kept:
        cold = (config.num_hidden_layers, entries - kept, config.num_key_value_heads, config.head_dim)
        evicted = torch.arange(min(4, kept), entries - (kept - min(4, kept)))
        arena.cold.append(torch.randn(cold, generator=gen), torch.randn(cold, generator=gen),
                          evicted[None, :, None].expand(cold[:3]).contiguous())
    return arena


def store(arena: KVArena, stored: str, layer: int, x: torch.Tensor, gen: torch.Generator) -> None:
    """``x: [n_kv, n, head_dim]`` into slots ``[0, n)`` of ``layer`` of the arena's ``stored`` ("key" or "value")
    entries (quantized formats: random codes with a step of 0.1 from -0.75)."""
    n = x.shape[1]
    entries = arena.buffer(stored + "s")
    if arena.kv_dtype not in BITS:
        entries[layer, :, :n] = x
        return
    codes = entries[layer, :, :n]
    codes.copy_(torch.randint(0, 256, codes.shape, generator=gen, dtype=torch.uint8))
    arena.buffer(stored + "_params")[layer, :, :n] = torch.tensor([0.1, -0.75], dtype=torch.float16)


def time_steps(arena: KVArena, rows: int, steps: int, warmup: int) -> tuple[list[float], list[float]]:
    """Seconds of each decode step (every layer's ``attend`` for ``rows`` rows), and of the attention op inside it."""
    config = arena.config
    gen = torch.Generator().manual_seed(1)
    n_heads, n_kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q = torch.randn(n_heads, rows, hd, generator=gen).bfloat16()
    k = torch.randn(n_kv, rows, hd, generator=gen).bfloat16()
    v = torch.randn(n_kv, rows, hd, generator=gen).bfloat16()
    times, attention = [], []
    for step in range(warmup + steps):
        inside = 0.0
        t0 = time.perf_counter()
        arena.begin(rows)
        for layer in range(config.num_hidden_layers):
            t1 = time.perf_counter()
            arena.attend(layer, q, k, v)
            inside += time.perf_counter() - t1
        arena.end()
        arena.commit(rows)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
            attention.append(inside)
    return times, attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", default="1024,8192,16384", help="comma-separated tokens of context")
    parser.add_argument("--shapes", choices=tuple(SHAPES), default="smollm2-135m")
    parser.add_argument("--kv-dtypes", default="bf16", help="comma-separated: bf16, int8, int4 (default: bf16)")
    parser.add_argument("--policy", default="full",
                        choices=POLICIES)
    parser.add_argument("--budget", type=int, default=None, help="budget of a budgeted policy")
    parser.add_argument("--kv-recent", type=int, default=None,
                        help="int8 / int4: positions kept in full precision (default: the dtype's, 32 for int4)")
    parser.add_argument("--rows", default="1", help="comma-separated rows per step (a verification block: γ + 1)")
    parser.add_argument("--recall-pages", default="0",
                        help="comma-separated pages each row recalls from a cold tier of the evicted tokens (0: none)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=results_dir(__file__) / "attention.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.available():
        raise SystemExit(f"native kernels unavailable: {kernels.unavailable_reason()}")
    config = make_config(SHAPES[args.shapes])
    facts = machine()
    for entries, kv_dtype, rows, pages in itertools.product((int(e) for e in args.entries.split(",")),
                                                            args.kv_dtypes.split(","),
                                                            (int(r) for r in args.rows.split(",")),
                                                            (int(p) for p in args.recall_pages.split(","))):
        steps = args.steps + args.warmup
        recent = args.kv_recent if kv_dtype in BITS else None
        arena = filled_arena(config, args.policy, args.budget, entries, rows * steps, kv_dtype, rows, recent, pages)
        times, attention = time_steps(arena, rows, args.steps, args.warmup)
        step, inside = sorted(times)[len(times) // 2], sorted(attention)[len(attention) // 2]
        visible = entries + 1 if arena.policy.is_full else arena.policy.budget + 1
        full = min(arena.recent_window, visible)  # entries read from the full-precision ring instead
        kv_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * (
            (visible - full) * bytes_per_vector(kv_dtype, config.head_dim, torch.bfloat16)
            + full * bytes_per_vector("bf16", config.head_dim, torch.bfloat16))
        emit({
            "bench": "attention", "model_shapes": args.shapes, "kv_dtype": kv_dtype, "kv_recent": arena.recent_window,
            "policy": arena.policy.describe(),
            "positions": arena.positions_mode, "entries": entries, "visible": visible, "rows": rows,
            "isa": kernels.isa_name(), "threads": args.threads,
            "recall_pages": pages, "cold_entries": arena.cold.count if arena.cold else 0,
            "ms_per_step": round(step * 1e3, 3),
            "attention_us_per_layer": round(inside * 1e6 / config.num_hidden_layers, 1),
            "kv_mib_per_step": round(kv_bytes / 2**20, 2), "effective_gb_s": round(kv_bytes / inside / 1e9, 2),
            "steps": args.steps, **facts,
        }, args.out)


if __name__ == "__main__":
    main()
