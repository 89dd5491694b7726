// Portable scalar path (the reference every SIMD path must equal bit for bit), activation quantization,
// dequantization, format tables and the instruction-set dispatch.
#include <algorithm>
#include <cmath>
#include <vector>

#include "formats.h"
#include "quantize.h"

#if defined(__aarch64__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

namespace sparsespec {

bool supported_type(int type) {
  return is_tiled(type) || is_float_type(type) || dispatch_type(type, [] <int T>() {});
}

int code_bits(int type) {
  int out = 0;
  dispatch_type(type, [&] <int T>() { out = bits_of<T>(); });
  return out;
}

int scale_bytes(int type) {
  int out = 0;
  dispatch_type(type, [&] <int T>() { out = scale_bytes_of<T>(); });
  return out;
}

int quarter_bytes(int type) {
  int out = 0;
  dispatch_type(type, [&] <int T>() { out = quarter_bytes_of<T>(); });
  return out;
}

std::size_t row_bytes(int type, int k) {
  if (is_float_type(type)) return (std::size_t)k * float_type_bytes(type);
  std::size_t out = 0;
  dispatch_type(type, [&] <int T>() { out = row_bytes_of<T>(k); });
  return out;
}

int tile_span(int type) {
  int out = 0;
  dispatch_tiled(type, [&] <int T>() { out = tile_span_of<T>(); });
  return out;
}

std::size_t tile_bytes(int type, int k) {
  std::size_t out = 0;
  dispatch_tiled(type, [&] <int T>() { out = (std::size_t)(k / tile_span_of<T>()) * tile_chunk_bytes_of<T>(); });
  return out;
}

std::size_t weight_bytes(int type, int k, long rows) {
  if (is_tiled(type)) return tile_bytes(type, k) * (std::size_t)((rows + kTileColumns - 1) / kTileColumns);
  return row_bytes(type, k) * (std::size_t)rows;
}

int padded_k(int k) { return chunks_of(k) * kChunk; }

// The portable quantizer primitives (quantize.h): eight running maxima, then their maximum (the same value in any
// order; the lanes let the compiler use vector max instructions); nearbyint rounds to nearest even.
struct PortableQuantizer {
  static float abs_max(const float* x, int n) {
    float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int i = 0; i < n; i += 8)
      for (int l = 0; l < 8; ++l) lanes[l] = std::max(lanes[l], std::fabs(x[i + l]));
    float out = 0.0f;
    for (int l = 0; l < 8; ++l) out = std::max(out, lanes[l]);
    return out;
  }
  static int group(const float* x, float inv, int8_t* q) {
    int sum = 0;
    for (int i = 0; i < 16; ++i) {
      const int v = std::clamp((int)std::nearbyint(x[i] * inv), -127, 127);
      q[i] = (int8_t)v;
      sum += v;
    }
    return sum;
  }
};

// Compiled for several x86 levels and chosen at load time: the same IEEE operations (max, division, rounding to
// nearest even, integer sums), so every version gives the same bytes; the newer levels only run them faster.
#if defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
static void quantize_activations_portable(const float* x, int m, int k, long ldx, int8_t* q, float* dx, float* ds,
                                         float* dxl, int32_t* xsum) {
  quantize_rows_32<PortableQuantizer>(x, m, k, ldx, q, dx, ds, dxl, xsum);
}

#if defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
static void quantize_activations_256_portable(const float* x, int m, int k, long ldx, int8_t* q, float* d,
                                             int32_t* bsum) {
  quantize_rows_256<PortableQuantizer>(x, m, k, ldx, q, d, bsum);
}

