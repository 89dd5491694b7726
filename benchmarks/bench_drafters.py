"""Speculation by drafter (n-grams, a draft model, both) on code, edits and prose, against plain decoding and llama.cpp.

Speculation by drafter, on held-out requests of three kinds: code completion, edits whose answer copies code from
the request, and prose. Ours (1.5B target, greedy, chat template, 2 threads): plain decoding, n-gram drafts alone
(``--draft ngram``), the 0.5B draft with ``--draft-vocab 32768`` and n-gram drafts (the default with a draft) and
without them (``--draft-ngram off``); llama.cpp's ``llama-speculative-simple`` on the same files and prompt text:
``--spec-type draft-simple`` with the 0.5B draft, and each n-gram ``--spec-type`` (no draft model). ``--rounds``
rounds, every engine once per prompt in each, the order rotating from round to round; decode tok/s per run, then per
kind the median of each engine over ours plain and over llama.cpp's best (the per-prompt medians' median).

Every speculative run of ours is checked to give the plain run's tokens.

    python benchmarks/bench_drafters.py --llama-bin /path/to/llama.cpp/build/bin --rounds 3
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import torch

from common import emit, fixture_path, load_settled, machine, median, results_dir

from sparsespec.engine import CacheOptions, DraftOptions, RunStats, run_generation
from sparsespec.loading.tokenizer import eos_token_ids
from sparsespec.ngram import NgramOptions
from sparsespec.sampling import SamplingParams

# Written for this benchmark (held out from every tuning of the engine).
REQUESTS = {
    "code": [
        "Write a Python function `merge_intervals(intervals)` that merges overlapping closed intervals given as a "
        "list of (start, end) tuples and returns them sorted. Include a docstring and two doctest examples.",
        "Implement a small LRU cache class in Python with get(key) and put(key, value), O(1) each, using "
        "collections.OrderedDict, with type hints.",
    ],
    "edit": [
        "Add type hints and a docstring to this function, and return the whole function:\n\n"
        "def parse_config(lines):\n"
        "    config = {}\n"
        "    section = None\n"
        "    for line in lines:\n"
        "        line = line.strip()\n"
        "        if not line or line.startswith('#'):\n"
        "            continue\n"
        "        if line.startswith('[') and line.endswith(']'):\n"
        "            section = line[1:-1]\n"
        "            config[section] = {}\n"
        "        elif '=' in line and section is not None:\n"
        "            key, value = line.split('=', 1)\n"
        "            config[section][key.strip()] = value.strip()\n"
        "    return config\n",
        "Rename the class `Stack` to `BoundedStack`, add a `capacity` argument that push() checks, and return the "
        "whole class:\n\n"
        "class Stack:\n"
        "    def __init__(self):\n"
        "        self.items = []\n"
        "\n"
        "    def push(self, item):\n"
        "        self.items.append(item)\n"
        "\n"
        "    def pop(self):\n"
        "        if not self.items:\n"
        "            raise IndexError('pop from an empty stack')\n"
        "        return self.items.pop()\n"
        "\n"
        "    def peek(self):\n"
        "        return self.items[-1] if self.items else None\n"
        "\n"
        "    def __len__(self):\n"
        "        return len(self.items)\n",
    ],
    "prose": [
        "Write a short paragraph explaining why a lighthouse keeper's log might be valuable to historians.",
        "Describe, in a few sentences, how bread dough rises and why kneading matters.",
    ],
}
NGRAM_SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod")


def ours(target, draft, ids: list[int], tokens: int, mode: str, eos: set[int]) -> tuple[float, list[int], RunStats]:
    options = {
        "plain": None,
        "ngram": DraftOptions(None, None, None, ngram=NgramOptions()),
        "draft+ngram": DraftOptions(draft, CacheOptions(), 3, only_while_faster=True, ngram=NgramOptions()),
        "draft": DraftOptions(draft, CacheOptions(), 3, only_while_faster=True),
    }[mode]
    stats = RunStats()
    out = list(run_generation(target, ids, max_new_tokens=tokens, sampling=SamplingParams(), cache=CacheOptions(),
                              eos_ids=eos, draft=options, stats=stats))
    return stats.tokens_per_s, out, stats


def llama(binary: Path, target: str, draft: str, prompt: str, tokens: int, threads: int, spec_type: str) -> float:
    """Decode tok/s of one llama-speculative-simple run (its own report)."""
    command = [str(binary), "-m", target, "-p", prompt, "-n", str(tokens), "-t", str(threads), "--temp", "0",
               "-c", "4096", "--spec-type", spec_type]
    if spec_type == "draft-simple":
        command += ["-md", draft, "-td", str(threads)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    match = re.search(r"decoded\s+(\d+)\s+tokens in\s+([0-9.]+) seconds", result.stderr)
    if result.returncode != 0 or match is None:
        raise RuntimeError(f"{' '.join(command[:3])} ... failed: {result.stderr[-400:]}")
    return int(match.group(1)) / float(match.group(2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bin", type=Path, required=True, help="folder of llama-speculative-simple")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--tokens", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kinds", default="code,edit,prose")
    parser.add_argument("--engines", default=None,
                        help="a comma-separated subset of plain, ngram, draft+ngram, draft, llama:<spec type>")
    parser.add_argument("--out", type=Path, default=results_dir(__file__) / "drafters.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_settled(args.target, torch.bfloat16, "auto")
    draft = load_settled(args.draft, torch.bfloat16, "auto", role="draft", share_tokenizer=target.tokenizer)
    draft.model.limit_vocabulary(32768)
    tokenizer = target.tokenizer
    eos = eos_token_ids(tokenizer)  # both engines end an answer at its end-of-turn token
    binary = args.llama_bin / "llama-speculative-simple"
    target_file, draft_file = str(fixture_path(args.target)), str(fixture_path(args.draft))
    engines = ["plain", "ngram", "draft+ngram", "draft", "llama:draft-simple",
               *(f"llama:{t}" for t in NGRAM_SPEC_TYPES)]
    if args.engines:
        engines = [e for e in engines if e in args.engines.split(",")]
    facts = machine()
    runs: dict[tuple[str, int, str], list[float]] = {}
    for round_index in range(args.rounds):
        for kind in args.kinds.split(","):
            for p, request in enumerate(REQUESTS[kind]):
                messages = [{"role": "user", "content": request}]
                ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                shift = round_index % len(engines)
                plain_tokens = None
                for engine in engines[shift:] + engines[:shift]:
                    record = {"bench": "drafters", "round": round_index, "kind": kind, "prompt": p,
                              "engine": engine}
                    if engine.startswith("llama:"):
                        tok_s = llama(binary, target_file, draft_file, text, args.tokens, args.threads,
                                      engine.split(":", 1)[1])
                    else:
                        tok_s, out, stats = ours(target, draft, ids, args.tokens, engine, eos)
                        if engine == "plain":
                            plain_tokens = out
                        record.update(tokens=len(out))
                        if stats.speculative is not None:
                            s = stats.speculative
                            record.update(acceptance=round(s.acceptance_rate, 3),
                                          tokens_per_pass=round(s.tokens_per_target_pass, 3),
                                          ngram_drafted=s.ngram_drafted, ngram_accepted=s.ngram_accepted)
                    record["tok_s"] = round(tok_s, 3)
                    runs.setdefault((kind, p, engine), []).append(tok_s)
                    emit({**record, **facts}, args.out)
                    if not engine.startswith("llama:") and engine != "plain" and plain_tokens is not None:
                        assert out == plain_tokens, f"{engine} changed the tokens of {kind} prompt {p}"
    for kind in args.kinds.split(","):
        prompts = range(len(REQUESTS[kind]))

        def per_prompt(engine: str) -> list[float]:
            return [median(runs[(kind, p, engine)]) for p in prompts]

        llama = [e for e in engines if e.startswith("llama:")]
        llama_best = [max(median(runs[(kind, p, e)]) for e in llama) for p in prompts] if llama else None
        plain = per_prompt("plain")
        summary = {"bench": "drafters_summary", "kind": kind, "rounds": args.rounds, "tokens": args.tokens}
        for engine in engines:
            values = per_prompt(engine)
            summary[engine] = {"tok_s": round(median(values), 3),
                               "over_plain": round(median([v / b for v, b in zip(values, plain)]), 3)}
            if llama_best:
                summary[engine]["over_llama_best"] = round(median([v / b for v, b in zip(values, llama_best)]), 3)
        emit({**summary, **facts}, args.out)


if __name__ == "__main__":
    main()
