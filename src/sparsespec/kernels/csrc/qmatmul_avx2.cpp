// x86 AVX2 path: a quarter in two ymm, maddubs + madd integer dots (exact: codes <= 63, or |q| for Q8_0), the
// canonical float steps on 2 x 8 lanes.
#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "scales_x86.h"

namespace sparsespec {
namespace {

// Four activations broadcast to every 32-bit lane.
inline __m256i quad(const int8_t* x) {
  int32_t v;
  __builtin_memcpy(&v, x, 4);
  return _mm256_set1_epi32(v);
}

// 32 bits -> 32 bytes, byte j = value where bit j is set, else 0.
inline __m256i expand_bits(uint32_t bits, char value) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32((int)bits),
      _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0));
  const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  const __m256i hit = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
  return _mm256_and_si256(hit, _mm256_set1_epi8(value));
}

template <int TYPE>
inline void load_codes(const uint8_t* q, __m256i& lo, __m256i& hi) {
  constexpr int bits = bits_of<TYPE>();
  if constexpr (bits == 8) {
    lo = _mm256_loadu_si256((const __m256i*)q);
    hi = _mm256_loadu_si256((const __m256i*)(q + 32));
  } else {
    const __m256i nib = _mm256_loadu_si256((const __m256i*)q);
    const __m256i low = _mm256_set1_epi8(0x0F);
    lo = _mm256_and_si256(nib, low);
    hi = _mm256_and_si256(_mm256_srli_epi16(nib, 4), low);
    for (int plane = 0; plane < bits - 4; ++plane) {
      uint32_t half[2];
      __builtin_memcpy(half, q + 32 + 8 * plane, 8);
      const char value = (char)(0x10 << plane);
      lo = _mm256_or_si256(lo, expand_bits(half[0], value));
      hi = _mm256_or_si256(hi, expand_bits(half[1], value));
    }
  }
}

inline __m256i dot4(__m256i codes, __m256i x) {  // 8 lanes, each the dot of 4 consecutive bytes
  return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1));
}

