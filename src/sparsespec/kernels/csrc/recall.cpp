// The cold tier (cache/recall.py describes it; tests/test_recall.py holds a float64 reference of every step): its
// storage, what a commit moves into it, and a row's recall: page bounds from the summaries, the best pages, their
// entries and the tail dequantized, rotated and attended. Each KV head is one task; a head's steps run in a fixed
// order, whatever the number of pages, so a row reads the same bits in a verification block as in an
// autoregressive step.
#include "recall.h"
#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "elementwise.h"

namespace sparsespec {
namespace {

// The hot loops are built for AVX2 as well as the baseline and chosen when the program loads; their lanes do the
// same float steps either way, so both give the same bits.
#if defined(__x86_64__)
#define SPARSESPEC_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define SPARSESPEC_CLONES
#endif

// An entry's channels in out[hd] (a key or a value: codes at codes, float16 (scale, zero) per group at params).
SPARSESPEC_CLONES void dequantize_entry(const uint8_t* codes, const uint16_t* params, int hd, int group,
                                        float* out) {
  const int half = hd / 2;
  for (int g = 0; g < hd / group; ++g) {
    const float scale = half_to_float(params[2 * g]), zero = half_to_float(params[2 * g + 1]);
    for (int c = g * group; c < (g + 1) * group; ++c) {
      const int code = c < half ? codes[c] & 15 : codes[c - half] >> 4;
      out[c] = zero + (float)code * scale;
    }
  }
}

// sum_i a[i] * b[i] over n (a multiple of 8) in 8 running sums combined in a fixed order: the same bits for the
// same inputs, without a chain of n dependent additions.
SPARSESPEC_CLONES float dot8(const float* a, const float* b, int n) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += a[i + j] * b[i + j];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

// sum_d max(q[d] * high[d], q[d] * low[d]), as dot8 sums.
SPARSESPEC_CLONES float bound8(const float* q, const float* high, const float* low, int n) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += std::max(q[i + j] * high[i + j], q[i + j] * low[i + j]);
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

// x[hd] rotated by a RoPE table row (the "rotate half" layout), into out.
void rotate(const float* x, const float* cos, const float* sin, int hd, float* out) {
  const int half = hd / 2;
  for (int c = 0; c < hd; ++c) out[c] = x[c] * cos[c] + (c < half ? -x[c + half] : x[c - half]) * sin[c];
}

// The inverse of rotate by the same row, in place: the rotation back, divided by the row's squared norm
// (attention_factor^2: a scaled RoPE's tables scale every rotated vector by it).
void unrotate(float* x, const float* cos, const float* sin, int hd, float attention_factor) {
  const int half = hd / 2;
  const float inverse = 1.0f / (attention_factor * attention_factor);
  float out[kAttnMaxHeadDim];
  for (int c = 0; c < hd; ++c) out[c] = x[c] * cos[c] - (c < half ? -x[c + half] : x[c - half]) * sin[c];
  for (int c = 0; c < hd; ++c) x[c] = attention_factor == 1.0f ? out[c] : out[c] * inverse;
}

// The entry at `slot` of KV head h in `layer` of the arena as float32 [hd]: a key (dequantized, key_offset added)
// or a value.
void read_arena_entry(const ArenaStorage& a, int layer, int h, int slot, bool key, float* out) {
  const long index = ((long)layer * a.n_kv + h) * a.cap + slot;
  const int hd = a.hd;
  if (a.code_bits) {
    const uint8_t* codes = static_cast<const uint8_t*>(key ? a.keys : a.values) + index * code_bytes(hd, a.code_bits);
    const uint16_t* params = (key ? a.key_params : a.value_params) + index * param_halves(hd, a.code_group);
    dequantize_row_scalar(codes, params, hd, a.code_bits, a.code_group, out);
    if (key && a.key_offset)
      for (int c = 0; c < hd; ++c) out[c] += a.key_offset[((long)layer * a.n_kv + h) * hd + c];
  } else if (a.bf16) {
    const uint16_t* x = static_cast<const uint16_t*>(key ? a.keys : a.values) + index * hd;
    for (int c = 0; c < hd; ++c) out[c] = bf16_to_float(x[c]);
  } else {
    std::memcpy(out, static_cast<const float*>(key ? a.keys : a.values) + index * hd, (std::size_t)hd * 4);
  }
}

// Per KV head of `layer`, the arena slots below slot_stop that in-flight rows below `before_row` evicted, in the
// order an autoregressive run commits them: by the row that evicted them, then by position.
std::vector<std::vector<int>> departed(const ArenaStorage& a, int layer, int slot_stop, int before_row) {
  std::vector<std::vector<int>> slots(a.n_kv);
  for (int h = 0; h < a.n_kv; ++h) {
    const long at = ((long)layer * a.n_kv + h) * a.cap;
    const int32_t* evicted_at = a.evicted_at + at;
    const int64_t* positions = a.positions + at;
    for (int s = 0; s < slot_stop; ++s)
      if (evicted_at[s] < before_row) slots[h].push_back(s);
    std::sort(slots[h].begin(), slots[h].end(), [&](int x, int y) {
      return evicted_at[x] < evicted_at[y] || (evicted_at[x] == evicted_at[y] && positions[x] < positions[y]);
    });
  }
  return slots;
}

// The departed entries of `layer` as the tier stores them: keys and values [n, n_kv, hd] as the model produced
// them (unrotated in the original mode), positions [n, n_kv]. The tables must reach their positions.
void read_departed(const ColdTier& tier, const ArenaStorage& a, int layer, const std::vector<std::vector<int>>& slots,
                   int n, float* keys, float* values, int64_t* positions) {
  const int hd = a.hd;
  for (int h = 0; h < a.n_kv; ++h)
    for (int j = 0; j < n; ++j) {
      const int s = slots[h][j];
      const long at = (long)j * a.n_kv + h;
      positions[at] = a.positions[((long)layer * a.n_kv + h) * a.cap + s];
      read_arena_entry(a, layer, h, s, true, keys + at * hd);
      read_arena_entry(a, layer, h, s, false, values + at * hd);
      if (tier.rank < 0)
        unrotate(keys + at * hd, tier.rope.cos_row(positions[at]), tier.rope.sin_row(positions[at]), hd,
                 tier.rope.attention_factor);
    }
}

// The highest position among slots of `layer` listed in `slots`' first n, or -1. A position the RoPE tables cannot
// hold (negative, or past 2^40: a corrupt arena) is an error.
int64_t highest_departed(const ArenaStorage& a, int layer, const std::vector<std::vector<int>>& slots, int n) {
  int64_t highest = -1;
  for (int h = 0; h < a.n_kv; ++h)
    for (int j = 0; j < n; ++j) {
      const int64_t position = a.positions[((long)layer * a.n_kv + h) * a.cap + slots[h][j]];
      if (position < 0 || position >= (int64_t)1 << 40)
        throw std::invalid_argument("the cold tier: slot " + std::to_string(slots[h][j]) + " of KV head " +
                                    std::to_string(h) + " holds position " + std::to_string(position));
      highest = std::max(highest, position);
    }
  return highest;
}

}  // namespace

void recall_row(const RecallRow& r) {
  const int hd = r.hd, G = r.group, P = r.page_size;
  const int half = hd / 2, groups = hd / r.code_group;
  const int n_pages = r.total / P;
  const int stored_pages = r.extra ? r.extra_start / P : n_pages;
  parallel_for(0, r.n_kv, 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> bounds(n_pages), key(hd), rotated(hd), value(hd), logits, sums(G), q((std::size_t)G * hd);
    std::vector<float> recalled((std::size_t)G * hd);
    std::vector<int> chosen(n_pages), read, by_position;
    std::vector<int64_t> ranks;
    for (int h = (int)h0; h < (int)h1; ++h) {
      for (int g = 0; g < G; ++g)
        rotate(r.query + ((long)h * G + g) * hd, r.cos + r.query_row * hd, r.sin + r.query_row * hd, hd,
               q.data() + (long)g * hd);
      // Bounds: the largest over the group of sum_d max(q_d * max_d, q_d * min_d).
      for (int p = 0; p < n_pages; ++p) {
        const float* s = p < stored_pages ? r.summaries + ((long)p * r.n_kv + h) * 2 * hd
                                          : r.extra_summaries + ((long)(p - stored_pages) * r.n_kv + h) * 2 * hd;
        float best = -std::numeric_limits<float>::infinity();
        for (int g = 0; g < G; ++g) {
          const float sum = bound8(q.data() + (long)g * hd, s, s + hd, hd);
          if (sum > best) best = sum;  // a nan sum is never the best
        }
        bounds[p] = best;
      }
      // The best pages (ties: the older page), read in page order, then the tail.
      std::iota(chosen.begin(), chosen.end(), 0);
      const int k = std::min(r.pages, n_pages);
      std::partial_sort(chosen.begin(), chosen.begin() + k, chosen.end(), [&](int a, int b) {
        return bounds[a] > bounds[b] || (bounds[a] == bounds[b] && a < b);
      });
      std::sort(chosen.begin(), chosen.begin() + k);
      read.clear();
      for (int i = 0; i < k; ++i)
        for (int j = 0; j < P; ++j) read.push_back(chosen[i] * P + j);
      for (int e = n_pages * P; e < r.total; ++e) read.push_back(e);
      const int R = (int)read.size();
      auto entry = [&](int e) -> const uint8_t* {
        return r.extra && e >= r.extra_start ? r.extra + ((long)(e - r.extra_start) * r.n_kv + h) * r.width
                                             : r.entries + ((long)e * r.n_kv + h) * r.width;
      };
      auto position = [&](int e) -> int64_t {
        return r.extra && e >= r.extra_start ? r.extra_positions[(long)(e - r.extra_start) * r.n_kv + h]
                                             : r.positions[(long)e * r.n_kv + h];
      };
      // Ranks (the in-cache mode): the recalled entries in position order from the fixed rank on.
      if (r.rank >= 0) {
        by_position.resize(R);
        std::iota(by_position.begin(), by_position.end(), 0);
        std::sort(by_position.begin(), by_position.end(),
                  [&](int a, int b) { return position(read[a]) < position(read[b]); });
        ranks.resize(R);
        for (int i = 0; i < R; ++i) ranks[by_position[i]] = r.rank + i;
      }
      // Logits: each key dequantized, its bias added, rotated by its position or its rank.
      logits.assign((std::size_t)G * R, 0.0f);
      for (int i = 0; i < R; ++i) {
        const uint8_t* bytes = entry(read[i]);
        dequantize_entry(bytes, reinterpret_cast<const uint16_t*>(bytes + hd), hd, r.code_group, key.data());
        if (r.key_offset)
          for (int c = 0; c < hd; ++c) key[c] += r.key_offset[(long)h * hd + c];
        const int64_t row = r.rank >= 0 ? ranks[i] : position(read[i]);
        rotate(key.data(), r.cos + row * hd, r.sin + row * hd, hd, rotated.data());
        for (int g = 0; g < G; ++g)
          logits[(long)g * R + i] = dot8(q.data() + (long)g * hd, rotated.data(), hd) * r.scale;
      }
      // Softmax over the read entries, and the values it weighs.
      float* lse = sums.data();
      for (int g = 0; g < G; ++g) {
        float* l = logits.data() + (long)g * R;
        const float m = *std::max_element(l, l + R);
        float sum = 0.0f;
        for (int i = 0; i < R; ++i) sum += (l[i] = std::exp(l[i] - m));
        for (int i = 0; i < R; ++i) l[i] /= sum;
        lse[g] = m + std::log(sum);
      }
      std::fill(recalled.begin(), recalled.end(), 0.0f);
      for (int i = 0; i < R; ++i) {
        const uint8_t* bytes = entry(read[i]);
        dequantize_entry(bytes + half, reinterpret_cast<const uint16_t*>(bytes + hd) + 2 * groups, hd, r.code_group,
                         value.data());
        for (int g = 0; g < G; ++g) {
          const float w = logits[(long)g * R + i];
          float* o = recalled.data() + (long)g * hd;
          for (int c = 0; c < hd; ++c) o[c] += w * value[c];
        }
      }
      // The merge: softmax over the union of the resident and the recalled entries, from each part's own.
      for (int g = 0; g < G; ++g) {
        const long at = ((long)h * G + g) * hd;
        const float resident_lse = r.lse[(long)h * G + g];
        const float total = std::max(resident_lse, lse[g]) + std::log1p(std::exp(-std::fabs(resident_lse - lse[g])));
        const float w_resident = std::exp(resident_lse - total), w_recalled = std::exp(lse[g] - total);
        for (int c = 0; c < hd; ++c) {
          const float resident = r.out_bf16 ? bf16_to_float(static_cast<const uint16_t*>(r.out)[at + c])
                                            : static_cast<const float*>(r.out)[at + c];
          const float merged = w_resident * resident + w_recalled * recalled[(long)g * hd + c];
          if (r.out_bf16)
            static_cast<uint16_t*>(r.out)[at + c] = float_to_bf16(merged);
          else
            static_cast<float*>(r.out)[at + c] = merged;
        }
      }
    }
  });
}

