"""Torch operations dispatched by one decode step, by where they come from (attention/arena, linears, the rest of
the model), counted with a ``TorchDispatchMode``: the per-step overhead a native layer loop would remove.

    python benchmarks/count_ops.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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
    with Counter(where) as counter:
        model.forward(torch.tensor([200]), arena)
    print(json.dumps({"model": args.model, "weights": loaded.weights, "policy": args.policy,
                      "ops_per_step": sum(counter.counts.values()), **dict(counter.counts)}))


if __name__ == "__main__":
    main()