template <int TYPE, int MT>
inline void row_tile(const uint8_t* row, int k, int r0, const Activations& act, const float* bias, int n, float* out,
                     long ldo) {
  constexpr int SB = scale_bytes_of<TYPE>();
  constexpr int QB = quarter_bytes_of<TYPE>();
  const int n_chunks = chunks_of(k);
  __m256 acc_lo[MT], acc_hi[MT], off_lo[MT], off_hi[MT];
  for (int i = 0; i < MT; ++i) acc_lo[i] = acc_hi[i] = off_lo[i] = off_hi[i] = _mm256_setzero_ps();
  ChunkScales sc;
  for (int c = 0; c < n_chunks; ++c) {
    const uint8_t* chunk = row + (std::size_t)c * chunk_bytes_of<TYPE>();
    prefetch_ahead(chunk, chunk_bytes_of<TYPE>());
    decode_scales_x86<TYPE>(chunk, sc);
    const int nq = quarters_in(k, c);
    for (int p = 0; p < nq; ++p) {
      __m256i lo, hi;
      load_codes<TYPE>(chunk + SB + p * QB, lo, hi);
      const __m256 a_lo = _mm256_set_m128(_mm_set1_ps(sc.a[4 * p + 1]), _mm_set1_ps(sc.a[4 * p]));
      const __m256 a_hi = _mm256_set_m128(_mm_set1_ps(sc.a[4 * p + 3]), _mm_set1_ps(sc.a[4 * p + 2]));
      const int base = c * kChunk + p * kQuarter;
      __m256i ulo = lo, uhi = hi;
      if constexpr (!has_offsets<TYPE>()) {
        ulo = _mm256_sign_epi8(lo, lo);
        uhi = _mm256_sign_epi8(hi, hi);
      }
      for (int i = 0; i < MT; ++i) {
        const long r = r0 + i;
        const int8_t* xq = act.q + r * act.k_pad + base;
        __m256i x_lo = _mm256_loadu_si256((const __m256i*)xq);
        __m256i x_hi = _mm256_loadu_si256((const __m256i*)(xq + 32));
        if constexpr (!has_offsets<TYPE>()) {
          x_lo = _mm256_sign_epi8(x_lo, lo);
          x_hi = _mm256_sign_epi8(x_hi, hi);
        }
        const float* dxl = act.dxl + r * (act.k_pad / 4) + base / 4;
        acc_lo[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot4(ulo, x_lo)), _mm256_mul_ps(a_lo, _mm256_loadu_ps(dxl)),
                                    acc_lo[i]);
        acc_hi[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot4(uhi, x_hi)),
                                    _mm256_mul_ps(a_hi, _mm256_loadu_ps(dxl + 8)), acc_hi[i]);
      }
    }
    if constexpr (has_offsets<TYPE>()) {
      const __m256 c_lo = _mm256_load_ps(sc.c), c_hi = _mm256_load_ps(sc.c + 8);
      for (int i = 0; i < MT; ++i) {
        const float* ds = act.ds + (long)(r0 + i) * (act.k_pad / 16) + c * 16;
        off_lo[i] = _mm256_fmadd_ps(c_lo, _mm256_loadu_ps(ds), off_lo[i]);
        off_hi[i] = _mm256_fmadd_ps(c_hi, _mm256_loadu_ps(ds + 8), off_hi[i]);
      }
    }
  }
  for (int i = 0; i < MT; ++i) {
    float y = hsum(acc_lo[i], acc_hi[i]) + hsum(off_lo[i], off_hi[i]);
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
  __m256 acc_lo[MT], acc_hi[MT], off_lo[MT], off_hi[MT];
  for (int i = 0; i < MT; ++i) acc_lo[i] = acc_hi[i] = off_lo[i] = off_hi[i] = _mm256_setzero_ps();
  KScales ks;
  for (int c = 0; c < n_chunks; ++c) {
    const uint8_t* chunk = row + (std::size_t)c * chunk_bytes_of<TYPE>();
    prefetch_ahead(chunk, chunk_bytes_of<TYPE>());
    decode_k_scales<TYPE>(chunk, ks);
    __m256i sum_lo[MT], sum_hi[MT];
    for (int i = 0; i < MT; ++i) sum_lo[i] = sum_hi[i] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      __m256i lo, hi;
      load_codes<TYPE>(chunk + SB + p * QB, lo, hi);
      const __m256i s_lo = _mm256_setr_epi32(ks.s[4 * p], ks.s[4 * p], ks.s[4 * p], ks.s[4 * p], ks.s[4 * p + 1],
                                             ks.s[4 * p + 1], ks.s[4 * p + 1], ks.s[4 * p + 1]);
      const __m256i s_hi = _mm256_setr_epi32(ks.s[4 * p + 2], ks.s[4 * p + 2], ks.s[4 * p + 2], ks.s[4 * p + 2],
                                             ks.s[4 * p + 3], ks.s[4 * p + 3], ks.s[4 * p + 3], ks.s[4 * p + 3]);
      // The lane's scale in both 16-bit halves: madd then gives s * (pair 0 + pair 1) of maddubs' sums, the lane's
      // dot times s, exactly (|pair| <= 2 * 63 * 127, |s| <= 128).
      const __m256i s_lo_pairs = _mm256_or_si256(_mm256_and_si256(s_lo, _mm256_set1_epi32(0xFFFF)),
                                                 _mm256_slli_epi32(s_lo, 16));
      const __m256i s_hi_pairs = _mm256_or_si256(_mm256_and_si256(s_hi, _mm256_set1_epi32(0xFFFF)),
                                                 _mm256_slli_epi32(s_hi, 16));
      const int base = c * kChunk + p * kQuarter;
      for (int i = 0; i < MT; ++i) {
        const int8_t* xq = act.q256 + (long)(r0 + i) * act.k_pad + base;
        const __m256i x_lo = _mm256_loadu_si256((const __m256i*)xq);
        const __m256i x_hi = _mm256_loadu_si256((const __m256i*)(xq + 32));
        sum_lo[i] = _mm256_add_epi32(sum_lo[i], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x_lo), s_lo_pairs));
        sum_hi[i] = _mm256_add_epi32(sum_hi[i], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x_hi), s_hi_pairs));
      }
    }
    for (int i = 0; i < MT; ++i) {
      const long r = r0 + i;
      const float d256 = act.d256[r * chunks_per_row + c];
      const __m256 scale = _mm256_set1_ps(ks.d * d256);
      acc_lo[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_lo[i]), scale, acc_lo[i]);
      acc_hi[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_hi[i]), scale, acc_hi[i]);
      const int32_t* b = act.bsum + r * (act.k_pad / 16) + c * 16;
      const __m256 factor = _mm256_set1_ps(k_offset_factor<TYPE>(ks, d256));
      const __m256i o_lo = _mm256_loadu_si256((const __m256i*)ks.o);
      const __m256i o_hi = _mm256_loadu_si256((const __m256i*)(ks.o + 8));
      off_lo[i] = _mm256_fmadd_ps(
          _mm256_cvtepi32_ps(_mm256_mullo_epi32(o_lo, _mm256_loadu_si256((const __m256i*)b))), factor, off_lo[i]);
      off_hi[i] = _mm256_fmadd_ps(
          _mm256_cvtepi32_ps(_mm256_mullo_epi32(o_hi, _mm256_loadu_si256((const __m256i*)(b + 8)))), factor,
          off_hi[i]);
    }
  }
  for (int i = 0; i < MT; ++i) {
    float y = hsum(acc_lo[i], acc_hi[i]) + hsum(off_lo[i], off_hi[i]);
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
void rows_avx2(const uint8_t* w, int k, int n_begin, int n_end, const Activations& act, const float* bias,
               float* out, long ldo) {
  const std::size_t rb = row_bytes_of<TYPE>(k);
  constexpr int kRowBlock = 16;
  for (int n0 = n_begin; n0 < n_end; n0 += kRowBlock) {
    const int n1 = n0 + kRowBlock < n_end ? n0 + kRowBlock : n_end;
    for (int r = 0; r < act.m; r += 4) {
      const int tile = act.m - r < 4 ? act.m - r : 4;
      for (int n = n0; n < n1; ++n) {
        const uint8_t* row = w + n * rb;
        switch (tile) {
          case 1: run_tile<TYPE, 1>(row, k, r, act, bias, n, out, ldo); break;
          case 2: run_tile<TYPE, 2>(row, k, r, act, bias, n, out, ldo); break;
          case 3: run_tile<TYPE, 3>(row, k, r, act, bias, n, out, ldo); break;
          default: run_tile<TYPE, 4>(row, k, r, act, bias, n, out, ldo); break;
        }
      }
    }
  }
}

// Column tiles (qmatmul.h): 8 columns per ymm (column c in 32-bit lane c), a tile as two halves. The integer sums
// are exact, so they are grouped for the fewest instructions per activation row (an exact sum does not depend on its
// order); only the float steps follow the canonical order. maddubs sums stay exact in int16 (Q4_K: 8 of them, each
// <= 2 * 15 * 127; Q6_K: 2, each <= 2 * 63 * 127), and one madd with the columns' scales in both 16-bit halves of
// each lane widens and scales them at once. The offsets (Q4_K's mins, Q6_K's -32) are one dot per chunk and row of
// the columns' scales with the row's group sums, by madd over pairs of them (every factor fits int16: |b_g| <= 16 *
// 127, scales <= 128).

// Both 16-bit halves of each lane set to the lane's int32 value (which fits int16).
inline __m256i in_both_halves(__m256i v) {
  return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
}

// Lane c = (row a's byte c, row b's byte c) as two int16 (8 columns of two rows of a scale table).
template <bool SIGNED>
inline __m256i interleave_columns(const uint8_t* a, const uint8_t* b) {
  const __m128i pairs = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i*)a), _mm_loadl_epi64((const __m128i*)b));
  return SIGNED ? _mm256_cvtepi8_epi16(pairs) : _mm256_cvtepu8_epi16(pairs);
}

