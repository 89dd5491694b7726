"""Which KV entries to keep: the cache policies and their sizes.

A policy keeps three kinds of tokens (any part may be zero):

- **sinks**: the first ``sinks`` tokens of the text (StreamingLLM's attention sinks),
- **heavy hitters**: the ``heavy`` tokens with the highest accumulated attention score (H2O),
- **window**: the ``window`` most recent tokens.

The budget is their sum. ``full`` keeps everything. ``hybrid-age`` is ``hybrid`` with heavy hitters ranked by
attention per row that saw them (``hybrid_age.py``), ``hybrid-decay`` with heavy hitters ranked by attention that
fades row by row (``hybrid_decay.py``). When the visible tokens outnumber the budget, the protected
tokens (sinks and window) stay and the rest are ranked by score; the lowest-scoring go first, ties broken towards
the oldest position so that the choice never depends on where a token sits in memory. The rule runs in the native
attention op, after every row or block (``kernels/csrc/attention.cpp``: ``evict``); its reference is the naive
decoder of ``tests/test_arena_reference.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, UserError
from .hybrid_decay import SCORE_DECAY

POLICIES = ("full", "window", "streaming", "h2o", "hybrid", "hybrid-age", "hybrid-decay")
DEFAULT_SINKS = 4


@dataclass(frozen=True)
class CachePolicy:
    """A cache policy: ``name`` in :data:`POLICIES` and the sizes of its three parts (0 where unused)."""

    name: str
    sinks: int = 0
    heavy: int = 0
    window: int = 0

    @property
    def is_full(self) -> bool:
        return self.name == "full"

    @property
    def budget(self) -> int | None:
        """Tokens kept per layer and KV head; ``None`` for the full cache."""
        return None if self.is_full else self.sinks + self.heavy + self.window

    @property
    def age_normalised(self) -> bool:
        """Whether heavy hitters are ranked by attention per row that saw them (``hybrid-age``)."""
        return self.name == "hybrid-age"

    @property
    def score_decay(self) -> float:
        """The factor every row multiplies the scores by before adding its attention (``hybrid-decay``), else 1."""
        return SCORE_DECAY if self.name == "hybrid-decay" else 1.0

    @property
    def needs_scores(self) -> bool:
        """Whether eviction depends on accumulated attention (so the attention probabilities must be kept)."""
        return self.heavy > 0

    def describe(self) -> str:
        if self.is_full:
            return "full"
        return f"{self.name}(sinks={self.sinks}, heavy={self.heavy}, window={self.window})"


def make_policy(
    name: str,
    budget: int | None = None,
    *,
    sinks: int | None = None,
    heavy: int | None = None,
    window: int | None = None,
) -> CachePolicy:
    """Build a policy from a name and a budget, with default splits that the explicit sizes override.

    Defaults: ``window`` keeps the last ``budget`` tokens; ``streaming`` keeps 4 sinks and the rest as window;
    ``h2o`` splits the budget half heavy hitters, half window; ``hybrid`` keeps 4 sinks and splits the rest half
    heavy hitters, half window. When all three sizes are given, the budget is their sum (and must equal
    ``budget`` if that is given too).
    """
    if name not in POLICIES:
        raise UserError(f"Unknown cache policy {name!r}; choose one of {', '.join(POLICIES)}.")
    for label, value in (("budget", budget), ("sinks", sinks), ("heavy", heavy), ("window", window)):
        if value is not None and value < 0:
            raise ConfigError("{" + label + "} must not be negative (got {value}).", value=value)
    if name == "full":
        if budget is not None or sinks or heavy or window:
            raise ConfigError("Policy 'full' keeps every token; drop {budget}/{sinks}/{heavy}/{window} or choose a "
                              "budgeted policy.")
        return CachePolicy("full")

    uses = {
        "window": (False, False),
        "streaming": (True, False),
        "h2o": (False, True),
        "hybrid": (True, True),
        "hybrid-age": (True, True),
        "hybrid-decay": (True, True),
    }[name]
    has_sinks, has_heavy = uses
    if not has_sinks and sinks:
        raise ConfigError("Policy {name!r} keeps no attention sinks; drop {sinks} or choose streaming/hybrid.",
                          name=name)
    if not has_heavy and heavy:
        raise ConfigError("Policy {name!r} keeps no heavy hitters; drop {heavy} or choose h2o/hybrid.", name=name)

    if budget is None and None in (window, *((sinks,) if has_sinks else ()), *((heavy,) if has_heavy else ())):
        raise ConfigError("Policy {name!r} needs {budget} (or all of its {sinks}/{heavy}/{window} sizes).", name=name)

    s = (sinks if sinks is not None else min(DEFAULT_SINKS, budget or 0)) if has_sinks else 0
    if budget is not None and budget < s + 1:
        raise UserError(f"A budget of {budget} cannot hold {s} sinks plus a window of at least 1 token.")
    rest = (budget - s) if budget is not None else None
    if has_heavy:
        h = heavy if heavy is not None else (rest - window if window is not None else rest // 2)
    else:
        h = 0
    w = window if window is not None else rest - h
    policy = CachePolicy(name, s, h, w)

    if w < 1:
        raise UserError(f"Policy {name!r} needs a window of at least 1 token (budget {budget}, sinks {s}, heavy {h}).")
    if budget is not None and s + w > budget:
        raise ConfigError("{sinks} {s} + {window} {w} exceed {budget} {b}.", s=s, w=w, b=budget)
    if h < 0 or (has_heavy and h == 0):
        raise UserError(f"A budget of {budget} leaves no room for heavy hitters after {s} sinks and a window of {w}.")
    if budget is not None and policy.budget != budget:
        raise ConfigError("{sinks} {s} + {heavy} {h} + {window} {w} = {total}, which does not match {budget} {b}.",
                          s=s, h=h, w=w, total=policy.budget, b=budget)
    return policy
