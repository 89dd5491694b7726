"""One GGUF file against llama.cpp's own binaries: decode against ``llama-bench`` in alternated rounds, perplexity.

sparsespec against llama.cpp's own binaries on one GGUF file: decode speed against ``llama-bench``, rounds
alternated, and perplexity by ``llama-perplexity``'s protocol.

* decode: ``llama-bench -p 0 -n N -t T -r 1`` (N tokens from an empty context) against sparsespec's default
  configuration (native weights, bfloat16, full cache) decoding N tokens greedily after a 1-token prompt (the BOS),
  EOS ignored; ``--rounds`` rounds, the engines alternated within each; the per-round ratio's median and spread.
  ``--activations int8,float`` times sparsespec with each choice of ``--activations`` in the same rounds (prefill
  and perplexity take the first).
* prefill: ``llama-bench -p N -n 0`` against one sparsespec forward pass over the first N tokens of the text
  (logits for the last row), ``--rounds`` alternated rounds.
* perplexity: the text cut into chunks of ``--ctx`` tokens, each chunk's first token replaced by BOS where the
  model adds one, the second half of each chunk scored (what ``llama-perplexity -c CTX`` computes); llama.cpp
  tokenizes the text itself, sparsespec with its own tokenizer (transformers' reading of the file's vocabulary).

llama.cpp's binaries: built with cmake from the llama.cpp source inside the llama-cpp-python sdist
(``pip download --no-binary :all: --no-deps llama-cpp-python``, then ``cmake -B build && cmake --build build
--target llama-bench llama-perplexity``); ``--llama-bin`` is their folder.

    python benchmarks/bench_llamacpp_bin.py --model gemma3-270m --llama-bin /path/to/llama.cpp/build/bin
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from common import emit, fixture_path, load_settled, machine, median, results_dir

from sparsespec.engine import CacheOptions, RunStats, make_arena, run_generation
from sparsespec.eval.perplexity import streaming_nll
from sparsespec.eval.texts import read_text
from sparsespec.sampling import SamplingParams


def llama_bench_tok_s(binary: Path, model: Path, tokens: int, threads: int) -> float:
    out = subprocess.run([str(binary), "-m", str(model), "-p", "0", "-n", str(tokens), "-t", str(threads), "-r", "1",
                          "-o", "json"], capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def ours_tok_s(loaded, tokens: int) -> float:
    bos = loaded.tokenizer.bos_token_id
    stats = RunStats()
    for _ in run_generation(loaded, [bos if bos is not None else 0], max_new_tokens=tokens, sampling=SamplingParams(),
                            cache=CacheOptions(), stats=stats):
        pass
    return stats.tokens_per_s


def llama_prefill_tok_s(binary: Path, model: Path, tokens: int, threads: int) -> float:
    out = subprocess.run([str(binary), "-m", str(model), "-p", str(tokens), "-n", "0", "-t", str(threads), "-r", "1",
                          "-o", "json"], capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def ours_prefill_tok_s(loaded, ids: list[int]) -> float:
    arena = make_arena(loaded, CacheOptions(prefill_chunk=len(ids)), max_tokens=len(ids), max_inflight=1)
    started = time.perf_counter()
    loaded.model.forward(torch.tensor(ids), arena, per_block=True, last_only=True)
    return len(ids) / (time.perf_counter() - started)


def llama_perplexity(binary: Path, model: Path, text: Path, ctx: int, chunks: int, threads: int) -> dict:
    run = subprocess.run([str(binary), "-m", str(model), "-f", str(text), "-c", str(ctx), "-b", str(ctx),
                          "--chunks", str(chunks), "-t", str(threads)], capture_output=True, text=True, check=True)
    log = run.stdout + run.stderr
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    return {"ppl": float(final.group(1)), "ppl_error": float(final.group(2))}


def ours_perplexity(loaded, ids: list[int], ctx: int, chunks: int) -> dict:
    """llama-perplexity's protocol: chunk i is ``ids[i·ctx : (i+1)·ctx]`` with its first token BOS (when the model
    adds one); the tokens after the chunk's first half are scored."""
    bos = loaded.tokenizer.bos_token_id
    if loaded.tokenizer.encode("a")[:1] != [bos]:  # the model adds no BOS
        bos = None
    total, count = 0.0, 0
    first = ctx // 2
    for i in range(chunks):
        chunk = ids[i * ctx:(i + 1) * ctx]
        if bos is not None:
            chunk = [bos] + chunk[1:]
        nll = streaming_nll(loaded.model, _arena(loaded, ctx), chunk, chunk=ctx)  # [ctx - 1]: token j+1 given ≤ j
        total += float(nll[first:].sum())
        count += len(nll[first:])
    return {"ppl": math.exp(total / count), "scored_tokens": count, "text_tokens": len(ids)}


