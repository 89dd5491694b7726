// Rotary position embeddings' tables: every rotation in the kernels (the arena's queries and keys, the cold tier's
// recalled keys and page summaries) reads rows made here, so a model's RoPE scaling changes its inverse frequencies
// (sparsespec/rope.py computes them as transformers does, for every scaling kind) and nothing else.
//
// Row p of cos / sin [rows, hd] is the rotation by p (a true position, or a rank inside the cache) in Hugging Face's
// rotate-half layout: angle = float32(p) * inv_freq[c] (rounded to float32, as transformers computes it), its cos
// and sin correctly rounded to float32 (computed in double: a float32 cos may be an ulp off, and where a test's
// reference computes the same rows its own way, every row must come out the same), times attention_factor (YaRN's;
// 1 for the other kinds), in channels c and c + hd / 2 alike. The vector paths read a row's first half.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace sparsespec {

struct RopeTables {
  int hd = 0;
  std::vector<float> inv_freq;  // [hd / 2]
  float attention_factor = 1.0f;
  int64_t first = 0, rows = 0;  // the tables hold rows [first, first + rows)
  std::vector<float> cos, sin;  // [rows, hd]

  // The reason inv_freq and attention_factor cannot rotate heads of hd channels, or "".
  static std::string check(int hd, const std::vector<float>& inv_freq, double attention_factor) {
    if (hd < 2 || hd % 2 || (int)inv_freq.size() != hd / 2)
      return "RoPE needs hd / 2 = " + std::to_string(hd / 2) + " inverse frequencies, not " +
             std::to_string(inv_freq.size());
    for (float f : inv_freq)
      if (!std::isfinite(f) || f < 0) return "RoPE's inverse frequencies must be finite and >= 0";
    if (!std::isfinite(attention_factor) || attention_factor <= 0) return "RoPE's attention factor must be positive";
    return "";
  }

  RopeTables() = default;
  RopeTables(int hd, std::vector<float> inv_freq, float attention_factor)
      : hd(hd), inv_freq(std::move(inv_freq)), attention_factor(attention_factor) {}

  // Rows [0, upto) at least: kept while they reach, else grown by doubling (call before any thread reads them).
  void cover(int64_t upto) {
    if (first == 0 && rows >= upto) return;
    fill(0, std::max<int64_t>({upto, first == 0 ? 2 * rows : 0, 256}));
  }

  // Rows [from, from + count) at least: kept while they reach, else exactly these (memory stays bounded however far
  // the positions go).
  void hold(int64_t from, int64_t count) {
    if (from >= first && from + count <= first + rows) return;
    fill(from, count);
  }

  const float* cos_row(int64_t p) const { return cos.data() + (p - first) * hd; }
  const float* sin_row(int64_t p) const { return sin.data() + (p - first) * hd; }

 private:
  // The tables become rows [from, from + count).
  void fill(int64_t from, int64_t count) {
    const int half = hd / 2;
    cos.resize((std::size_t)count * hd);
    sin.resize(cos.size());
    for (int64_t r = 0; r < count; ++r)
      for (int c = 0; c < half; ++c) {
        const float angle = (float)(from + r) * inv_freq[c];
        float cv = (float)std::cos((double)angle), sv = (float)std::sin((double)angle);
        if (attention_factor != 1.0f) {
          cv *= attention_factor;
          sv *= attention_factor;
        }
        cos[r * hd + c] = cos[r * hd + c + half] = cv;
        sin[r * hd + c] = sin[r * hd + c + half] = sv;
      }
    first = from;
    rows = count;
  }
};

}  // namespace sparsespec
