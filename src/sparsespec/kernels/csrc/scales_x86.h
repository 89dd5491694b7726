// Chunk scale decoding with AVX2 + F16C (included by the x86 paths after their target pragmas); the values equal
// formats.h's decode_scales bit for bit (half -> float is exact; the products are the same float products). And the
// canonical horizontal sum of 16 float lanes, which every x86 path ends with.
#pragma once

#include <immintrin.h>

#include "formats.h"

namespace sparsespec {

// Each of 8 floats twice: [v0 v0 v1 v1 v2 v2 v3 v3] and [v4 v4 ... v7 v7].
inline void store_pairs(__m256 v, float* out) {
  const __m256 lo = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
  const __m256 hi = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
  _mm256_store_ps(out, lo);
  _mm256_store_ps(out + 8, hi);
}

// formats.h's canonical_hsum of 16 lanes (lanes 0 .. 7 in lo, 8 .. 15 in hi): i + 8, then i + 4, i + 2, i + 1.
inline float hsum(__m256 lo, __m256 hi) {
  const __m256 s8 = _mm256_add_ps(lo, hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

template <int TYPE>
inline void decode_scales_x86(const uint8_t* s, ChunkScales& out) {
  if constexpr (TYPE == Q4_0 || TYPE == Q5_0 || TYPE == Q8_0) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)s));
    const float bias = TYPE == Q4_0 ? -8.0f : TYPE == Q5_0 ? -16.0f : 0.0f;
    store_pairs(d, out.a);
    store_pairs(_mm256_mul_ps(_mm256_set1_ps(bias), d), out.c);
  } else if constexpr (TYPE == Q4_1 || TYPE == Q5_1) {
    store_pairs(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)s)), out.a);
    store_pairs(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + 16))), out.c);
  } else if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
    const float d = _cvtsh_ss(load_u16(s));
    const float dmin = _cvtsh_ss(load_u16(s + 2));
    const __m128i sc = _mm_loadl_epi64((const __m128i*)(s + 4));
    const __m128i mn = _mm_loadl_epi64((const __m128i*)(s + 12));
    const __m128i sc2 = _mm_unpacklo_epi8(sc, sc), mn2 = _mm_unpacklo_epi8(mn, mn);
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(dmin);
    _mm256_store_ps(out.a, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc2))));
    _mm256_store_ps(out.a + 8, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sc2, 8)))));
    const __m256 sign = _mm256_set1_ps(-0.0f);
    _mm256_store_ps(out.c, _mm256_xor_ps(sign, _mm256_mul_ps(vm, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn2)))));
    _mm256_store_ps(out.c + 8, _mm256_xor_ps(
        sign, _mm256_mul_ps(vm, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(mn2, 8))))));
  } else {  // Q6_K
    const __m256 vd = _mm256_set1_ps(_cvtsh_ss(load_u16(s)));
    const __m128i sc = _mm_loadu_si128((const __m128i*)(s + 2));
    const __m256 a_lo = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
    const __m256 a_hi = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
    const __m256 k = _mm256_set1_ps(-32.0f);
    _mm256_store_ps(out.a, a_lo);
    _mm256_store_ps(out.a + 8, a_hi);
    _mm256_store_ps(out.c, _mm256_mul_ps(k, a_lo));
    _mm256_store_ps(out.c + 8, _mm256_mul_ps(k, a_hi));
  }
}

}  // namespace sparsespec
