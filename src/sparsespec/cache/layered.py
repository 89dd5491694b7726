"""A model whose layers attend differently (Gemma 3: sliding-window layers between global ones): one
:class:`~sparsespec.cache.arena.KVArena` per kind of layer, driven as one arena.

- **Global layers** keep what the cache policy says (budget, retention, recall, position mode, KV dtype), in an
  arena over those layers alone.
- **Sliding-window layers** attend to the ``sliding_window`` most recent positions, the row itself included. Their
  arena keeps exactly those: the ``window`` policy with a budget of ``sliding_window − 1`` entries, evicting after
  every row of every block (prefill chunks too, so each row of a chunk sees its own window, as in the model), keys
  rotated by their true positions with the layers' own RoPE base. Whatever the policy, the full cache included, a
  sliding layer holds its window and never more: ``--budget`` bounds the global layers only.

The model addresses layers by their index in the model; :meth:`LayeredArena.attend` sends each to its arena under
its index there. Both arenas see the same blocks, commits and rollbacks, so speculation's row-by-row semantics hold
in each. Statistics are the global arena's (its budget, its evictions; a sliding layer dropping what left its
window is the model's own attention, not an eviction), bytes the sum of both.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from typing import Callable

import torch

from ..config import ModelConfig
from .arena import KVArena
from .policy import CachePolicy


def window_policy(config: ModelConfig) -> CachePolicy:
    """What a sliding-window layer keeps between rows: the ``sliding_window − 1`` newest entries (a row sees them
    and itself)."""
    return CachePolicy("window", window=config.sliding_window - 1)


def global_config(config: ModelConfig) -> ModelConfig:
    """The shapes and RoPE of ``config``'s global layers, as a model of those layers alone."""
    return replace(config, num_hidden_layers=config.num_hidden_layers - len(config.sliding_layers), layer_types=())


def sliding_config(config: ModelConfig) -> ModelConfig:
    """The shapes and RoPE of ``config``'s sliding-window layers (their own base, no scaling), as a model of those
    layers alone."""
    return replace(config, num_hidden_layers=len(config.sliding_layers), layer_types=(),
                   rope_theta=config.local_rope_theta, rope_scaling=None)


class LayeredArena:
    """The KV arena of a model with sliding-window layers; the interface of :class:`KVArena` that the decoding
    loops, the engine and perplexity use."""

    def __init__(self, config: ModelConfig, make: Callable[..., KVArena], key_offset: torch.Tensor | None = None):
        """``make(config, **overrides)`` builds the run's arena for a model of some of the layers, with
        :class:`KVArena` arguments overridden: the global layers' call overrides only ``key_offset``; the sliding
        layers' sets their policy, true positions, no retention and no recall. ``key_offset``: ``[n_layers,
        n_kv_heads, head_dim]`` of the whole model, or None."""
        sliding = set(config.sliding_layers)
        global_layers = [i for i in range(config.num_hidden_layers) if i not in sliding]
        local_layers = sorted(sliding)

        def offsets(layers: list[int]) -> torch.Tensor | None:
            return None if key_offset is None else key_offset[layers]

        self.global_arena = make(global_config(config), key_offset=offsets(global_layers))
        self.sliding_arena = make(sliding_config(config), policy=window_policy(config),
                                  key_offset=offsets(local_layers), positions="original", retention=None,
                                  recall=None)
        index = {layer: (self.global_arena, n) for n, layer in enumerate(global_layers)}
        index |= {layer: (self.sliding_arena, n) for n, layer in enumerate(local_layers)}
        self._route = [index[i] for i in range(config.num_hidden_layers)]  # model layer -> (arena, its index)
        self._arenas = (self.global_arena, self.sliding_arena)

    # -------------------------------------------------------------------------------------------- the blocks
    def begin(self, n_rows: int, per_block: bool = False, parents: list[int] | None = None) -> None:
        self.global_arena.begin(n_rows, per_block, parents)
        self.sliding_arena.begin(n_rows, False, parents)  # every row sees its own window

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """:meth:`KVArena.attend` in the arena of model layer ``layer``."""
        arena, index = self._route[layer]
        return arena.attend(index, q, k, v)

    def end(self) -> None:
        for arena in self._arenas:
            arena.end()

    def native_pass(self) -> tuple[list, list[tuple[int, int]]]:
        """:meth:`KVArena.native_pass` of both arenas, each model layer routed to its arena and its index there."""
        passes = [arena.native_pass() for arena in self._arenas]
        which = {id(arena): n for n, arena in enumerate(self._arenas)}
        return [p[0][0] for p in passes], [(which[id(arena)], index) for arena, index in self._route]

    def commit(self, n_rows: int) -> None:
        for arena in self._arenas:
            arena.commit(n_rows)

    def takes_tree(self, n_rows: int) -> bool:
        return all(arena.takes_tree(n_rows) for arena in self._arenas)

    def commit_path(self, path: list[int]) -> None:
        for arena in self._arenas:
            arena.commit_path(path)

    def rollback(self) -> None:
        self.commit(0)

    def reset(self) -> None:
        for arena in self._arenas:
            arena.reset()

    @contextmanager
    def hold(self, n_tokens: int):
        """The global layers' retention (:meth:`KVArena.hold`); the sliding layers read the held rows as any."""
        with self.global_arena.hold(n_tokens):
            yield

    def tokens_to_hold(self, n_prompt: int) -> int:
        return self.global_arena.tokens_to_hold(n_prompt)

    def observation_rows(self, n_held: int) -> int:
        return self.global_arena.observation_rows(n_held)

    # ------------------------------------------------------------------------------------------ what it holds
    @property
    def nbytes(self) -> int:
        return sum(arena.nbytes for arena in self._arenas)

    @property
    def peak_nbytes(self) -> int:
        return sum(arena.peak_nbytes for arena in self._arenas)

    def restart_peak(self) -> None:
        for arena in self._arenas:
            arena.restart_peak()

    @property
    def metadata_nbytes(self) -> int:
        return sum(arena.metadata_nbytes for arena in self._arenas)

    def __getattr__(self, name: str):
        """The global arena's settings and counters: ``policy``, ``positions_mode``, ``kv_dtype``,
        ``recent_window``, ``max_block``, ``max_inflight``, ``max_tokens``, ``staging``, ``next_position``,
        ``n_committed``, ``n_inflight``, ``n_visible``, ``evicted_tokens``, ``cold``, ``retention``."""
        if name in _FROM_GLOBAL:
            return getattr(self.global_arena, name)
        raise AttributeError(name)


_FROM_GLOBAL = frozenset({"policy", "positions_mode", "kv_dtype", "recent_window", "max_block", "max_inflight",
                          "max_tokens", "staging", "next_position", "n_committed", "n_inflight", "n_visible",
                          "evicted_tokens", "cold", "retention"})
