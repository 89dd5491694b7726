"""``hybrid-decay``: the hybrid cache (sinks + heavy hitters + window) with heavy hitters ranked by attention that
fades: every row first multiplies each slot's score by ``SCORE_DECAY``, then adds the attention the slot received
from that row (``score ← λ · score + p``, in float32, in the native attention op).

Accumulated attention (H2O) lets a token that collected attention early keep its place long after the text moved
on; ``hybrid-age`` divides by age instead, which also forgets a token's useful past. A decay of 0.999 remembers
roughly the last thousand rows. The score stored in the arena is the decayed sum, so commit, rollback and the
per-row snapshots keep their meaning (each snapshot is the score after its row).

``SCORE_DECAY`` was chosen on one text and checked on another, where it reads better than both ``hybrid-age`` and
``hybrid`` at equal bytes. Measured:
benchmarks/history/source-notes.md#hybrid-decay
"""

from __future__ import annotations

SCORE_DECAY = 0.999
