// Portable scalar attention kernels (plain sequential sums; the path every CPU has).
#include <cmath>
#include <cstdint>

#include "attention.h"

#define ATTN_ISA attn_scalar
namespace sparsespec {
namespace attn_scalar {

inline float to_f(float x) { return x; }
inline float to_f(uint16_t x) {
  const uint32_t bits = (uint32_t)x << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

template <class K>
inline float dot(const float* q, const K* k, int n) {
  float acc = 0.0f;
  for (int j = 0; j < n; ++j) acc += q[j] * to_f(k[j]);
  return acc;
}

template <class K>
inline void axpy(float a, const K* v, float* y, int n) {
  for (int j = 0; j < n; ++j) y[j] += a * to_f(v[j]);
}

inline void dequantize_row(const uint8_t* codes, const uint16_t* params, int hd, int bits, int code_group,
                           float* out) {
  dequantize_row_scalar(codes, params, hd, bits, code_group, out);
}

inline float exp_sum(float* x, int n, float m) {
  float acc = 0.0f;
  for (int j = 0; j < n; ++j) {
    x[j] = std::exp(x[j] - m);
    acc += x[j];
  }
  return acc;
}

}  // namespace attn_scalar
}  // namespace sparsespec

#include "attention_chunk.h"

namespace sparsespec {

const AttnKernels& attention_kernels_scalar() {
  static const AttnKernels kernels{&attn_scalar::logits_chunk, &attn_scalar::exp_values_chunk};
  return kernels;
}

}  // namespace sparsespec
