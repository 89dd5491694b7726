// Shared inline pieces of every instruction set's kernel: format tables, scale decoding, the canonical sums.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "qmatmul.h"

namespace sparsespec {

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1Fu;
  uint32_t mantissa = h & 0x3FFu;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal half: normalise
      exponent = 113;
      while (!(mantissa & 0x400u)) {
        mantissa <<= 1;
        --exponent;
      }
      bits = sign | (exponent << 23) | ((mantissa & 0x3FFu) << 13);
    }
  } else if (exponent == 31) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// Per-group scale a and offset c of one chunk: w = a[g] * q + c[g] for inputs 16g .. 16g+15 of the chunk.
struct ChunkScales {
  alignas(64) float a[16];
  alignas(64) float c[16];
};

// Whether a format has offsets c (all but Q8_0, whose codes are signed).
template <int TYPE>
constexpr bool has_offsets() { return TYPE != Q8_0; }

template <int TYPE>
constexpr int bits_of() {
  return TYPE == Q8_0 ? 8 : (TYPE == Q5_0 || TYPE == Q5_1 || TYPE == Q5_K) ? 5 : TYPE == Q6_K ? 6 : 4;
}

template <int TYPE>
constexpr int scale_bytes_of() {
  return (TYPE == Q4_0 || TYPE == Q5_0 || TYPE == Q8_0) ? 16
         : (TYPE == Q4_1 || TYPE == Q5_1)                ? 32
         : (TYPE == Q4_K || TYPE == Q5_K)                ? 20
                                                         : 18;  // Q6_K
}

template <int TYPE>
constexpr int quarter_bytes_of() {
  return bits_of<TYPE>() == 8 ? 64 : 32 + (bits_of<TYPE>() - 4) * 8;
}

template <int TYPE>
inline void decode_scales(const uint8_t* s, ChunkScales& out) {
  if constexpr (TYPE == Q4_0 || TYPE == Q5_0 || TYPE == Q8_0) {
    const float bias = TYPE == Q4_0 ? -8.0f : TYPE == Q5_0 ? -16.0f : 0.0f;
    for (int b = 0; b < 8; ++b) {
      const float d = half_to_float(load_u16(s + 2 * b));
      out.a[2 * b] = out.a[2 * b + 1] = d;
      out.c[2 * b] = out.c[2 * b + 1] = bias * d;
    }
  } else if constexpr (TYPE == Q4_1 || TYPE == Q5_1) {
    for (int b = 0; b < 8; ++b) {
      const float d = half_to_float(load_u16(s + 2 * b));
      const float m = half_to_float(load_u16(s + 16 + 2 * b));
      out.a[2 * b] = out.a[2 * b + 1] = d;
      out.c[2 * b] = out.c[2 * b + 1] = m;
    }
  } else if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
    const float d = half_to_float(load_u16(s));
    const float dmin = half_to_float(load_u16(s + 2));
    for (int j = 0; j < 8; ++j) {
      const float a = d * (float)s[4 + j];
      const float c = -(dmin * (float)s[12 + j]);
      out.a[2 * j] = out.a[2 * j + 1] = a;
      out.c[2 * j] = out.c[2 * j + 1] = c;
    }
  } else {  // Q6_K
    const float d = half_to_float(load_u16(s));
    for (int g = 0; g < 16; ++g) {
      const float a = d * (float)(int8_t)s[2 + g];
      out.a[g] = a;
      out.c[g] = -32.0f * a;
    }
  }
}

// Integer sub-block scales of a K-quant chunk: s[g] multiplies the dots of group g of 16 (Q4_K / Q5_K: sc of the
// group's sub-block of 32), o[g] the group's activation sum in the offset term (Q4_K / Q5_K: mn of the sub-block;
// Q6_K: -32 s[g]), and the chunk's float factors.
struct KScales {
  int32_t s[16];
  int32_t o[16];
  float d, dmin;
};

