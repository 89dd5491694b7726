// The cold tier (cache/recall.py describes it): what a budgeted KV arena evicts, kept as int4 pages with key
// summaries in memory this object owns, and each decode row's attention over the pages its query points at.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attention.h"
#include "rope.h"

namespace sparsespec {

// The row's view of the tier is `total` entries: entry e is entries[e] (head h at [e][h], `width` bytes: int4 key
// codes, int4 value codes, then float16 (scale, zero) per group of code_group channels, key then value), or, with
// `extra` and e >= extra_start, extra[e - extra_start]. Page p (page_size entries) is summarised by summaries[p]
// ([n_kv][2 * hd]: max, then min, per channel of its rotated keys), or extra_summaries[p - extra_start / page_size].
struct RecallRow {
  int n_kv = 0, group = 0, hd = 0, code_group = 16, width = 0, page_size = 16, pages = 0, total = 0;
  const float* query = nullptr;  // [n_kv, group, hd] before RoPE; rotated by table row query_row
  int64_t query_row = 0;
  const uint8_t* entries = nullptr;
  const int64_t* positions = nullptr;  // [e][h]
  const float* summaries = nullptr;
  const uint8_t* extra = nullptr;  // or null: the view is `entries`
  const int64_t* extra_positions = nullptr;
  const float* extra_summaries = nullptr;
  int extra_start = 0;  // a multiple of page_size
  const float* key_offset = nullptr;  // [n_kv, hd] added to each dequantized key, or null
  // [rows, hd] RoPE tables. A key rotates by its position, or (rank >= 0) by rank + its place in position order
  // among the row's recalled entries; the summaries are of keys rotated by `rank`.
  const float* cos = nullptr;
  const float* sin = nullptr;
  int64_t rank = -1;
  float scale = 1.0f;
  // The row's attention over the resident entries, merged in place with its attention over the recalled ones:
  // out [n_kv * group * hd] (float32, or bfloat16 when out_bf16) and its log-sum-exps lse [n_kv * group].
  void* out = nullptr;
  bool out_bf16 = false;
  const float* lse = nullptr;
};

// Per KV head: the query rotated; the `pages` pages of highest bound sum_d max(q_d max_d, q_d min_d) (largest over
// the group; ties: the older page), in page order, then the tail (entries past the last complete page); their keys
// dequantized, offset added and rotated; softmax attention of each query head over them, merged with the resident
// attention by the two log-sum-exps.
void recall_row(const RecallRow& r);

// Every layer's cold entries. Layout (cache/recall.py): entries [L, capacity, n_kv, width] uint8 (int4 key codes,
// int4 value codes, then float16 (scale, zero) per group of code_group channels, key then value; keys stored
// unrotated and minus key_offset), positions [L, capacity, n_kv] int64, summaries [L, capacity / page_size, n_kv,
// 2 * hd] float32 (max, then min, per channel of each complete page's keys, rotated by their positions or, rank
// >= 0, by rank). The first `count` entries per layer and KV head are the tier's.
struct ColdTier {
  int n_layers = 0, n_kv = 0, hd = 0, code_group = 16, width = 0, page_size = 16, pages = 1;
  int64_t rank = -1;  // >= 0: the in-cache mode (the arena's keys are unrotated); -1: true positions
  float scale = 1.0f;
  std::vector<float> key_offset;  // [L, n_kv, hd] the model's key bias, or empty
  RopeTables rope;  // rows from 0 (cover()): rotations by position, or by rank from `rank` up
  int count = 0, capacity = 0;
  int64_t highest_position = -1;  // of every entry appended
  std::vector<uint8_t> entries;
  std::vector<int64_t> positions;
  std::vector<float> summaries;

  // Bytes one entry holds in one layer and KV head, its share of its page's summary included.
  long bytes_per_entry() const { return width + 8 + 2L * hd * 4 / page_size; }
  long nbytes() const { return (long)count * n_layers * n_kv * bytes_per_entry(); }
  // The RoPE tables reach row upto - 1 (call before any thread reads them).
  void cover(int64_t upto) { rope.cover(upto); }
  // One entry's bytes from its key (unrotated, key_offset in) and value [hd] float32, of KV head h in `layer`.
  void encode(int layer, int h, const float* key, const float* value, uint8_t* out) const;
  // Page summaries [n_kv, 2 * hd] of `page_size` consecutive entries at entries [page_size, n_kv, width] with
  // positions [page_size, n_kv] (rotated by position or by rank; cover() must reach them).
  void summarise(int layer, const uint8_t* page_entries, const int64_t* page_positions, float* out) const;
  // Add n entries per layer and KV head: keys, values [L, n, n_kv, hd] float32 (keys unrotated, key_offset in),
  // positions [L, n, n_kv] >= 0; the pages they complete are summarised.
  void append(int n, const float* keys, const float* values, const int64_t* positions_in);
  // The reason append() cannot take n entries, or "" (room past INT32_MAX).
  std::string check_append(int64_t n) const;
  // A row of `group` query heads per KV head recalling from the stored entries of `layer` (the caller sets its
  // query, its output and, for entries not yet stored, the extra view); cover() must reach its rotations.
  RecallRow stored_view(int layer, int group) const;
};

// The entries the first n_rows of the in-flight rows after `committed` evicted (in [0, extent), extent = committed
// + n_rows), into the tier, per layer and KV head in the order an autoregressive run commits them (by the row that
// evicted them, then by position); keys read back as the model produced them (dequantized with the arena's
// key_offset, unrotated in the original mode). Call before commit_arena moves them. Returns "" or the reason the
// KV heads disagree (nothing is then changed).
std::string retire_evicted(ColdTier& tier, const ArenaStorage& arena, int n_rows, int extent);

// The rows of a row-by-row block recalling, after their attention over the resident entries of `layer`
// (attend_arena_layer): row i's view of the tier is the committed entries, then those the in-flight rows before
// it evicted, encoded as retire_evicted would encode them, so that it recalls what the autoregressive step at its
// position recalls. q [n_heads, T, hd] float32 before RoPE; out [T, n_heads * hd] float32 merged in place, with
// lse [T, n_heads] the resident log-sum-exps.
void recall_rows(ColdTier& tier, const ArenaStorage& arena, const ArenaPass& pass, int layer, int n_heads, int T,
                 const float* q, float* out, const float* lse);

}  // namespace sparsespec