// ------------------------------------------------------------------------------------------------ the tier
void ColdTier::encode(int layer, int h, const float* key, const float* value, uint8_t* out) const {
  float shifted[kAttnMaxHeadDim];
  const float* offset = key_offset.empty() ? nullptr : key_offset.data() + ((long)layer * n_kv + h) * hd;
  for (int c = 0; c < hd; ++c) shifted[c] = offset ? key[c] - offset[c] : key[c];
  uint16_t params[2 * 2 * kAttnMaxHeadDim / 16];
  const int groups = hd / code_group;
  quantize_row(shifted, hd, 4, code_group, out, params);
  quantize_row(value, hd, 4, code_group, out + hd / 2, params + 2 * groups);
  std::memcpy(out + hd, params, (std::size_t)4 * groups * sizeof(uint16_t));
}

void ColdTier::summarise(int layer, const uint8_t* page_entries, const int64_t* page_positions, float* out) const {
  std::vector<float> key(hd), rotated(hd);
  for (int h = 0; h < n_kv; ++h) {
    float* high = out + (long)h * 2 * hd;
    float* low = high + hd;
    std::fill(high, high + hd, -std::numeric_limits<float>::infinity());
    std::fill(low, low + hd, std::numeric_limits<float>::infinity());
    for (int j = 0; j < page_size; ++j) {
      const uint8_t* bytes = page_entries + ((long)j * n_kv + h) * width;
      uint16_t params[2 * kAttnMaxHeadDim / 16];
      std::memcpy(params, bytes + hd, (std::size_t)2 * (hd / code_group) * sizeof(uint16_t));
      dequantize_entry(bytes, params, hd, code_group, key.data());
      if (!key_offset.empty())
        for (int c = 0; c < hd; ++c) key[c] += key_offset[((long)layer * n_kv + h) * hd + c];
      const int64_t row = rank >= 0 ? rank : page_positions[(long)j * n_kv + h];
      rotate(key.data(), rope.cos_row(row), rope.sin_row(row), hd, rotated.data());
      for (int c = 0; c < hd; ++c) {
        high[c] = std::max(high[c], rotated[c]);
        low[c] = std::min(low[c], rotated[c]);
      }
    }
  }
}

