// x86 AVX-512 VNNI path: one 64-code quarter per zmm, vpdpbusd integer dots, the canonical float steps.
#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,avx2,f16c")
#include <immintrin.h>

#include "quantize.h"
#include "scales_x86.h"
#include "tiles_avx512.h"

namespace sparsespec {
namespace {

// The 64 codes of a quarter in one zmm (byte j = code j).
template <int TYPE>
inline __m512i load_codes(const uint8_t* q) {
  constexpr int bits = bits_of<TYPE>();
  if constexpr (bits == 8) {
    return _mm512_loadu_si512(q);
  } else {
    const __m256i nib = _mm256_loadu_si256((const __m256i*)q);
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(nib, low);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(nib, 4), low);
    __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    if constexpr (bits >= 5) {
      uint64_t plane;
      __builtin_memcpy(&plane, q + 32, 8);
      codes = _mm512_or_si512(codes, _mm512_maskz_mov_epi8(plane, _mm512_set1_epi8(0x10)));
    }
    if constexpr (bits >= 6) {
      uint64_t plane;
      __builtin_memcpy(&plane, q + 40, 8);
      codes = _mm512_or_si512(codes, _mm512_maskz_mov_epi8(plane, _mm512_set1_epi8(0x20)));
    }
    return codes;
  }
}

// A chunk's per-group scales a and offsets c straight into registers (the values of formats.h's decode_scales).
template <int TYPE>
inline void chunk_scales(const uint8_t* s, __m512& a16, __m512& c16) {
  const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  if constexpr (TYPE == Q4_0 || TYPE == Q5_0 || TYPE == Q8_0) {
    a16 = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)s))));
    const float bias = TYPE == Q4_0 ? -8.0f : TYPE == Q5_0 ? -16.0f : 0.0f;
    c16 = _mm512_mul_ps(_mm512_set1_ps(bias), a16);
  } else if constexpr (TYPE == Q4_1 || TYPE == Q5_1) {
    a16 = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)s))));
    c16 = _mm512_permutexvar_ps(
        pairs, _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + 16)))));
  } else if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
    const __m128i sc = _mm_loadl_epi64((const __m128i*)(s + 4));
    const __m128i mn = _mm_loadl_epi64((const __m128i*)(s + 12));
    const __m512 sc16 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(sc, sc)));
    const __m512 mn16 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(mn, mn)));
    a16 = _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(load_u16(s))), sc16);
    c16 = _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(_mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(load_u16(s + 2))), mn16)),
        _mm512_set1_epi32((int)0x80000000u)));
  } else {  // Q6_K
    a16 = _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(load_u16(s))),
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(s + 2)))));
    c16 = _mm512_mul_ps(_mm512_set1_ps(-32.0f), a16);
  }
}

// Canonical 16-lane sum (scales_x86.h).
inline float hsum(__m512 v) { return sparsespec::hsum(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); }

