// x86 AMX path for the Q4_K / Q6_K column tiles in a pass of 4 or more rows: the integer dots of up to 16
// activation rows against one sub-block of 16 columns in one tile multiply (TDPBSSD), then the canonical integer and
// float steps of qmatmul.h in AVX-512, so the results equal the scalar path bit for bit (integer sums are exact in
// any order).
//
// Per tile of 16 columns, per chunk: the codes are unpacked once into the tile multiply's B layout (row r = inputs
// 4r .. 4r + 3 of the 16 columns, byte 4c + b: column c, input b; the repacked tiles already hold them in that
// order, as nibbles); per sub-block (Q4_K: 32 inputs; Q6_K: 16, its codes minus 32 as signed bytes) A is the rows'
// activation codes straight from the quantized activations (row stride k_pad) and C [rows, 16] int32 the dots,
// stored to a buffer that the vector steps read. The tile work per chunk is the same for 1 or 16 rows (a tile store
// per sub-block sets its pace), so fewer than 4 rows, and Q5_0 tiles, keep the AVX-512 path.
#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,avx2,f16c,amx-tile,amx-int8")
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>

#include "formats.h"
#include "tiles_avx512.h"

namespace sparsespec {
namespace {

// The tile registers' shapes (palette 1): C tiles 0-1 [m, 16] int32, A tiles 4-5 [m, span] int8, B tiles 6-7
// [span / 4, 64] int8.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure(int m, int span) {
  TileConfig cfg;
  for (int t = 0; t < 2; ++t) cfg.colsb[t] = 64, cfg.rows[t] = (uint8_t)m;
  for (int t = 4; t < 6; ++t) cfg.colsb[t] = (uint16_t)span, cfg.rows[t] = (uint8_t)m;
  for (int t = 6; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = (uint8_t)(span / 4);
  _tile_loadconfig(&cfg);
}

// dots [N, m, 16] int32: dots[j] = the m activation rows at x (row stride ldx) over sub-block j's `span` inputs
// (at x + span j) against B codes[j] ([span / 4, 64] bytes), for j in [0, N).
template <int N>
inline void sub_block_dots(const int8_t* x, long ldx, const uint8_t* codes, int span, int32_t* dots) {
  static_assert(N % 2 == 0);
  const int b_bytes = span * 16;
  for (int j = 0; j < N; j += 2) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(4, x + span * j, ldx);
    _tile_loadd(6, codes + b_bytes * j, 64);
    _tile_loadd(5, x + span * (j + 1), ldx);
    _tile_loadd(7, codes + b_bytes * (j + 1), 64);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 5, 7);
    _tile_stored(0, dots + 256 * j, 64);
    _tile_stored(1, dots + 256 * (j + 1), 64);
  }
}

// Per thread: one chunk's unpacked codes and its sub-block dots for up to 16 rows.
struct Buffers {
  alignas(64) uint8_t codes[4096];
  alignas(64) int32_t dots[16 * 16 * 16];
};
thread_local Buffers buffers;
std::atomic<long> tile_passes{0};  // calls of tiles_amx (amx_tile_passes)

// Fewer rows than this run the AVX-512 tiles (a tile round trip per sub-block costs more than their dots).
constexpr int kAmxRows = 4;
// Q4_K_T16 (qmatmul.h): per chunk, isum = sum_j sc_j dot_j and osum = sum_j mn_j (b_2j + b_2j+1) per column and
// row, then the float steps. Results go to y[i] (16 columns of row r0 + i), i < m.
inline void q4_k_pass(const uint8_t* tile, int n_chunks, int r0, int m, const Activations& act, __m512* y) {
  const long per_row16 = act.k_pad / 16, per_row256 = act.k_pad / kChunk;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  Buffers& buf = buffers;
  __m512 acc[16], off[16];
  for (int i = 0; i < m; ++i) acc[i] = off[i] = _mm512_setzero_ps();
  for (int ch = 0; ch < n_chunks; ++ch) {
    const uint8_t* chunk = tile + (std::size_t)ch * tile_chunk_bytes_of<Q4_K_T16>();
    const uint8_t* pairs = chunk + tile_scale_bytes_of<Q4_K_T16>();
    prefetch_ahead(chunk, tile_chunk_bytes_of<Q4_K_T16>());
    for (int p = 0; p < 32; ++p) {  // pair p: inputs 8p + b (low nibbles) and 8p + 4 + b (high)
      const __m512i packed = _mm512_loadu_si512(pairs + 64 * p);
      _mm512_store_si512(buf.codes + 128 * p, _mm512_and_si512(packed, low4));
      _mm512_store_si512(buf.codes + 128 * p + 64, _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4));
    }
    sub_block_dots<8>(act.q256 + (long)r0 * act.k_pad + ch * kChunk, act.k_pad, buf.codes, 32, buf.dots);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)chunk));
    const __m512 neg_dmin = _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(chunk + 32)))),
        _mm512_set1_epi32((int)0x80000000u)));
    __m512i sc[8], mn_pairs[4];
    for (int j = 0; j < 8; ++j) sc[j] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(chunk + 64 + 16 * j)));
    q4_k_tile_min_pairs(chunk, mn_pairs);
    for (int i = 0; i < m; ++i) {
      const long r = r0 + i;
      __m512i isum = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j)
        isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(_mm512_load_si512(buf.dots + 256 * j + 16 * i), sc[j]));
      const __m512i osum = q4_k_tile_min_sum(mn_pairs, act.bsum + r * per_row16 + ch * 16);
      const __m512 D = _mm512_set1_ps(act.d256[r * per_row256 + ch]);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, D), acc[i]);
      off[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(osum), _mm512_mul_ps(neg_dmin, D), off[i]);
    }
  }
  for (int i = 0; i < m; ++i) y[i] = _mm512_add_ps(acc[i], off[i]);
}

