"""Query-aware retention at the end of a prompt: SnapKV's observation window over a heavy-hitter cache.

Accumulated attention (H2O) is query-agnostic: a fact stated once in a long prompt draws little attention while the
prompt is read, so a budgeted cache evicts it before the question that needs it arrives. Retention defers that
choice to the end of the prompt, where the question is:

1. the prompt's last tokens (up to :attr:`Retention.max_held` of them) are read into the arena with nothing
   evicted (the arena grows for the duration: the peak, :meth:`KVArena.hold`);
2. its last :attr:`Retention.observation_rows` rows (the observation window, which holds the question) are read as
   one block; in every layer their attention to every held entry is summed over the rows and over the query heads
   of each KV head (GQA-aware: each KV head keeps its own entries);
3. those sums are max-pooled over the :attr:`Retention.pool` entries nearest in position (a phrase is kept whole,
   not only its most-attended token), and the cache policy's protected entries (sinks, window) stay while the rest
   are ranked by the pooled sums: the lowest go until the budget is met (ties: the older goes), as eviction always
   ranks;
4. every kept entry's heavy-hitter score becomes the attention the window paid it, so decoding goes on with the
   policy as before, ranking from what the question looked at rather than from what the prompt's reading did.

Steps 2-4 run in the native attention op, as part of the window's block (``kernels/csrc/attention.h``:
``AttnBlock::pool``); the arena asks for them (``KVArena.hold``), and ``tests/test_retention.py`` checks the kept
entries against a float64 reference of these steps.

Exactness: the selection is made once, from the prompt alone, by the same code whether decoding that follows is
autoregressive or speculative; a verification row sees exactly what the autoregressive step sees (the tests prove
speculative == autoregressive with retention on, both position modes).

Only policies with heavy hitters can keep what was selected: ``window`` and ``streaming`` evict every entry outside
their sinks and window at the next step.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, UserError
from .policy import CachePolicy

RETENTION_MODES = ("auto", "query", "off")
# SnapKV's observation window and pooling kernel (its defaults: 32 rows, a pool of 7 positions).
OBSERVATION_ROWS = 32
POOL_KERNEL = 7
# Prompt tokens held in full before the selection: a 16k-token prompt is chosen from whole. The arena holds
# budget + this many entries while the prompt is read (the peak) and returns to budget + staging after.
DEFAULT_MAX_HELD = 16384


@dataclass(frozen=True)
class Retention:
    """How the end of a prompt chooses what a budgeted cache keeps."""

    max_held: int = DEFAULT_MAX_HELD  # prompt tokens read with nothing evicted before the selection
    observation_rows: int = OBSERVATION_ROWS  # the prompt's last rows whose attention ranks the entries
    pool: int = POOL_KERNEL  # positions max-pooled around each entry (odd)

    def __post_init__(self) -> None:
        if self.max_held < self.observation_rows:
            raise ConfigError("{retention_tokens} must be at least the {rows}-row observation window (got "
                              "{value}).", rows=self.observation_rows, value=self.max_held)
        if self.observation_rows < 1 or self.pool < 1 or self.pool % 2 == 0:
            raise ValueError("retention needs at least one observation row and an odd pool width")


def retention_for(mode: str, policy: CachePolicy, max_held: int | None = None,
                  context: int | None = None) -> Retention | None:
    """The retention of ``--retention MODE`` for ``policy``: ``query`` selects at each prompt's end, ``off`` never,
    ``auto`` (the default) wherever the policy can keep the selection (heavy hitters). ``max_held``: see
    :class:`Retention`; None: :data:`DEFAULT_MAX_HELD`, or the model's ``context`` minus the budget where that is
    less (in-cache ranks must stay inside the context). Raises :class:`ConfigError` for a mode the policy cannot use,
    or a ``max_held`` without retention."""
    if mode not in RETENTION_MODES:
        raise UserError(f"Unknown retention {mode!r}; choose one of {', '.join(RETENTION_MODES)}.")
    usable = policy.needs_scores
    if mode == "query" and not usable:
        what = "keeps every token" if policy.is_full else "keeps no heavy hitters, so it would evict the selection"
        raise ConfigError("{retention} query chooses what a heavy-hitter cache keeps; policy {name!r} {what} (use "
                          "h2o or a hybrid policy, or drop {retention}).", name=policy.name, what=what)
    if mode == "off" or not usable:
        if max_held is not None:
            raise ConfigError("{retention_tokens} does nothing without retention (a heavy-hitter policy with "
                              "{retention} auto or query); drop it.")
        return None
    if max_held is None:
        max_held = DEFAULT_MAX_HELD if context is None else min(DEFAULT_MAX_HELD, context - policy.budget)
        max_held = max(max_held, OBSERVATION_ROWS)
    return Retention(max_held=max_held)