// One weight row against MT activation rows starting at r0.
template <int TYPE, int MT>
inline void row_tile(const uint8_t* row, int k, int r0, const Activations& act, const float* bias, int n, float* out,
                     long ldo) {
  constexpr int SB = scale_bytes_of<TYPE>();
  constexpr int QB = quarter_bytes_of<TYPE>();
  const int n_chunks = chunks_of(k);
  __m512 acc[MT], off[MT];
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) acc[i] = off[i] = _mm512_setzero_ps();
  for (int c = 0; c < n_chunks; ++c) {
    const uint8_t* chunk = row + (std::size_t)c * chunk_bytes_of<TYPE>();
    prefetch_ahead(chunk, chunk_bytes_of<TYPE>());
    __m512 a16, c16;
    chunk_scales<TYPE>(chunk, a16, c16);
    const int nq = quarters_in(k, c);
    for (int p = 0; p < nq; ++p) {
      const __m512i codes = load_codes<TYPE>(chunk + SB + p * QB);
      const __m512i group = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
      const __m512 a_lanes = _mm512_permutexvar_ps(_mm512_add_epi32(group, _mm512_set1_epi32(4 * p)), a16);
      const int base = c * kChunk + p * kQuarter;
      __m512i ucodes = codes;
      __mmask64 negative = 0;
      if constexpr (!has_offsets<TYPE>()) {  // signed codes: |q| times x with q's sign
        ucodes = _mm512_abs_epi8(codes);
        negative = _mm512_movepi8_mask(codes);
      }
#pragma GCC unroll 8
      for (int i = 0; i < MT; ++i) {
        const long r = r0 + i;
        __m512i x = _mm512_loadu_si512(act.q + r * act.k_pad + base);
        if constexpr (!has_offsets<TYPE>()) x = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ucodes, x);
        const __m512 dx_lanes = _mm512_loadu_ps(act.dxl + r * (act.k_pad / 4) + base / 4);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(a_lanes, dx_lanes), acc[i]);
      }
    }
    if constexpr (has_offsets<TYPE>()) {
#pragma GCC unroll 8
      for (int i = 0; i < MT; ++i) {
        const __m512 ds = _mm512_loadu_ps(act.ds + (long)(r0 + i) * (act.k_pad / 16) + c * 16);
        off[i] = _mm512_fmadd_ps(c16, ds, off[i]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) {
    float y = hsum(acc[i]) + hsum(off[i]);
    if (bias) y += bias[n];
    out[(long)(r0 + i) * ldo + n] = y;
  }
}

// K-quants: whole chunks accumulate in int32 (qmatmul.h), one float step per chunk and row.
template <int TYPE, int MT>
inline void row_tile_k(const uint8_t* row, int k, int r0, const Activations& act, const float* bias, int n,
                       float* out, long ldo) {
  constexpr int SB = scale_bytes_of<TYPE>();
  constexpr int QB = quarter_bytes_of<TYPE>();
  const int n_chunks = chunks_of(k);
  const long chunks_per_row = act.k_pad / kChunk;
  const __m512i group = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[MT], off[MT];
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) acc[i] = off[i] = _mm512_setzero_ps();
  for (int c = 0; c < n_chunks; ++c) {
    const uint8_t* chunk = row + (std::size_t)c * chunk_bytes_of<TYPE>();
    prefetch_ahead(chunk, chunk_bytes_of<TYPE>());
    __m512i s16, o16;  // per-group integer scales, and the offset multipliers (mins, or Q6_K's -32 s)
    float d, dmin = 0.0f;
    if constexpr (TYPE == Q6_K) {
      d = _cvtsh_ss(load_u16(chunk));
      s16 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(chunk + 2)));
      o16 = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(s16, 5));
    } else {
      d = _cvtsh_ss(load_u16(chunk));
      dmin = _cvtsh_ss(load_u16(chunk + 2));
      const __m128i sc = _mm_loadl_epi64((const __m128i*)(chunk + 4));
      const __m128i mn = _mm_loadl_epi64((const __m128i*)(chunk + 12));
      s16 = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(sc, sc));
      o16 = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(mn, mn));
    }
    __m512i isum[MT];
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) isum[i] = _mm512_setzero_si512();
    // Each group's scale in both 16-bit halves of its int32: vpdpwssd then adds s * (pair 0) + s * (pair 1) of
    // maddubs' sums, the lane's dot times s, exactly (|pair| <= 2 * 63 * 127, |s| <= 128).
    const __m512i s_pairs16 =
        _mm512_or_si512(_mm512_and_si512(s16, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(s16, 16));
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512i codes = load_codes<TYPE>(chunk + SB + p * QB);
      const __m512i s_pairs = _mm512_permutexvar_epi32(_mm512_add_epi32(group, _mm512_set1_epi32(4 * p)), s_pairs16);
      const int base = c * kChunk + p * kQuarter;
#pragma GCC unroll 8
      for (int i = 0; i < MT; ++i) {
        const __m512i x = _mm512_loadu_si512(act.q256 + (long)(r0 + i) * act.k_pad + base);
        isum[i] = _mm512_dpwssd_epi32(isum[i], _mm512_maddubs_epi16(codes, x), s_pairs);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      const long r = r0 + i;
      const float d256 = act.d256[r * chunks_per_row + c];
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_set1_ps(d * d256), acc[i]);
      const __m512i b = _mm512_loadu_si512(act.bsum + r * (act.k_pad / 16) + c * 16);
      const __m512 factor = _mm512_set1_ps(TYPE == Q6_K ? d * d256 : -dmin * d256);
      off[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_mullo_epi32(o16, b)), factor, off[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) {
    float y = hsum(acc[i]) + hsum(off[i]);
    if (bias) y += bias[n];
    out[(long)(r0 + i) * ldo + n] = y;
  }
}