// Q6_K_T16 (qmatmul.h): the codes minus 32 as signed B bytes, so each group's tile dot is dot_g - 32 b_g; per chunk
// isum = sum_g sc_g (dot_g - 32 b_g) per column and row, then the float step.
inline void q6_k_pass(const uint8_t* tile, int n_chunks, int r0, int m, const Activations& act, __m512* y) {
  const long per_row256 = act.k_pad / kChunk;
  const __m512i low4 = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x30), bias = _mm512_set1_epi8(32);
  Buffers& buf = buffers;
  __m512 acc[16];
  for (int i = 0; i < m; ++i) acc[i] = _mm512_setzero_ps();
  for (int ch = 0; ch < n_chunks; ++ch) {
    const uint8_t* chunk = tile + (std::size_t)ch * tile_chunk_bytes_of<Q6_K_T16>();
    const uint8_t* pairs = chunk + tile_scale_bytes_of<Q6_K_T16>();
    prefetch_ahead(chunk, tile_chunk_bytes_of<Q6_K_T16>());
    for (int g = 0; g < 16; ++g) {
      const uint8_t* group = pairs + kTileGroupBytes * g;
      const __m512i p0 = _mm512_loadu_si512(group), p1 = _mm512_loadu_si512(group + 64);
      const __m512i h = _mm512_loadu_si512(group + 128);
      uint8_t* codes = buf.codes + 256 * g;
      _mm512_store_si512(codes, _mm512_sub_epi8(_mm512_or_si512(
          _mm512_and_si512(p0, low4), _mm512_and_si512(_mm512_slli_epi16(h, 4), two)), bias));
      _mm512_store_si512(codes + 64, _mm512_sub_epi8(_mm512_or_si512(
          _mm512_and_si512(_mm512_srli_epi16(p0, 4), low4), _mm512_and_si512(_mm512_slli_epi16(h, 2), two)), bias));
      _mm512_store_si512(codes + 128, _mm512_sub_epi8(_mm512_or_si512(
          _mm512_and_si512(p1, low4), _mm512_and_si512(h, two)), bias));
      _mm512_store_si512(codes + 192, _mm512_sub_epi8(_mm512_or_si512(
          _mm512_and_si512(_mm512_srli_epi16(p1, 4), low4), _mm512_and_si512(_mm512_srli_epi16(h, 2), two)), bias));
    }
    sub_block_dots<16>(act.q256 + (long)r0 * act.k_pad + ch * kChunk, act.k_pad, buf.codes, 16, buf.dots);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)chunk));
    __m512i sc[16];
    for (int g = 0; g < 16; ++g) sc[g] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(chunk + 32 + 16 * g)));
    for (int i = 0; i < m; ++i) {
      __m512i isum = _mm512_setzero_si512();
#pragma GCC unroll 16
      for (int g = 0; g < 16; ++g)
        isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(_mm512_load_si512(buf.dots + 256 * g + 16 * i), sc[g]));
      const __m512 D = _mm512_set1_ps(act.d256[(long)(r0 + i) * per_row256 + ch]);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, D), acc[i]);
    }
  }
  for (int i = 0; i < m; ++i) y[i] = _mm512_add_ps(acc[i], _mm512_setzero_ps());  // + off (zero), as the scalar path
}

template <int TYPE>
void tiles_amx(const uint8_t* w, int k, int n_begin, int n_end, const Activations& act, const float* bias,
               float* out, long ldo) {
  const int n_chunks = k / tile_span_of<TYPE>();
  const std::size_t tb = (std::size_t)n_chunks * tile_chunk_bytes_of<TYPE>();
  tile_passes.fetch_add(1, std::memory_order_relaxed);
  for (int r = 0; r < act.m; r += 16) {
    const int rows = act.m - r < 16 ? act.m - r : 16;
    configure(rows, TYPE == Q6_K_T16 ? 16 : 32);
    for (int t = n_begin / kTileColumns; t * kTileColumns < n_end; ++t) {
      const int n0 = t * kTileColumns;
      __m512 y[16];
      if constexpr (TYPE == Q4_K_T16) q4_k_pass(w + (std::size_t)t * tb, n_chunks, r, rows, act, y);
      else q6_k_pass(w + (std::size_t)t * tb, n_chunks, r, rows, act, y);
      store_tile_rows(y, rows, r, n0, tile_column_mask(n0, n_begin, n_end), bias, out, ldo);
    }
    _tile_release();
  }
}

}  // namespace

long amx_tile_passes() { return tile_passes.load(); }

bool amx_usable() {
  static const bool usable = [] {
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512vnni")) return false;
    unsigned eax, ebx, ecx, edx;
    __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    const bool tile = (edx >> 24) & 1, int8 = (edx >> 25) & 1;
    // Linux hands out the tile registers' state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
    return tile && int8 && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return usable;
}

void qmatmul_tiles_amx(int type, const uint8_t* w, int k, int n_begin, int n_end, const Activations& act,
                       const float* bias, float* out, long ldo) {
  if (act.m < kAmxRows || type == Q5_0_T16)
    return qmatmul_tiles_avx512(type, w, k, n_begin, n_end, act, bias, out, ldo);
  if (type == Q4_K_T16) tiles_amx<Q4_K_T16>(w, k, n_begin, n_end, act, bias, out, ldo);
  else tiles_amx<Q6_K_T16>(w, k, n_begin, n_end, act, bias, out, ldo);
}

}  // namespace sparsespec
#endif
