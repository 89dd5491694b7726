// The Q4_K column tiles' mins term in AVX-512 (included by the AVX-512 and AMX paths after their target pragmas):
// osum = sum_j mn_j (b_2j + b_2j+1) over a chunk's 8 sub-blocks, per column, as exact int32 (qmatmul.h), with one
// vpmaddwd per two sub-blocks (|mn| <= 63 and |b_2j + b_2j+1| <= 32 * 127 fit 16 bits; the pairs' sums are exact).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace sparsespec {

// pairs[p], per column lane: mn_2p in the low 16 bits, mn_2p+1 in the high (chunk: a Q4_K_T16 chunk).
inline void q4_k_tile_min_pairs(const uint8_t* chunk, __m512i pairs[4]) {
  for (int p = 0; p < 4; ++p) {
    const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(chunk + 192 + 32 * p)));
    const __m512i hi = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(chunk + 192 + 32 * p + 16)));
    pairs[p] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
  }
}

// osum for one activation row, from its 16 group sums of the chunk (b = bsum of the row at the chunk).
inline __m512i q4_k_tile_min_sum(const __m512i pairs[4], const int32_t* b) {
  __m512i osum = _mm512_setzero_si512();
  for (int p = 0; p < 4; ++p) {
    const uint32_t lo = (uint16_t)(b[4 * p] + b[4 * p + 1]), hi = (uint16_t)(b[4 * p + 2] + b[4 * p + 3]);
    osum = _mm512_add_epi32(osum, _mm512_madd_epi16(pairs[p], _mm512_set1_epi32((int)(lo | hi << 16))));
  }
  return osum;
}

}  // namespace sparsespec
