"""The server: its cost against ``generate``, long chats, and several chats at once against llama.cpp's servers.

The server's cost, its long-chat behaviour and its load, through the real ``openai`` client against
``sparsespec serve``.

Each measurement is a JSON line (appended to ``results/bench_serve/serve.jsonl``;
``results/bench_serve/serve_concurrent.jsonl`` for the load modes):

- ``overhead``: streamed decode tok/s through the API against the engine called as ``sparsespec generate`` calls
  it, in this same run (same prompt, flags and tokens; the server is idle while the engine runs here);
- ``ttft``: time to first token of a follow-up turn after ~``--history-tokens`` of conversation, resumed from the
  cache (prefix reuse) against re-reading the whole history (after an unrelated request emptied the cache);
- ``long_chat``: ``--turns`` turns of ``--turn-tokens`` of corpus text each, with a hybrid ``--budget`` cache and
  in-cache positions: the server's RSS, decode tok/s, time to first token, evictions per turn (one line each);
- ``side_by_side`` (not in the default modes; needs llama-cpp-python and its server extra): ``--side-turns`` turns
  of the same script through ``sparsespec serve`` (its default cache) and llama-cpp-python's server on the same
  GGUF file, one after the other: per turn tok/s and time to first token, and the medians' ratios;
- ``concurrent`` (not in the default modes; needs llama.cpp's ``llama-server`` binary, else it measures sparsespec
  alone): for each C of ``--concurrency``, both ``sparsespec serve --parallel C`` and ``llama-server -np C`` (same
  GGUF file, ``--slot-context`` tokens a slot) are started once and warmed up with C short requests; then, for
  ``--rounds`` rounds, alternating the engines (and which goes first), C distinct short chats are sent at once
  (``openai.AsyncOpenAI``, greedy, streamed, ``--max-tokens`` each, not forced past EOS). A line per engine and
  round (aggregate tok/s = completion tokens / wall time from the first send to the last finish; per request time
  to first token, tokens, decode tok/s), a summary per C (median aggregate with its min-max, median time to first
  token of the first and the last request to get one, sparsespec over llama-server), then each engine's aggregate
  at each C over its C = 1 and the plot ``serve_concurrent.png`` next to the JSONL (``--plot-only`` redraws it).
  ``--baseline-src DIR`` adds ``sparsespec serve`` as the source tree DIR has it (e.g. a worktree of an earlier
  commit, with its own default slots) to the alternation: the before/after of a change in the same run.
- ``repeat`` (not in the default modes): each held-out request of ``bench_drafters.py`` (code, edits, prose) sent
  twice with one ``cache_salt``, to ``sparsespec serve --draft ngram`` drafting across conversations (the default)
  and with ``--ngram-shared-tokens 0``, alternated for ``--rounds`` rounds (a salt per round, so that each starts
  with nothing shared): the repeat's decode tok/s on each, and per kind the medians' ratio (``--max-tokens``, 128);
- ``aiperf`` (not in the default modes; needs NVIDIA's ``aiperf`` load generator, ``--aiperf PATH``): for each C,
  ``--rounds`` runs of ``aiperf profile`` (``--aiperf-requests`` synthetic streamed chats of
  ``--aiperf-prompt-tokens`` tokens, C in flight) against each server, alternated round by round. aiperf runs
  several processes of its own (one of them, its timing manager, kept a core busy on the 2-core host even with
  the lightest settings used here), so on a small host it starves both servers alike: compare engines, not
  absolutes, and prefer ``concurrent`` there;
  output tok/s, time to first token, errors per round, the medians per C;
- ``join`` (not in the default modes): a long prompt (``--join-prompt-tokens``) joins a chat that is decoding, on
  ``sparsespec serve --parallel 2`` with each ``--join-chunks`` value as its ``--prefill-chunk``: the time to read
  the prompt alone and beside the chat, and the gaps between the chat's text chunks meanwhile (how long the prompt
  stalls the others);
- ``soak`` (not in the default modes): ``--soak-requests`` chats kept ``--soak-concurrency`` at a time in flight on
  ``sparsespec serve --parallel`` as many: failures (exceptions, error statuses), and the server's RSS every 10.

The server runs as a subprocess so that its RSS is its own. Run on an idle machine:

    python benchmarks/bench_serve.py                       # all three, SmolLM2-135M
    python benchmarks/bench_serve.py --modes long_chat --turns 60 --turn-tokens 400
    python benchmarks/bench_serve.py --modes side_by_side --model qwen2.5-coder-1.5b
    python benchmarks/bench_serve.py --history-tokens 200 --turns 3 --turn-tokens 20 --max-tokens 4 --new-tokens 8 \\
        --out /tmp/serve.jsonl                             # a few seconds' smoke run
    python benchmarks/bench_serve.py --modes concurrent --model qwen2.5-coder-0.5b --threads 2
    python benchmarks/bench_serve.py --modes aiperf --model qwen2.5-coder-0.5b --threads 2 --concurrency 4
    python benchmarks/bench_serve.py --modes soak --model qwen2.5-coder-0.5b --threads 2
    python benchmarks/bench_serve.py --plot-only           # redraw results/bench_serve/serve_concurrent.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

from common import PROSE_PROMPT, emit, fixture_path, machine, results_dir

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


def request_options(max_tokens: int) -> dict:
    """The options of every benchmark request: greedy, streamed, with the usage in the last chunk."""
    return dict(model="any", max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True})


class StreamTally:
    """Client-side times, text, usage and ``sparsespec`` extension object of one streamed answer, fed chunk by
    chunk (from the sync or the async client); started when created, so create it just before sending."""

    def __init__(self, chat: bool):
        self.chat = chat
        self.started = time.perf_counter()
        self.pieces: list[str] = []
        self.first = self.last = None
        self.usage = None
        self.extension: dict = {}

    def add(self, chunk) -> None:
        if chunk.choices:
            choice = chunk.choices[0]
            piece = choice.delta.content if self.chat else choice.text
            if piece:
                self.last = time.perf_counter()
                self.first = self.first if self.first is not None else self.last
                self.pieces.append(piece)
            self.extension = (chunk.model_extra or {}).get("sparsespec") or self.extension
        if chunk.usage is not None:
            self.usage = chunk.usage

    def result(self) -> dict:
        # A server that ignores include_usage streams one token per chunk: count the chunks that carried text.
        tokens = self.usage.completion_tokens if self.usage is not None else len(self.pieces)
        first, last = self.first, self.last
        decode = (tokens - 1) / (last - first) if first is not None and last > first and tokens > 1 else 0.0
        return {"text": "".join(self.pieces), "ttft_s": (first or time.perf_counter()) - self.started,
                "tokens": tokens, "prompt_tokens": self.usage.prompt_tokens if self.usage is not None else None,
                "tok_s": decode, "server": self.extension}


class Server:
    """An OpenAI-compatible server in a subprocess on a free loopback port, given the model's GGUF file: ``kind``
    ``sparsespec`` (``sparsespec serve``), ``llama_cpp_python`` (llama-cpp-python's server) or ``llama_server``
    (llama.cpp's own binary, ``--llama-server``); ``flags`` are added to its command line."""

    def __init__(self, args, *flags: str, kind: str = "sparsespec"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [*self._command(args, kind), *flags]
        env = None
        if kind == "sparsespec_baseline":  # the same command, importing sparsespec from another source tree
            env = dict(os.environ, PYTHONPATH=str(Path(args.baseline_src).resolve() / "src"))
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        # Each answers 503 here while it loads the model.
        self.health_url = self.url + ("/health" if kind == "llama_server" else "/v1/models")
        deadline = time.monotonic() + 600
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise SystemExit(f"the server did not start: {' '.join(command)}")
            time.sleep(0.2)
        from openai import OpenAI

        self.client = OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=3600)

    def _command(self, args, kind: str) -> list[str]:
        model, threads, port = str(fixture_path(args.model)), str(args.threads), str(self.port)
        if kind in ("sparsespec", "sparsespec_baseline"):
            return [sys.executable, "-m", "sparsespec.cli", "serve", "--model", args.model, "--dtype", args.dtype,
                    "--weights", args.weights, "--threads", threads, "--port", port]
        if kind == "llama_cpp_python":
            return [sys.executable, "-m", "llama_cpp.server", "--model", model, "--n_threads", threads,
                    "--n_threads_batch", threads, "--n_ctx", str(args.llama_context), "--port", port,
                    "--verbose", "False"]
        if kind == "llama_server":
            return [args.llama_server, "-m", model, "-t", threads, "-tb", threads, "--host", "127.0.0.1",
                    "--port", port]
        raise ValueError(f"unknown server kind {kind!r}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=5) as response:
                return response.status == 200
        except OSError:
            return False

    def rss_mb(self) -> float:
        return psutil.Process(self.process.pid).memory_info().rss / 2**20

    def stream(self, *, messages=None, prompt=None, max_tokens: int, salt: str | None = None) -> dict:
        """One greedy streamed request (with ``cache_salt`` ``salt``); client-side times and the server's usage and
        extension object."""
        tally = StreamTally(chat=messages is not None)
        options = request_options(max_tokens)
        if salt is not None:
            options["extra_body"] = {"cache_salt": salt}
        if messages is not None:
            chunks = self.client.chat.completions.create(messages=messages, **options)
        else:
            chunks = self.client.completions.create(prompt=prompt, **options)
        for chunk in chunks:
            tally.add(chunk)
        return tally.result()

    def close(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def bench_repeat(args, base: dict) -> None:
    """A request asked again by another client of the same salt: decode tok/s of the repeat with n-gram drafting
    across conversations (the default) against each conversation drafting from its own text only."""
    from bench_drafters import REQUESTS

    servers = {"shared": Server(args, "--draft", "ngram"),
               "own_text": Server(args, "--draft", "ngram", "--ngram-shared-tokens", "0")}
    runs: dict[tuple[str, int, str], list[float]] = {}
    try:
        for round_index in range(args.rounds):
            order = list(servers) if round_index % 2 == 0 else list(reversed(servers))
            for kind, prompts in REQUESTS.items():
                for p, text in enumerate(prompts):
                    messages = [{"role": "user", "content": text}]
                    for name in order:
                        salt = f"round {round_index}"  # each round starts with nothing shared
                        first = servers[name].stream(messages=messages, max_tokens=args.load_tokens, salt=salt)
                        again = servers[name].stream(messages=messages, max_tokens=args.load_tokens, salt=salt)
                        if again["text"] != first["text"]:
                            raise SystemExit(f"{name}: the repeated request's answer differs")
                        runs.setdefault((kind, p, name), []).append(again["tok_s"])
                        emit({"bench": "serve_repeat", **base, "server": name, "kind": kind, "prompt": p,
                              "round": round_index, "tokens": again["tokens"], "first_tok_s": round(first["tok_s"], 3),
                              "repeat_tok_s": round(again["tok_s"], 3),
                              "shared_accepted": again["server"].get("ngram_shared_accepted_tokens")}, args.out)
    finally:
        for server in servers.values():
            server.close()
    for kind, prompts in REQUESTS.items():
        ratios = [statistics.median(runs[(kind, p, "shared")]) / statistics.median(runs[(kind, p, "own_text")])
                  for p in range(len(prompts))]
        emit({"bench": "serve_repeat_summary", **base, "kind": kind, "rounds": args.rounds,
              "repeat_shared_over_own_text": [round(r, 3) for r in ratios]}, args.out)


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
        server = Server(args, kind="llama_cpp_python" if engine == "llama.cpp" else "sparsespec")
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


# Short distinct user questions for the load modes; request i asks question(i).
QUESTIONS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain the difference between a process and a thread.",
    "Describe a quiet harbour town at dawn.",
    "How does a hash map handle collisions?",
    "Write a SQL query that finds the second highest salary in a table.",
    "Summarize the plot of a detective story you invent.",
    "What is the difference between a list and a tuple in Python?",
    "Write a short letter thanking a neighbour for their help.",
    "Explain what a closure is, with a JavaScript example.",
    "Describe the smell of a forest after rain.",
    "How would you reverse a linked list in C?",
    "Give three tips for writing clear commit messages.",
    "Explain big-O notation to a beginner.",
    "Write a bash one-liner that counts the lines of every .py file in a folder.",
    "Tell a short story about a lighthouse keeper who retires.",
    "What does the Rust borrow checker prevent?",
)
ENGINE_LABELS = {"sparsespec": "sparsespec serve --parallel N",
                 "sparsespec_baseline": "sparsespec serve (--baseline-src)", "llama_server": "llama-server -np N"}
DEFAULT_LLAMA_SERVER = "/tmp/lcpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"
WARMUP_TOKENS = 8  # each server's untimed first load: C requests of this many tokens
SOAK_RSS_EVERY = 10  # soak: finished requests between two samples of the server's RSS


def question(index: int) -> str:
    return f"Question {index + 1}: {QUESTIONS[index % len(QUESTIONS)]}"


def async_client(url: str):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)


async def stream_chat(client, text: str, max_tokens: int, ignore_eos: bool = False) -> dict:
    """One streamed greedy chat request through the async client: ``StreamTally``'s result, or ``{"error": ...}``.
    ``ignore_eos``: ask the server to go on past end-of-sequence to ``max_tokens`` (both servers read the field)."""
    tally = StreamTally(chat=True)
    extra = {"extra_body": {"ignore_eos": True}} if ignore_eos else {}
    try:
        chunks = await client.chat.completions.create(messages=[{"role": "user", "content": text}],
                                                      **request_options(max_tokens), **extra)
        async for chunk in chunks:
            tally.add(chunk)
    except Exception as error:  # an HTTP error status, a refused or dropped connection: counted, not fatal
        return {"error": f"{type(error).__name__}: {error}"}
    return tally.result()


async def send_together(url: str, texts: list[str], max_tokens: int, ignore_eos: bool = False
                        ) -> tuple[list[dict], float]:
    """All requests at once; their results and the wall time from the first send to the last finish."""
    async with async_client(url) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(stream_chat(client, text, max_tokens, ignore_eos) for text in texts))
        return list(results), time.perf_counter() - started


def load_record(results: list[dict], wall_s: float) -> dict:
    """Aggregate tok/s (completion tokens of all answers over the wall time), the earliest, median and latest time
    to first token, and the failures of one load."""
    answered = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    ttfts = sorted(round(r["ttft_s"], 4) for r in answered)
    tokens = sum(r["tokens"] for r in answered)
    record = {"requests": len(results), "errors": len(errors), "error_messages": sorted(set(errors))[:5],
              "wall_s": round(wall_s, 3), "completion_tokens": tokens, "aggregate_tok_s": round(tokens / wall_s, 3)}
    if ttfts:
        record |= {"ttft_first_s": ttfts[0], "ttft_median_s": round(statistics.median(ttfts), 4),
                   "ttft_last_s": ttfts[-1]}
    return record


def load_server(args, engine: str, slots: int) -> Server:
    """``sparsespec serve --parallel slots``, or ``llama-server -np slots`` with ``--slot-context`` tokens a slot."""
    if engine == "llama_server":
        return Server(args, "-np", str(slots), "-c", str(slots * args.slot_context), kind="llama_server")
    if engine == "sparsespec_baseline":  # as it runs by default (a tree older than --parallel runs one at a time)
        return Server(args, *args.draft_flags, kind="sparsespec_baseline")
    return Server(args, "--parallel", str(slots), *args.draft_flags)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 4) if numerator is not None and denominator else None


