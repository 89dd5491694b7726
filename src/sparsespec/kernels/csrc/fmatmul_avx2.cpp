// Float-activation matmul (fmatmul.h), AVX2 + FMA: the 16 canonical lanes as two ymm (lanes 0 .. 7 and 8 .. 15);
// each weight row's dequantized group serves up to four activation rows.
#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "fmatmul.h"
#include "scales_x86.h"

namespace sparsespec {
namespace {

// Lanes whose bit of `bits` (one per lane, lane 0 the lowest) is set get `value`, the others 0.
inline __m256i bit_lanes(uint32_t bits, int value) {
  const __m256i select = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i set = _mm256_and_si256(_mm256_set1_epi32((int)bits), select);
  return _mm256_and_si256(_mm256_cmpeq_epi32(set, select), _mm256_set1_epi32(value));
}

// Group t's 16 codes (inputs 16t .. 16t + 15 of the quarter at q) as floats: lanes 0 .. 7 and 8 .. 15.
template <int TYPE>
inline void group_codes(const uint8_t* q, int t, __m256& lo, __m256& hi) {
  constexpr int bits = bits_of<TYPE>();
  if constexpr (bits == 8) {
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + 16 * t))));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + 16 * t + 8))));
  } else {
    const uint8_t* bytes = q + 16 * (t & 1);
    __m256i l = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)bytes));
    __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(bytes + 8)));
    if (t < 2) {
      l = _mm256_and_si256(l, _mm256_set1_epi32(0x0F));
      h = _mm256_and_si256(h, _mm256_set1_epi32(0x0F));
    } else {
      l = _mm256_srli_epi32(l, 4);
      h = _mm256_srli_epi32(h, 4);
    }
    for (int plane = 0; plane < bits - 4; ++plane) {
      uint64_t mask;
      __builtin_memcpy(&mask, q + 32 + 8 * plane, 8);
      l = _mm256_or_si256(l, bit_lanes((uint32_t)(mask >> (16 * t)) & 0xFF, 16 << plane));
      h = _mm256_or_si256(h, bit_lanes((uint32_t)(mask >> (16 * t + 8)) & 0xFF, 16 << plane));
    }
    lo = _mm256_cvtepi32_ps(l);
    hi = _mm256_cvtepi32_ps(h);
  }
}

// Weight row n against activation rows r0 .. r0 + R - 1.
template <int TYPE, int R>
inline void tile(const uint8_t* row, int k, int n, int r0, const float* x, long ldx, const float* bias, float* out,
                 long ldo) {
  constexpr int SB = scale_bytes_of<TYPE>();
  constexpr int QB = quarter_bytes_of<TYPE>();
  __m256 lo[R], hi[R];
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
  ChunkScales sc;
  for (int c = 0; c < chunks_of(k); ++c) {
    const uint8_t* chunk = row + (std::size_t)c * chunk_bytes_of<TYPE>();
    prefetch_ahead(chunk, chunk_bytes_of<TYPE>());
    decode_scales_x86<TYPE>(chunk, sc);
    for (int p = 0; p < quarters_in(k, c); ++p) {
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        const int g = 4 * p + t;
        __m256 q_lo, q_hi;
        group_codes<TYPE>(chunk + SB + p * QB, t, q_lo, q_hi);
        const __m256 a = _mm256_set1_ps(sc.a[g]), off = _mm256_set1_ps(sc.c[g]);
        const __m256 w_lo = _mm256_fmadd_ps(q_lo, a, off), w_hi = _mm256_fmadd_ps(q_hi, a, off);
        const long at = (long)c * kChunk + p * kQuarter + 16 * t;
#pragma GCC unroll 4
        for (int i = 0; i < R; ++i) {
          const float* xr = x + (long)(r0 + i) * ldx + at;
          lo[i] = _mm256_fmadd_ps(w_lo, _mm256_loadu_ps(xr), lo[i]);
          hi[i] = _mm256_fmadd_ps(w_hi, _mm256_loadu_ps(xr + 8), hi[i]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i) {
    float y = hsum(lo[i], hi[i]);
    if (bias) y += bias[n];
    out[(long)(r0 + i) * ldo + n] = y;
  }
}

template <int TYPE>
void rows_avx2(const uint8_t* w, int k, int n_begin, int n_end, const float* x, int m, long ldx, const float* bias,
               float* out, long ldo) {
  const std::size_t rb = row_bytes_of<TYPE>(k);
  for (int n = n_begin; n < n_end; ++n) {
    const uint8_t* row = w + (std::size_t)n * rb;
    int r = 0;
    for (; r + 4 <= m; r += 4) tile<TYPE, 4>(row, k, n, r, x, ldx, bias, out, ldo);
    switch (m - r) {
      case 3: tile<TYPE, 3>(row, k, n, r, x, ldx, bias, out, ldo); break;
      case 2: tile<TYPE, 2>(row, k, n, r, x, ldx, bias, out, ldo); break;
      case 1: tile<TYPE, 1>(row, k, n, r, x, ldx, bias, out, ldo); break;
      default: break;
    }
  }
}

// Eight inputs of a float weight's row from `at` as floats (exact for every type).
template <int TYPE>
inline __m256 float_weights(const uint8_t* at) {
  if constexpr (TYPE == F32) {
    return _mm256_loadu_ps((const float*)at);
  } else if constexpr (TYPE == F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)at));
  } else {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)at)), 16));
  }
}

