// One row's attention over what it recalls from one layer of the cold tier (cache/recall.py, which holds the
// torch reference of every step): page bounds from the summaries, the best pages, their entries and the tail
// dequantized, rotated and attended. Each KV head is one task; a head's steps run in a fixed order, whatever the
// number of pages, so a row reads the same bits in a verification block as in an autoregressive step.
#include "recall.h"
#include "parallel.h"


#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
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

}  // namespace sparsespec
