// One row's attention over what it recalls from a layer of the cold tier (recall.cpp; cache/recall.py describes the
// tier and holds the torch reference).
#pragma once

#include <cstdint>

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

}  // namespace sparsespec