def _arena(loaded, ctx: int):
    return make_arena(loaded, CacheOptions(prefill_chunk=ctx), max_tokens=ctx, max_inflight=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--llama-bin", type=Path, required=True, help="folder of llama-bench and llama-perplexity")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128, help="decoded tokens per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--text", default="corpus:hamlet", help="text for perplexity (corpus:NAME or a file)")
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--chunks", type=int, default=8, help="0 skips perplexity")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--prefill-tokens", type=int, default=512, help="0 skips prefill")
    parser.add_argument("--activations", default="auto",
                        help="sparsespec's --activations, or several separated by commas (default: auto)")
    parser.add_argument("--out", type=Path, default=results_dir(__file__) / "llamacpp_bin.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # the native kernels' threads too
    path = fixture_path(args.model)
    choices = args.activations.split(",")
    models = {choice: load_settled(args.model, torch.bfloat16, "auto", activations=choice) for choice in choices}
    loaded = models[choices[0]]
    base = {"model": args.model, "weights": loaded.weights, "threads": args.threads, **machine()}

    for model in models.values():
        ours_tok_s(model, 16)  # warm-up
    engines = [*choices, "llama"]
    speeds: dict[str, list[float]] = {engine: [] for engine in engines}
    for round_index in range(0 if args.skip_decode else args.rounds):
        for engine in (engines if round_index % 2 == 0 else engines[::-1]):
            speeds[engine].append(ours_tok_s(models[engine], args.tokens) if engine in models
                                  else llama_bench_tok_s(args.llama_bin / "llama-bench", path, args.tokens, args.threads))
        for choice in choices:
            emit({"bench": "decode_round", "round": round_index, "activations": choice,
                  "ours_tok_s": round(speeds[choice][-1], 2), "llama_bench_tok_s": round(speeds["llama"][-1], 2),
                  **base}, args.out)
    for choice in choices if speeds["llama"] else ():  # decode rounds ran
        ratios = [ours / theirs for ours, theirs in zip(speeds[choice], speeds["llama"])]
        float_activations = models[choice].model.lm_head.float_activations
        emit({"bench": "decode", "tokens": args.tokens, "rounds": args.rounds, "activations": choice,
              "float_activations": float_activations,
              "ours_tok_s": round(median(speeds[choice]), 2), "llama_bench_tok_s": round(median(speeds["llama"]), 2),
              "ratio_median": round(median(ratios), 3), "ratio_min": round(min(ratios), 3),
              "ratio_max": round(max(ratios), 3), **base}, args.out)

    text = read_text(args.text)
    if args.prefill_tokens:
        ids = loaded.tokenizer.encode(text)[:args.prefill_tokens]
        ours_prefill_tok_s(loaded, ids)  # warm-up
        ratios = []
        for round_index in range(args.rounds):
            order = ("ours", "llama") if round_index % 2 == 0 else ("llama", "ours")
            speeds = {engine: ours_prefill_tok_s(loaded, ids) if engine == "ours" else
                      llama_prefill_tok_s(args.llama_bin / "llama-bench", path, len(ids), args.threads)
                      for engine in order}
            ratios.append(speeds["ours"] / speeds["llama"])
            emit({"bench": "prefill_round", "round": round_index, "tokens": len(ids),
                  "ours_tok_s": round(speeds["ours"], 1), "llama_bench_tok_s": round(speeds["llama"], 1), **base},
                 args.out)
        emit({"bench": "prefill", "tokens": len(ids), "rounds": args.rounds, "ratio_median": round(median(ratios), 3),
              "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3), **base}, args.out)

    if args.chunks:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as file:
            file.write(text)
        started = time.perf_counter()
        theirs = llama_perplexity(args.llama_bin / "llama-perplexity", path, Path(file.name), args.ctx, args.chunks,
                                  args.threads)
        theirs_s = time.perf_counter() - started
        started = time.perf_counter()
        ours = ours_perplexity(loaded, loaded.tokenizer.encode(text, add_special_tokens=False), args.ctx,
                               args.chunks)
        ours_s = time.perf_counter() - started
        Path(file.name).unlink()
        emit({"bench": "perplexity", "text": args.text, "ctx": args.ctx, "chunks": args.chunks,
              "ours_ppl": round(ours["ppl"], 4), "llama_ppl": theirs["ppl"], "llama_ppl_error": theirs["ppl_error"],
              "ratio": round(ours["ppl"] / theirs["ppl"], 4), "scored_tokens": ours["scored_tokens"],
              "ours_seconds": round(ours_s, 1),
              "llama_seconds": round(theirs_s, 1), **base}, args.out)


if __name__ == "__main__":
    main()