template <int TYPE, int MT>
inline void run_tile(const uint8_t* row, int k, int r0, const Activations& act, const float* bias, int n, float* out,
                 long ldo) {
  if constexpr (TYPE == Q4_K || TYPE == Q5_K || TYPE == Q6_K)
    row_tile_k<TYPE, MT>(row, k, r0, act, bias, n, out, ldo);
  else
    row_tile<TYPE, MT>(row, k, r0, act, bias, n, out, ldo);
}

template <int TYPE>
void rows_avx512(const uint8_t* w, int k, int n_begin, int n_end, const Activations& act, const float* bias,
                 float* out, long ldo) {
  const std::size_t rb = row_bytes_of<TYPE>(k);
  constexpr int kRowBlock = 16;  // weight rows kept hot in cache while every activation tile passes over them
  for (int n0 = n_begin; n0 < n_end; n0 += kRowBlock) {
    const int n1 = n0 + kRowBlock < n_end ? n0 + kRowBlock : n_end;
    for (int r = 0; r < act.m; r += 8) {
      const int tile = act.m - r < 8 ? act.m - r : 8;  // all rows of a verification block (<= 8) in one pass
      for (int n = n0; n < n1; ++n) {
        const uint8_t* row = w + n * rb;
        switch (tile) {
          case 1: run_tile<TYPE, 1>(row, k, r, act, bias, n, out, ldo); break;
          case 2: run_tile<TYPE, 2>(row, k, r, act, bias, n, out, ldo); break;
          case 3: run_tile<TYPE, 3>(row, k, r, act, bias, n, out, ldo); break;
          case 4: run_tile<TYPE, 4>(row, k, r, act, bias, n, out, ldo); break;
          case 5: run_tile<TYPE, 5>(row, k, r, act, bias, n, out, ldo); break;
          case 6: run_tile<TYPE, 6>(row, k, r, act, bias, n, out, ldo); break;
          case 7: run_tile<TYPE, 7>(row, k, r, act, bias, n, out, ldo); break;
          default: run_tile<TYPE, 8>(row, k, r, act, bias, n, out, ldo); break;
        }
      }
    }
  }
}

// Four activations broadcast to every lane (one column's 4 inputs in each).
typedef int32_t unaligned_i32 __attribute__((aligned(1), may_alias));
inline __m512i quad(const int8_t* x) { return _mm512_set1_epi32(*(const unaligned_i32*)x); }

