"""How far each weight format moves a model's next-token distribution: KL(float32 dense || format) on real text.

For each model, the float32 model with dense weights (the file's weights as they dequantize) is the reference; each
format runs in the compute dtype the engine uses with it (bfloat16) on the same tokens, one pass over a full cache.
Prints one JSON line per model and format: mean KL in nats per token, with the fraction of tokens whose argmax
differs from the reference. This is the measurement behind ``linear.auto_format``'s rule (a target takes the fastest
format within 0.01 nats/token).

    python benchmarks/format_quality.py --models smollm2-135m qwen2.5-coder-0.5b --formats dense int8 int4 native
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from sparsespec.cache.arena import KVArena
from sparsespec.cache.policy import make_policy
from sparsespec.eval.texts import read_text
from sparsespec.loading.load import load_model


def logits(loaded, ids: torch.Tensor) -> torch.Tensor:
    """``[T, vocab]`` float32 log-probabilities of the next token after each of ``ids`` (one pass, full cache)."""
    model = loaded.model
    arena = KVArena(loaded.config, make_policy("full"), dtype=model.dtype, max_tokens=len(ids), max_block=len(ids))
    return torch.log_softmax(model.forward(ids, arena).float(), dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    parser.add_argument("--formats", nargs="+", default=["dense", "int8", "int4", "native"])
    parser.add_argument("--text", default="corpus:hamlet")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--skip", type=int, default=2000, help="characters skipped at the text's start (front matter)")
    args = parser.parse_args()
    text = read_text(args.text)[args.skip:]
    for ref in args.models:
        reference = load_model(ref, torch.float32, "dense", weight_store=False)
        ids = torch.tensor(reference.tokenizer.encode(text)[: args.tokens])
        base = logits(reference, ids)
        del reference
        for fmt in args.formats:
            started = time.perf_counter()
            loaded = load_model(ref, torch.bfloat16, fmt, tokenizer=False, weight_store=False)
            load_s = time.perf_counter() - started
            other = logits(loaded, ids)
            kl = (base.exp() * (base - other)).sum(-1)
            print(json.dumps({"model": ref, "format": fmt, "resolved": loaded.weights, "tokens": len(ids),
                              "kl_nats_per_token": round(kl.mean().item(), 5),
                              "kl_p95": round(kl.quantile(0.95).item(), 5),
                              "argmax_differs": round((base.argmax(-1) != other.argmax(-1)).float().mean().item(), 4),
                              "weight_bytes": loaded.model.bytes_read_per_token(), "load_s": round(load_s, 1)}),
                  flush=True)


if __name__ == "__main__":
    main()
