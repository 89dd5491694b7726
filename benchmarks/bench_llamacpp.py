"""llama.cpp and sparsespec side by side, in one run, on the same GGUF files, prompt tokens and thread count.

For each model:

* decode: greedy autoregressive decoding of ``--new-tokens`` tokens for each prompt (EOS ignored), llama.cpp
  (through ``llama-cpp-python``, the file's own quantization) and sparsespec in each ``--formats`` weight format
  (``native`` = the file's own blocks through the native kernels, ``bf16`` = dense bfloat16, ``int8``, ``int4``).
  Decode tok/s counts the tokens after the first over the time
  after the first; prefill tok/s is prompt tokens over the time to the first token. Median of ``--runs`` runs.
* prefill: time to the first token for the first ``--prefill-tokens`` tokens of the corpus text.
* memory: RSS of a fresh process that loaded the model and decoded 8 tokens, per engine / format (``rss_mb``),
  and its growth over the RSS before loading (``rss_growth_mb``; both probes import torch and transformers first).
  ``--no-rss`` skips these.
* perplexity: over the first ``--ppl-tokens`` tokens of ``--ppl-text`` (full cache): sparsespec through
  :func:`sparsespec.eval.perplexity.streaming_nll`, llama.cpp through ``logits_all=True``; plus the KL divergence
  of each format's next-token distributions from sparsespec bf16 and from llama.cpp (nats per token).

And for each ``--spec`` pair ``DRAFT:TARGET``: sparsespec speculative decoding (each ``--gamma``, the draft in
``--draft-weights``, its head cut to ``--draft-vocab`` ids if given) with the target in each
``--spec-target-weights`` format, alternated round by round with the target's autoregressive decoding in sparsespec
and in llama.cpp (llama-cpp-python has no draft-model speculative decoding to compare with). ``--models ''`` runs
only this part.

Every prompt is tokenized once by sparsespec's tokenizer and the same ids are fed to both engines. Each result is
one JSON line (stdout and ``--out``); the last line per model is a ``summary``.

    pip install -r benchmarks/requirements-bench.txt      # llama-cpp-python (compiles llama.cpp)
    python benchmarks/bench_llamacpp.py                   # the full run (minutes per model)
    python benchmarks/bench_llamacpp.py --quick           # smoke test: SmolLM2-135M, few tokens

The first run of a model builds sparsespec's weight store (see ``sparsespec/loading/weight_store.py``) for each format;
later runs load in seconds. llama.cpp runs without a GPU, with ``n_threads = n_threads_batch = --threads``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from common import emit, fixture_path, load_settled, machine, median, results_dir

from sparsespec.engine import CacheOptions, DraftOptions, RunStats, parse_gamma, run_generation
from sparsespec.sampling import SamplingParams

DEFAULT_MODELS = "smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b"
DEFAULT_PROMPTS = "py-lru-class,prose-lighthouse,chat-python-primes"  # one per kind
FALLBACK_PROMPT = (
    "The lighthouse keeper had kept a log for thirty-one years, and in all that time he had never missed a night. "
    "He wrote down the wind, the state of the sea, the ships that passed and the ones that did not."
)


# ------------------------------------------------------------------------------------------------- inputs


def bench_prompts(tokenizer, wanted: str) -> list[tuple[str, list[int]]]:
    """``(id, token ids)`` of the benchmark prompts (the sweep's prompt set when available)."""
    try:
        from sparsespec.eval.prompts import load_prompts, prompt_ids
    except ImportError:
        return [("fallback", list(tokenizer.encode(FALLBACK_PROMPT)))]
    prompts = load_prompts()
    if wanted != "all":
        ids = wanted.split(",")
        prompts = [p for p in prompts if p.id in ids]
    out = []
    for p in prompts:
        if p.chat and not getattr(tokenizer, "chat_template", None):
            continue
        out.append((p.id, prompt_ids(tokenizer, p)))
    return out or [("fallback", list(tokenizer.encode(FALLBACK_PROMPT)))]


def text_ids(tokenizer, spec: str, n: int) -> list[int]:
    from sparsespec.eval.texts import text_token_ids

    return text_token_ids(tokenizer, spec, max_tokens=n)


def weights_arg(label: str) -> str:
    """Benchmark label (bf16, int8, int4) -> ``load_model`` weights."""
    return "dense" if label == "bf16" else label


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ------------------------------------------------------------------------------------------------- llama.cpp


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def open_llama(path: Path, threads: int, n_ctx: int, logits_all: bool = False):
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=512,
                 n_ubatch=512, logits_all=logits_all, verbose=False)


