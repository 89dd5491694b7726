// Float-activation matmul (fmatmul.h): the portable path, which defines the canonical arithmetic, and the
// dispatch to the instruction sets.
#include "fmatmul.h"

#include <cmath>

#include "formats.h"

namespace sparsespec {
namespace {

template <int TYPE>
void rows_scalar(const uint8_t* w, int k, int n_begin, int n_end, const float* x, int m, long ldx, const float* bias,
                 float* out, long ldo) {
  const std::size_t rb = row_bytes_of<TYPE>(k);
  ChunkScales sc;
  int8_t codes[64];
  for (int n = n_begin; n < n_end; ++n) {
    const uint8_t* row = w + (std::size_t)n * rb;
    for (int r = 0; r < m; ++r) {
      const float* xr = x + (long)r * ldx;
      float acc[16] = {};
      for (int c = 0; c < chunks_of(k); ++c) {
        const uint8_t* chunk = row + (std::size_t)c * chunk_bytes_of<TYPE>();
        decode_scales<TYPE>(chunk, sc);
        for (int p = 0; p < quarters_in(k, c); ++p) {
          decode_quarter<TYPE>(chunk + scale_bytes_of<TYPE>() + p * quarter_bytes_of<TYPE>(), codes);
          for (int t = 0; t < 4; ++t) {
            const int g = 4 * p + t;
            const float* xg = xr + c * kChunk + p * kQuarter + 16 * t;
            for (int L = 0; L < 16; ++L) {
              const float wv = std::fma((float)codes[16 * t + L], sc.a[g], sc.c[g]);
              acc[L] = std::fma(wv, xg[L], acc[L]);
            }
          }
        }
      }
      float y = canonical_hsum(acc);
      if (bias) y += bias[n];
      out[(long)r * ldo + n] = y;
    }
  }
}

// A float weight (F32, F16, BF16): the same 16 lanes over the inputs in order, w the stored value.
template <int TYPE>
void float_rows_scalar(const uint8_t* w, int k, int n_begin, int n_end, const float* x, int m, long ldx,
                       const float* bias, float* out, long ldo) {
  const std::size_t rb = (std::size_t)k * float_type_bytes(TYPE);
  for (int n = n_begin; n < n_end; ++n) {
    const uint8_t* row = w + (std::size_t)n * rb;
    for (int r = 0; r < m; ++r) {
      const float* xr = x + (long)r * ldx;
      float acc[16] = {};
      for (int i = 0; i < k; i += 16)
        for (int L = 0; L < 16; ++L) acc[L] = std::fma(float_weight<TYPE>(row, i + L), xr[i + L], acc[L]);
      float y = canonical_hsum(acc);
      if (bias) y += bias[n];
      out[(long)r * ldo + n] = y;
    }
  }
}

}  // namespace

void fmatmul_rows_scalar(int type, const uint8_t* w, int k, int n_begin, int n_end, const float* x, int m, long ldx,
                         const float* bias, float* out, long ldo) {
  if (dispatch_float(type, [&] <int T>() {
        float_rows_scalar<T>(w, k, n_begin, n_end, x, m, ldx, bias, out, ldo);
      }))
    return;
  dispatch_type(type, [&] <int T>() { rows_scalar<T>(w, k, n_begin, n_end, x, m, ldx, bias, out, ldo); });
}

#if !defined(__x86_64__)
void fmatmul_rows_avx2(int, const uint8_t*, int, int, int, const float*, int, long, const float*, float*, long) {}
void fmatmul_rows_avx512(int, const uint8_t*, int, int, int, const float*, int, long, const float*, float*, long) {}
#endif
#if !defined(__aarch64__)
void fmatmul_rows_neon(int, const uint8_t*, int, int, int, const float*, int, long, const float*, float*, long) {}
#endif

void fmatmul_rows(int isa, int type, const uint8_t* w, int k, int n_begin, int n_end, const float* x, int m,
                  long ldx, const float* bias, float* out, long ldo) {
  if (isa == kAuto) isa = best_isa();
  switch (isa) {
    case kAmx:
    case kAvx512: fmatmul_rows_avx512(type, w, k, n_begin, n_end, x, m, ldx, bias, out, ldo); break;
    case kAvx2: fmatmul_rows_avx2(type, w, k, n_begin, n_end, x, m, ldx, bias, out, ldo); break;
    case kNeon: fmatmul_rows_neon(type, w, k, n_begin, n_end, x, m, ldx, bias, out, ldo); break;
    default: fmatmul_rows_scalar(type, w, k, n_begin, n_end, x, m, ldx, bias, out, ldo); break;
  }
}

}  // namespace sparsespec
