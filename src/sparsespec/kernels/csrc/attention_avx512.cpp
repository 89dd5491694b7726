// x86 AVX-512 attention kernels: 16-lane dot products and value sums, bf16 widened in registers, polynomial exp.
#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2,f16c")
#include <immintrin.h>

#include <cstdint>

#include "attention.h"
#include "elementwise.h"

#define ATTN_ISA attn_avx512
namespace sparsespec {
namespace attn_avx512 {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline float scalar(float x) { return x; }
inline float scalar(uint16_t x) { return bf16_to_float(x); }

// Canonical 16-lane sum: i + 8, i + 4, i + 2, i + 1.
inline float hsum(__m512 v) {
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

template <class K>
inline float dot(const float* q, const K* k, int n) {
  __m512 acc = _mm512_setzero_ps();
  int j = 0;
  for (; j + 16 <= n; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + j), load16(k + j), acc);
  float r = hsum(acc);
  for (; j < n; ++j) r += q[j] * scalar(k[j]);
  return r;
}

template <class K>
inline void axpy(float a, const K* v, float* y, int n) {
  const __m512 av = _mm512_set1_ps(a);
  int j = 0;
  for (; j + 16 <= n; j += 16) _mm512_storeu_ps(y + j, _mm512_fmadd_ps(av, load16(v + j), _mm512_loadu_ps(y + j)));
  for (; j < n; ++j) y[j] += a * scalar(v[j]);
}

// attention.h's dequantize_row_scalar, 16 channels at a time (groups and, for int4, half rows of whole vectors;
// else the scalar loop): fma(code, scale, zero) lane by lane, the same value as the scalar fma.
inline void dequantize_row(const uint8_t* codes, const uint16_t* params, int hd, int bits, int code_group,
                           float* out) {
  const int half = hd / 2;
  if (code_group % 16 || (bits == 4 && half % 16)) {
    dequantize_row_scalar(codes, params, hd, bits, code_group, out);
    return;
  }
  for (int g = 0; g < hd / code_group; ++g) {
    const __m512 scale = _mm512_set1_ps(_cvtsh_ss(params[2 * g]));  // F16C: exact, as half_to_float
    const __m512 zero = _mm512_set1_ps(_cvtsh_ss(params[2 * g + 1]));
    for (int c = g * code_group; c < (g + 1) * code_group; c += 16) {
      __m512i code;
      if (bits == 8) {
        code = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(codes + c)));
      } else {
        const uint8_t* pair = codes + (c < half ? c : c - half);  // low nibbles: channel c, high: c + half
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)pair));
        code = c < half ? _mm512_and_si512(bytes, _mm512_set1_epi32(15)) : _mm512_srli_epi32(bytes, 4);
      }
      _mm512_storeu_ps(out + c, _mm512_fmadd_ps(_mm512_cvtepi32_ps(code), scale, zero));
    }
  }
}

// exp(x) for x <= 0 (Cephes' polynomial, ~1 ulp); 0 below -87.3 (and for -inf).
inline __m512 exp16(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(~tiny, y, _mm512_castsi512_ps(e));
}

inline float exp_sum(float* x, int n, float m) {
  const __m512 vm = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (int j = 0; j < n; j += 16) {
    const __mmask16 live = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, x + j), vm)));
    _mm512_mask_storeu_ps(x + j, live, e);
    acc = _mm512_add_ps(acc, e);
  }
  return hsum(acc);
}

struct Vec {
  using T = __m512;
  static constexpr int R = 32;
  static constexpr int W = 16;
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T load(const uint16_t* p) { return load16(p); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  // out[i] = sum of the lanes of a[i]: lanes l + 8, then + 4, then + 2, then + 1.
  static void hsum4(const T* a, float* out) {
    const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(a[0], a[1], 0x44), _mm512_shuffle_f32x4(a[0], a[1], 0xEE));
    const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(a[2], a[3], 0x44), _mm512_shuffle_f32x4(a[2], a[3], 0xEE));
    const __m512 z = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
    const __m512 w = _mm512_add_ps(z, _mm512_permute_ps(z, 0x4E));
    const __m512 v = _mm512_add_ps(w, _mm512_permute_ps(w, 0xB1));
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, v);
    for (int i = 0; i < 4; ++i) out[i] = lanes[4 * i];
  }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
};

}  // namespace attn_avx512
}  // namespace sparsespec

#define ATTN_VEC
#include "attention_chunk.h"

namespace sparsespec {

const AttnKernels& attention_kernels_avx512() {
  static const AttnKernels kernels{&attn_avx512::logits_chunk, &attn_avx512::exp_values_chunk};
  return kernels;
}

}  // namespace sparsespec
#else
#include "attention.h"
namespace sparsespec {
const AttnKernels& attention_kernels_avx512() { return attention_kernels_scalar(); }
}  // namespace sparsespec
#endif