def llama_last_logits(llm) -> np.ndarray:
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))


def llama_greedy(llm, prompt: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
    """``(prefill seconds, decode seconds, tokens)`` of greedy decoding with llama.cpp (fresh KV cache)."""
    llm.reset()
    started = time.perf_counter()
    llm.eval(prompt)
    token = int(llama_last_logits(llm).argmax())
    first = time.perf_counter()
    tokens = [token]
    for _ in range(new_tokens - 1):
        llm.eval([token])
        token = int(llama_last_logits(llm).argmax())
        tokens.append(token)
    return first - started, time.perf_counter() - first, tokens


class LlamaProcess:
    """llama.cpp in a child process that decodes on request, for runs that alternate it with sparsespec: each engine
    keeps its own process, threads and heap, and a crash of one (llama.cpp's AMX path segfaults on some hosts,
    ``requirements-bench.txt``) does not take the other's results with it."""

    def __init__(self, path: Path, threads: int, n_ctx: int):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--llama-worker", f"{path}:{n_ctx}",
               "--threads", str(threads)]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self._proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the llama.cpp worker did not start")

    def decode_tok_s(self, prompt: list[int], new_tokens: int) -> float:
        """Greedy decoding of ``new_tokens`` after ``prompt`` (fresh cache): tokens after the first per second."""
        self._proc.stdin.write(json.dumps({"prompt": prompt, "new_tokens": new_tokens}) + "\n")
        self._proc.stdin.flush()
        return float(self._proc.stdout.readline())

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(timeout=60)


def llama_worker(spec: str, threads: int) -> None:
    path, n_ctx = spec.rsplit(":", 1)
    llm = open_llama(Path(path), threads, int(n_ctx))
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        _, seconds, _ = llama_greedy(llm, request["prompt"], request["new_tokens"])
        print((request["new_tokens"] - 1) / seconds, flush=True)
    llm.close()


def llama_logits(path: Path, ids: list[int], threads: int) -> tuple[np.ndarray, float]:
    """``[N - 1, vocab]`` logits of llama.cpp over ``ids`` (row i predicts token i + 1) and the seconds taken."""
    llm = open_llama(path, threads, n_ctx=len(ids) + 16, logits_all=True)
    started = time.perf_counter()
    llm.eval(ids[:-1])
    seconds = time.perf_counter() - started
    logits = np.array(llm.scores[: len(ids) - 1], dtype=np.float32)
    llm.close()
    return logits, seconds


# ------------------------------------------------------------------------------------------------- sparsespec


def ours_greedy(
    loaded, prompt: list[int], new_tokens: int, draft: DraftOptions | None = None
) -> tuple[RunStats, list[int]]:
    stats = RunStats()
    tokens = list(run_generation(loaded, prompt, max_new_tokens=new_tokens, sampling=SamplingParams(),
                                 cache=CacheOptions(), draft=draft, stats=stats))
    return stats, tokens


class _LogitRecorder:
    """Stands in for the model inside ``streaming_nll`` and keeps every chunk's logits."""

    def __init__(self, model):
        self._model = model
        self.chunks: list[torch.Tensor] = []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def forward(self, tokens, arena, **kwargs):
        logits = self._model.forward(tokens, arena, **kwargs)
        self.chunks.append(logits)
        return logits


def ours_perplexity(loaded, ids: list[int], chunk: int) -> tuple[dict, torch.Tensor]:
    """Perplexity summary via ``streaming_nll`` (full cache) and the ``[N - 1, vocab]`` logits it computed."""
    from sparsespec.eval.perplexity import measure_perplexity

    recorder = _LogitRecorder(loaded.model)
    _, summary = measure_perplexity(replace(loaded, model=recorder), CacheOptions(), ids, chunk)
    summary.pop("window_ppl", None)
    return summary, torch.cat(recorder.chunks)


