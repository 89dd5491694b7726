// One row's attention over what it recalls from one layer of the cold tier (cache/recall.py, which holds the
// torch reference of every step): page bounds from the summaries, the best pages, their entries and the tail
// dequantized, rotated and attended. Each KV head is one task; a head's steps run in a fixed order, whatever the
// number of pages, so a row reads the same bits in a verification block as in an autoregressive step.
#include "recall.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "elementwise.h"

namespace sparsespec {
namespace {

// Entry e's channels in out[hd] (key or value: codes at codes, float16 (scale, zero) per group at params).
void dequantize_entry(const uint8_t* codes, const uint16_t* params, int hd, int group, float* out) {
  const int half = hd / 2;
  for (int c = 0; c < hd; ++c) {
    const int code = c < half ? codes[c] & 15 : codes[c - half] >> 4;
    const int g = c / group;
    out[c] = half_to_float(params[2 * g + 1]) + (float)code * half_to_float(params[2 * g]);
  }
}

}  // namespace

void recall_row(const RecallRow& r) {
  const int hd = r.hd, G = r.group, P = r.page_size;
  const int half = hd / 2, groups = hd / r.code_group;
  const int n_pages = r.total / P;
  const int stored_pages = r.extra ? r.extra_start / P : n_pages;
  at::parallel_for(0, r.n_kv, 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> bounds(n_pages), key(hd), value(hd), logits, sums(G);
    std::vector<int> chosen(n_pages), read;
    for (int h = (int)h0; h < (int)h1; ++h) {
      const float* q = r.query + (long)h * G * hd;
      // Bounds: the largest over the group of sum_d max(q_d * max_d, q_d * min_d), d in order.
      for (int p = 0; p < n_pages; ++p) {
        const float* s = p < stored_pages ? r.summaries + ((long)p * r.n_kv + h) * 2 * hd
                                          : r.extra_summaries + ((long)(p - stored_pages) * r.n_kv + h) * 2 * hd;
        float best = -std::numeric_limits<float>::infinity();
        for (int g = 0; g < G; ++g) {
          float sum = 0.0f;
          for (int d = 0; d < hd; ++d) sum += std::max(q[g * hd + d] * s[d], q[g * hd + d] * s[hd + d]);
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
      // Logits: each key dequantized, its bias added, rotated by its position or the fixed rank.
      logits.assign((std::size_t)G * R, 0.0f);
      for (int i = 0; i < R; ++i) {
        const uint8_t* bytes = entry(read[i]);
        const uint16_t* params = reinterpret_cast<const uint16_t*>(bytes + hd);
        dequantize_entry(bytes, params, hd, r.code_group, key.data());
        if (r.key_offset)
          for (int c = 0; c < hd; ++c) key[c] += r.key_offset[(long)h * hd + c];
        const int64_t row = r.rank >= 0 ? r.rank : position(read[i]);
        const float* cos = r.cos + row * hd;
        const float* sin = r.sin + row * hd;
        for (int c = 0; c < hd; ++c) value[c] = key[c] * cos[c] + (c < half ? -key[c + half] : key[c - half]) * sin[c];
        for (int g = 0; g < G; ++g) {
          float dot = 0.0f;
          for (int c = 0; c < hd; ++c) dot += q[g * hd + c] * value[c];
          logits[(long)g * R + i] = dot * r.scale;
        }
      }
      // Softmax over the read entries, and the values it weighs.
      for (int g = 0; g < G; ++g) {
        float* l = logits.data() + (long)g * R;
        const float m = *std::max_element(l, l + R);
        float sum = 0.0f;
        for (int i = 0; i < R; ++i) sum += (l[i] = std::exp(l[i] - m));
        sums[g] = sum;
        r.lse[(long)h * G + g] = m + std::log(sum);
        float* o = r.out + ((long)h * G + g) * hd;
        std::fill(o, o + hd, 0.0f);
      }
      for (int i = 0; i < R; ++i) {
        const uint8_t* bytes = entry(read[i]);
        dequantize_entry(bytes + half, reinterpret_cast<const uint16_t*>(bytes + hd) + 2 * groups, hd, r.code_group,
                         value.data());
        for (int g = 0; g < G; ++g) {
          const float w = logits[(long)g * R + i];
          float* o = r.out + ((long)h * G + g) * hd;
          for (int c = 0; c < hd; ++c) o[c] += w * value[c];
        }
      }
      for (int g = 0; g < G; ++g) {
        float* o = r.out + ((long)h * G + g) * hd;
        for (int c = 0; c < hd; ++c) o[c] /= sums[g];
      }
    }
  });
}

}  // namespace sparsespec
