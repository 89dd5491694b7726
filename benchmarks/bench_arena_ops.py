"""The KV arena's own operations, as one JSON line: a commit of verification rows, or a prompt read with retention.

The unit of an A/B between two checkouts (run it alternately from two source trees, each with its own ``src`` on
``PYTHONPATH``, as ``bench_speculative_ab.py`` says). Cases (bfloat16, 2 threads):

``commit``: a 1.5B-shaped arena (28 layers, 2 KV heads of 128 channels, ``hybrid`` 1024, random rows), full and
evicting; blocks of 5 verification rows of which 3 are committed: the median seconds of ``KVArena.commit`` over 60
blocks, for bf16 and int8 entries.

``retention``: Qwen2.5-Coder-0.5B (native weights) reads the first 4,096 tokens of ``hamlet`` with ``hybrid`` 1024
and retention (the whole prompt held, its last 32 rows choosing what stays): the seconds of each of two prefills.

    for round in 1 2 3; do for src in src /tmp/before/src; do
        PYTHONPATH=$src python benchmarks/bench_arena_ops.py commit; done; done
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from common import emit, load_settled, machine, results_dir

from sparsespec.cache.arena import KVArena
from sparsespec.cache.policy import make_policy
from sparsespec.cache.retention import retention_for
from sparsespec.config import ModelConfig
from sparsespec.generate import prefill
from sparsespec.loading.fetch import corpus_text_path


def _attend(arena: KVArena, n_rows: int, per_block: bool, gen: torch.Generator) -> None:
    """A block of ``n_rows`` random rows through every layer of ``arena``."""
    cfg = arena.config
    arena.begin(n_rows, per_block)
    for layer in range(cfg.num_hidden_layers):
        q = torch.randn(cfg.num_attention_heads, n_rows, cfg.head_dim, generator=gen).bfloat16()
        k, v = (torch.randn(cfg.num_key_value_heads, n_rows, cfg.head_dim, generator=gen).bfloat16() for _ in "kv")
        arena.attend(layer, q, k, v)
    arena.end()


def commit_seconds(kv_dtype: str, blocks: int = 60) -> float:
    config = ModelConfig(architecture="qwen2", vocab_size=1000, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                         rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False,
                         attention_bias=True)
    arena = KVArena(config, make_policy("hybrid", 1024, sinks=4, heavy=256), dtype=torch.bfloat16, max_block=64,
                    max_inflight=6, kv_dtype=kv_dtype)
    gen = torch.Generator().manual_seed(0)
    for _ in range(18):  # past the budget: every verification row evicts
        _attend(arena, 64, True, gen)
        arena.commit(64)
    seconds = []
    for _ in range(blocks):
        _attend(arena, 5, False, gen)
        started = time.perf_counter()
        arena.commit(3)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def retention_prefill_seconds(tokens: int = 4096, runs: int = 2) -> list[float]:
    loaded = load_settled("qwen2.5-coder-0.5b", torch.bfloat16, "auto")
    model = loaded.model
    text = corpus_text_path("hamlet").read_text(encoding="utf-8", errors="replace")
    ids = loaded.tokenizer.encode(text)[:tokens]
    policy = make_policy("hybrid", 1024)
    arena = KVArena(model.config, policy, dtype=model.dtype, max_block=512, max_inflight=6,
                    retention=retention_for("auto", policy, context=model.config.max_position_embeddings))
    seconds = []
    for _ in range(runs):
        arena.reset()
        started = time.perf_counter()
        prefill(model, arena, ids, chunk=512)
        seconds.append(time.perf_counter() - started)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("case", choices=("commit", "retention"))
    parser.add_argument("--out", default=None, help="JSON lines file (default: results/bench_arena_ops/ops.jsonl)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    import sparsespec

    record = {"case": args.case, "src": sparsespec.__file__}
    if args.case == "commit":
        record.update({f"{kv}_commit_s": commit_seconds(kv) for kv in ("auto", "int8")})
    else:
        record["prefill_s"] = retention_prefill_seconds()
    record["machine"] = machine()
    emit(record, Path(args.out) if args.out else results_dir(__file__) / "ops.jsonl")


if __name__ == "__main__":
    main()