def measure_level(args, engines: list[str], concurrency: int, base: dict) -> dict[str, list[dict]]:
    """``--rounds`` rounds of ``concurrency`` requests at once on each engine (each started with as many slots), the
    engines alternating round by round; one record per engine and round."""
    rounds: dict[str, list[dict]] = {engine: [] for engine in engines}
    servers: dict[str, Server] = {}
    try:
        for engine in engines:
            servers[engine] = load_server(args, engine, args.slots or concurrency)
            warmup = [question(index) for index in range(concurrency)]
            asyncio.run(send_together(servers[engine].url, warmup, min(WARMUP_TOKENS, args.load_tokens)))
        for round_index in range(args.rounds):
            # New questions each round (nothing resumes from a cache), the same for both engines; the order
            # alternates too, so that neither engine always runs first.
            first = (round_index + 1) * concurrency
            texts = [question(index) for index in range(first, first + concurrency)]
            for engine in engines if round_index % 2 == 0 else engines[::-1]:
                results, wall_s = asyncio.run(send_together(servers[engine].url, texts, args.load_tokens,
                                                            args.ignore_eos))
                record = load_record(results, wall_s)
                if record["errors"] == record["requests"]:
                    raise SystemExit(f"every request to {engine} failed at concurrency {concurrency}: "
                                     f"{record['error_messages'][0]}")
                answered = [r for r in results if "error" not in r]
                record |= {"ttft_s": [round(r["ttft_s"], 4) for r in answered],
                           "tokens": [r["tokens"] for r in answered],
                           "decode_tok_s": [round(r["tok_s"], 3) for r in answered]}
                emit({"bench": "serve_concurrent_round", **base, "engine": engine, "concurrency": concurrency,
                      "slots": args.slots or concurrency, "max_tokens": args.load_tokens, "round": round_index + 1,
                      **record},
                     args.load_out)
                rounds[engine].append(record)
    finally:
        for server in servers.values():
            server.close()
    return rounds


