"""The server's cost and its long-chat behaviour, through the real ``openai`` client against ``sparsespec serve``.

Four measurements, each a JSON line (appended to ``results/serve.jsonl``):

- ``overhead``: streamed decode tok/s through the API against the engine called as ``sparsespec generate`` calls
  it, in this same run (same prompt, flags and tokens; the server is idle while the engine runs here);
- ``ttft``: time to first token of a follow-up turn after ~``--history-tokens`` of conversation, resumed from the
  cache (prefix reuse) against re-reading the whole history (after an unrelated request emptied the cache);
- ``long_chat``: ``--turns`` turns of ``--turn-tokens`` of corpus text each, with a hybrid ``--budget`` cache and
  in-cache positions: the server's RSS, decode tok/s, time to first token, evictions per turn (one line each);
- ``side_by_side`` (not in the default modes; needs llama-cpp-python and its server extra): ``--side-turns`` turns
  of the same script through ``sparsespec serve`` (its default cache) and llama-cpp-python's server on the same
  GGUF file, one after the other: per turn tok/s and time to first token, and the medians' ratios.

The server runs as a subprocess so that its RSS is its own. Run on an idle machine:

    python benchmarks/bench_serve.py                       # all three, SmolLM2-135M
    python benchmarks/bench_serve.py --modes long_chat --turns 60 --turn-tokens 400
    python benchmarks/bench_serve.py --modes side_by_side --model qwen2.5-coder-1.5b
    python benchmarks/bench_serve.py --history-tokens 200 --turns 3 --turn-tokens 20 --max-tokens 4 --new-tokens 8 \\
        --out /tmp/serve.jsonl                             # a few seconds' smoke run
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import torch

from common import PROSE_PROMPT, RESULTS_DIR, emit, fixture_path, machine

from sparsespec.engine import CacheOptions, RunStats, run_generation
from sparsespec.loading.fetch import corpus_text_path
from sparsespec.loading.load import DTYPES, load_model
from sparsespec.loading.tokenizer import eos_token_ids
from sparsespec.sampling import SamplingParams


def free_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


class Server:
    """An OpenAI-compatible server in a subprocess on a free loopback port: ``sparsespec serve`` by default, or
    llama-cpp-python's server on the same GGUF file (``llama=True``)."""

    def __init__(self, args, *flags: str, llama: bool = False):
        self.port = free_port()
        if llama:
            command = [sys.executable, "-m", "llama_cpp.server", "--model", str(fixture_path(args.model)),
                       "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
                       "--n_ctx", str(args.llama_context), "--port", str(self.port), "--verbose", "False", *flags]
        else:
            command = [sys.executable, "-m", "sparsespec.cli", "serve", "--model", args.model, "--dtype", args.dtype,
                       "--weights", args.weights, "--threads", str(args.threads), "--port", str(self.port), *flags]
        self.flags = list(flags)
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 600
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start: {' '.join(command)}")
            time.sleep(0.2)
        from openai import OpenAI

        self.client = OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=3600)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as response:  # 503 while loading
                return response.status == 200
        except OSError:
            return False

    def rss_mb(self) -> float:
        return psutil.Process(self.process.pid).memory_info().rss / 2**20

    def stream(self, *, messages=None, prompt=None, max_tokens: int) -> dict:
        """One greedy streamed request; client-side times and the server's usage and extension object."""
        kwargs = dict(model="any", max_tokens=max_tokens, temperature=0, stream=True,
                      stream_options={"include_usage": True})
        started = time.perf_counter()
        if messages is not None:
            chunks = self.client.chat.completions.create(messages=messages, **kwargs)
        else:
            chunks = self.client.completions.create(prompt=prompt, **kwargs)
        text, first, last, usage, extension = [], None, None, None, {}
        pieces = 0
        for chunk in chunks:
            if chunk.choices:
                choice = chunk.choices[0]
                piece = choice.delta.content if messages is not None else choice.text
                if piece:
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    text.append(piece)
                    pieces += 1
                extension = (chunk.model_extra or {}).get("sparsespec") or extension
            if chunk.usage is not None:
                usage = chunk.usage
        # A server that ignores include_usage streams one token per chunk: count the chunks that carried text.
        tokens = usage.completion_tokens if usage is not None else pieces
        decode = (tokens - 1) / (last - first) if first is not None and last > first and tokens > 1 else 0.0
        return {"text": "".join(text), "ttft_s": (first or time.perf_counter()) - started, "tokens": tokens,
                "prompt_tokens": usage.prompt_tokens if usage is not None else None, "tok_s": decode,
                "server": extension}

    def close(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def corpus_words(count_tokens: int, tokenizer, start: int = 0) -> str:
    """About ``count_tokens`` tokens of corpus text, from character ``start`` on."""
    text = corpus_text_path("paradise_lost").read_text(encoding="utf-8", errors="replace")
    piece = text[start : start + count_tokens * 6]
    ids = tokenizer.encode(piece, add_special_tokens=False)[:count_tokens]
    return tokenizer.decode(ids)


def bench_overhead(args, server: Server, base: dict) -> None:
    """Streamed tok/s through the API vs the engine run as ``generate`` runs it."""
    loaded = load_model(args.model, DTYPES[args.dtype], args.weights)
    ids = loaded.tokenizer.encode(PROSE_PROMPT, add_special_tokens=True)
    eos = eos_token_ids(loaded.tokenizer)
    api_runs, engine_runs = [], []
    for _ in range(args.repeats):
        api_runs.append(server.stream(prompt=PROSE_PROMPT, max_tokens=args.new_tokens))
        stats = RunStats()
        tokens = list(run_generation(loaded, ids, max_new_tokens=args.new_tokens, sampling=SamplingParams(),
                                     cache=CacheOptions(), eos_ids=eos, stats=stats))
        engine_runs.append((stats, tokens))
    api = max(r["tok_s"] for r in api_runs)
    engine = max(s.tokens_per_s for s, _ in engine_runs)
    emit({"bench": "serve_overhead", **base, "new_tokens": args.new_tokens,
          "api_tokens": api_runs[0]["tokens"], "engine_tokens": len(engine_runs[0][1]),
          "api_tok_s": round(api, 3), "generate_tok_s": round(engine, 3),
          "api_over_generate": round(api / engine, 4) if engine else None,
          "api_ttft_s": round(min(r["ttft_s"] for r in api_runs), 4),
          "generate_ttft_s": round(min(s.prefill_seconds for s, _ in engine_runs), 4)}, args.out)
    del loaded


def bench_ttft(args, server: Server, base: dict) -> None:
    """TTFT of a follow-up turn at ~history_tokens: resumed from the cache vs read again."""
    tokenizer = load_model(args.model, DTYPES[args.dtype], args.weights).tokenizer
    history = [{"role": "user", "content": corpus_words(args.history_tokens, tokenizer) + "\n\nSummarize this."}]
    answer = server.stream(messages=history, max_tokens=args.max_tokens)
    follow = history + [{"role": "assistant", "content": answer["text"]},
                        {"role": "user", "content": "Now say it in one sentence."}]
    resumed = server.stream(messages=follow, max_tokens=args.max_tokens)
    server.stream(prompt="Unrelated.", max_tokens=1)  # empties the conversation cache
    reread = server.stream(messages=follow, max_tokens=args.max_tokens)
    emit({"bench": "serve_ttft", **base, "history_tokens": resumed["prompt_tokens"],
          "resumed_prompt_tokens": resumed["server"].get("reused_prompt_tokens"),
          "reread_prompt_tokens_resumed": reread["server"].get("reused_prompt_tokens"),
          "ttft_resumed_s": round(resumed["ttft_s"], 4), "ttft_reread_s": round(reread["ttft_s"], 4),
          "resumed_over_reread": round(resumed["ttft_s"] / reread["ttft_s"], 4),
          "same_answer": resumed["text"] == reread["text"]}, args.out)


def bench_long_chat(args, base: dict) -> None:
    """Many turns through a budgeted cache: per turn RSS, tok/s, TTFT, evictions."""
    server = Server(args, "--budget", str(args.budget), "--positions", "in-cache", *args.draft_flags)
    try:
        tokenizer = load_model(args.model, DTYPES[args.dtype], args.weights).tokenizer
        history: list[dict] = []
        total_tokens = 0
        for turn in range(args.turns):
            text = corpus_words(args.turn_tokens, tokenizer, start=turn * args.turn_tokens * 6)
            history = history + [{"role": "user", "content": text + "\n\nWhat happens next?"}]
            result = server.stream(messages=history, max_tokens=args.max_tokens)
            history = history + [{"role": "assistant", "content": result["text"]}]
            total_tokens = result["prompt_tokens"] + result["tokens"]
            extension = result["server"]
            emit({"bench": "serve_long_chat", **base, "budget": args.budget, "turn": turn + 1,
                  "conversation_tokens": total_tokens, "prompt_tokens": result["prompt_tokens"],
                  "resumed_prompt_tokens": extension.get("reused_prompt_tokens"), "new_tokens": result["tokens"],
                  "tok_s": round(result["tok_s"], 3), "ttft_s": round(result["ttft_s"], 4),
                  "evicted_tokens": extension.get("evicted_tokens"),
                  "conversation_evicted_tokens": extension.get("conversation_evicted_tokens"),
                  "kv_cache_bytes": extension.get("kv_cache_bytes"), "server_rss_mb": round(server.rss_mb(), 1)},
                 args.out)
    finally:
        server.close()


def chat_script(args, server: Server, tokenizer) -> list[dict]:
    """``--side-turns`` turns of corpus text, each answered greedily; one record per turn."""
    history: list[dict] = []
    records = []
    for turn in range(args.side_turns):
        text = corpus_words(args.turn_tokens, tokenizer, start=turn * args.turn_tokens * 6)
        history = history + [{"role": "user", "content": text + "\n\nWhat happens next?"}]
        result = server.stream(messages=history, max_tokens=args.max_tokens)
        history = history + [{"role": "assistant", "content": result["text"]}]
        records.append({"turn": turn + 1, "prompt_tokens": result["prompt_tokens"], "new_tokens": result["tokens"],
                        "tok_s": round(result["tok_s"], 3), "ttft_s": round(result["ttft_s"], 4)})
    return records


def bench_side_by_side(args, base: dict) -> None:
    """The same conversation script through ``sparsespec serve`` and llama-cpp-python's server on the same GGUF file,
    one server at a time: per turn tok/s and time to first token, then the medians."""
    tokenizer = load_model(args.model, DTYPES[args.dtype], args.weights).tokenizer
    medians = {}
    for engine in ("sparsespec", "llama.cpp"):
        server = Server(args, llama=engine == "llama.cpp")
        try:
            records = chat_script(args, server, tokenizer)
        finally:
            server.close()
        for record in records:
            emit({"bench": "serve_side_by_side", **base, "engine": engine, **record}, args.out)
        # The first turn reads the prompt from scratch; the follow-ups resume from the cache on both servers.
        follow = records[1:] or records
        medians[engine] = {"tok_s": statistics.median(r["tok_s"] for r in records),
                           "first_ttft_s": records[0]["ttft_s"],
                           "follow_up_ttft_s": statistics.median(r["ttft_s"] for r in follow)}
    ours, theirs = medians["sparsespec"], medians["llama.cpp"]
    emit({"bench": "serve_side_by_side_summary", **base, "turns": args.side_turns, "turn_tokens": args.turn_tokens,
          "max_tokens": args.max_tokens, "sparsespec": ours, "llama_cpp": theirs,
          "tok_s_ratio": round(ours["tok_s"] / theirs["tok_s"], 4),
          "follow_up_ttft_ratio": round(ours["follow_up_ttft_s"] / theirs["follow_up_ttft_s"], 4)}, args.out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="overhead,ttft,long_chat")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--weights", default="auto", choices=["auto", "native", "dense", "int8", "int4"])
    parser.add_argument("--draft", default=None, help="draft for speculative decoding (e.g. self), in every mode")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128, help="overhead: tokens per run")
    parser.add_argument("--repeats", type=int, default=3, help="overhead: runs of each side (best kept)")
    parser.add_argument("--history-tokens", type=int, default=4000, help="ttft: tokens of conversation")
    parser.add_argument("--max-tokens", type=int, default=64, help="ttft / long_chat: tokens per answer")
    parser.add_argument("--turns", type=int, default=50, help="long_chat: turns")
    parser.add_argument("--turn-tokens", type=int, default=400, help="long_chat: corpus tokens per user turn")
    parser.add_argument("--budget", type=int, default=1024, help="long_chat: hybrid budget")
    parser.add_argument("--side-turns", type=int, default=8, help="side_by_side: turns of the conversation script")
    parser.add_argument("--llama-context", type=int, default=8192, help="side_by_side: llama.cpp's n_ctx")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "serve.jsonl")
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = set(modes) - {"overhead", "ttft", "long_chat", "side_by_side"}
    if unknown:
        raise SystemExit(f"unknown modes: {', '.join(sorted(unknown))}")
    if "overhead" in modes and args.draft:
        raise SystemExit("overhead compares plain decoding; run it without --draft")
    args.draft_flags = ["--draft", args.draft] if args.draft else []
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    base = {**machine(), "model": args.model, "dtype": args.dtype, "weights": args.weights, "draft": args.draft}
    if "overhead" in modes or "ttft" in modes:
        server = Server(args, *args.draft_flags)
        try:
            if "overhead" in modes:
                bench_overhead(args, server, base)
            if "ttft" in modes:
                bench_ttft(args, server, base)
        finally:
            server.close()
    if "long_chat" in modes:
        bench_long_chat(args, base)
    if "side_by_side" in modes:
        if args.draft or args.weights not in ("auto", "native"):
            raise SystemExit("side_by_side compares the GGUF file's own weights without a draft; "
                             "run it with the default --weights and no --draft")
        bench_side_by_side(args, base)


if __name__ == "__main__":
    main()