template <int TYPE>
inline void decode_k_scales(const uint8_t* s, KScales& out) {
  if constexpr (TYPE == Q6_K) {
    out.d = half_to_float(load_u16(s));
    out.dmin = 0.0f;
    for (int g = 0; g < 16; ++g) {
      out.s[g] = (int8_t)s[2 + g];
      out.o[g] = -32 * out.s[g];
    }
  } else {
    out.d = half_to_float(load_u16(s));
    out.dmin = half_to_float(load_u16(s + 2));
    for (int g = 0; g < 16; ++g) {
      out.s[g] = s[4 + g / 2];
      out.o[g] = s[12 + g / 2];
    }
  }
}

// The float factor of a chunk's offset terms (see qmatmul.h): Q6_K d * D, Q4_K / Q5_K (-dmin) * D.
template <int TYPE>
inline float k_offset_factor(const KScales& ks, float d256) {
  return TYPE == Q6_K ? ks.d * d256 : -ks.dmin * d256;
}

// The 64 codes of one quarter: unsigned (0 .. 63) for every format but Q8_0, whose codes are signed bytes.
template <int TYPE>
inline void decode_quarter(const uint8_t* q, int8_t codes[64]) {
  constexpr int bits = bits_of<TYPE>();
  if constexpr (bits == 8) {
    std::memcpy(codes, q, 64);
  } else {
    for (int j = 0; j < 32; ++j) {
      codes[j] = (int8_t)(q[j] & 0x0F);
      codes[j + 32] = (int8_t)(q[j] >> 4);
    }
    for (int plane = 0; plane < bits - 4; ++plane) {
      uint64_t mask;
      std::memcpy(&mask, q + 32 + 8 * plane, 8);
      for (int j = 0; j < 64; ++j) codes[j] |= (int8_t)(((mask >> j) & 1u) << (4 + plane));
    }
  }
}