def engine_summary(rounds: list[dict]) -> dict:
    """Median aggregate tok/s over the rounds with its min-max spread, and the median time to first token of the
    first and of the last request to get its first token."""
    aggregates = [r["aggregate_tok_s"] for r in rounds]
    return {"aggregate_tok_s": statistics.median(aggregates), "aggregate_tok_s_min": min(aggregates),
            "aggregate_tok_s_max": max(aggregates),
            "ttft_first_s": round(statistics.median(r["ttft_first_s"] for r in rounds), 4),
            "ttft_last_s": round(statistics.median(r["ttft_last_s"] for r in rounds), 4),
            "errors": sum(r["errors"] for r in rounds)}


def bench_concurrent(args, base: dict) -> None:
    """Aggregate tok/s and time to first token of C concurrent chats on ``sparsespec serve --parallel C`` and
    ``llama-server -np C`` (same GGUF file), for each C of ``--concurrency``; one summary per C, then the ratios."""
    engines = ["sparsespec"]
    if args.baseline_src:
        engines.append("sparsespec_baseline")
    if Path(args.llama_server).is_file():
        engines.append("llama_server")
    else:
        print(f"No llama-server binary at {args.llama_server} (give --llama-server PATH or set LLAMA_SERVER), so "
              "this run measures sparsespec serve alone.", file=sys.stderr, flush=True)
    summaries: dict[int, dict[str, dict]] = {}

    def aggregate(engine: str, concurrency: int) -> float | None:
        return summaries.get(concurrency, {}).get(engine, {}).get("aggregate_tok_s")

    for concurrency in args.concurrency:
        rounds = measure_level(args, engines, concurrency, base)
        summaries[concurrency] = {engine: engine_summary(rounds[engine]) for engine in engines}
        emit({"bench": "serve_concurrent_summary", **base, "concurrency": concurrency,
              "slots": args.slots or concurrency,
              "max_tokens": args.load_tokens, "rounds": args.rounds, "engines": summaries[concurrency],
              "sparsespec_over_llama_server": ratio(aggregate("sparsespec", concurrency),
                                                    aggregate("llama_server", concurrency))}, args.load_out)
    emit({"bench": "serve_concurrent_ratios", **base, "concurrency": args.concurrency,
          "max_tokens": args.load_tokens, "rounds": args.rounds,
          **{f"{engine}_over_one_stream": {str(c): ratio(aggregate(engine, c), aggregate(engine, 1))
                                           for c in args.concurrency} for engine in engines},
          "sparsespec_over_llama_server": {str(c): ratio(aggregate("sparsespec", c), aggregate("llama_server", c))
                                           for c in args.concurrency},
          "sparsespec_over_baseline": {str(c): ratio(aggregate("sparsespec", c), aggregate("sparsespec_baseline", c))
                                       for c in args.concurrency}}, args.load_out)
    plot_concurrent(args.load_out)


