// x86 AVX2 attention kernels: 8-lane dot products and value sums, bf16 widened in registers, polynomial exp.
#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include <cstdint>
#include <limits>

#include "attention.h"
#include "elementwise.h"

#define ATTN_ISA attn_avx2
namespace sparsespec {
namespace attn_avx2 {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline float scalar(float x) { return x; }
inline float scalar(uint16_t x) { return bf16_to_float(x); }

// Canonical 8-lane sum: i + 4, i + 2, i + 1.
inline float hsum(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

template <class K>
inline float dot(const float* q, const K* k, int n) {
  __m256 acc = _mm256_setzero_ps();
  int j = 0;
  for (; j + 8 <= n; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), load8(k + j), acc);
  float r = hsum(acc);
  for (; j < n; ++j) r += q[j] * scalar(k[j]);
  return r;
}

template <class K>
inline void axpy(float a, const K* v, float* y, int n) {
  const __m256 av = _mm256_set1_ps(a);
  int j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(y + j, _mm256_fmadd_ps(av, load8(v + j), _mm256_loadu_ps(y + j)));
  for (; j < n; ++j) y[j] += a * scalar(v[j]);
}

// attention.h's dequantize_row_scalar, 8 channels at a time (groups and, for int4, half rows of whole vectors;
// else the scalar loop): fma(code, scale, zero) lane by lane, the same value as the scalar fma.
inline void dequantize_row(const uint8_t* codes, const uint16_t* params, int hd, int bits, int code_group,
                           float* out) {
  const int half = hd / 2;
  if (code_group % 8 || (bits == 4 && half % 8)) {
    dequantize_row_scalar(codes, params, hd, bits, code_group, out);
    return;
  }
  for (int g = 0; g < hd / code_group; ++g) {
    const __m256 scale = _mm256_set1_ps(_cvtsh_ss(params[2 * g]));  // F16C: exact, as half_to_float
    const __m256 zero = _mm256_set1_ps(_cvtsh_ss(params[2 * g + 1]));
    for (int c = g * code_group; c < (g + 1) * code_group; c += 8) {
      __m256i code;
      if (bits == 8) {
        code = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(codes + c)));
      } else {
        const uint8_t* pair = codes + (c < half ? c : c - half);  // low nibbles: channel c, high: c + half
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)pair));
        code = c < half ? _mm256_and_si256(bytes, _mm256_set1_epi32(15)) : _mm256_srli_epi32(bytes, 4);
      }
      _mm256_storeu_ps(out + c, _mm256_fmadd_ps(_mm256_cvtepi32_ps(code), scale, zero));
    }
  }
}

// exp(x) for x <= 0 (Cephes' polynomial, ~1 ulp); 0 below -87.3 (and for -inf).
inline __m256 exp8(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

inline float exp_sum(float* x, int n, float m) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm));
    _mm256_storeu_ps(x + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  if (j < n) {  // the tail through a padded lane block, so it takes the same steps
    alignas(32) float tail[8];
    for (int l = 0; l < 8; ++l) tail[l] = j + l < n ? x[j + l] : -std::numeric_limits<float>::infinity();
    const __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(tail), vm));
    _mm256_store_ps(tail, e);
    for (int l = 0; j + l < n; ++l) x[j + l] = tail[l];
    acc = _mm256_add_ps(acc, e);
  }
  return hsum(acc);
}

struct Vec {
  using T = __m256;
  static constexpr int R = 16;
  static constexpr int W = 8;
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T load(const uint16_t* p) { return load8(p); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  // out[i] = sum of the lanes of a[i]: lanes l + 4, then pairs (l, l + 1), then (l, l + 2).
  static void hsum4(const T* a, float* out) {
    const __m256 x = _mm256_add_ps(_mm256_permute2f128_ps(a[0], a[1], 0x20), _mm256_permute2f128_ps(a[0], a[1], 0x31));
    const __m256 y = _mm256_add_ps(_mm256_permute2f128_ps(a[2], a[3], 0x20), _mm256_permute2f128_ps(a[2], a[3], 0x31));
    const __m256 h = _mm256_hadd_ps(x, y);
    const __m256 v = _mm256_hadd_ps(h, h);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    out[0] = lanes[0];
    out[1] = lanes[4];
    out[2] = lanes[1];
    out[3] = lanes[5];
  }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
};

}  // namespace attn_avx2
}  // namespace sparsespec

#define ATTN_VEC
#include "attention_chunk.h"

namespace sparsespec {

const AttnKernels& attention_kernels_avx2() {
  static const AttnKernels kernels{&attn_avx2::logits_chunk, &attn_avx2::exp_values_chunk};
  return kernels;
}

}  // namespace sparsespec
#else
#include "attention.h"
namespace sparsespec {
const AttnKernels& attention_kernels_avx2() { return attention_kernels_scalar(); }
}  // namespace sparsespec
#endif
