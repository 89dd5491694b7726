// Element-wise steps of the decoder layer (torch-free core of ops.cpp's silu_mul).
// No FP-exception semantics are needed here, which lets the compiler turn the clamps into vector min / max (the
// values are the same IEEE operations either way).
#pragma GCC optimize("no-trapping-math")
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "elementwise.h"
#include "parallel.h"

namespace sparsespec {
namespace {

// exp(x) in float32 to about 2 ulp, branch-free so that loops of it vectorize: x = n ln2 + r (two-part ln2), a
// degree-7 polynomial for exp(r), times 2^n as two exact power-of-two factors (so that n may reach 128). Past
// ln(FLT_MAX) the result is +inf, as the true exponential's; below -87 it is exp(-87) (about 1.6e-38, which
// silu's 1 + exp(-g) absorbs exactly as it absorbs the true value).
inline float exp_poly(float x) {
  constexpr float kLogMax = 88.72283935546875f;
  const float xc = std::min(std::max(x, -87.0f), kLogMax);
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t half = (int32_t)n >> 1;
  const int32_t bits1 = (half + 127) << 23, bits2 = ((int32_t)n - half + 127) << 23;
  float scale1, scale2;
  std::memcpy(&scale1, &bits1, 4);
  std::memcpy(&scale2, &bits2, 4);
  const float result = y * scale1 * scale2;
  return x > kLogMax ? std::numeric_limits<float>::infinity() : result;
}

inline float silu(float g) { return g / (1.0f + exp_poly(-g)); }

// GELU with the tanh approximation, as torch computes it in float32: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715
// x^3))).
inline float gelu_tanh(float x) {
  constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
  const float inner = kBeta * (x + kKappa * (x * x * x));
  return 0.5f * x * (1.0f + std::tanh(inner));
}

// Nearest bfloat16, ties to even (finite values and infinities; a NaN stays a NaN unless its payload is only in
// the low 16 bits), branch-free.
inline uint16_t narrow(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace

#if defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void silu_mul_span(const void* gate, const void* up, void* out, int n, bool bf16) {
  if (bf16) {
    const uint16_t* g = static_cast<const uint16_t*>(gate);
    const uint16_t* u = static_cast<const uint16_t*>(up);
    uint16_t* y = static_cast<uint16_t*>(out);
    for (int j = 0; j < n; ++j) y[j] = narrow(bf16_to_float(narrow(silu(bf16_to_float(g[j])))) * bf16_to_float(u[j]));
  } else {
    const float* g = static_cast<const float*>(gate);
    const float* u = static_cast<const float*>(up);
    float* y = static_cast<float*>(out);
    for (int j = 0; j < n; ++j) y[j] = silu(g[j]) * u[j];
  }
}

namespace {

void gelu_mul_span(const void* gate, const void* up, void* out, int n, bool bf16) {
  if (bf16) {
    const uint16_t* g = static_cast<const uint16_t*>(gate);
    const uint16_t* u = static_cast<const uint16_t*>(up);
    uint16_t* y = static_cast<uint16_t*>(out);
    for (int j = 0; j < n; ++j)
      y[j] = narrow(bf16_to_float(narrow(gelu_tanh(bf16_to_float(g[j])))) * bf16_to_float(u[j]));
  } else {
    const float* g = static_cast<const float*>(gate);
    const float* u = static_cast<const float*>(up);
    float* y = static_cast<float*>(out);
    for (int j = 0; j < n; ++j) y[j] = gelu_tanh(g[j]) * u[j];
  }
}

}  // namespace

void gated_rows(const void* gate_up, int64_t m, int64_t inner, bool bf16, bool gelu, void* out) {
  const char* src = static_cast<const char*>(gate_up);
  char* dst = static_cast<char*>(out);
  const std::size_t elt = bf16 ? 2 : 4;
  constexpr int64_t kSpan = 2048;  // elements per task
  const int64_t spans = (inner + kSpan - 1) / kSpan;
  parallel_for(0, m * spans, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / spans, j0 = task % spans * kSpan, n = std::min(kSpan, inner - j0);
      const char* gate = src + (r * 2 * inner + j0) * elt;
      (gelu ? gelu_mul_span : silu_mul_span)(gate, gate + inner * elt, dst + (r * inner + j0) * elt, (int)n, bf16);
    }
  });
}

}  // namespace sparsespec