namespace {

template <int TYPE>
void rows_scalar_k(const uint8_t* w, int k, int n_begin, int n_end, const Activations& act, const float* bias,
                   float* out, long ldo) {
  const std::size_t rb = row_bytes_of<TYPE>(k);
  const int n_chunks = chunks_of(k);
  KScales ks;
  int8_t codes[64];
  for (int n = n_begin; n < n_end; ++n) {
    const uint8_t* row = w + (std::size_t)n * rb;
    for (int r = 0; r < act.m; ++r) {
      const int8_t* xq = act.q256 + (long)r * act.k_pad;
      float acc[16] = {0}, off[16] = {0};
      for (int c = 0; c < n_chunks; ++c) {
        const uint8_t* chunk = row + (std::size_t)c * chunk_bytes_of<TYPE>();
        decode_k_scales<TYPE>(chunk, ks);
        int32_t isum[16] = {0};
        for (int p = 0; p < 4; ++p) {
          decode_quarter<TYPE>(chunk + scale_bytes_of<TYPE>() + p * quarter_bytes_of<TYPE>(), codes);
          const int base = c * kChunk + p * kQuarter;
          for (int lane = 0; lane < 16; ++lane) {
            int dot = 0;
            for (int e = 0; e < 4; ++e) dot += (int)codes[4 * lane + e] * (int)xq[base + 4 * lane + e];
            isum[lane] += dot * ks.s[4 * p + lane / 4];
          }
        }
        const float d256 = act.d256[(long)r * (act.k_pad / kChunk) + c];
        const float scale = ks.d * d256;
        for (int lane = 0; lane < 16; ++lane) acc[lane] = std::fma((float)isum[lane], scale, acc[lane]);
        const int32_t* b = act.bsum + (long)r * (act.k_pad / 16) + c * 16;
        const float factor = k_offset_factor<TYPE>(ks, d256);
        for (int g = 0; g < 16; ++g) off[g] = std::fma((float)(ks.o[g] * b[g]), factor, off[g]);
      }
      float y = canonical_hsum(acc) + canonical_hsum(off);
      if (bias) y += bias[n];
      out[(long)r * ldo + n] = y;
    }
  }
}

template <int TYPE>
void rows_scalar(const uint8_t* w, int k, int n_begin, int n_end, const Activations& act, const float* bias,
                 float* out, long ldo) {
  const std::size_t rb = row_bytes_of<TYPE>(k);
  const int n_chunks = chunks_of(k);
  ChunkScales sc;
  int8_t codes[64];
  for (int n = n_begin; n < n_end; ++n) {
    const uint8_t* row = w + (std::size_t)n * rb;
    for (int r = 0; r < act.m; ++r) {
      const int8_t* xq = act.q + (long)r * act.k_pad;
      const float* dx = act.dx + (long)r * (act.k_pad / kActBlock);
      const float* ds = act.ds + (long)r * (act.k_pad / 16);
      float acc[16] = {0}, off[16] = {0};
      for (int c = 0; c < n_chunks; ++c) {
        const uint8_t* chunk = row + (std::size_t)c * chunk_bytes_of<TYPE>();
        decode_scales<TYPE>(chunk, sc);
        const int nq = quarters_in(k, c);
        for (int p = 0; p < nq; ++p) {
          decode_quarter<TYPE>(chunk + scale_bytes_of<TYPE>() + p * quarter_bytes_of<TYPE>(), codes);
          const int base = c * kChunk + p * kQuarter;
          for (int lane = 0; lane < 16; ++lane) {
            int dot = 0;
            for (int e = 0; e < 4; ++e) dot += (int)codes[4 * lane + e] * (int)xq[base + 4 * lane + e];
            const float scale = sc.a[4 * p + lane / 4] * dx[(base + 4 * lane) / kActBlock];
            acc[lane] = std::fma((float)dot, scale, acc[lane]);
          }
        }
        if constexpr (has_offsets<TYPE>()) {
          for (int g = 0; g < 16; ++g) off[g] = std::fma(sc.c[g], ds[c * 16 + g], off[g]);
        }
      }
      float y = canonical_hsum(acc) + canonical_hsum(off);
      if (bias) y += bias[n];
      out[(long)r * ldo + n] = y;
    }
  }
}

// The codes of one tiled chunk: codes[i][c] = code(c, i) for input i (0 .. span - 1) and column c.
template <int TYPE>
void decode_tile_chunk(const uint8_t* chunk, uint8_t codes[kChunk][kTileColumns]) {
  for (int i = 0; i < tile_span_of<TYPE>(); ++i) tile_codes<TYPE>(chunk, i, codes[i]);
}

// Column tiles, the canonical arithmetic of qmatmul.h spelled out one column and row at a time.
template <int TYPE>
void tiles_scalar(const uint8_t* w, int k, int n_begin, int n_end, const Activations& act, const float* bias,
                  float* out, long ldo) {
  const int n_chunks = k / tile_span_of<TYPE>();
  const std::size_t tb = (std::size_t)n_chunks * tile_chunk_bytes_of<TYPE>();
  const long per_row16 = act.k_pad / 16, per_row32 = act.k_pad / kActBlock, per_row256 = act.k_pad / kChunk;
  std::vector<float> acc((std::size_t)act.m * kTileColumns), off(acc.size());
  static thread_local uint8_t codes[kChunk][kTileColumns];
  for (int t = n_begin / kTileColumns; t * kTileColumns < n_end; ++t) {
    const uint8_t* tile = w + (std::size_t)t * tb;
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::fill(off.begin(), off.end(), 0.0f);
    for (int ch = 0; ch < n_chunks; ++ch) {
      const uint8_t* chunk = tile + (std::size_t)ch * tile_chunk_bytes_of<TYPE>();
      decode_tile_chunk<TYPE>(chunk, codes);
      for (int r = 0; r < act.m; ++r) {
        // The chunk's activations: the K-quants' per 256 inputs, Q5_0_T16's per block of 32 (D is then its dx).
        constexpr bool block32 = TYPE == Q5_0_T16;
        const int8_t* xq = block32 ? act.q + (long)r * act.k_pad + ch * kActBlock
                                   : act.q256 + (long)r * act.k_pad + ch * kChunk;
        const int32_t* b = block32 ? act.xsum + r * per_row32 + ch : act.bsum + r * per_row16 + ch * 16;
        const float D = block32 ? act.dx[r * per_row32 + ch] : act.d256[r * per_row256 + ch];
        for (int c = 0; c < kTileColumns; ++c) {
          const float d = half_to_float(load_u16(chunk + 2 * c));
          int32_t isum = 0, osum = 0;
          if constexpr (TYPE == Q4_K_T16) {
            for (int j = 0; j < 8; ++j) {
              int32_t dot = 0;
              for (int i = 32 * j; i < 32 * j + 32; ++i) dot += (int32_t)codes[i][c] * (int32_t)xq[i];
              isum += (int32_t)chunk[64 + 16 * j + c] * dot;
              osum += (int32_t)chunk[192 + 16 * j + c] * (b[2 * j] + b[2 * j + 1]);
            }
            const float dmin = half_to_float(load_u16(chunk + 32 + 2 * c));
            off[r * kTileColumns + c] = std::fma((float)osum, (-dmin) * D, off[r * kTileColumns + c]);
          } else if constexpr (TYPE == Q6_K_T16) {
            for (int g = 0; g < 16; ++g) {
              int32_t dot = 0;
              for (int i = 16 * g; i < 16 * g + 16; ++i) dot += (int32_t)codes[i][c] * (int32_t)xq[i];
              isum += (int32_t)(int8_t)chunk[32 + 16 * g + c] * (dot - 32 * b[g]);
            }
          } else {  // Q5_0_T16: codes 0 .. 31 for w = d (q - 16)
            int32_t dot = 0;
            for (int i = 0; i < kActBlock; ++i) dot += (int32_t)codes[i][c] * (int32_t)xq[i];
            isum = dot - 16 * b[0];
          }
          acc[r * kTileColumns + c] = std::fma((float)isum, d * D, acc[r * kTileColumns + c]);
        }
      }
    }
    for (int c = 0; c < kTileColumns; ++c) {
      const int n = t * kTileColumns + c;
      if (n < n_begin || n >= n_end) continue;
      for (int r = 0; r < act.m; ++r) {
        float y = acc[r * kTileColumns + c] + off[r * kTileColumns + c];
        if (bias) y += bias[n];
        out[(long)r * ldo + n] = y;
      }
    }
  }
}

// Row `n` of a tiled weight as floats (the GGUF's own values: w = a q + c as decode_scales computes a and c).
template <int TYPE>
void dequantize_tiled_row(const uint8_t* w, int k, long n, float* o) {
  constexpr int span = tile_span_of<TYPE>();
  const int n_chunks = k / span;
  const uint8_t* tile = w + (std::size_t)(n / kTileColumns) * n_chunks * tile_chunk_bytes_of<TYPE>();
  const int c = (int)(n % kTileColumns);
  uint8_t codes[kTileColumns];
  for (int ch = 0; ch < n_chunks; ++ch) {
    const uint8_t* chunk = tile + (std::size_t)ch * tile_chunk_bytes_of<TYPE>();
    const float d = half_to_float(load_u16(chunk + 2 * c));
    for (int i = 0; i < span; ++i) {
      tile_codes<TYPE>(chunk, i, codes);
      float a, offset;
      if constexpr (TYPE == Q5_0_T16) {  // the row layout's a and c (decode_scales)
        a = d;
        offset = -16.0f * d;
      } else if constexpr (TYPE == Q4_K_T16) {
        a = d * (float)chunk[64 + 16 * (i / 32) + c];
        offset = -(half_to_float(load_u16(chunk + 32 + 2 * c)) * (float)chunk[192 + 16 * (i / 32) + c]);
      } else {
        a = d * (float)(int8_t)chunk[32 + 16 * (i / 16) + c];
        offset = -32.0f * a;
      }
      o[ch * span + i] = a * (float)codes[c] + offset;
    }
  }
}

}  // namespace