// Float weight row n against activation rows r0 .. r0 + R - 1.
template <int TYPE, int R>
inline void float_tile(const uint8_t* row, int k, int n, int r0, const float* x, long ldx, const float* bias,
                       float* out, long ldo) {
  constexpr int E = float_type_bytes(TYPE);
  __m256 lo[R], hi[R];
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
  for (int at = 0; at < k; at += 16) {
    if (at % 64 == 0) prefetch_ahead(row + (std::size_t)at * E, 64 * E);
    const __m256 w_lo = float_weights<TYPE>(row + (std::size_t)at * E);
    const __m256 w_hi = float_weights<TYPE>(row + (std::size_t)(at + 8) * E);
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      const float* xr = x + (long)(r0 + i) * ldx + at;
      lo[i] = _mm256_fmadd_ps(w_lo, _mm256_loadu_ps(xr), lo[i]);
      hi[i] = _mm256_fmadd_ps(w_hi, _mm256_loadu_ps(xr + 8), hi[i]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i) {
    float y = hsum(lo[i], hi[i]);
    if (bias) y += bias[n];
    out[(long)(r0 + i) * ldo + n] = y;
  }
}

// Float weight rows n0 .. n0 + NC - 1 against activation rows r0 .. r0 + R - 1, for passes of several rows: one half
// of the 16 lanes at a time (lanes 0 .. 7, then 8 .. 15; each lane still sums its inputs in order), so NC x R sums
// stay in registers and every load of weights or activations feeds several of them (the row's second read of its
// weights comes from the cache).
template <int TYPE, int NC, int R>
inline void float_block(const uint8_t* w, std::size_t rb, int k, int n0, int r0, const float* x, long ldx,
                        const float* bias, float* out, long ldo) {
  constexpr int E = float_type_bytes(TYPE);
  __m256 halves[2][NC][R];
  for (int h = 0; h < 2; ++h) {
    __m256 acc[NC][R];
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c)
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) acc[c][i] = _mm256_setzero_ps();
    for (int at = 8 * h; at < k; at += 16) {
      __m256 wv[NC];
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) wv[c] = float_weights<TYPE>(w + (std::size_t)(n0 + c) * rb + (std::size_t)at * E);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        const __m256 xv = _mm256_loadu_ps(x + (long)(r0 + i) * ldx + at);
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) acc[c][i] = _mm256_fmadd_ps(wv[c], xv, acc[c][i]);
      }
    }
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c)
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) halves[h][c][i] = acc[c][i];
  }
#pragma GCC unroll 4
  for (int c = 0; c < NC; ++c)
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      float y = hsum(halves[0][c][i], halves[1][c][i]);
      if (bias) y += bias[n0 + c];
      out[(long)(r0 + i) * ldo + n0 + c] = y;
    }
}

template <int TYPE>
void float_rows_avx2(const uint8_t* w, int k, int n_begin, int n_end, const float* x, int m, long ldx,
                     const float* bias, float* out, long ldo) {
  const std::size_t rb = (std::size_t)k * float_type_bytes(TYPE);
  int n = n_begin;
  if (m > 1) {  // three weight rows at a time; a one-row pass streams its weights once (below)
    for (; n + 3 <= n_end; n += 3) {
      int r = 0;
      for (; r + 4 <= m; r += 4) float_block<TYPE, 3, 4>(w, rb, k, n, r, x, ldx, bias, out, ldo);
      switch (m - r) {
        case 3: float_block<TYPE, 3, 3>(w, rb, k, n, r, x, ldx, bias, out, ldo); break;
        case 2: float_block<TYPE, 3, 2>(w, rb, k, n, r, x, ldx, bias, out, ldo); break;
        case 1: float_block<TYPE, 3, 1>(w, rb, k, n, r, x, ldx, bias, out, ldo); break;
        default: break;
      }
    }
  }
  for (; n < n_end; ++n) {
    const uint8_t* row = w + (std::size_t)n * rb;
    int r = 0;
    for (; r + 4 <= m; r += 4) float_tile<TYPE, 4>(row, k, n, r, x, ldx, bias, out, ldo);
    switch (m - r) {
      case 3: float_tile<TYPE, 3>(row, k, n, r, x, ldx, bias, out, ldo); break;
      case 2: float_tile<TYPE, 2>(row, k, n, r, x, ldx, bias, out, ldo); break;
      case 1: float_tile<TYPE, 1>(row, k, n, r, x, ldx, bias, out, ldo); break;
      default: break;
    }
  }
}

}  // namespace

void fmatmul_rows_avx2(int type, const uint8_t* w, int k, int n_begin, int n_end, const float* x, int m, long ldx,
                       const float* bias, float* out, long ldo) {
  if (dispatch_float(type, [&] <int T>() { float_rows_avx2<T>(w, k, n_begin, n_end, x, m, ldx, bias, out, ldo); }))
    return;
  dispatch_type(type, [&] <int T>() { rows_avx2<T>(w, k, n_begin, n_end, x, m, ldx, bias, out, ldo); });
}

}  // namespace sparsespec
#endif
