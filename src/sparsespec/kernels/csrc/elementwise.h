// Element-wise helpers shared by the ops: bfloat16 rounding, and the decoder layer's silu * up (elementwise.cpp).
#pragma once

#include <cstdint>

namespace sparsespec {

// silu(gate[j]) * up[j] for j < n, float32 or bfloat16 (bf16: silu rounded to bfloat16, then the product, as
// torch's silu and mul do); elementwise.cpp.
void silu_mul_span(const void* gate, const void* up, void* out, int n, bool bf16);

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

}  // namespace sparsespec