// Keeps v in a register here: the compiler otherwise regroups a row's integer sums across the unrolled loop and spills
// every partial product to the stack (a store and a load per maddubs).
inline void in_register(__m256i& v) { asm("" : "+x"(v)); }

// Two int16 in one 32-bit word, what madd multiplies by a lane's pair of scales.
inline int32_t int16_pair(int32_t low, int32_t high) {
  return (int32_t)((uint32_t)(uint16_t)low | (uint32_t)(uint16_t)high << 16);
}

// Halves h0 .. h0 + H - 1 of a tile (H = 2: both, so that each 64-byte pair of codes is read in one pass, as a
// one-row pass streams the weights) against activation rows r0 .. r0 + MT - 1: y[h][i] = half h0 + h, row r0 + i.
template <int TYPE, int MT, int H>
inline void tile_pass(const uint8_t* tile, int n_chunks, int h0, int r0, const Activations& act, __m256 y[H][MT]) {
  const long per_row16 = act.k_pad / 16, per_row256 = act.k_pad / kChunk;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  constexpr int n_pairs = TYPE == Q4_K_T16 ? 4 : 8;  // offset pairs per chunk: sub-blocks 2q, 2q + 1 / groups
  __m256 acc[H][MT], off[H][MT];
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < MT; ++i) acc[h][i] = off[h][i] = _mm256_setzero_ps();
  for (int ch = 0; ch < n_chunks; ++ch) {
    const uint8_t* chunk = tile + (std::size_t)ch * tile_chunk_bytes_of<TYPE>();
    prefetch_ahead(chunk, tile_chunk_bytes_of<TYPE>());
    __m256i isum[H][MT];
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < MT; ++i) isum[h][i] = _mm256_setzero_si256();
    if constexpr (TYPE == Q4_K_T16) {
      for (int j = 0; j < 8; ++j) {
        __m256i sc[H], s16[H][MT];
        for (int h = 0; h < H; ++h) {
          sc[h] = in_both_halves(
              _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(chunk + 64 + 16 * j + 8 * (h0 + h)))));
          for (int i = 0; i < MT; ++i) s16[h][i] = _mm256_setzero_si256();
        }
        for (int p = 0; p < 4; ++p) {
          for (int h = 0; h < H; ++h) {
            const uint8_t* pairs = chunk + tile_scale_bytes_of<TYPE>() + 32 * (h0 + h);
            const __m256i packed = _mm256_loadu_si256((const __m256i*)(pairs + 64 * (4 * j + p)));
            const __m256i z0 = _mm256_and_si256(packed, low4);
            const __m256i z1 = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
            for (int i = 0; i < MT; ++i) {
              const int8_t* x = act.q256 + (long)(r0 + i) * act.k_pad + ch * kChunk + 32 * j + 8 * p;
              s16[h][i] = _mm256_add_epi16(s16[h][i], _mm256_maddubs_epi16(z0, quad(x)));
              s16[h][i] = _mm256_add_epi16(s16[h][i], _mm256_maddubs_epi16(z1, quad(x + 4)));
              in_register(s16[h][i]);
            }
          }
        }
        for (int h = 0; h < H; ++h)
          for (int i = 0; i < MT; ++i) isum[h][i] = _mm256_add_epi32(isum[h][i], _mm256_madd_epi16(s16[h][i], sc[h]));
      }
    } else {  // Q6_K_T16
      const __m256i two = _mm256_set1_epi8(0x30);
      for (int g = 0; g < 16; ++g) {
        for (int h = 0; h < H; ++h) {
          const __m256i sc = in_both_halves(
              _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(chunk + 32 + 16 * g + 8 * (h0 + h)))));
          const uint8_t* group = chunk + tile_scale_bytes_of<TYPE>() + 32 * (h0 + h) + kTileGroupBytes * g;
          const __m256i p0 = _mm256_loadu_si256((const __m256i*)group);
          const __m256i p1 = _mm256_loadu_si256((const __m256i*)(group + 64));
          const __m256i hb = _mm256_loadu_si256((const __m256i*)(group + 128));
          const __m256i z0 = _mm256_or_si256(_mm256_and_si256(p0, low4),
                                             _mm256_and_si256(_mm256_slli_epi16(hb, 4), two));
          const __m256i z1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(p0, 4), low4),
                                             _mm256_and_si256(_mm256_slli_epi16(hb, 2), two));
          const __m256i z2 = _mm256_or_si256(_mm256_and_si256(p1, low4), _mm256_and_si256(hb, two));
          const __m256i z3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(p1, 4), low4),
                                             _mm256_and_si256(_mm256_srli_epi16(hb, 2), two));
          for (int i = 0; i < MT; ++i) {
            const int8_t* x = act.q256 + (long)(r0 + i) * act.k_pad + ch * kChunk + 16 * g;
            const __m256i s01 =
                _mm256_add_epi16(_mm256_maddubs_epi16(z0, quad(x)), _mm256_maddubs_epi16(z1, quad(x + 4)));
            const __m256i s23 =
                _mm256_add_epi16(_mm256_maddubs_epi16(z2, quad(x + 8)), _mm256_maddubs_epi16(z3, quad(x + 12)));
            isum[h][i] = _mm256_add_epi32(isum[h][i],
                                          _mm256_add_epi32(_mm256_madd_epi16(s01, sc), _mm256_madd_epi16(s23, sc)));
          }
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      const int h8 = 8 * (h0 + h);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(chunk + 2 * h8)));
      const __m256 neg_dmin = TYPE == Q4_K_T16 ? _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128(
                                                     (const __m128i*)(chunk + 32 + 2 * h8))), _mm256_set1_ps(-0.0f))
                                               : _mm256_setzero_ps();
      // The offsets' scales, a pair per lane: Q4_K mn of sub-blocks 2q, 2q + 1; Q6_K sc of groups 2q, 2q + 1.
      __m256i offset_scales[n_pairs];
      for (int q = 0; q < n_pairs; ++q) {
        if constexpr (TYPE == Q4_K_T16)
          offset_scales[q] = interleave_columns<false>(chunk + 192 + 32 * q + h8, chunk + 192 + 32 * q + 16 + h8);
        else
          offset_scales[q] = interleave_columns<true>(chunk + 32 + 32 * q + h8, chunk + 32 + 32 * q + 16 + h8);
      }
      for (int i = 0; i < MT; ++i) {
        const long r = r0 + i;
        const int32_t* b = act.bsum + r * per_row16 + ch * 16;
        __m256i osum = _mm256_setzero_si256();
        for (int q = 0; q < n_pairs; ++q) {
          const int32_t word = TYPE == Q4_K_T16 ? int16_pair(b[4 * q] + b[4 * q + 1], b[4 * q + 2] + b[4 * q + 3])
                                                : int16_pair(b[2 * q], b[2 * q + 1]);
          osum = _mm256_add_epi32(osum, _mm256_madd_epi16(offset_scales[q], _mm256_set1_epi32(word)));
        }
        const __m256 D = _mm256_set1_ps(act.d256[r * per_row256 + ch]);
        if constexpr (TYPE == Q4_K_T16) {
          acc[h][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[h][i]), _mm256_mul_ps(d, D), acc[h][i]);
          off[h][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(osum), _mm256_mul_ps(neg_dmin, D), off[h][i]);
        } else {  // isum = sum_g sc_g dot_g - 32 sum_g sc_g b_g
          const __m256i exact = _mm256_sub_epi32(isum[h][i], _mm256_slli_epi32(osum, 5));
          acc[h][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_mul_ps(d, D), acc[h][i]);
        }
      }
    }
  }
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < MT; ++i) y[h][i] = _mm256_add_ps(acc[h][i], off[h][i]);
}