AIPERF_METRICS = {  # what each aiperf round records: our name -> (aiperf's metric, statistic)
    "output_tok_s": ("output_token_throughput", "avg"), "ttft_p50_s": ("time_to_first_token", "p50"),
    "ttft_max_s": ("time_to_first_token", "max"), "request_latency_p50_s": ("request_latency", "p50"),
    "output_tokens": ("total_output_tokens", "avg"), "completed": ("completed_request_count", "avg"),
    "error_rate_pct": ("request_error_rate", "avg"),
}


def run_aiperf(args, server: Server, concurrency: int, tokenizer_dir: Path, work: Path, seed: int) -> dict:
    """One ``aiperf profile`` of ``server``: ``--aiperf-requests`` synthetic chats (``--aiperf-prompt-tokens`` in,
    up to ``--max-tokens`` out, streamed) kept ``concurrency`` at a time in flight; its summary metrics."""
    out = work / f"run{seed}"
    command = [args.aiperf, "profile", "--model", args.model, "--url", server.url, "--endpoint-type", "chat",
               "--streaming", "--concurrency", str(concurrency), "--request-count", str(args.aiperf_requests),
               "--prompt-input-tokens-mean", str(args.aiperf_prompt_tokens), "--prompt-input-tokens-stddev", "0",
               "--prompt-output-tokens-mean", str(args.load_tokens), "--prompt-output-tokens-stddev", "0",
               "--use-server-token-count", "--tokenizer", str(tokenizer_dir), "--random-seed", str(seed),
               "--output-artifact-dir", str(out), "--no-auto-plot", "--ui-type", "none", "--workers-max", "1",
               "--record-processor-service-count", "1", "--no-server-metrics", "--no-gpu-telemetry"]
    if args.ignore_eos:
        command += ["--extra-inputs", "ignore_eos:true"]
    finished = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    export = out / "profile_export_aiperf.json"
    if finished.returncode != 0 or not export.is_file():
        raise SystemExit(f"aiperf failed ({' '.join(command)}):\n{finished.stdout[-2000:]}")
    summary = json.loads(export.read_text())
    record = {}
    for name, (metric, statistic) in AIPERF_METRICS.items():
        value = (summary.get(metric) or {}).get(statistic)
        if value is not None and summary[metric].get("unit") == "ms":
            value /= 1000
        record[name] = None if value is None else round(value, 4)
    return record


