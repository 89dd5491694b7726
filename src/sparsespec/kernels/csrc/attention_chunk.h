// The chunk kernels of attention.h, written once over an instruction set's primitives. Included by each
// attention_<isa>.cpp after it defines, in its own namespace:
//   float dot(const float* q, const float* k, int n), float dot(const float* q, const uint16_t* k, int n)
//   void axpy(float a, const float* v, float* y, int n), void axpy(float a, const uint16_t* v, float* y, int n)
//   float exp_sum(float* x, int n, float m): x = exp(x - m) in place (0 where x = -inf), returns their sum
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "attention.h"

namespace sparsespec {
namespace ATTN_ISA {

constexpr int kMaxHeadDim = 256;

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {
  const uint32_t bits = (uint32_t)x << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline bool sees(const AttnChunk& a, int s) { return s <= a.last_slot && a.evicted_at[s] == kNever; }

// key(s) rotated by its rank: x * cos + rotate_half(x) * sin, in float32 (the arena's Rope, Hugging Face layout).
template <class K>
inline void rotate_key(const AttnChunk& a, const K* k, int rank, float* out) {
  const int half = a.hd / 2;
  const float* c = a.cos + (long)rank * a.hd;
  const float* s = a.sin + (long)rank * a.hd;
  for (int j = 0; j < half; ++j) out[j] = to_float(k[j]) * c[j] + (-to_float(k[j + half])) * s[j];
  for (int j = half; j < a.hd; ++j) out[j] = to_float(k[j]) * c[j] + to_float(k[j - half]) * s[j];
}

template <class K>
void logits_impl(const AttnChunk& a, int s0, int s1, float* max_out) {
  const K* keys = static_cast<const K*>(a.keys);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  alignas(64) float rotated[kMaxHeadDim];
  for (int g = 0; g < a.group; ++g) max_out[g] = kNegInf;
  for (int s = s0; s < s1; ++s) {
    if (!sees(a, s)) {
      for (int g = 0; g < a.group; ++g) a.logits[g * a.lds + s] = kNegInf;
      continue;
    }
    const K* k = keys + (long)s * a.hd;
    for (int g = 0; g < a.group; ++g) {
      float logit;
      if (a.ranks) {
        if (g == 0) rotate_key(a, k, a.ranks[s], rotated);
        logit = dot(a.q + g * a.ldq, rotated, a.hd) * a.scale;
      } else {
        logit = dot(a.q + g * a.ldq, k, a.hd) * a.scale;
      }
      a.logits[g * a.lds + s] = logit;
      max_out[g] = std::max(max_out[g], logit);
    }
  }
}

template <class K>
void exp_values_impl(const AttnChunk& a, int s0, int s1, const float* m, float* sum_out, float* out) {
  const K* values = static_cast<const K*>(a.values);
  for (int g = 0; g < a.group; ++g) sum_out[g] = exp_sum(a.logits + g * a.lds + s0, s1 - s0, m[g]);
  std::memset(out, 0, sizeof(float) * a.group * a.hd);
  for (int s = s0; s < s1; ++s) {
    if (!sees(a, s)) continue;
    const K* v = values + (long)s * a.hd;
    for (int g = 0; g < a.group; ++g) axpy(a.logits[g * a.lds + s], v, out + g * a.hd, a.hd);
  }
}

inline void logits_chunk(const AttnChunk& a, int s0, int s1, float* max_out) {
  if (a.bf16) logits_impl<uint16_t>(a, s0, s1, max_out);
  else logits_impl<float>(a, s0, s1, max_out);
}

inline void exp_values_chunk(const AttnChunk& a, int s0, int s1, const float* m, float* sum_out, float* out) {
  if (a.bf16) exp_values_impl<uint16_t>(a, s0, s1, m, sum_out, out);
  else exp_values_impl<float>(a, s0, s1, m, sum_out, out);
}

}  // namespace ATTN_ISA
}  // namespace sparsespec