// Q5_0_T16 (qmatmul.h): vector V of a half chunk's codes (inputs 4V .. 4V + 3 of 8 columns) from its pair of
// nibbles and the half's high bits (bit V of each byte).
template <int V>
inline __m256i q5_codes(__m256i pair, __m256i high) {
  const __m256i nibbles = V % 2 ? _mm256_srli_epi16(pair, 4) : pair;
  __m256i bit = high;  // bit V of each byte moved to bit 4
  if constexpr (V < 4) bit = _mm256_slli_epi16(high, 4 - V);
  if constexpr (V > 4) bit = _mm256_srli_epi16(high, V - 4);
  return _mm256_or_si256(_mm256_and_si256(nibbles, _mm256_set1_epi8(0x0F)),
                         _mm256_and_si256(bit, _mm256_set1_epi8(0x10)));
}

// Q5_0_T16 tiles, one half (8 columns): per chunk (one block of 32 inputs) 8 vectors of codes; maddubs sums of
// four stay exact in int16 (each <= 2 * 31 * 127) before madd widens them.
template <int MT>
inline void q5_0_tile_half_pass(const uint8_t* tile, int n_chunks, int half, int r0, const Activations& act,
                                __m256 y[MT]) {
  const long per_row32 = act.k_pad / kActBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = _mm256_setzero_ps();
  for (int ch = 0; ch < n_chunks; ++ch) {
    const uint8_t* chunk = tile + (std::size_t)ch * tile_chunk_bytes_of<Q5_0_T16>();
    prefetch_ahead(chunk, tile_chunk_bytes_of<Q5_0_T16>());
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(chunk + 16 * half)));
    const __m256i high = _mm256_loadu_si256((const __m256i*)(chunk + kTileQ5HighBytes + 32 * half));
    const uint8_t* pairs = chunk + tile_scale_bytes_of<Q5_0_T16>() + 32 * half;
    const __m256i p0 = _mm256_loadu_si256((const __m256i*)pairs);
    const __m256i p1 = _mm256_loadu_si256((const __m256i*)(pairs + 64));
    const __m256i p2 = _mm256_loadu_si256((const __m256i*)(pairs + 128));
    const __m256i p3 = _mm256_loadu_si256((const __m256i*)(pairs + 192));
    const __m256i z0 = q5_codes<0>(p0, high), z1 = q5_codes<1>(p0, high), z2 = q5_codes<2>(p1, high),
                  z3 = q5_codes<3>(p1, high), z4 = q5_codes<4>(p2, high), z5 = q5_codes<5>(p2, high),
                  z6 = q5_codes<6>(p3, high), z7 = q5_codes<7>(p3, high);
    for (int i = 0; i < MT; ++i) {
      const long at = (long)(r0 + i) * per_row32 + ch;
      const int8_t* x = act.q + at * kActBlock;
      const __m256i s0 = _mm256_add_epi16(
          _mm256_add_epi16(_mm256_maddubs_epi16(z0, quad(x)), _mm256_maddubs_epi16(z1, quad(x + 4))),
          _mm256_add_epi16(_mm256_maddubs_epi16(z2, quad(x + 8)), _mm256_maddubs_epi16(z3, quad(x + 12))));
      const __m256i s1 = _mm256_add_epi16(
          _mm256_add_epi16(_mm256_maddubs_epi16(z4, quad(x + 16)), _mm256_maddubs_epi16(z5, quad(x + 20))),
          _mm256_add_epi16(_mm256_maddubs_epi16(z6, quad(x + 24)), _mm256_maddubs_epi16(z7, quad(x + 28))));
      const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones));
      const __m256i isum = _mm256_sub_epi32(dot, _mm256_set1_epi32(16 * act.xsum[at]));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(act.dx[at])), acc[i]);
    }
  }
  for (int i = 0; i < MT; ++i) y[i] = _mm256_add_ps(acc[i], _mm256_setzero_ps());  // + off (zero), as the scalar path
}