def bench_aiperf(args, base: dict) -> None:
    """NVIDIA's ``aiperf`` load generator against ``sparsespec serve --parallel C`` and ``llama-server -np C`` (same
    file), for each C of ``--concurrency``, rounds alternated; a line per engine and round, then a summary per C."""
    import tempfile

    from transformers import AutoTokenizer

    from sparsespec.loading.source import resolve_model

    if not Path(args.aiperf).is_file():
        raise SystemExit(f"No aiperf at {args.aiperf}: install it (`python -m venv /tmp/aiperf-venv && "
                         "/tmp/aiperf-venv/bin/pip install aiperf`) and give --aiperf PATH.")
    engines = ["sparsespec"] + (["llama_server"] if Path(args.llama_server).is_file() else [])
    with tempfile.TemporaryDirectory() as work:
        tokenizer_dir = Path(work) / "tokenizer"  # aiperf reads a Hugging Face tokenizer folder
        source = resolve_model(args.model)
        hf = (AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
              if source.kind == "gguf" else AutoTokenizer.from_pretrained(str(source.path)))
        hf.save_pretrained(tokenizer_dir)
        for concurrency in args.concurrency:
            rounds: dict[str, list[dict]] = {engine: [] for engine in engines}
            servers: dict[str, Server] = {}
            try:
                for engine in engines:  # both up at once; the idle one sleeps
                    servers[engine] = load_server(args, engine, args.slots or concurrency)
                    run_aiperf(args, servers[engine], concurrency, tokenizer_dir, Path(work), seed=0)  # warm-up
                for round_index in range(args.rounds):
                    for engine in engines if round_index % 2 == 0 else engines[::-1]:
                        record = run_aiperf(args, servers[engine], concurrency, tokenizer_dir, Path(work),
                                            seed=round_index + 1)
                        emit({"bench": "serve_aiperf_round", **base, "engine": engine, "concurrency": concurrency,
                              "round": round_index + 1, "requests": args.aiperf_requests,
                              "prompt_tokens": args.aiperf_prompt_tokens, "max_tokens": args.load_tokens, **record},
                             args.load_out)
                        rounds[engine].append(record)
            finally:
                for server in servers.values():
                    server.close()
            medians = {engine: {name: statistics.median(r[name] for r in records if r[name] is not None)
                                for name in ("output_tok_s", "ttft_p50_s", "ttft_max_s", "error_rate_pct")}
                       | {"output_tok_s_min": min(r["output_tok_s"] for r in records),
                          "output_tok_s_max": max(r["output_tok_s"] for r in records)}
                       for engine, records in rounds.items()}
            emit({"bench": "serve_aiperf_summary", **base, "concurrency": concurrency, "rounds": args.rounds,
                  "engines": medians, "sparsespec_over_llama_server": ratio(
                      medians["sparsespec"]["output_tok_s"], medians.get("llama_server", {}).get("output_tok_s"))},
                 args.load_out)


