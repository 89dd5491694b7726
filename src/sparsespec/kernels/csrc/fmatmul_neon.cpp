// Float-activation matmul (fmatmul.h), AArch64 NEON: the 16 canonical lanes as four float32x4; each weight row's
// dequantized group serves up to four activation rows.
#if defined(__aarch64__)
#pragma GCC target("arch=armv8.2-a+dotprod")
#include <arm_neon.h>

#include "codes_neon.h"
#include "fmatmul.h"

namespace sparsespec {
namespace {

// Weight row n against activation rows r0 .. r0 + R - 1.
template <int TYPE, int R>
inline void tile(const uint8_t* row, int k, int n, int r0, const float* x, long ldx, const float* bias, float* out,
                 long ldo) {
  constexpr int SB = scale_bytes_of<TYPE>();
  constexpr int QB = quarter_bytes_of<TYPE>();
  float32x4_t acc[R][4];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < 4; ++v) acc[i][v] = vdupq_n_f32(0.0f);
  ChunkScales sc;
  for (int c = 0; c < chunks_of(k); ++c) {
    const uint8_t* chunk = row + (std::size_t)c * chunk_bytes_of<TYPE>();
    decode_scales<TYPE>(chunk, sc);
    for (int p = 0; p < quarters_in(k, c); ++p) {
      int8x16_t codes[4];
      load_codes<TYPE>(chunk + SB + p * QB, codes);
      for (int t = 0; t < 4; ++t) {
        const int g = 4 * p + t;
        const int16x8_t low = vmovl_s8(vget_low_s8(codes[t])), high = vmovl_s8(vget_high_s8(codes[t]));
        const int32x4_t q[4] = {vmovl_s16(vget_low_s16(low)), vmovl_s16(vget_high_s16(low)),
                                vmovl_s16(vget_low_s16(high)), vmovl_s16(vget_high_s16(high))};
        const float32x4_t a = vdupq_n_f32(sc.a[g]), offset = vdupq_n_f32(sc.c[g]);
        float32x4_t w[4];
        for (int v = 0; v < 4; ++v) w[v] = vfmaq_f32(offset, vcvtq_f32_s32(q[v]), a);  // fma(q, a, c)
        const long at = (long)c * kChunk + p * kQuarter + 16 * t;
        for (int i = 0; i < R; ++i) {
          const float* xr = x + (long)(r0 + i) * ldx + at;
          for (int v = 0; v < 4; ++v) acc[i][v] = vfmaq_f32(acc[i][v], w[v], vld1q_f32(xr + 4 * v));
        }
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    float y = hsum(acc[i]);
    if (bias) y += bias[n];
    out[(long)(r0 + i) * ldo + n] = y;
  }
}

template <int TYPE>
void rows_neon(const uint8_t* w, int k, int n_begin, int n_end, const float* x, int m, long ldx, const float* bias,
               float* out, long ldo) {
  const std::size_t rb = row_bytes_of<TYPE>(k);
  for (int n = n_begin; n < n_end; ++n) {
    const uint8_t* row = w + (std::size_t)n * rb;
    int r = 0;
    for (; r + 4 <= m; r += 4) tile<TYPE, 4>(row, k, n, r, x, ldx, bias, out, ldo);
    for (; r < m; ++r) tile<TYPE, 1>(row, k, n, r, x, ldx, bias, out, ldo);
  }
}

// Four inputs of a float weight's row from `at` as floats (exact for every type).
template <int TYPE>
inline float32x4_t float_weights(const uint8_t* at) {
  if constexpr (TYPE == F32) {
    return vld1q_f32((const float*)at);
  } else if constexpr (TYPE == F16) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t*)at)));
  } else {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t*)at), 16));
  }
}

// Float weight row n against activation rows r0 .. r0 + R - 1.
template <int TYPE, int R>
inline void float_tile(const uint8_t* row, int k, int n, int r0, const float* x, long ldx, const float* bias,
                       float* out, long ldo) {
  constexpr int E = float_type_bytes(TYPE);
  float32x4_t acc[R][4];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < 4; ++v) acc[i][v] = vdupq_n_f32(0.0f);
  for (int at = 0; at < k; at += 16) {
    float32x4_t w[4];
    for (int v = 0; v < 4; ++v) w[v] = float_weights<TYPE>(row + (std::size_t)(at + 4 * v) * E);
    for (int i = 0; i < R; ++i) {
      const float* xr = x + (long)(r0 + i) * ldx + at;
      for (int v = 0; v < 4; ++v) acc[i][v] = vfmaq_f32(acc[i][v], w[v], vld1q_f32(xr + 4 * v));
    }
  }
  for (int i = 0; i < R; ++i) {
    float y = hsum(acc[i]);
    if (bias) y += bias[n];
    out[(long)(r0 + i) * ldo + n] = y;
  }
}

template <int TYPE>
void float_rows_neon(const uint8_t* w, int k, int n_begin, int n_end, const float* x, int m, long ldx,
                     const float* bias, float* out, long ldo) {
  const std::size_t rb = (std::size_t)k * float_type_bytes(TYPE);
  for (int n = n_begin; n < n_end; ++n) {
    const uint8_t* row = w + (std::size_t)n * rb;
    int r = 0;
    for (; r + 4 <= m; r += 4) float_tile<TYPE, 4>(row, k, n, r, x, ldx, bias, out, ldo);
    for (; r < m; ++r) float_tile<TYPE, 1>(row, k, n, r, x, ldx, bias, out, ldo);
  }
}

}  // namespace

void fmatmul_rows_neon(int type, const uint8_t* w, int k, int n_begin, int n_end, const float* x, int m, long ldx,
                       const float* bias, float* out, long ldo) {
  if (dispatch_float(type, [&] <int T>() { float_rows_neon<T>(w, k, n_begin, n_end, x, m, ldx, bias, out, ldo); }))
    return;
  dispatch_type(type, [&] <int T>() { rows_neon<T>(w, k, n_begin, n_end, x, m, ldx, bias, out, ldo); });
}

}  // namespace sparsespec
#endif