constexpr int kTileRows = 6;  // activation rows per pass over a half tile (what the 16 ymm registers hold)
constexpr int kBothHalvesRows = 2;  // the most rows a pass over both halves of a tile holds in registers

template <int TYPE>
void tiles_avx2(const uint8_t* w, int k, int n_begin, int n_end, const Activations& act, const float* bias,
                float* out, long ldo) {
  const int n_chunks = k / tile_span_of<TYPE>();
  const std::size_t tb = (std::size_t)n_chunks * tile_chunk_bytes_of<TYPE>();
  // Passes of up to kBothHalvesRows rows take a K-quant tile's two halves at once (each pair of codes read in one
  // pass: these passes stream the weights from memory); longer ones a half at a time, for the registers.
  const bool both = TYPE != Q5_0_T16 && act.m <= kBothHalvesRows;
  // The rows in groups of at most kTileRows, as even as they go (5 rows: one group, not 4 + 1), each group one pass
  // over the half tile that decodes its codes once.
  const int n_groups = (act.m + kTileRows - 1) / kTileRows;
  for (int t = n_begin / kTileColumns; t * kTileColumns < n_end; ++t) {
    const uint8_t* tile = w + (std::size_t)t * tb;
    for (int h0 = 0; h0 < 2; h0 += both ? 2 : 1) {
      const int halves = both ? 2 : 1;
      const int n0 = t * kTileColumns + 8 * h0;
      if (n0 + 8 * halves <= n_begin || n0 >= n_end) continue;
      for (int group = 0, r = 0; group < n_groups; ++group) {
        const int rows = (act.m - r + (n_groups - group) - 1) / (n_groups - group);
        __m256 y[2][kTileRows];
        auto pass = [&] <int MT>() {
          if constexpr (TYPE == Q5_0_T16) {
            q5_0_tile_half_pass<MT>(tile, n_chunks, h0, r, act, y[0]);
          } else if (both) {
            if constexpr (MT <= kBothHalvesRows) {
              __m256 pair[2][MT];
              tile_pass<TYPE, MT, 2>(tile, n_chunks, 0, r, act, pair);
              for (int i = 0; i < MT; ++i) y[0][i] = pair[0][i], y[1][i] = pair[1][i];
            }
          } else {
            __m256 one[1][MT];
            tile_pass<TYPE, MT, 1>(tile, n_chunks, h0, r, act, one);
            for (int i = 0; i < MT; ++i) y[0][i] = one[0][i];
          }
        };
        switch (rows) {
          case 1: pass.template operator()<1>(); break;
          case 2: pass.template operator()<2>(); break;
          case 3: pass.template operator()<3>(); break;
          case 4: pass.template operator()<4>(); break;
          case 5: pass.template operator()<5>(); break;
          default: pass.template operator()<6>(); break;
        }
        for (int h = 0; h < halves; ++h)
          for (int i = 0; i < rows; ++i) {
            alignas(32) float v[8];
            _mm256_store_ps(v, y[h][i]);
            for (int c = 0; c < 8; ++c) {
              const int n = n0 + 8 * h + c;
              if (n < n_begin || n >= n_end) continue;
              out[(long)(r + i) * ldo + n] = bias ? v[c] + bias[n] : v[c];
            }
          }
        r += rows;
      }
    }
  }
}

}  // namespace

void qmatmul_tiles_avx2(int type, const uint8_t* w, int k, int n_begin, int n_end, const Activations& act,
                        const float* bias, float* out, long ldo) {
  dispatch_tiled(type, [&] <int T>() { tiles_avx2<T>(w, k, n_begin, n_end, act, bias, out, ldo); });
}

void qmatmul_rows_avx2(int type, const uint8_t* w, int k, int n_begin, int n_end, const Activations& act,
                       const float* bias, float* out, long ldo) {
  dispatch_type(type, [&] <int T>() { rows_avx2<T>(w, k, n_begin, n_end, act, bias, out, ldo); });
}

}  // namespace sparsespec
#endif