std::string ColdTier::check_append(int64_t n) const {
  if (n < 0 || count + n > (int64_t)INT32_MAX / 2) return "the cold tier cannot hold " + std::to_string(n) + " more";
  return "";
}

void ColdTier::append(int n, const float* keys, const float* values, const int64_t* positions_in) {
  if (n <= 0) return;
  const int P = page_size;
  if (count + n > capacity) {  // grow by doubling, a whole number of pages, keeping the first `count`
    const int grown = (std::max({2 * capacity, count + n, 4 * P}) + P - 1) / P * P;
    std::vector<uint8_t> e((std::size_t)n_layers * grown * n_kv * width);
    std::vector<int64_t> pos((std::size_t)n_layers * grown * n_kv);
    std::vector<float> sums((std::size_t)n_layers * (grown / P) * n_kv * 2 * hd);
    for (int l = 0; l < n_layers; ++l) {
      std::memcpy(&e[(std::size_t)l * grown * n_kv * width], entries.data() + (std::size_t)l * capacity * n_kv * width,
                  (std::size_t)count * n_kv * width);
      std::memcpy(&pos[(std::size_t)l * grown * n_kv], positions.data() + (std::size_t)l * capacity * n_kv,
                  (std::size_t)count * n_kv * sizeof(int64_t));
      std::memcpy(&sums[(std::size_t)l * (grown / P) * n_kv * 2 * hd],
                  summaries.data() + (std::size_t)l * (capacity / P) * n_kv * 2 * hd,
                  (std::size_t)(count / P) * n_kv * 2 * hd * sizeof(float));
    }
    entries.swap(e);
    positions.swap(pos);
    summaries.swap(sums);
    capacity = grown;
  }
  for (long i = 0; i < (long)n_layers * n * n_kv; ++i) highest_position = std::max(highest_position, positions_in[i]);
  cover(std::max(rank, highest_position) + 1);
  parallel_for(0, (int64_t)n_layers * n_kv, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const int l = (int)(w / n_kv), h = (int)(w % n_kv);
      for (int j = 0; j < n; ++j) {
        const long from = ((long)l * n + j) * n_kv + h, to = ((long)l * capacity + count + j) * n_kv + h;
        encode(l, h, keys + from * hd, values + from * hd, entries.data() + to * width);
        positions[to] = positions_in[from];
      }
    }
  });
  const int first_page = count / P, end_page = (count + n) / P, new_pages = end_page - first_page;
  parallel_for(0, (int64_t)n_layers * new_pages, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const int l = (int)(w / new_pages), page = first_page + (int)(w % new_pages);
      const long first = (long)l * capacity + (long)page * P;
      summarise(l, entries.data() + first * n_kv * width, positions.data() + first * n_kv,
                summaries.data() + (((long)l * (capacity / P) + page) * n_kv) * 2 * hd);
    }
  });
  count += n;
}