void qmatmul_tiles_scalar(int type, const uint8_t* w, int k, int n_begin, int n_end, const Activations& act,
                          const float* bias, float* out, long ldo) {
  dispatch_tiled(type, [&] <int T>() { tiles_scalar<T>(w, k, n_begin, n_end, act, bias, out, ldo); });
}

void qmatmul_rows_scalar(int type, const uint8_t* w, int k, int n_begin, int n_end, const Activations& act,
                         const float* bias, float* out, long ldo) {
  dispatch_type(type, [&] <int T>() {
    if constexpr (T == Q4_K || T == Q5_K || T == Q6_K)
      rows_scalar_k<T>(w, k, n_begin, n_end, act, bias, out, ldo);
    else
      rows_scalar<T>(w, k, n_begin, n_end, act, bias, out, ldo);
  });
}

void dequantize_rows(int type, const uint8_t* w, int k, const int64_t* rows, int n_rows, float* out) {
  if (dispatch_float(type, [&] <int T>() {
        for (int i = 0; i < n_rows; ++i) {
          const uint8_t* row = w + (std::size_t)rows[i] * k * float_type_bytes(T);
          for (int j = 0; j < k; ++j) out[(long)i * k + j] = float_weight<T>(row, j);
        }
      }))
    return;
  if (dispatch_tiled(type, [&] <int T>() {
        for (int i = 0; i < n_rows; ++i) dequantize_tiled_row<T>(w, k, rows[i], out + (long)i * k);
      }))
    return;
  dispatch_type(type, [&] <int T>() {
    const std::size_t rb = row_bytes_of<T>(k);
    ChunkScales sc;
    int8_t codes[64];
    for (int i = 0; i < n_rows; ++i) {
      const uint8_t* row = w + (std::size_t)rows[i] * rb;
      float* o = out + (long)i * k;
      for (int c = 0; c < chunks_of(k); ++c) {
        const uint8_t* chunk = row + (std::size_t)c * chunk_bytes_of<T>();
        decode_scales<T>(chunk, sc);
        for (int p = 0; p < quarters_in(k, c); ++p) {
          decode_quarter<T>(chunk + scale_bytes_of<T>() + p * quarter_bytes_of<T>(), codes);
          for (int j = 0; j < 64; ++j) {
            const int g = 4 * p + j / 16;
            o[c * kChunk + p * kQuarter + j] = sc.a[g] * (float)codes[j] + sc.c[g];
          }
        }
      }
    }
  });
}

