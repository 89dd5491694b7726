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

}  // namespace sparsespec