RecallRow ColdTier::stored_view(int layer, int group) const {
  RecallRow r;
  r.n_kv = n_kv;
  r.group = group;
  r.hd = hd;
  r.code_group = code_group;
  r.width = width;
  r.page_size = page_size;
  r.pages = pages;
  r.total = count;
  r.entries = entries.data() + (long)layer * capacity * n_kv * width;
  r.positions = positions.data() + (long)layer * capacity * n_kv;
  r.summaries = summaries.data() + (long)layer * (capacity / page_size) * n_kv * 2 * hd;
  if (!key_offset.empty()) r.key_offset = key_offset.data() + (long)layer * n_kv * hd;
  r.cos = rope.cos_row(0);
  r.sin = rope.sin_row(0);
  r.rank = rank;
  r.scale = scale;
  return r;
}

std::string retire_evicted(ColdTier& tier, const ArenaStorage& a, int n_rows, int extent) {
  std::vector<std::vector<std::vector<int>>> slots;
  int n = -1;
  int64_t highest = -1;
  for (int l = 0; l < a.n_layers; ++l) {
    slots.push_back(departed(a, l, extent, n_rows));
    for (int h = 0; h < a.n_kv; ++h) {
      const int size = (int)slots[l][h].size();
      if (n < 0) n = size;
      if (size != n)
        return "KV head " + std::to_string(h) + " of layer " + std::to_string(l) + " evicted " +
               std::to_string(size) + " entries, the first head " + std::to_string(n);
    }
    if (n > 0) highest = std::max(highest, highest_departed(a, l, slots[l], n));
  }
  if (n <= 0) return "";
  std::string problem = tier.check_append(n);
  if (!problem.empty()) return problem;
  tier.cover(highest + 1);
  const long per_layer = (long)n * a.n_kv;
  std::vector<float> keys((std::size_t)a.n_layers * per_layer * a.hd), values(keys.size());
  std::vector<int64_t> positions((std::size_t)a.n_layers * per_layer);
  parallel_for(0, a.n_layers, 1, [&](int64_t l0, int64_t l1) {
    for (int64_t l = l0; l < l1; ++l)
      read_departed(tier, a, (int)l, slots[l], n, keys.data() + l * per_layer * a.hd,
                    values.data() + l * per_layer * a.hd, positions.data() + l * per_layer);
  });
  tier.append(n, keys.data(), values.data(), positions.data());
  return "";
}

