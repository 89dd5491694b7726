// Column-tile helpers in AVX-512 (included by the AVX-512 and AMX paths after their target pragmas): the output
// columns of one tile, and the Q4_K tiles' mins term,
// osum = sum_j mn_j (b_2j + b_2j+1) over a chunk's 8 sub-blocks, per column, as exact int32 (qmatmul.h), with one
// vpmaddwd per two sub-blocks (|mn| <= 63 and |b_2j + b_2j+1| <= 32 * 127 fit 16 bits; the pairs' sums are exact).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace sparsespec {

// The lanes of the 16-column tile starting at column n0 that fall inside [n_begin, n_end).
inline __mmask16 tile_column_mask(int n0, int n_begin, int n_end) {
  const int lo = n_begin > n0 ? n_begin - n0 : 0, hi = n_end - n0 < 16 ? n_end - n0 : 16;
  return (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

// out[r0 + i, n0 + c] = y[i][c] (+ bias[n0 + c]) for i < rows and the lanes c in mask.
inline void store_tile_rows(const __m512* y, int rows, int r0, int n0, __mmask16 mask, const float* bias,
                            float* out, long ldo) {
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int i = 0; i < rows; ++i)
    _mm512_mask_storeu_ps(out + (long)(r0 + i) * ldo + n0, mask, bias ? _mm512_add_ps(y[i], b) : y[i]);
}

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
