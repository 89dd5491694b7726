"""``hybrid-age``: the hybrid cache (sinks + heavy hitters + window) with heavy hitters ranked by the attention a
token received *per row that saw it* rather than in total.

Accumulated attention (H2O) favours old tokens: a token that has been in the cache for a thousand rows has had a
thousand chances to collect attention, one that arrived just outside the window only a few, so the heavy-hitter
part fills with early tokens. Dividing by the token's age — the number of rows that attended to it, ``newest -
position + 1`` (each row attends to itself and to every earlier kept token) — compares tokens by their mean
attention instead, in float32, when the native attention op evicts (``kernels/csrc/attention.cpp``: ``evict``). The
score stored in the arena is still the plain sum, so commit, rollback and the per-row snapshots are unchanged; only
the ranking at eviction time differs.

It reads better than ``hybrid`` on the 1.5B over a long text but ties with it on SmolLM2, so ``hybrid`` stays the
default policy. Measured:
benchmarks/history/kv-cache.md#kv-cache-at-equal-bytes-int8-entries-and-age-normalised-heavy-hitters-bench_kv_bytespy
"""
