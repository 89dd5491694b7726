"""``hybrid-decay``: the hybrid cache (sinks + heavy hitters + window) with heavy hitters ranked by attention that
fades: every row first multiplies each slot's score by ``SCORE_DECAY``, then adds the attention the slot received
from that row (``score ← λ · score + p``, in float32, on the arena's torch path and in the native op alike).

Accumulated attention (H2O) lets a token that collected attention early keep its place long after the text moved
on; ``hybrid-age`` divides by age instead, which also forgets a token's useful past. A decay of 0.999 remembers
roughly the last thousand rows. The score stored in the arena is the decayed sum, so commit, rollback and the
per-row snapshots keep their meaning (each snapshot is the score after its row).

``SCORE_DECAY`` was chosen on one text and measured on another (``sparsespec ppl``, qwen2.5-coder-1.5b, int8
entries, a 903-entry cache — half the bytes of a bf16 1024-entry one — in-cache positions, 64-token chunks, 16,384
tokens): over Richard III (full cache 22.495) decays of 0.95 / 0.99 / 0.995 / 0.998 / 0.999 read 23.286 / 23.181 /
23.129 / 23.065 / 23.064, against 23.229 for ``hybrid`` and 23.133 for ``hybrid-age``; over Paradise Lost (full
cache 67.63) 0.999 reads 71.033 (+5.0%) against ``hybrid-age``'s 71.24 (+5.3%) and ``hybrid``'s 74.17 (+9.7%).
"""

from __future__ import annotations

SCORE_DECAY = 0.999
