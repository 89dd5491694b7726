"""Operations one decode step runs (torch operations and native calls), by where they come from.

Operations one decode step runs, by where they come from (attention/arena, linears, the rest of the model): torch
operations, counted with a ``TorchDispatchMode``, and calls of the native ops (``sparsespec.kernels``: functions of
the extension module, outside the dispatcher; each counts as one operation, the allocations inside it not at all):
the per-step overhead a native layer loop would remove.

    python benchmarks/count_ops.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from sparsespec import kernels
from sparsespec.cache.arena import KVArena
from sparsespec.cache.policy import make_policy
from sparsespec.linear import NativeLinear
from sparsespec.loading.load import load_model


class Counter(TorchDispatchMode):
    """Counts every dispatched op under the innermost label of ``where``."""

    def __init__(self, where: list[str]) -> None:
        super().__init__()
        self.where = where
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[self.where[-1]] += 1
        return func(*args, **(kwargs or {}))


def labelled(method, label: str, where: list[str]):
    def wrapper(*args, **kwargs):
        where.append(label)
        try:
            return method(*args, **kwargs)
        finally:
            where.pop()
    return wrapper


NATIVE_OPS = ("gguf_linear", "gguf_dequantize", "arena_attention", "rms_norm", "gated")


def counted(function, where: list[str], counts: collections.Counter, native: collections.Counter):
    """``function`` counted as one operation under the innermost label of ``where`` (and in ``native``)."""
    def wrapper(*args, **kwargs):
        counts[where[-1]] += 1
        native[function.__name__] += 1
        with _disable_current_modes():
            return function(*args, **kwargs)
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--policy", default="full")
    parser.add_argument("--budget", type=int, default=None)
    args = parser.parse_args()
    loaded = load_model(args.model, torch.bfloat16, args.weights)
    model = loaded.model
    arena = KVArena(loaded.config, make_policy(args.policy, args.budget), dtype=model.dtype, max_tokens=128,
                    max_block=16)
    model.forward(torch.arange(16) + 100, arena, per_block=True)
    arena.commit(16)
    where = ["rest of the model"]
    KVArena.attend = labelled(KVArena.attend, "attention", where)
    NativeLinear.__call__ = labelled(NativeLinear.__call__, "linears", where)
    native: collections.Counter = collections.Counter()
    with Counter(where) as counter:
        for name in NATIVE_OPS:
            setattr(kernels, name, counted(getattr(kernels, name), where, counter.counts, native))
        model.forward(torch.tensor([200]), arena)
    print(json.dumps({"model": args.model, "weights": loaded.weights, "policy": args.policy,
                      "ops_per_step": sum(counter.counts.values()), **dict(counter.counts),
                      "native_calls": dict(native)}))


if __name__ == "__main__":
    main()