// ------------------------------------------------------------------------------------------ instruction sets
#if !defined(__x86_64__)
void qmatmul_rows_avx2(int, const uint8_t*, int, int, int, const Activations&, const float*, float*, long) {}
void qmatmul_rows_avx512(int, const uint8_t*, int, int, int, const Activations&, const float*, float*, long) {}
void qmatmul_tiles_avx2(int, const uint8_t*, int, int, int, const Activations&, const float*, float*, long) {}
void qmatmul_tiles_avx512(int, const uint8_t*, int, int, int, const Activations&, const float*, float*, long) {}
void quantize_activations_avx512(const float*, int, int, long, int8_t*, float*, float*, float*, int32_t*) {}
void quantize_activations_256_avx512(const float*, int, int, long, int8_t*, float*, int32_t*) {}
void qmatmul_tiles_amx(int, const uint8_t*, int, int, int, const Activations&, const float*, float*, long) {}
bool amx_usable() { return false; }
long amx_tile_passes() { return 0; }
#endif
#if !defined(__aarch64__)
void qmatmul_rows_neon(int, const uint8_t*, int, int, int, const Activations&, const float*, float*, long) {}
#endif

bool isa_available(int isa) {
  switch (isa) {
    case kScalar:
      return true;
#if defined(__x86_64__)
    case kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    case kAmx:
      return isa_available(kAvx512) && amx_usable();
#endif
#if defined(__aarch64__)
    case kNeon:
      return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#endif
    default:
      return false;
  }
}