// Column tiles (qmatmul.h): one zmm lane per column. Per sub-block / group and activation row: the integer dots
// (vpdpbusd with the row's 4 activations broadcast), one multiply by the 16 columns' scales; per chunk and row the
// float steps. Results go to y[i] (16 columns of row r0 + i).
template <int TYPE, int MT>
inline void tile_pass(const uint8_t* tile, int n_chunks, int r0, const Activations& act, __m512 y[MT]) {
  const long per_row16 = act.k_pad / 16, per_row256 = act.k_pad / kChunk;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MT], off[MT];
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) acc[i] = off[i] = _mm512_setzero_ps();
  for (int ch = 0; ch < n_chunks; ++ch) {
    const uint8_t* chunk = tile + (std::size_t)ch * tile_chunk_bytes_of<TYPE>();
    const uint8_t* pairs = chunk + tile_scale_bytes_of<TYPE>();
    if constexpr (MT > 1) prefetch_ahead(chunk, tile_chunk_bytes_of<TYPE>());  // formats.h: not for one row
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)chunk));
    __m512i isum[MT], osum[MT];
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) isum[i] = osum[i] = _mm512_setzero_si512();
    if constexpr (TYPE == Q4_K_T16) {
      for (int j = 0; j < 8; ++j) {
        const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(chunk + 64 + 16 * j)));
        __m512i z[8];
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) {
          const __m512i packed = _mm512_loadu_si512(pairs + 64 * (4 * j + p));
          z[2 * p] = _mm512_and_si512(packed, low4);
          z[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
        }
#pragma GCC unroll 8
        for (int i = 0; i < MT; ++i) {
          const int8_t* x = act.q256 + (long)(r0 + i) * act.k_pad + ch * kChunk + 32 * j;
          __m512i dot0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z[0], quad(x));
          __m512i dot1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z[1], quad(x + 4));
          dot0 = _mm512_dpbusd_epi32(dot0, z[2], quad(x + 8));
          dot1 = _mm512_dpbusd_epi32(dot1, z[3], quad(x + 12));
          dot0 = _mm512_dpbusd_epi32(dot0, z[4], quad(x + 16));
          dot1 = _mm512_dpbusd_epi32(dot1, z[5], quad(x + 20));
          dot0 = _mm512_dpbusd_epi32(dot0, z[6], quad(x + 24));
          dot1 = _mm512_dpbusd_epi32(dot1, z[7], quad(x + 28));
          isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(_mm512_add_epi32(dot0, dot1), sc));
        }
      }
      __m512i mn_pairs[4];  // the mins' terms, apart so that the loop above keeps its registers
      q4_k_tile_min_pairs(chunk, mn_pairs);
#pragma GCC unroll 8
      for (int i = 0; i < MT; ++i)
        osum[i] = q4_k_tile_min_sum(mn_pairs, act.bsum + (long)(r0 + i) * per_row16 + ch * 16);
    } else {  // Q6_K_T16
      const __m512i two = _mm512_set1_epi8(0x30);
      for (int g = 0; g < 16; ++g) {
        const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(chunk + 32 + 16 * g)));
        const uint8_t* group = pairs + kTileGroupBytes * g;
        const __m512i p0 = _mm512_loadu_si512(group);
        const __m512i p1 = _mm512_loadu_si512(group + 64);
        const __m512i h = _mm512_loadu_si512(group + 128);
        const __m512i z0 = _mm512_or_si512(_mm512_and_si512(p0, low4),
                                           _mm512_and_si512(_mm512_slli_epi16(h, 4), two));
        const __m512i z1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(p0, 4), low4),
                                           _mm512_and_si512(_mm512_slli_epi16(h, 2), two));
        const __m512i z2 = _mm512_or_si512(_mm512_and_si512(p1, low4), _mm512_and_si512(h, two));
        const __m512i z3 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(p1, 4), low4),
                                           _mm512_and_si512(_mm512_srli_epi16(h, 2), two));
