// Element-wise helpers shared by the ops: bfloat16 and float16 conversions, and the decoder layer's silu * up
// (elementwise.cpp).
#pragma once

#include <cmath>
#include <cstdint>

namespace sparsespec {

// silu(gate[j]) * up[j] for j < n, float32 or bfloat16 (bf16: silu rounded to bfloat16, then the product, as
// torch's silu and mul do); elementwise.cpp.
void silu_mul_span(const void* gate, const void* up, void* out, int n, bool bf16);

// The gated activation of the decoder's MLP over rows: gate_up [m, 2 i] holds each row's gate and up halves side
// by side; out [m, i] = act(gate) * up, act SiLU or (gelu) GELU with the tanh approximation, float32 or bfloat16
// (each step rounded to bfloat16 as torch's activation and mul round them). Rows and spans split across the team.
void gated_rows(const void* gate_up, int64_t m, int64_t inner, bool bf16, bool gelu, void* out);

// RMS norm of each row of x [m, n] (float32 or bfloat16) times weight [n] (float32 or bfloat16), as torch's fused
// rms_norm computes it: in float32, y = x * (1 / sqrt(mean(x^2) + eps)) * weight, the squares summed in 8 lanes
// in a fixed order; rounded once to x's dtype (norm.cpp). Rows split across the team.
void rms_norm_rows(const void* x, int64_t m, int64_t n, bool bf16, const void* weight, bool weight_bf16, float eps,
                   void* out);

// x rounded to the nearest bfloat16 (ties to even), as a float.
inline float round_bf16(float x) {
  uint32_t bits;
  __builtin_memcpy(&bits, &x, 4);
  if ((bits & 0x7f800000u) == 0x7f800000u) {  // inf, nan: keep (nan stays nan)
    bits &= 0xffff0000u | ((bits & 0xffffu) ? 0x00400000u : 0u);
  } else {
    bits += 0x7fffu + ((bits >> 16) & 1u);
    bits &= 0xffff0000u;
  }
  float out;
  __builtin_memcpy(&out, &bits, 4);
  return out;
}

// A bfloat16 (its 16 bits) widened to float32 (exact).
inline float bf16_to_float(uint16_t x) {
  const uint32_t bits = (uint32_t)x << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

// The bits of x rounded to the nearest bfloat16 (ties to even).
inline uint16_t float_to_bf16(float x) {
  const float r = round_bf16(x);
  uint32_t bits;
  __builtin_memcpy(&bits, &r, 4);
  return (uint16_t)(bits >> 16);
}

// A float16 (its 16 bits) widened to float32 (exact; subnormals, infinities and nan included).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else {
    const float magnitude = (float)mantissa * 0x1p-24f;  // subnormal (or zero): mantissa * 2^-24, exact
    __builtin_memcpy(&bits, &magnitude, 4);
    bits |= sign;
  }
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

// The bits of x rounded to the nearest float16 (ties to even; beyond the largest finite value: infinity), as
// torch's float32 -> float16 conversion.
inline uint16_t float_to_half(float x) {
  uint32_t bits;
  __builtin_memcpy(&bits, &x, 4);
  const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
  bits &= 0x7fffffffu;
  if (bits >= 0x7f800000u) return sign | 0x7c00u | (bits > 0x7f800000u ? 0x200u : 0u);  // inf, nan
  if (bits >= 0x477ff000u) return sign | 0x7c00u;  // 65520 and above round to infinity
  if (bits < 0x38800000u) {  // below 2^-14: a subnormal float16, round(|x| * 2^24) units of 2^-24
    float magnitude;
    __builtin_memcpy(&magnitude, &bits, 4);
    return sign | (uint16_t)std::nearbyint(magnitude * 0x1p24f);
  }
  bits += 0xfffu + ((bits >> 13) & 1u);  // round the 13 dropped mantissa bits to nearest even
  return sign | (uint16_t)((bits - 0x38000000u) >> 13);
}

}  // namespace sparsespec