# ------------------------------------------------------------------------------------------------- numbers


def mean_kl(reference, other, rows_per_step: int = 64) -> float:
    """Mean KL(softmax(reference) || softmax(other)) over rows, in nats (float64, in row blocks)."""
    reference, other = torch.as_tensor(reference), torch.as_tensor(other)
    total = 0.0
    for start in range(0, reference.shape[0], rows_per_step):
        p = torch.log_softmax(reference[start : start + rows_per_step].double(), -1)
        q = torch.log_softmax(other[start : start + rows_per_step].double(), -1)
        total += float((p.exp() * (p - q)).sum())
    return total / reference.shape[0]


def nll_from_logits(logits, ids: list[int]) -> torch.Tensor:
    logprobs = torch.log_softmax(torch.as_tensor(logits).double(), -1)
    return -logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def rnd(x: float, digits: int = 3) -> float:
    return round(x, digits) if math.isfinite(x) else x


# ------------------------------------------------------------------------------------------------- RSS probe


def probe_rss(spec: str, threads: int) -> dict:
    """Run in a fresh process: load ``engine:model:format``, decode 8 tokens, report RSS (``--probe``)."""
    engine, name, fmt = spec.split(":")
    torch.set_num_threads(threads)
    import transformers  # noqa: F401  (imported before the baseline by both engines' probes)

    before = rss_bytes()
    if engine == "llama.cpp":
        llm = open_llama(fixture_path(name), threads, n_ctx=256)
        llama_greedy(llm, llm.tokenize(FALLBACK_PROMPT.encode()), 8)
        return {"rss_bytes": rss_bytes(), "rss_before_load_bytes": before}
    loaded = load_settled(name, torch.bfloat16, weights_arg(fmt))
    ours_greedy(loaded, list(loaded.tokenizer.encode(FALLBACK_PROMPT)), 8)
    return {"rss_bytes": rss_bytes(), "rss_before_load_bytes": before, "weight_bytes": loaded.model.weight_nbytes}


