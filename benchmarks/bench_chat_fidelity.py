"""How often greedy chat answers equal the float32 reference's, ours against llama.cpp's, on the same file and tokens.

How often the default path's greedy chat answers equal the float32 dense reference's, against how often
llama.cpp's do, on the same file and the same prompt tokens; and the default path's KL from the reference.

For each model and each question of :data:`QUESTIONS` (written for this benchmark): the chat prompt's ids from
sparsespec's tokenizer; the greedy answer (up to ``--new-tokens`` tokens, ending at an end-of-sequence token) of

* the reference: sparsespec in float32 with dense weights (the GGUF dequantized; the configuration that matches
  transformers to 1e-4 in the tests);
* the default path: bfloat16, ``--weights auto`` (native blocks) and ``--activations auto`` (float activations for
  the small models, 8-bit ones per block for the larger; ``--activations`` chooses another);
* llama.cpp: ``llama-server`` on the same file, ``/completion`` with the same ids, temperature 0.

An answer "equals" the reference when its tokens are the same, end included. Also per model: the mean KL (nats per
token) of the default path's next-token distribution from the reference's over each prompt plus the reference's
answer (teacher-forced), and where each engine's answer departs from the reference's, on average (the first
differing token; an equal answer counts its length). ``--dtype float32`` compares float32 compute on the native
weights instead, ``--kv-dtype bf16`` a cache stored in bfloat16.

    python benchmarks/bench_chat_fidelity.py --llama-bin /path/to/llama.cpp/build/bin
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
import urllib.request
from pathlib import Path

import torch

from common import emit, fixture_path, machine, results_dir

from sparsespec.engine import CacheOptions, make_arena, run_generation
from sparsespec.loading.load import load_model
from sparsespec.loading.tokenizer import eos_token_ids
from sparsespec.sampling import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "How many legs does a spider have?",
    "What is 17 times 3?",
    "Who wrote the play Hamlet?",
    "Explain in one sentence what photosynthesis is.",
    "What is the boiling point of water at sea level in Celsius?",
    "Translate 'good morning' into Spanish.",
    "Write a Python function that returns the square of a number.",
    "What does HTTP stand for?",
    "Give me a synonym for 'happy'.",
    "What is the largest planet in the solar system?",
    "In which year did the Second World War end?",
    "What is the chemical symbol for gold?",
    "How do I reverse a list in Python?",
    "Which ocean lies between Europe and North America?",
    "What is the square root of 81?",
    "Describe a cat in five words.",
    "What language is spoken in Brazil?",
    "Write a haiku about the sea.",
    "What is a prime number?",
    "How many days are there in a leap year?",
    "What is the opposite of 'cold'?",
    "Name a famous painting by Leonardo da Vinci.",
]


def chat_ids(tokenizer, question: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True))


def answer(loaded, ids: list[int], new_tokens: int, eos: set[int], kv_dtype: str = "auto") -> list[int]:
    tokens = []
    for token in run_generation(loaded, ids, max_new_tokens=new_tokens, sampling=SamplingParams(),
                                cache=CacheOptions(kv_dtype=kv_dtype), eos_ids=eos):
        tokens.append(token)
    return tokens


def mean_kl(reference, other, sequences: list[list[int]]) -> float:
    """Mean KL(reference ‖ other) per token over every position of ``sequences``, full caches."""
    total, count = 0.0, 0
    for ids in sequences:
        logits = []
        for loaded in (reference, other):
            arena = make_arena(loaded, CacheOptions(prefill_chunk=len(ids)), max_tokens=len(ids), max_inflight=1)
            logits.append(loaded.model.forward(torch.tensor(ids), arena).float())
        log_p, log_q = torch.log_softmax(logits[0], -1), torch.log_softmax(logits[1], -1)
        total += float((log_p.exp() * (log_p - log_q)).sum(-1).sum())
        count += len(ids)
    return total / count


class LlamaServer:
    """``llama-server`` on one file, for ``/completion`` requests with token ids."""

    def __init__(self, binary: Path, model: Path, threads: int, port: int):
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(
            [str(binary), "-m", str(model), "-t", str(threads), "-c", "4096", "-np", "1", "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        self.close()
        raise RuntimeError("llama-server did not start")

    def answer(self, ids: list[int], new_tokens: int) -> list[int]:
        body = json.dumps({"prompt": ids, "n_predict": new_tokens, "temperature": 0.0, "top_k": 1,
                           "cache_prompt": False, "return_tokens": True}).encode()
        request = urllib.request.Request(self.url + "/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            result = json.loads(response.read())
        return list(result["tokens"])

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def departs(a: list[int], b: list[int]) -> int:
    """Index of the first token where ``a`` and ``b`` differ (their common length when one extends the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    parser.add_argument("--llama-bin", type=Path, required=True, help="folder of llama-server")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--port", type=int, default=8093)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="compute dtype of the path compared with the reference (default: generate's)")
    parser.add_argument("--activations", choices=("auto", "int8", "float"), default="auto",
                        help="the compared path's --activations (default: generate's)")
    parser.add_argument("--kv-dtype", choices=("auto", "bf16"), default="auto",
                        help="the compared path's --kv-dtype (default: generate's, the compute dtype)")
    parser.add_argument("--out", type=Path, default=results_dir(__file__) / "chat_fidelity.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.models.split(","):
        reference = load_model(name, torch.float32, "dense")
        default = load_model(name, getattr(torch, args.dtype), "auto", activations=args.activations)
        float_activations = default.model.lm_head.float_activations
        eos = eos_token_ids(reference.tokenizer)
        prompts = [chat_ids(reference.tokenizer, q) for q in QUESTIONS]
        expected = [answer(reference, ids, args.new_tokens, eos) for ids in prompts]
        ours = [answer(default, ids, args.new_tokens, eos, args.kv_dtype) for ids in prompts]
        server = LlamaServer(args.llama_bin / "llama-server", fixture_path(name), args.threads, args.port)
        try:
            theirs = [[t for t in server.answer(ids, args.new_tokens)] for ids in prompts]
        finally:
            server.close()
        # llama-server leaves the end-of-sequence token out of its tokens; ours ends at it: compare without it.
        expected_text = [[t for t in answer_ if t not in eos] for answer_ in expected]
        ours_text = [[t for t in answer_ if t not in eos] for answer_ in ours]
        theirs_text = [[t for t in answer_ if t not in eos] for answer_ in theirs]
        for question, e, o, t in zip(QUESTIONS, expected_text, ours_text, theirs_text):
            emit({"bench": "chat_fidelity_answer", "model": name, "dtype": args.dtype, "kv_dtype": args.kv_dtype,
                  "float_activations": float_activations, "question": question,
                  "reference": reference.tokenizer.decode(e), "default": reference.tokenizer.decode(o),
                  "llama_cpp": reference.tokenizer.decode(t), "default_equal": o == e, "llama_cpp_equal": t == e},
                 args.out)
        kl = mean_kl(reference, default, [ids + answer_ for ids, answer_ in zip(prompts, expected)])
        n = len(QUESTIONS)
        emit({"bench": "chat_fidelity", "model": name, "dtype": args.dtype, "kv_dtype": args.kv_dtype,
              "float_activations": float_activations,
              "questions": n,
              "new_tokens": args.new_tokens,
              "default_weights": default.weights,
              "default_equal": sum(o == e for o, e in zip(ours_text, expected_text)),
              "llama_cpp_equal": sum(t == e for t, e in zip(theirs_text, expected_text)),
              "default_departs_mean": sum(departs(o, e) for o, e in zip(ours_text, expected_text)) / n,
              "llama_cpp_departs_mean": sum(departs(t, e) for t, e in zip(theirs_text, expected_text)) / n,
              "default_vs_llama_cpp_equal": sum(o == t for o, t in zip(ours_text, theirs_text)),
              "kl_default_from_reference": round(kl, 5), **machine()}, args.out)
        del reference, default


if __name__ == "__main__":
    main()
