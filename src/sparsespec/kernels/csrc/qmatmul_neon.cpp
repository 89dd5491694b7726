// AArch64 NEON path (ARMv8.2 dot product): a quarter in four int8x16 vectors, sdot integer dots, the canonical
// float steps on 4 x 4 lanes.
#if defined(__aarch64__)
#pragma GCC target("arch=armv8.2-a+dotprod")
#include <arm_neon.h>

#include "codes_neon.h"

namespace sparsespec {
namespace {

template <int TYPE, int MT>
inline void row_tile(const uint8_t* row, int k, int r0, const Activations& act, const float* bias, int n, float* out,
                     long ldo) {
  constexpr int SB = scale_bytes_of<TYPE>();
  constexpr int QB = quarter_bytes_of<TYPE>();
  const int n_chunks = chunks_of(k);
  float32x4_t acc[MT][4], off[MT][4];
  for (int i = 0; i < MT; ++i)
    for (int v = 0; v < 4; ++v) acc[i][v] = off[i][v] = vdupq_n_f32(0.0f);
  ChunkScales sc;
  for (int c = 0; c < n_chunks; ++c) {
    const uint8_t* chunk = row + (std::size_t)c * chunk_bytes_of<TYPE>();
    decode_scales<TYPE>(chunk, sc);
    const int nq = quarters_in(k, c);
    for (int p = 0; p < nq; ++p) {
      int8x16_t codes[4];
      load_codes<TYPE>(chunk + SB + p * QB, codes);
      const int base = c * kChunk + p * kQuarter;
      for (int i = 0; i < MT; ++i) {
        const long r = r0 + i;
        const int8_t* xq = act.q + r * act.k_pad + base;
        const float* dxl = act.dxl + r * (act.k_pad / 4) + base / 4;
        for (int v = 0; v < 4; ++v) {
          const int32x4_t dot = vdotq_s32(vdupq_n_s32(0), codes[v], vld1q_s8(xq + 16 * v));
          const float32x4_t scale = vmulq_f32(vdupq_n_f32(sc.a[4 * p + v]), vld1q_f32(dxl + 4 * v));
          acc[i][v] = vfmaq_f32(acc[i][v], vcvtq_f32_s32(dot), scale);
        }
      }
    }
    if constexpr (has_offsets<TYPE>()) {
      for (int i = 0; i < MT; ++i) {
        const float* ds = act.ds + (long)(r0 + i) * (act.k_pad / 16) + c * 16;
        for (int v = 0; v < 4; ++v) off[i][v] = vfmaq_f32(off[i][v], vld1q_f32(sc.c + 4 * v), vld1q_f32(ds + 4 * v));
      }
    }
  }
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
  float32x4_t acc[MT][4], off[MT][4];
  for (int i = 0; i < MT; ++i)
    for (int v = 0; v < 4; ++v) acc[i][v] = off[i][v] = vdupq_n_f32(0.0f);
  KScales ks;
  for (int c = 0; c < n_chunks; ++c) {
    const uint8_t* chunk = row + (std::size_t)c * chunk_bytes_of<TYPE>();
    decode_k_scales<TYPE>(chunk, ks);
    int32x4_t sum[MT][4];
    for (int i = 0; i < MT; ++i)
      for (int v = 0; v < 4; ++v) sum[i][v] = vdupq_n_s32(0);
    for (int p = 0; p < 4; ++p) {
      int8x16_t codes[4];
      load_codes<TYPE>(chunk + SB + p * QB, codes);
      const int base = c * kChunk + p * kQuarter;
      for (int i = 0; i < MT; ++i) {
        const int8_t* xq = act.q256 + (long)(r0 + i) * act.k_pad + base;
        for (int v = 0; v < 4; ++v) {
          const int32x4_t dot = vdotq_s32(vdupq_n_s32(0), codes[v], vld1q_s8(xq + 16 * v));
          sum[i][v] = vmlaq_n_s32(sum[i][v], dot, ks.s[4 * p + v]);
        }
      }
    }
    for (int i = 0; i < MT; ++i) {
      const long r = r0 + i;
      const float d256 = act.d256[r * chunks_per_row + c];
      for (int v = 0; v < 4; ++v) acc[i][v] = vfmaq_n_f32(acc[i][v], vcvtq_f32_s32(sum[i][v]), ks.d * d256);
      const int32_t* b = act.bsum + r * (act.k_pad / 16) + c * 16;
      const float factor = k_offset_factor<TYPE>(ks, d256);
      for (int v = 0; v < 4; ++v)
        off[i][v] = vfmaq_n_f32(off[i][v], vcvtq_f32_s32(vmulq_s32(vld1q_s32(ks.o + 4 * v), vld1q_s32(b + 4 * v))),
                                factor);
    }
  }
  for (int i = 0; i < MT; ++i) {
    float y = hsum(acc[i]) + hsum(off[i]);
    if (bias) y += bias[n];
    out[(long)(r0 + i) * ldo + n] = y;
  }
}

template <int TYPE>
void rows_neon(const uint8_t* w, int k, int n_begin, int n_end, const Activations& act, const float* bias,
               float* out, long ldo) {
  const std::size_t rb = row_bytes_of<TYPE>(k);
  for (int n = n_begin; n < n_end; ++n) {
    int r = 0;
    constexpr bool k_quant = TYPE == Q4_K || TYPE == Q5_K || TYPE == Q6_K;
    for (; r + 4 <= act.m; r += 4) {
      if constexpr (k_quant) row_tile_k<TYPE, 4>(w + n * rb, k, r, act, bias, n, out, ldo);
      else row_tile<TYPE, 4>(w + n * rb, k, r, act, bias, n, out, ldo);
    }
    for (; r < act.m; ++r) {
      if constexpr (k_quant) row_tile_k<TYPE, 1>(w + n * rb, k, r, act, bias, n, out, ldo);
      else row_tile<TYPE, 1>(w + n * rb, k, r, act, bias, n, out, ldo);
    }
  }
}

}  // namespace

void qmatmul_rows_neon(int type, const uint8_t* w, int k, int n_begin, int n_end, const Activations& act,
                       const float* bias, float* out, long ldo) {
  dispatch_type(type, [&] <int T>() { rows_neon<T>(w, k, n_begin, n_end, act, bias, out, ldo); });
}

}  // namespace sparsespec
#endif