#pragma GCC unroll 8
        for (int i = 0; i < MT; ++i) {
          const int8_t* x = act.q256 + (long)(r0 + i) * act.k_pad + ch * kChunk + 16 * g;
          __m512i dot0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z0, quad(x));
          __m512i dot1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z1, quad(x + 4));
          dot0 = _mm512_dpbusd_epi32(dot0, z2, quad(x + 8));
          dot1 = _mm512_dpbusd_epi32(dot1, z3, quad(x + 12));
          const int32_t b = act.bsum[(long)(r0 + i) * per_row16 + ch * 16 + g];
          const __m512i t = _mm512_sub_epi32(_mm512_add_epi32(dot0, dot1), _mm512_set1_epi32(32 * b));
          isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(t, sc));
        }
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      const __m512 D = _mm512_set1_ps(act.d256[(long)(r0 + i) * per_row256 + ch]);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_mul_ps(d, D), acc[i]);
      if constexpr (TYPE == Q4_K_T16) {
        const __m512 neg_dmin = _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(chunk + 32)))),
            _mm512_set1_epi32((int)0x80000000u)));
        off[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(osum[i]), _mm512_mul_ps(neg_dmin, D), off[i]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) y[i] = _mm512_add_ps(acc[i], off[i]);
}

// Q5_0_T16 (qmatmul.h): vector V of a chunk's codes (inputs 4V .. 4V + 3 of 16 columns) from its pair of
// nibbles and the chunk's high bits (bit V of each byte).
template <int V>
inline __m512i q5_codes(__m512i pair, __m512i high) {
  const __m512i nibbles = V % 2 ? _mm512_srli_epi16(pair, 4) : pair;
  __m512i bit = high;  // bit V of each byte moved to bit 4
  if constexpr (V < 4) bit = _mm512_slli_epi16(high, 4 - V);
  if constexpr (V > 4) bit = _mm512_srli_epi16(high, V - 4);
  return _mm512_or_si512(_mm512_and_si512(nibbles, _mm512_set1_epi8(0x0F)),
                         _mm512_and_si512(bit, _mm512_set1_epi8(0x10)));
}

// Q5_0_T16 tiles: per chunk (one block of 32 inputs) 8 vectors of codes, 8 vpdpbusd per activation row for 16
// columns, then the block's float step. Results go to y[i] (16 columns of row r0 + i).
template <int MT>
inline void q5_0_tile_pass(const uint8_t* tile, int n_chunks, int r0, const Activations& act, __m512 y[MT]) {
  const long per_row32 = act.k_pad / kActBlock;
  __m512 acc[MT];
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
  for (int ch = 0; ch < n_chunks; ++ch) {
    const uint8_t* chunk = tile + (std::size_t)ch * tile_chunk_bytes_of<Q5_0_T16>();
    if constexpr (MT > 1) prefetch_ahead(chunk, tile_chunk_bytes_of<Q5_0_T16>());  // formats.h: not for one row
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)chunk));
    const __m512i high = _mm512_loadu_si512(chunk + kTileQ5HighBytes);
    const uint8_t* pairs = chunk + tile_scale_bytes_of<Q5_0_T16>();
    const __m512i p0 = _mm512_loadu_si512(pairs), p1 = _mm512_loadu_si512(pairs + 64);
    const __m512i p2 = _mm512_loadu_si512(pairs + 128), p3 = _mm512_loadu_si512(pairs + 192);
    const __m512i z0 = q5_codes<0>(p0, high), z1 = q5_codes<1>(p0, high), z2 = q5_codes<2>(p1, high),
                  z3 = q5_codes<3>(p1, high), z4 = q5_codes<4>(p2, high), z5 = q5_codes<5>(p2, high),
                  z6 = q5_codes<6>(p3, high), z7 = q5_codes<7>(p3, high);
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      const long at = (long)(r0 + i) * per_row32 + ch;
      const int8_t* x = act.q + at * kActBlock;
      __m512i dot0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z0, quad(x));
      __m512i dot1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z1, quad(x + 4));
      dot0 = _mm512_dpbusd_epi32(dot0, z2, quad(x + 8));
      dot1 = _mm512_dpbusd_epi32(dot1, z3, quad(x + 12));
      dot0 = _mm512_dpbusd_epi32(dot0, z4, quad(x + 16));
      dot1 = _mm512_dpbusd_epi32(dot1, z5, quad(x + 20));
      dot0 = _mm512_dpbusd_epi32(dot0, z6, quad(x + 24));
      dot1 = _mm512_dpbusd_epi32(dot1, z7, quad(x + 28));
      const __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(dot0, dot1), _mm512_set1_epi32(16 * act.xsum[at]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(act.dx[at])), acc[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) y[i] = _mm512_add_ps(acc[i], _mm512_setzero_ps());  // + off (zero), as the scalar path
}