async def soak_load(server: Server, args) -> tuple[list[dict], list[list], float]:
    """``--soak-requests`` chats kept ``--soak-concurrency`` at a time in flight; the results, the server's RSS
    every ``SOAK_RSS_EVERY`` finished requests, and the wall time."""
    results: list[dict] = []
    rss_samples: list[list] = []
    pending = iter(range(args.soak_requests))  # shared: a free worker takes the next index

    async def worker(client) -> None:
        for index in pending:
            results.append(await stream_chat(client, question(index), args.load_tokens, args.ignore_eos))
            if len(results) % SOAK_RSS_EVERY == 0 and server.process.poll() is None:
                rss_samples.append([len(results), round(server.rss_mb(), 1)])

    async with async_client(server.url) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(args.soak_concurrency)))
        return results, rss_samples, time.perf_counter() - started


async def join_load(server: Server, long_prompt: str, args) -> dict:
    """The long prompt read alone, then again while one chat decodes (``--join-decode-tokens``, EOS ignored),
    joining after the chat's tenth text chunk: how long the prompt took to read each time and the gaps between the
    chat's text chunks meanwhile."""
    arrivals: list[float] = []
    async with async_client(server.url) as client:
        started = time.perf_counter()  # the same prompt again later is read afresh: it does not extend this one
        await client.completions.create(model="any", prompt=long_prompt, max_tokens=1, temperature=0)
        alone_s = time.perf_counter() - started

        async def decode() -> None:
            chunks = await client.chat.completions.create(
                messages=[{"role": "user", "content": question(0)}], **request_options(args.join_decode_tokens),
                extra_body={"ignore_eos": True})
            async for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    arrivals.append(time.perf_counter())

        decoding = asyncio.create_task(decode())
        while len(arrivals) < 10:
            await asyncio.sleep(0.005)
        sent = time.perf_counter()
        answer = await client.completions.create(model="any", prompt=long_prompt, max_tokens=1, temperature=0)
        read = time.perf_counter()
        await decoding
    # The chat's chunks from the last before the prompt was sent to the first after it was read.
    before = max(i for i, t in enumerate(arrivals) if t < sent)
    after = min((i for i, t in enumerate(arrivals) if t > read), default=len(arrivals) - 1)
    window = arrivals[before : after + 1]
    gaps = [b - a for a, b in zip(window, window[1:])]
    return {"prompt_tokens": answer.usage.prompt_tokens, "read_alone_s": round(alone_s, 3),
            "read_s": round(read - sent, 3),
            "chat_chunks_meanwhile": len(window) - 2, "gap_max_s": round(max(gaps), 3),
            "gap_median_s": round(statistics.median(gaps), 3)}