def rss_of(spec: str, threads: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--probe", spec, "--threads", str(threads)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}


# ------------------------------------------------------------------------------------------------- benchmark


def bench_model(name: str, args, out: Path | None, have_llama: bool) -> None:
    threads = args.threads
    formats = args.formats.split(",")
    path = fixture_path(name)
    summary: dict = {"bench": "summary", "model": name, "gguf": path.name, "threads": threads,
                     "new_tokens": args.new_tokens, "decode_tok_s": {}, "prompt_prefill_tok_s": {},
                     "prefill_tok_s": {}, "ppl": {}, "kl_vs_bf16": {}, "kl_vs_llama_cpp": {}, "rss_mb": {},
                     "rss_growth_mb": {}, "load_seconds": {}}

    base = load_settled(name, torch.bfloat16, "dense")
    tokenizer = base.tokenizer
    prompts = bench_prompts(tokenizer, args.prompts)
    long_ids = text_ids(tokenizer, args.ppl_text, max(args.ppl_tokens, args.prefill_tokens))
    ppl_ids, prefill_ids = long_ids[: args.ppl_tokens], long_ids[: args.prefill_tokens]
    del base
    gc.collect()
    n_ctx = max(len(p) for _, p in prompts) + args.new_tokens + len(prefill_ids) + 16

    # ---- decode + prefill, llama.cpp
    llama_tokens: dict[str, list[int]] = {}
    if have_llama:
        started = time.perf_counter()
        llm = open_llama(path, threads, n_ctx)
        summary["load_seconds"]["llama.cpp"] = rnd(time.perf_counter() - started, 2)
        decode, pprefill = [], []
        for pid, prompt in prompts:
            llama_greedy(llm, prompt, 8)  # warm-up
            runs = [llama_greedy(llm, prompt, args.new_tokens) for _ in range(args.runs)]
            llama_tokens[pid] = runs[0][2]
            rec = {"bench": "decode", "engine": "llama.cpp", "weights": "gguf", "model": name, "prompt": pid,
                   "prompt_tokens": len(prompt), "new_tokens": args.new_tokens,
                   "decode_tok_s": rnd(median([(args.new_tokens - 1) / r[1] for r in runs])),
                   "prompt_prefill_tok_s": rnd(median([len(prompt) / r[0] for r in runs])),
                   "decode_runs": [rnd((args.new_tokens - 1) / r[1], 2) for r in runs]}
            decode.append(rec["decode_tok_s"])
            pprefill.append(rec["prompt_prefill_tok_s"])
            emit(rec, out)
        prefill_runs = [llama_greedy(llm, prefill_ids, 1)[0] for _ in range(args.runs)]
        prefill = rnd(len(prefill_ids) / median(prefill_runs), 2)
        emit({"bench": "prefill", "engine": "llama.cpp", "weights": "gguf", "model": name,
              "tokens": len(prefill_ids), "prefill_tok_s": prefill}, out)
        summary["decode_tok_s"]["llama.cpp"] = rnd(median(decode))
        summary["prompt_prefill_tok_s"]["llama.cpp"] = rnd(median(pprefill))
        summary["prefill_tok_s"]["llama.cpp"] = prefill
        llm.close()
        del llm
        gc.collect()

    # ---- decode + prefill, sparsespec per format
    for label in formats:
        started = time.perf_counter()
        loaded = load_settled(name, torch.bfloat16, weights_arg(label), role="target")
        summary["load_seconds"][label] = rnd(time.perf_counter() - started, 2)
        decode, pprefill = [], []
        for pid, prompt in prompts:
            ours_greedy(loaded, prompt, 8)  # warm-up
            runs = [ours_greedy(loaded, prompt, args.new_tokens) for _ in range(args.runs)]
            rec = {"bench": "decode", "engine": "sparsespec", "weights": label, "model": name, "prompt": pid,
                   "prompt_tokens": len(prompt), "new_tokens": args.new_tokens,
                   "decode_tok_s": rnd(median([s.tokens_per_s for s, _ in runs])),
                   "prompt_prefill_tok_s": rnd(median([len(prompt) / s.prefill_seconds for s, _ in runs])),
                   "decode_runs": [rnd(s.tokens_per_s, 2) for s, _ in runs],
                   "weight_bytes": loaded.model.weight_nbytes,
                   "weight_bytes_per_token": loaded.model.bytes_read_per_token(),
                   "from_weight_store": loaded.from_cache}
            if pid in llama_tokens:
                rec["same_tokens_as_llama_cpp"] = common_prefix(runs[0][1], llama_tokens[pid])
            decode.append(rec["decode_tok_s"])
            pprefill.append(rec["prompt_prefill_tok_s"])
            emit(rec, out)
        prefill_runs = [ours_greedy(loaded, prefill_ids, 1)[0].prefill_seconds for _ in range(args.runs)]
        prefill = rnd(len(prefill_ids) / median(prefill_runs), 2)
        emit({"bench": "prefill", "engine": "sparsespec", "weights": label, "model": name,
              "tokens": len(prefill_ids), "prefill_tok_s": prefill}, out)
        summary["decode_tok_s"][label] = rnd(median(decode))
        summary["prompt_prefill_tok_s"][label] = rnd(median(pprefill))
        summary["prefill_tok_s"][label] = prefill
        del loaded
        gc.collect()

    # ---- perplexity and KL on the corpus text
    if args.ppl_tokens >= 2:
        llama_logit_rows = None
        if have_llama:
            llama_logit_rows, seconds = llama_logits(path, ppl_ids, threads)
            nll = nll_from_logits(llama_logit_rows, ppl_ids)
            ppl = math.exp(float(nll.mean()))
            emit({"bench": "perplexity", "engine": "llama.cpp", "weights": "gguf", "model": name, "text": args.ppl_text,
                  "tokens": len(ppl_ids), "ppl": rnd(ppl, 4), "mean_nll": rnd(float(nll.mean()), 6),
                  "seconds": rnd(seconds, 2)}, out)
            summary["ppl"]["llama.cpp"] = rnd(ppl, 4)
            llama_logit_rows = torch.from_numpy(llama_logit_rows)
        reference = None
        for label in (["bf16"] + [f for f in formats if f != "bf16"]):
            loaded = load_settled(name, torch.bfloat16, weights_arg(label))
            ppl_summary, logits = ours_perplexity(loaded, ppl_ids, args.ppl_chunk)
            rec = {"bench": "perplexity", "engine": "sparsespec", "weights": label, "model": name,
                   "text": args.ppl_text, **ppl_summary}
            if reference is None:
                reference = logits
            else:
                rec["kl_vs_bf16"] = rnd(mean_kl(reference, logits), 5)
                summary["kl_vs_bf16"][label] = rec["kl_vs_bf16"]
            if llama_logit_rows is not None:
                rec["kl_vs_llama_cpp"] = rnd(mean_kl(llama_logit_rows, logits), 5)
                summary["kl_vs_llama_cpp"][label] = rec["kl_vs_llama_cpp"]
            summary["ppl"][label] = ppl_summary["ppl"]
            emit(rec, out)
            del loaded, logits
            gc.collect()

    # ---- memory, each in a fresh process
    if args.rss:
        specs = ([f"llama.cpp:{name}:gguf"] if have_llama else []) + [f"sparsespec:{name}:{f}" for f in formats]
        for spec in specs:
            engine, _, label = spec.split(":")
            result = rss_of(spec, threads)
            emit({"bench": "rss", "engine": engine, "weights": label, "model": name, **result}, out)
            if "rss_bytes" in result:
                key = label if engine == "sparsespec" else "llama.cpp"
                summary["rss_mb"][key] = round(result["rss_bytes"] / 2**20)
                summary["rss_growth_mb"][key] = round((result["rss_bytes"] - result["rss_before_load_bytes"]) / 2**20)

    if have_llama and "llama.cpp" in summary["decode_tok_s"]:
        base_speed = summary["decode_tok_s"]["llama.cpp"]
        summary["decode_vs_llama_cpp"] = {
            k: rnd(v / base_speed) for k, v in summary["decode_tok_s"].items() if k != "llama.cpp" and base_speed
        }
    emit({**summary, **machine()}, out)


def bench_speculative(pair: str, args, out: Path | None, have_llama: bool) -> None:
    """Speculative decoding against both engines' autoregressive decoding of the target, alternated round by round
    (``--runs`` rounds per prompt: llama.cpp, sparsespec alone, then sparsespec with the draft for each ``--gamma``
    value), so that every ratio comes from the same minutes of this shared host."""
    draft_name, target_name = pair.split(":")
    draft = load_settled(draft_name, torch.bfloat16, weights_arg(args.draft_weights), role="draft")
    if args.draft_vocab:
        draft.model.limit_vocabulary(args.draft_vocab)
    prompts = bench_prompts(draft.tokenizer, args.prompts)
    gammas = [parse_gamma(g) for g in str(args.gamma).split(",")]
    llm = None
    if have_llama:
        llm = LlamaProcess(fixture_path(target_name), args.threads,
                           max(len(p) for _, p in prompts) + args.new_tokens + 16)
    for label in args.spec_target_weights.split(","):
        target = load_settled(target_name, torch.bfloat16, weights_arg(label), role="target")
        options = {g: DraftOptions(draft, CacheOptions(), g) for g in gammas}
        for pid, prompt in prompts:
            ours_greedy(target, prompt, 8)  # warm-up
            for o in options.values():
                ours_greedy(target, prompt, 8, o)
            if llm is not None:
                llm.decode_tok_s(prompt, 8)
            llama, ar, spec = [], [], {g: [] for g in gammas}
            for _ in range(args.runs):
                if llm is not None:
                    llama.append(llm.decode_tok_s(prompt, args.new_tokens))
                ar.append(ours_greedy(target, prompt, args.new_tokens))
                for g, o in options.items():
                    spec[g].append(ours_greedy(target, prompt, args.new_tokens, o))
            llama_tok_s = rnd(median(llama)) if llama else None
            ar_tok_s = rnd(median([r[0].tokens_per_s for r in ar]))
            for g in gammas:
                s = spec[g][0][0].speculative
                rec = {"bench": "speculative", "engine": "sparsespec", "model": target_name, "draft": draft_name,
                       "weights": label, "draft_weights": args.draft_weights, "draft_vocab": args.draft_vocab,
                       "gamma": g, "prompt": pid, "prompt_tokens": len(prompt), "new_tokens": args.new_tokens,
                       "llama_cpp_tok_s": llama_tok_s, "ar_tok_s": ar_tok_s,
                       "spec_tok_s": rnd(median([r[0].tokens_per_s for r in spec[g]])),
                       "spec_runs": [rnd(r[0].tokens_per_s, 2) for r in spec[g]],
                       "llama_cpp_runs": [rnd(x, 2) for x in llama],
                       "acceptance_rate": rnd(s.acceptance_rate, 4),
                       "tokens_per_target_pass": rnd(s.tokens_per_target_pass, 3),
                       "draft_target_cost_ratio": rnd(s.draft_target_cost_ratio, 3),
                       "same_tokens_as_ar": common_prefix(spec[g][0][1], ar[0][1])}
                rec["speedup_vs_ar"] = rnd(rec["spec_tok_s"] / ar_tok_s) if ar_tok_s else None
                rec["spec_vs_llama_cpp"] = rnd(rec["spec_tok_s"] / llama_tok_s) if llama_tok_s else None
                emit({**rec, **machine()}, out)
        del target
        gc.collect()
    if llm is not None:
        llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=DEFAULT_MODELS)
    parser.add_argument("--formats", default="native", help="sparsespec weight formats (native, bf16, int8, int4)")
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS, help="prompt ids of the sweep's prompt set, or 'all'")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--ppl-text", default="corpus:hamlet")
    parser.add_argument("--ppl-tokens", type=int, default=1024, help="0 skips perplexity")
    parser.add_argument("--ppl-chunk", type=int, default=256)
    parser.add_argument("--spec", default="qwen2.5-coder-0.5b:qwen2.5-coder-1.5b",
                        help="DRAFT:TARGET pairs, comma-separated ('' for none)")
    parser.add_argument("--draft-weights", default="native")
    parser.add_argument("--spec-target-weights", default="native")
    parser.add_argument("--gamma", default="4", help="γ of the speculative runs: integers or 'auto', comma-separated")
    parser.add_argument("--draft-vocab", type=int, default=0,
                        help="the draft's head over the first N token ids (0: its whole vocabulary)")
    parser.add_argument("--no-rss", dest="rss", action="store_false", help="skip the fresh-process RSS probes")
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: SmolLM2-135M, 16 tokens, one prompt, 128-token perplexity, "
                             "SmolLM2 int4 -> bf16 self-pair for the speculative path")
    parser.add_argument("--out", type=Path, default=results_dir(__file__) / "llamacpp.jsonl")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--llama-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    if args.probe:
        print(json.dumps(probe_rss(args.probe, args.threads)), flush=True)
        return
    if args.llama_worker:
        llama_worker(args.llama_worker, args.threads)
        return
    if args.quick:
        args.models, args.prompts, args.new_tokens, args.runs = "smollm2-135m", "prose-lighthouse", 16, 3
        args.prefill_tokens, args.ppl_tokens, args.ppl_chunk = 128, 128, 128
        args.spec, args.spec_target_weights = "smollm2-135m:smollm2-135m", "bf16"
    if args.runs < 3:
        parser.error("--runs must be at least 3 (medians of fewer runs are noise)")

    have_llama = not args.skip_llamacpp and llama_cpp_available()
    emit({"bench": "machine", **machine(), "llama_cpp": _llama_version() if have_llama else None}, args.out)
    if not args.skip_llamacpp and not have_llama:
        emit({"bench": "note", "message": "llama-cpp-python is not installed; "
              "pip install -r benchmarks/requirements-bench.txt for the llama.cpp side"}, args.out)
    for name in filter(None, args.models.split(",")):
        bench_model(name, args, args.out, have_llama)
    for pair in filter(None, args.spec.split(",")):
        bench_speculative(pair, args, args.out, have_llama)


def _llama_version() -> str:
    import llama_cpp

    return getattr(llama_cpp, "__version__", "unknown")


if __name__ == "__main__":
    main()