namespace {
int chosen_isa = kAuto;  // set_isa's choice, or kAuto: the best available
}

int best_isa() {
  if (chosen_isa != kAuto) return chosen_isa;
  for (int isa : {kAmx, kAvx512, kAvx2, kNeon})
    if (isa_available(isa)) return isa;
  return kScalar;
}

bool set_isa(int isa) {
  if (isa != kAuto && !isa_available(isa)) return false;
  chosen_isa = isa;
  return true;
}

const char* isa_name(int isa) {
  switch (isa) {
    case kScalar: return "scalar";
    case kAvx2: return "avx2";
    case kAvx512: return "avx512-vnni";
    case kNeon: return "neon-dotprod";
    case kAmx: return "avx512-vnni+amx";
    default: return "unknown";
  }
}

void quantize_activations(int isa, const float* x, int m, int k, long ldx, int8_t* q, float* dx, float* ds,
                          float* dxl, int32_t* xsum) {
  if (isa == kAuto) isa = best_isa();
  if (isa == kAvx512 || isa == kAmx) quantize_activations_avx512(x, m, k, ldx, q, dx, ds, dxl, xsum);
  else quantize_activations_portable(x, m, k, ldx, q, dx, ds, dxl, xsum);
}

void quantize_activations_256(int isa, const float* x, int m, int k, long ldx, int8_t* q, float* d, int32_t* bsum) {
  if (isa == kAuto) isa = best_isa();
  if (isa == kAvx512 || isa == kAmx) quantize_activations_256_avx512(x, m, k, ldx, q, d, bsum);
  else quantize_activations_256_portable(x, m, k, ldx, q, d, bsum);
}

void qmatmul_rows(int isa, int type, const uint8_t* w, int k, int n_begin, int n_end, const Activations& act,
                  const float* bias, float* out, long ldo) {
  if (isa == kAuto) isa = best_isa();
  if (is_tiled(type)) {  // the column tiles have x86 paths; elsewhere the scalar one (ARM loads row layouts)
    switch (isa) {
      case kAmx: qmatmul_tiles_amx(type, w, k, n_begin, n_end, act, bias, out, ldo); break;
      case kAvx512: qmatmul_tiles_avx512(type, w, k, n_begin, n_end, act, bias, out, ldo); break;
      case kAvx2: qmatmul_tiles_avx2(type, w, k, n_begin, n_end, act, bias, out, ldo); break;
      default: qmatmul_tiles_scalar(type, w, k, n_begin, n_end, act, bias, out, ldo); break;
    }
    return;
  }
  switch (isa) {
    case kAmx:
    case kAvx512: qmatmul_rows_avx512(type, w, k, n_begin, n_end, act, bias, out, ldo); break;
    case kAvx2: qmatmul_rows_avx2(type, w, k, n_begin, n_end, act, bias, out, ldo); break;
    case kNeon: qmatmul_rows_neon(type, w, k, n_begin, n_end, act, bias, out, ldo); break;
    default: qmatmul_rows_scalar(type, w, k, n_begin, n_end, act, bias, out, ldo); break;
  }
}

}  // namespace sparsespec
