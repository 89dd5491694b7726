// The activation quantizers of qmatmul.h (quantize_activations, quantize_activations_256), written once over an
// instruction set's two primitives, a struct P with
//   static float abs_max(const float* x, int n): max |x[i]| over n (a multiple of 16) values
//   static int group(const float* x, float inv, int8_t* q): q[i] = x[i] * inv rounded to nearest even and clamped
//     to [-127, 127] for 16 inputs; returns their sum
// (qmatmul_scalar.cpp's portable ones, qmatmul_avx512.cpp's 16-lane ones). Every step is exact or one IEEE
// operation (a maximum, one division each way per block, one product and one rounding per input, integer sums), so
// every version writes the same bytes.
#pragma once

#include <cstring>

#include "qmatmul.h"

namespace sparsespec {

// The 16 inputs at `at` of a row of k inputs (k a multiple of 64: a group is wholly inside or wholly padding).
template <class P>
[[gnu::always_inline]] inline int quantize_group(const float* xr, int at, int k, float inv, int8_t* qr) {
  if (at < k) return P::group(xr + at, inv, qr + at);
  std::memset(qr + at, 0, 16);
  return 0;
}

// quantize_activations: blocks of 32 inputs.
template <class P>
[[gnu::always_inline]] inline void quantize_rows_32(const float* x, int m, int k, long ldx, int8_t* q, float* dx,
                                                    float* ds, float* dxl, int32_t* xsum) {
  const int k_pad = padded_k(k);
  for (int r = 0; r < m; ++r) {
    const float* xr = x + (long)r * ldx;
    int8_t* qr = q + (long)r * k_pad;
    for (int b = 0; b < k_pad / kActBlock; ++b) {
      const int begin = b * kActBlock;
      const float amax = begin < k ? P::abs_max(xr + begin, kActBlock) : 0.0f;
      const float d = amax / 127.0f;
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      const int low = quantize_group<P>(xr, begin, k, inv, qr);
      const int high = quantize_group<P>(xr, begin + 16, k, inv, qr);
      const long at = (long)r * (k_pad / kActBlock) + b;
      ds[2 * at] = d * (float)low;
      ds[2 * at + 1] = d * (float)high;
      xsum[at] = low + high;
      dx[at] = d;
      for (int lane = 0; lane < kActBlock / 4; ++lane) dxl[at * (kActBlock / 4) + lane] = d;
    }
  }
}

// quantize_activations_256: chunks of 256 inputs (the K-quants), with the sum of every group of 16.
template <class P>
[[gnu::always_inline]] inline void quantize_rows_256(const float* x, int m, int k, long ldx, int8_t* q, float* d,
                                                     int32_t* bsum) {
  const int k_pad = padded_k(k);
  for (int r = 0; r < m; ++r) {
    const float* xr = x + (long)r * ldx;
    int8_t* qr = q + (long)r * k_pad;
    for (int c = 0; c < k_pad / kChunk; ++c) {
      const int begin = c * kChunk;
      const float amax = P::abs_max(xr + begin, k - begin < kChunk ? k - begin : kChunk);
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      d[(long)r * (k_pad / kChunk) + c] = amax / 127.0f;
      for (int g = 0; g < 16; ++g)
        bsum[(long)r * (k_pad / 16) + c * 16 + g] = quantize_group<P>(xr, begin + 16 * g, k, inv, qr);
    }
  }
}

}  // namespace sparsespec