void recall_rows(ColdTier& tier, const ArenaStorage& a, const ArenaPass& p, int layer, int n_heads, int T,
                 const float* q, float* out, const float* lse) {
  const int n_kv = a.n_kv, hd = a.hd, P = tier.page_size, W = tier.width;
  // What the in-flight rows before the block's last row evicted, in eviction order; row i's pending entries are
  // the first n_pending[i] (those evicted by rows before it).
  const auto slots = departed(a, layer, p.start + T - 1, p.first + T - 1);
  std::vector<int> n_pending(T);
  for (int i = 0; i < T; ++i) {
    for (int h = 0; h < n_kv; ++h) {
      const long at = ((long)layer * n_kv + h) * a.cap;
      const int before = (int)std::count_if(slots[h].begin(), slots[h].end(),
                                            [&](int s) { return a.evicted_at[at + s] < p.first + i; });
      if (h == 0) n_pending[i] = before;
      if (before != n_pending[i]) throw std::runtime_error("recall: the KV heads' in-flight evictions disagree");
    }
  }
  const int most = n_pending[T - 1];
  // Each row's rotation: its position, or (in-cache) its rank, the tokens visible before it.
  std::vector<int64_t> query_rows(T);
  int64_t highest = tier.rank >= 0 ? tier.rank + (int64_t)tier.pages * P + P : -1;
  for (int i = 0; i < T; ++i) {
    query_rows[i] = p.in_cache ? row_rank(p.visible_before, i, p.per_row, p.budget) : p.first_position + i;
    highest = std::max(highest, query_rows[i]);
  }
  if (tier.rank < 0) {
    highest = std::max(highest, tier.highest_position);
    if (most) highest = std::max(highest, highest_departed(a, layer, slots, most));
  }
  tier.cover(highest + 1);
  // The views of rows with pending entries, past the stored pages: the committed tail, then the pending entries,
  // with the summaries of the pages they complete (a page's summary depends on its entries alone, so one set serves
  // every row). Rows without pending entries (every one-row step) read the stored tier alone.
  const int extra_start = tier.count / P * P, tail = tier.count - extra_start, extra_n = most ? tail + most : 0;
  const long stored_at = (long)layer * tier.capacity;
  std::vector<uint8_t> extra((std::size_t)extra_n * n_kv * W);
  std::vector<int64_t> extra_positions((std::size_t)extra_n * n_kv);
  if (most) {
    std::memcpy(extra.data(), tier.entries.data() + (stored_at + extra_start) * n_kv * W,
                (std::size_t)tail * n_kv * W);
    std::memcpy(extra_positions.data(), tier.positions.data() + (stored_at + extra_start) * n_kv,
                (std::size_t)tail * n_kv * sizeof(int64_t));
    std::vector<float> keys((std::size_t)most * n_kv * hd), values(keys.size());
    read_departed(tier, a, layer, slots, most, keys.data(), values.data(), extra_positions.data() + (long)tail * n_kv);
    for (int j = 0; j < most; ++j)
      for (int h = 0; h < n_kv; ++h) {
        const long at = (long)j * n_kv + h;
        tier.encode(layer, h, keys.data() + at * hd, values.data() + at * hd, extra.data() + (tail * n_kv + at) * W);
      }
  }
  const int extra_pages = extra_n / P;
  std::vector<float> extra_summaries((std::size_t)extra_pages * n_kv * 2 * hd);
  for (int page = 0; page < extra_pages; ++page)
    tier.summarise(layer, extra.data() + (long)page * P * n_kv * W, extra_positions.data() + (long)page * P * n_kv,
                   extra_summaries.data() + (long)page * n_kv * 2 * hd);
  std::vector<float> query((std::size_t)n_heads * hd);
  for (int i = 0; i < T; ++i) {
    const int total = tier.count + n_pending[i];
    if (!total) continue;
    for (int head = 0; head < n_heads; ++head)
      std::memcpy(query.data() + (long)head * hd, q + ((long)head * T + i) * hd, (std::size_t)hd * 4);
    RecallRow r = tier.stored_view(layer, n_heads / n_kv);
    r.total = total;
    r.query = query.data();
    r.query_row = query_rows[i];
    if (n_pending[i]) {
      r.extra = extra.data();
      r.extra_positions = extra_positions.data();
      r.extra_summaries = extra_summaries.data();
      r.extra_start = extra_start;
    }
    r.out = out + (long)i * n_heads * hd;
    r.lse = lse + (long)i * n_heads;
    recall_row(r);
  }
}

}  // namespace sparsespec