// The canonical horizontal sum of 16 lanes: i + 8, then i + 4, i + 2, i + 1.
inline float canonical_hsum(const float v[16]) {
  float s8[8], s4[4], s2[2];
  for (int i = 0; i < 8; ++i) s8[i] = v[i] + v[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  for (int i = 0; i < 2; ++i) s2[i] = s4[i] + s4[i + 2];
  return s2[0] + s2[1];
}

inline int chunks_of(int k) { return (k + kChunk - 1) / kChunk; }

// Number of quarters in chunk `chunk` of a row of k inputs (k a multiple of 64).
inline int quarters_in(int k, int chunk) {
  const int left = k - chunk * kChunk;
  return left >= kChunk ? 4 : left / kQuarter;
}

template <int TYPE>
inline std::size_t chunk_bytes_of() {
  return (std::size_t)scale_bytes_of<TYPE>() + 4 * (std::size_t)quarter_bytes_of<TYPE>();
}

template <int TYPE>
inline std::size_t row_bytes_of(int k) {
  const int full = k / kChunk;
  const int rest_quarters = (k % kChunk) / kQuarter;
  std::size_t bytes = (std::size_t)full * chunk_bytes_of<TYPE>();
  if (rest_quarters) bytes += scale_bytes_of<TYPE>() + (std::size_t)rest_quarters * quarter_bytes_of<TYPE>();
  return bytes;
}

// Column tiles (qmatmul.h): inputs per chunk of a tile, bytes of one chunk, and where its parts start.
template <int TYPE>
constexpr int tile_span_of() { return TYPE == Q5_0_T16 ? kActBlock : kChunk; }
template <int TYPE>
constexpr int tile_scale_bytes_of() { return TYPE == Q4_K_T16 ? 320 : TYPE == Q6_K_T16 ? 288 : 32; }
template <int TYPE>
constexpr int tile_chunk_bytes_of() {
  return TYPE == Q4_K_T16 ? 320 + 2048 : TYPE == Q6_K_T16 ? 288 + 16 * 192 : 32 + 4 * 64 + 64;
}
// Multi-row passes compute long enough per chunk that the hardware prefetcher alone leaves the memory idle part of
// the time, so each chunk asks for the bytes this far ahead of it (distances of a few KiB measured alike):
// benchmarks/history/decode.md#native-kernels-sixth-pass-each-chunk-asks-for-its-bytes-ahead-and-the-whole-side-by-side-run-again-2026-12-02
// The AVX-512 column tiles' one-row passes leave it to the hardware prefetcher: there the requests slowed the
// projections and the decode (the row layouts' one-row passes need them: SmolLM2's float path is slower without):
// benchmarks/history/decode.md#one-row-tile-passes-without-software-prefetch-2026-12-06-morning
constexpr int kPrefetchBytes = 4096;

// Asks for the `bytes` bytes that start kPrefetchBytes past `at`, one request per cache line.
inline void prefetch_ahead(const uint8_t* at, std::size_t bytes) {
  for (std::size_t b = 0; b < bytes; b += 64) __builtin_prefetch(at + kPrefetchBytes + b);
}

constexpr int kTileGroupBytes = 192;  // Q6_K_T16: one group's two pairs of low nibbles and its high bits
constexpr int kTileQ5HighBytes = 32 + 4 * 64;  // Q5_0_T16: where a chunk's high bits start

// Calls f.template operator()<TYPE>() for a tiled type id (returns false for any other).
template <class F>
inline bool dispatch_tiled(int type, F&& f) {
  switch (type) {
    case Q4_K_T16: f.template operator()<Q4_K_T16>(); return true;
    case Q6_K_T16: f.template operator()<Q6_K_T16>(); return true;
    case Q5_0_T16: f.template operator()<Q5_0_T16>(); return true;
    default: return false;
  }
}

// The 16 columns' code of input i (0 .. span - 1) of one tiled chunk: codes[c] = code(c, i).
template <int TYPE>
inline void tile_codes(const uint8_t* chunk, int i, uint8_t codes[16]) {
  const int quad = i / 4, b = i % 4, shift = 4 * (quad % 2);
  const uint8_t* group = chunk + tile_scale_bytes_of<TYPE>() + kTileGroupBytes * (quad / 4);  // Q6_K_T16
  const uint8_t* pair = TYPE == Q6_K_T16 ? group + 64 * ((quad % 4) / 2)
                                         : chunk + tile_scale_bytes_of<TYPE>() + 64 * (quad / 2);
  for (int c = 0; c < 16; ++c) {
    uint8_t code = (pair[4 * c + b] >> shift) & 0x0F;
    if constexpr (TYPE == Q6_K_T16) code |= ((group[128 + 4 * c + b] >> (2 * (quad % 4))) & 3) << 4;
    if constexpr (TYPE == Q5_0_T16) code |= ((chunk[kTileQ5HighBytes + 4 * c + b] >> quad) & 1) << 4;
    codes[c] = code;
  }
}

// Calls f.template operator()<TYPE>() for a float weight type (returns false for any other).
template <class F>
inline bool dispatch_float(int type, F&& f) {
  switch (type) {
    case F32: f.template operator()<F32>(); return true;
    case F16: f.template operator()<F16>(); return true;
    case BF16: f.template operator()<BF16>(); return true;
    default: return false;
  }
}

// Input i of a float weight's row (F32, F16 or BF16), as float32 (exact for every type).
template <int TYPE>
inline float float_weight(const uint8_t* row, int i) {
  if constexpr (TYPE == F32) {
    float v;
    std::memcpy(&v, row + 4 * (std::size_t)i, 4);
    return v;
  } else if constexpr (TYPE == F16) {
    return half_to_float(load_u16(row + 2 * (std::size_t)i));
  } else {
    const uint32_t bits = (uint32_t)load_u16(row + 2 * (std::size_t)i) << 16;
    float v;
    std::memcpy(&v, &bits, 4);
    return v;
  }
}

// Calls f.template operator()<TYPE>() for a runtime type id of a block format (returns false for any other).
template <class F>
inline bool dispatch_type(int type, F&& f) {
  switch (type) {
    case Q4_0: f.template operator()<Q4_0>(); return true;
    case Q4_1: f.template operator()<Q4_1>(); return true;
    case Q5_0: f.template operator()<Q5_0>(); return true;
    case Q5_1: f.template operator()<Q5_1>(); return true;
    case Q8_0: f.template operator()<Q8_0>(); return true;
    case Q4_K: f.template operator()<Q4_K>(); return true;
    case Q5_K: f.template operator()<Q5_K>(); return true;
    case Q6_K: f.template operator()<Q6_K>(); return true;
    default: return false;
  }
}

}  // namespace sparsespec