def bench_join(args, base: dict) -> None:
    """For each ``--join-chunks`` value, ``sparsespec serve --parallel 2 --prefill-chunk N``: a long prompt
    (``--join-prompt-tokens`` of corpus text) joins a decoding chat, ``--rounds`` times; the chat's stalls."""
    tokenizer = load_model(args.model, DTYPES[args.dtype], args.weights).tokenizer
    long_prompt = corpus_words(args.join_prompt_tokens, tokenizer)
    for chunk in args.join_chunks:
        server = Server(args, "--parallel", "2", "--prefill-chunk", str(chunk), *args.draft_flags)
        try:
            for round_index in range(args.rounds):
                record = asyncio.run(join_load(server, long_prompt, args))
                emit({"bench": "serve_join", **base, "prefill_chunk": chunk, "round": round_index + 1, **record},
                     args.load_out)
        finally:
            server.close()


def bench_soak(args, base: dict) -> None:
    """Many chats at ``--soak-concurrency`` on ``sparsespec serve --parallel`` as many: the failures, and whether
    the server's RSS stays flat."""
    server = load_server(args, "sparsespec", args.soak_concurrency)
    try:
        idle_mb = round(server.rss_mb(), 1)
        results, rss_samples, wall_s = asyncio.run(soak_load(server, args))
        if server.process.poll() is not None:
            raise SystemExit(f"sparsespec serve exited during the soak (status {server.process.returncode}); "
                             f"{sum('error' in r for r in results)} of {len(results)} requests failed")
    finally:
        server.close()
    rss = [mb for _, mb in rss_samples]
    emit({"bench": "serve_soak", **base, "engine": "sparsespec", "concurrency": args.soak_concurrency,
          "slots": args.soak_concurrency, "max_tokens": args.load_tokens, **load_record(results, wall_s),
          "rss_idle_mb": idle_mb, "rss_first_mb": rss[0], "rss_last_mb": rss[-1], "rss_max_mb": max(rss),
          "rss_mb_by_requests": rss_samples}, args.load_out)


