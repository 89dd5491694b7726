// Pieces shared by the NEON paths (included by them after their target pragmas): a quarter's codes in four int8x16
// vectors (vector v: the quarter's group v of 16 inputs) and the canonical horizontal sum of 16 float lanes.
#pragma once

#include <arm_neon.h>

#include "formats.h"

namespace sparsespec {

// 16 bits -> 16 bytes, byte j = value where bit j is set, else 0.
inline int8x16_t expand_bits(uint16_t bits, int8_t value) {
  const uint8x16_t spread = vcombine_u8(vdup_n_u8((uint8_t)bits), vdup_n_u8((uint8_t)(bits >> 8)));
  const uint8x16_t select = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  return vandq_s8(vreinterpretq_s8_u8(vtstq_u8(spread, select)), vdupq_n_s8(value));
}

// The 64 codes of the quarter at q: codes[v] holds group v (inputs 16v .. 16v + 15), signed for Q8_0.
template <int TYPE>
inline void load_codes(const uint8_t* q, int8x16_t codes[4]) {
  constexpr int bits = bits_of<TYPE>();
  if constexpr (bits == 8) {
    for (int v = 0; v < 4; ++v) codes[v] = vld1q_s8((const int8_t*)q + 16 * v);
  } else {
    const uint8x16_t low = vdupq_n_u8(0x0F);
    const uint8x16_t n0 = vld1q_u8(q), n1 = vld1q_u8(q + 16);
    codes[0] = vreinterpretq_s8_u8(vandq_u8(n0, low));
    codes[1] = vreinterpretq_s8_u8(vandq_u8(n1, low));
    codes[2] = vreinterpretq_s8_u8(vshrq_n_u8(n0, 4));
    codes[3] = vreinterpretq_s8_u8(vshrq_n_u8(n1, 4));
    for (int plane = 0; plane < bits - 4; ++plane) {
      uint16_t part[4];
      __builtin_memcpy(part, q + 32 + 8 * plane, 8);
      for (int v = 0; v < 4; ++v) codes[v] = vorrq_s8(codes[v], expand_bits(part[v], (int8_t)(0x10 << plane)));
    }
  }
}

// formats.h's canonical_hsum of 16 lanes (lanes 4v .. 4v + 3 in v[v]): i + 8, then i + 4, i + 2, i + 1.
inline float hsum(const float32x4_t v[4]) {
  const float32x4_t s8a = vaddq_f32(v[0], v[2]), s8b = vaddq_f32(v[1], v[3]);
  const float32x4_t s4 = vaddq_f32(s8a, s8b);
  const float32x2_t s2 = vadd_f32(vget_low_f32(s4), vget_high_f32(s4));
  return vget_lane_f32(s2, 0) + vget_lane_f32(s2, 1);
}

}  // namespace sparsespec
