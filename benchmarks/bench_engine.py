"""Autoregressive decode speed: sparsespec vs transformers, same model / dtype / threads / prompt, one run.

Each of ``--runs`` greedy runs reads the prompt (``--prompt-repeats`` copies of the prose prompt: its prefill time is
recorded too) and decodes ``--new-tokens``; medians over the runs.

Also measures the machine's DRAM read bandwidth and each model's fraction of the roofline (weight bytes read per
token / bandwidth over the measured time per token). Prints one JSON line per model.

    python benchmarks/bench_engine.py [--models smollm2-135m,...] [--runs 3] [--new-tokens 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import torch

from common import PROSE_PROMPT, dram_read_bandwidth, emit, load_transformers, machine, median, results_dir
from common import load_settled, transformers_decode_tok_s

from sparsespec.engine import CacheOptions, RunStats, run_generation
from sparsespec.sampling import SamplingParams


def ours_decode_tok_s(loaded, prompt_ids: list[int], new_tokens: int, cache: CacheOptions) -> tuple[float, float]:
    """(decode tokens per second, prefill seconds) of one greedy run."""
    stats = RunStats()
    for _ in run_generation(loaded, prompt_ids, max_new_tokens=new_tokens, sampling=SamplingParams(), cache=cache,
                            stats=stats):
        pass
    return stats.tokens_per_s, stats.prefill_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--weights", default="dense", help="sparsespec weight format (dense, int8, int4)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prompt-repeats", type=int, default=1, help="copies of the prose prompt read first")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out", type=Path, default=results_dir(__file__) / "engine.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    bandwidth = dram_read_bandwidth()
    emit({"bench": "dram_read", "bytes_per_s": bandwidth, **machine()}, args.out)
    for name in args.models.split(","):
        ours = load_settled(name, dtype, args.weights)
        prompt_ids = ours.tokenizer.encode(PROSE_PROMPT) * args.prompt_repeats
        cache = CacheOptions()
        ours_decode_tok_s(ours, prompt_ids, 8, cache)  # warm-up
        ours_runs = [ours_decode_tok_s(ours, prompt_ids, args.new_tokens, cache) for _ in range(args.runs)]
        record = {
            "bench": "engine", "model": name, "dtype": args.dtype, "weights": args.weights,
            "prompt_tokens": len(prompt_ids), "new_tokens": args.new_tokens,
            "ours_tok_s": median([r[0] for r in ours_runs]), "ours_runs": [round(r[0], 2) for r in ours_runs],
            "ours_prefill_s": median([r[1] for r in ours_runs]),
            "ours_prefill_runs": [round(r[1], 3) for r in ours_runs],
            "weight_bytes_per_token": ours.model.bytes_read_per_token(),
        }
        seconds_per_token = 1.0 / record["ours_tok_s"]
        record["roofline_fraction"] = record["weight_bytes_per_token"] / bandwidth / seconds_per_token
        record["effective_gb_s"] = record["weight_bytes_per_token"] / seconds_per_token / 1e9
        del ours
        gc.collect()
        if not args.skip_transformers:
            reference, _ = load_transformers(name, dtype)
            transformers_decode_tok_s(reference, prompt_ids, 8)  # warm-up
            hf_runs = [transformers_decode_tok_s(reference, prompt_ids, args.new_tokens)[0] for _ in range(args.runs)]
            record["transformers_tok_s"] = median(hf_runs)
            record["transformers_runs"] = [round(r, 2) for r in hf_runs]
            record["speedup_vs_transformers"] = record["ours_tok_s"] / record["transformers_tok_s"]
            del reference
            gc.collect()
        emit({**record, **machine()}, args.out)


if __name__ == "__main__":
    main()
