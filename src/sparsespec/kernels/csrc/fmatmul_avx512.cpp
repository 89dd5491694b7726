// Float-activation matmul (fmatmul.h), AVX-512: a group of 16 inputs per zmm; several weight rows share each load
// of the activations, and each weight row's dequantized group serves several activation rows.
#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2,f16c")
#include <immintrin.h>

#include "fmatmul.h"
#include "scales_x86.h"

namespace sparsespec {
namespace {

// A quarter's codes as int32 lanes: `lo` holds the bytes 0 .. 15, `hi` the bytes 16 .. 31 (8-bit codes: the
// quarter's 64 signed bytes are read per group instead).
struct QuarterCodes {
  __m512i lo, hi;
  uint64_t plane4, plane5;  // bits 4 and 5 of the 64 codes (5- and 6-bit formats)
};

template <int TYPE>
inline void load_quarter(const uint8_t* q, QuarterCodes& out) {
  constexpr int bits = bits_of<TYPE>();
  if constexpr (bits != 8) {
    out.lo = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
    out.hi = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + 16)));
    if constexpr (bits >= 5) __builtin_memcpy(&out.plane4, q + 32, 8);
    if constexpr (bits >= 6) __builtin_memcpy(&out.plane5, q + 40, 8);
  }
}

// Group t's 16 codes (inputs 16t .. 16t + 15 of the quarter at q) as floats.
template <int TYPE>
inline __m512 group_codes(const uint8_t* q, const QuarterCodes& quarter, int t) {
  constexpr int bits = bits_of<TYPE>();
  if constexpr (bits == 8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 16 * t))));
  } else {
    const __m512i bytes = (t & 1) ? quarter.hi : quarter.lo;
    __m512i codes = t < 2 ? _mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)) : _mm512_srli_epi32(bytes, 4);
    if constexpr (bits >= 5)
      codes = _mm512_mask_or_epi32(codes, (__mmask16)(quarter.plane4 >> (16 * t)), codes, _mm512_set1_epi32(16));
    if constexpr (bits >= 6)
      codes = _mm512_mask_or_epi32(codes, (__mmask16)(quarter.plane5 >> (16 * t)), codes, _mm512_set1_epi32(32));
    return _mm512_cvtepi32_ps(codes);
  }
}

// Canonical 16-lane sum (scales_x86.h).
inline float hsum(__m512 v) { return sparsespec::hsum(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); }

// Weight rows n0 .. n0 + NC - 1 against activation rows r0 .. r0 + R - 1.
template <int TYPE, int NC, int R>
inline void tile(const uint8_t* w, std::size_t rb, int k, int n0, int r0, const float* x, long ldx,
                 const float* bias, float* out, long ldo) {
  constexpr int SB = scale_bytes_of<TYPE>();
  constexpr int QB = quarter_bytes_of<TYPE>();
  __m512 acc[NC][R];
#pragma GCC unroll 16
  for (int j = 0; j < NC; ++j)
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) acc[j][i] = _mm512_setzero_ps();
  ChunkScales sc[NC];
  for (int c = 0; c < chunks_of(k); ++c) {
    const uint8_t* chunk[NC];
#pragma GCC unroll 16
    for (int j = 0; j < NC; ++j) {
      chunk[j] = w + (std::size_t)(n0 + j) * rb + (std::size_t)c * chunk_bytes_of<TYPE>();
      prefetch_ahead(chunk[j], chunk_bytes_of<TYPE>());
      decode_scales_x86<TYPE>(chunk[j], sc[j]);
    }
    const int nq = quarters_in(k, c);
    for (int p = 0; p < nq; ++p) {
      QuarterCodes quarter[NC];
#pragma GCC unroll 16
      for (int j = 0; j < NC; ++j) load_quarter<TYPE>(chunk[j] + SB + p * QB, quarter[j]);
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        const int g = 4 * p + t;
        const long at = (long)c * kChunk + p * kQuarter + 16 * t;
        __m512 xv[R];
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) xv[i] = _mm512_loadu_ps(x + (long)(r0 + i) * ldx + at);
#pragma GCC unroll 16
        for (int j = 0; j < NC; ++j) {
          const __m512 wv = _mm512_fmadd_ps(group_codes<TYPE>(chunk[j] + SB + p * QB, quarter[j], t),
                                            _mm512_set1_ps(sc[j].a[g]), _mm512_set1_ps(sc[j].c[g]));
#pragma GCC unroll 16
          for (int i = 0; i < R; ++i) acc[j][i] = _mm512_fmadd_ps(wv, xv[i], acc[j][i]);
        }
      }
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < NC; ++j)
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      float y = hsum(acc[j][i]);
      if (bias) y += bias[n0 + j];
      out[(long)(r0 + i) * ldo + n0 + j] = y;
    }
}

// Activation rows in blocks of R for weight rows n0 .. n0 + NC - 1.
template <int TYPE, int NC, int R>
inline void rows_block(const uint8_t* w, std::size_t rb, int k, int n0, int m, const float* x, long ldx,
                       const float* bias, float* out, long ldo) {
  int r = 0;
  for (; r + R <= m; r += R) tile<TYPE, NC, R>(w, rb, k, n0, r, x, ldx, bias, out, ldo);
  switch (m - r) {
    case 3: if constexpr (R > 3) tile<TYPE, NC, 3>(w, rb, k, n0, r, x, ldx, bias, out, ldo); break;
    case 2: if constexpr (R > 2) tile<TYPE, NC, 2>(w, rb, k, n0, r, x, ldx, bias, out, ldo); break;
    case 1: if constexpr (R > 1) tile<TYPE, NC, 1>(w, rb, k, n0, r, x, ldx, bias, out, ldo); break;
    default: break;
  }
}