template <int TYPE>
void tiles_avx512(const uint8_t* w, int k, int n_begin, int n_end, const Activations& act, const float* bias,
                  float* out, long ldo) {
  const int n_chunks = k / tile_span_of<TYPE>();
  const std::size_t tb = (std::size_t)n_chunks * tile_chunk_bytes_of<TYPE>();
  for (int t = n_begin / kTileColumns; t * kTileColumns < n_end; ++t) {
    const int n0 = t * kTileColumns;
    const __mmask16 mask = tile_column_mask(n0, n_begin, n_end);
    for (int r = 0; r < act.m; r += 8) {
      const int rows = act.m - r < 8 ? act.m - r : 8;
      __m512 y[8];
      const uint8_t* tile = w + (std::size_t)t * tb;
      auto pass = [&] <int MT>() {
        if constexpr (TYPE == Q5_0_T16) q5_0_tile_pass<MT>(tile, n_chunks, r, act, y);
        else tile_pass<TYPE, MT>(tile, n_chunks, r, act, y);
      };
      switch (rows) {
        case 1: pass.template operator()<1>(); break;
        case 2: pass.template operator()<2>(); break;
        case 3: pass.template operator()<3>(); break;
        case 4: pass.template operator()<4>(); break;
        case 5: pass.template operator()<5>(); break;
        case 6: pass.template operator()<6>(); break;
        case 7: pass.template operator()<7>(); break;
        default: pass.template operator()<8>(); break;
      }
      store_tile_rows(y, rows, r, n0, mask, bias, out, ldo);
    }
  }
}

}  // namespace

namespace {

// The quantizer primitives of quantize.h in 16 lanes. abs_max: max_ps(new, running) keeps the running value where
// new is NaN, as the portable path's std::max(running, new) does. group: cvtps rounds by the rounding mode, nearest
// even by default, as nearbyint.
struct Avx512Quantizer {
  static float abs_max(const float* x, int n) {
    __m512 m = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), m);
    return _mm512_reduce_max_ps(m);
  }
  static int group(const float* x, float inv, int8_t* q) {
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), _mm512_set1_ps(inv)));
    v = _mm512_min_epi32(_mm512_max_epi32(v, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
    _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(v));
    return _mm512_reduce_add_epi32(v);
  }
};

}  // namespace

void quantize_activations_avx512(const float* x, int m, int k, long ldx, int8_t* q, float* dx, float* ds, float* dxl,
                                 int32_t* xsum) {
  quantize_rows_32<Avx512Quantizer>(x, m, k, ldx, q, dx, ds, dxl, xsum);
}

void quantize_activations_256_avx512(const float* x, int m, int k, long ldx, int8_t* q, float* d, int32_t* bsum) {
  quantize_rows_256<Avx512Quantizer>(x, m, k, ldx, q, d, bsum);
}

void qmatmul_tiles_avx512(int type, const uint8_t* w, int k, int n_begin, int n_end, const Activations& act,
                          const float* bias, float* out, long ldo) {
  dispatch_tiled(type, [&] <int T>() { tiles_avx512<T>(w, k, n_begin, n_end, act, bias, out, ldo); });
}

void qmatmul_rows_avx512(int type, const uint8_t* w, int k, int n_begin, int n_end, const Activations& act,
                         const float* bias, float* out, long ldo) {
  dispatch_type(type, [&] <int T>() { rows_avx512<T>(w, k, n_begin, n_end, act, bias, out, ldo); });
}

}  // namespace sparsespec
#endif