def plot_concurrent(jsonl: Path) -> None:
    """Aggregate tok/s (median, min-max bars) and time to first token against concurrency, per engine, from the
    newest ``serve_concurrent_summary`` of each model and concurrency in ``jsonl``; drawn next to it as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = [json.loads(line) for line in (jsonl.read_text().splitlines() if jsonl.exists() else [])
                 if '"serve_concurrent_summary"' in line]
    # The newest run's kind of answers (forced to --max-tokens or not) for each model; a re-run replaces an older
    # point of the same kind.
    kind = {record["model"]: record.get("ignore_eos", False) for record in summaries}
    latest = {(r["model"], r["concurrency"]): r for r in summaries if r.get("ignore_eos", False) == kind[r["model"]]}
    if not latest:
        raise SystemExit(f"{jsonl} holds no serve_concurrent_summary record; run --modes concurrent first.")
    fig, (speed, ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    for model in sorted({model for model, _ in latest}):
        records = sorted((r for (m, _), r in latest.items() if m == model), key=lambda r: r["concurrency"])
        for engine, label in ENGINE_LABELS.items():
            points = [(r["concurrency"], r["engines"][engine]) for r in records if engine in r["engines"]]
            if not points:
                continue
            levels = [c for c, _ in points]
            medians = [s["aggregate_tok_s"] for _, s in points]
            spread = [[s["aggregate_tok_s"] - s["aggregate_tok_s_min"] for _, s in points],
                      [s["aggregate_tok_s_max"] - s["aggregate_tok_s"] for _, s in points]]
            name = f"{model}, {label}"
            speed.errorbar(levels, medians, yerr=spread, marker="o", capsize=4, label=name)
            (last,) = ttft.plot(levels, [s["ttft_last_s"] for _, s in points], marker="o", label=f"{name}: last")
            ttft.plot(levels, [s["ttft_first_s"] for _, s in points], marker="o", linestyle="--",
                      color=last.get_color(), label=f"{name}: first")
    levels = sorted({c for _, c in latest})
    speed.set(xticks=levels, ylim=(0, None), xlabel="concurrent chats (= slots)", ylabel="aggregate tok/s",
              title="Aggregate decode speed (median of rounds, min-max bars)")
    ttft.set(xticks=levels, ylim=(0, None), xlabel="concurrent chats (= slots)", ylabel="seconds",
             title="Time to first token of the first and last request (median)")
    speed.legend(fontsize=7)
    ttft.legend(fontsize=7)
    fig.tight_layout()
    png = jsonl.with_suffix(".png")
    fig.savefig(png, dpi=120)
    print(f"wrote {png}", flush=True)


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"takes a whole number of at least 1, not {text!r}")
    return int(text)


def concurrency_levels(text: str) -> list[int]:
    """``--concurrency``: comma-separated whole numbers of at least 1."""
    if not all(level.isdigit() and int(level) >= 1 for level in text.split(",")):
        raise argparse.ArgumentTypeError(f"takes whole numbers of at least 1 separated by commas (e.g. 1,4,8), "
                                         f"not {text!r}")
    return sorted({int(level) for level in text.split(",")})


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
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="tokens per answer (default: 64 in ttft / long_chat / side_by_side, 128 in concurrent "
                             "/ soak)")
    parser.add_argument("--turns", type=int, default=50, help="long_chat: turns")
    parser.add_argument("--turn-tokens", type=int, default=400, help="long_chat: corpus tokens per user turn")
    parser.add_argument("--budget", type=int, default=1024, help="long_chat: hybrid budget")
    parser.add_argument("--side-turns", type=int, default=8, help="side_by_side: turns of the conversation script")
    parser.add_argument("--llama-context", type=int, default=8192, help="side_by_side: llama.cpp's n_ctx")
    parser.add_argument("--concurrency", type=concurrency_levels, default="1,4,8",
                        help="concurrent: numbers of chats sent at once (each server gets as many slots)")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="concurrent, repeat: rounds of each engine (at each concurrency)")
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", DEFAULT_LLAMA_SERVER),
                        help=f"concurrent: llama.cpp's llama-server binary (default: $LLAMA_SERVER, else "
                             f"{DEFAULT_LLAMA_SERVER})")
    parser.add_argument("--slots", type=positive_int, default=None,
                        help="concurrent, aiperf: slots each server gets (default: as many as the concurrency)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="concurrent, aiperf, soak: every answer runs to --max-tokens (the servers' ignore_eos "
                             "field), so that each round decodes the same number of tokens")
    parser.add_argument("--baseline-src", type=Path, default=None,
                        help="concurrent: also run `sparsespec serve` as this source tree has it (e.g. a git "
                             "worktree of an earlier commit), with its default slots, as engine sparsespec_baseline")
    parser.add_argument("--slot-context", type=int, default=4096,
                        help="concurrent: llama-server's context per slot (its -c is slots times this)")
    parser.add_argument("--aiperf", default=os.environ.get("AIPERF", "/tmp/aiperf-venv/bin/aiperf"),
                        help="aiperf: the aiperf command (default: $AIPERF, else /tmp/aiperf-venv/bin/aiperf)")
    parser.add_argument("--aiperf-requests", type=positive_int, default=16, help="aiperf: requests per round")
    parser.add_argument("--aiperf-prompt-tokens", type=positive_int, default=64,
                        help="aiperf: synthetic prompt tokens per request")
    parser.add_argument("--join-chunks", type=concurrency_levels, default="512,128",
                        help="join: the --prefill-chunk values to compare")
    parser.add_argument("--join-prompt-tokens", type=positive_int, default=4000,
                        help="join: tokens of the prompt that joins")
    parser.add_argument("--join-decode-tokens", type=positive_int, default=600,
                        help="join: tokens the decoding chat asks for (long enough to outlast the prompt)")
    parser.add_argument("--soak-requests", type=int, default=200, help="soak: chats in all")
    parser.add_argument("--soak-concurrency", type=positive_int, default=8, help="soak: chats in flight (and slots)")
    parser.add_argument("--plot-only", action="store_true",
                        help="only redraw the concurrent mode's PNG from its JSONL (--out), then exit")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSONL to append to (default: results/bench_serve/serve.jsonl, or "
                             "results/bench_serve/serve_concurrent.jsonl for concurrent and soak)")
    args = parser.parse_args()
    args.load_out = args.out or results_dir(__file__) / "serve_concurrent.jsonl"
    args.out = args.out or results_dir(__file__) / "serve.jsonl"
    args.load_tokens = args.max_tokens or 128
    args.max_tokens = args.max_tokens or 64
    if args.plot_only:
        plot_concurrent(args.load_out)
        return
    modes = args.modes.split(",")
    unknown = set(modes) - {"overhead", "ttft", "long_chat", "side_by_side", "concurrent", "aiperf", "join", "soak",
                            "repeat"}
    if unknown:
        raise SystemExit(f"unknown modes: {', '.join(sorted(unknown))}")
    if args.soak_requests < SOAK_RSS_EVERY:
        raise SystemExit(f"--soak-requests must be at least {SOAK_RSS_EVERY} (the RSS is sampled every "
                         f"{SOAK_RSS_EVERY} requests)")
    if "overhead" in modes and args.draft:
        raise SystemExit("overhead compares plain decoding; run it without --draft")
    args.draft_flags = ["--draft", args.draft] if args.draft else []
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    base = {**machine(), "model": args.model, "dtype": args.dtype, "weights": args.weights, "draft": args.draft,
            "ignore_eos": args.ignore_eos}
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
    if "concurrent" in modes:
        bench_concurrent(args, base)
    if "aiperf" in modes:
        bench_aiperf(args, base)
    if "join" in modes:
        bench_join(args, base)
    if "soak" in modes:
        bench_soak(args, base)
    if "repeat" in modes:
        bench_repeat(args, base)


if __name__ == "__main__":
    main()