template <int TYPE>
void rows_avx512(const uint8_t* w, int k, int n_begin, int n_end, const float* x, int m, long ldx, const float* bias,
                 float* out, long ldo) {
  const std::size_t rb = row_bytes_of<TYPE>(k);
  int n = n_begin;
  if (m == 1) {  // one row: four weight rows at a time keep four independent sums in flight
    for (; n + 4 <= n_end; n += 4) tile<TYPE, 4, 1>(w, rb, k, n, 0, x, ldx, bias, out, ldo);
  } else {
    for (; n + 2 <= n_end; n += 2) rows_block<TYPE, 2, 4>(w, rb, k, n, m, x, ldx, bias, out, ldo);
  }
  for (; n < n_end; ++n) rows_block<TYPE, 1, 4>(w, rb, k, n, m, x, ldx, bias, out, ldo);
}

// Sixteen inputs of a float weight's row from `at` as floats (exact for every type).
template <int TYPE>
inline __m512 float_weights(const uint8_t* at) {
  if constexpr (TYPE == F32) {
    return _mm512_loadu_ps((const float*)at);
  } else if constexpr (TYPE == F16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)at));
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)at)), 16));
  }
}

// Float weight rows n0 .. n0 + NC - 1 against activation rows r0 .. r0 + R - 1.
template <int TYPE, int NC, int R>
inline void float_tile(const uint8_t* w, std::size_t rb, int k, int n0, int r0, const float* x, long ldx,
                       const float* bias, float* out, long ldo) {
  constexpr int E = float_type_bytes(TYPE);
  __m512 acc[NC][R];
#pragma GCC unroll 16
  for (int j = 0; j < NC; ++j)
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) acc[j][i] = _mm512_setzero_ps();
  for (int at = 0; at < k; at += 16) {
    __m512 xv[R];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) xv[i] = _mm512_loadu_ps(x + (long)(r0 + i) * ldx + at);
#pragma GCC unroll 16
    for (int j = 0; j < NC; ++j) {
      const uint8_t* from = w + (std::size_t)(n0 + j) * rb + (std::size_t)at * E;
      if (at % 64 == 0) prefetch_ahead(from, 64 * E);
      const __m512 wv = float_weights<TYPE>(from);
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) acc[j][i] = _mm512_fmadd_ps(wv, xv[i], acc[j][i]);
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < NC; ++j)
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      float y = hsum(acc[j][i]);
      if (bias) y += bias[n0 + j];
      out[(long)(r0 + i) * ldo + n0 + j] = y;
    }
}

template <int TYPE, int NC, int R>
inline void float_rows_block(const uint8_t* w, std::size_t rb, int k, int n0, int m, const float* x, long ldx,
                             const float* bias, float* out, long ldo) {
  int r = 0;
  for (; r + R <= m; r += R) float_tile<TYPE, NC, R>(w, rb, k, n0, r, x, ldx, bias, out, ldo);
  switch (m - r) {
    case 3: if constexpr (R > 3) float_tile<TYPE, NC, 3>(w, rb, k, n0, r, x, ldx, bias, out, ldo); break;
    case 2: if constexpr (R > 2) float_tile<TYPE, NC, 2>(w, rb, k, n0, r, x, ldx, bias, out, ldo); break;
    case 1: if constexpr (R > 1) float_tile<TYPE, NC, 1>(w, rb, k, n0, r, x, ldx, bias, out, ldo); break;
    default: break;
  }
}

template <int TYPE>
void float_rows_avx512(const uint8_t* w, int k, int n_begin, int n_end, const float* x, int m, long ldx,
                       const float* bias, float* out, long ldo) {
  const std::size_t rb = (std::size_t)k * float_type_bytes(TYPE);
  int n = n_begin;
  if (m == 1) {
    for (; n + 4 <= n_end; n += 4) float_tile<TYPE, 4, 1>(w, rb, k, n, 0, x, ldx, bias, out, ldo);
  } else {
    for (; n + 2 <= n_end; n += 2) float_rows_block<TYPE, 2, 4>(w, rb, k, n, m, x, ldx, bias, out, ldo);
  }
  for (; n < n_end; ++n) float_rows_block<TYPE, 1, 4>(w, rb, k, n, m, x, ldx, bias, out, ldo);
}

}  // namespace

void fmatmul_rows_avx512(int type, const uint8_t* w, int k, int n_begin, int n_end, const float* x, int m, long ldx,
                         const float* bias, float* out, long ldo) {
  if (dispatch_float(type, [&] <int T>() {
        float_rows_avx512<T>(w, k, n_begin, n_end, x, m, ldx, bias, out, ldo);
      }))
    return;
  dispatch_type(type, [&] <int T>() { rows_avx512<T>(w, k, n_begin, n_end, x, m, ldx, bias, out, ldo); });
}

}  // namespace sparsespec
#endif
