// The chunk kernels of attention.h, written once over an instruction set's primitives. Included by each
// attention_<isa>.cpp after it defines, in its own namespace:
//   float dot(const float* q, const float* k, int n), float dot(const float* q, const uint16_t* k, int n)
//   void axpy(float a, const float* v, float* y, int n), void axpy(float a, const uint16_t* v, float* y, int n)
//   float exp_sum(float* x, int n, float m): x = exp(x - m) in place (0 where x = -inf), returns their sum
//   void dequantize_row(const uint8_t* codes, const uint16_t* params, int hd, int bits, int code_group, float* out):
//     attention.h's dequantize_row_scalar, bit for bit
// and, for the vector paths, a struct Vec (register type T, W lanes, R registers; load from float or bf16, set1, add,
// sub, mul, fma, max, hsum4, store) for the fixed-head_dim kernels (head_dim = 2, 4, 8 or 16 registers): a key or
// value row is widened once into registers, and the value sums stay in registers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "attention.h"

namespace sparsespec {
namespace ATTN_ISA {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {
  const uint32_t bits = (uint32_t)x << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The arena slot that the row's s-th slot in reading order holds (attention.h: AttnChunk::slot_of).
inline int phys(const AttnChunk& a, int s) { return a.slot_of ? a.slot_of[s] : s; }

inline bool sees(const AttnChunk& a, int s) { return s <= a.last_slot && a.evicted_at[phys(a, s)] == kNever; }

// The entry type K of the kernels below: float, uint16_t (bfloat16) or Codes (quantized entries, which are read
// through dequantize_row into a float32 row first); Row<K> is the type of the row the arithmetic reads.
struct Codes {};
template <class K>
using Row = std::conditional_t<std::is_same_v<K, Codes>, float, K>;

// True when slot s is read in full precision by the chunk's row (quantized entries with a window, attention.h).
inline bool in_recent_window(const AttnChunk& a, int s) {
  return a.recent_window && a.positions[phys(a, s)] > a.newest - a.recent_window;
}

// The key (keys = true) or value row of the row's s-th slot in reading order: a pointer into the arena, or for
// quantized entries `buf` holding the row dequantized, plus the key offset unless `key_offset` is false (the
// caller adds it) — or, for a slot in the full-precision window, `buf` holding its full-precision row (whose key
// has the offset in already).
template <class K>
inline const Row<K>* entry_row(const AttnChunk& a, bool keys, int s, float* buf, bool key_offset = true) {
  const long slot = phys(a, s);
  if constexpr (std::is_same_v<K, Codes>) {
    if (in_recent_window(a, s)) {
      const int64_t p = a.positions[slot];
      if (p >= a.first_position) {
        std::memcpy(buf, (keys ? a.block_keys : a.block_values) + (p - a.first_position) * a.hd, sizeof(float) * a.hd);
      } else {
        const long at = (long)(p % a.recent_slots) * a.hd;
        const void* ring = keys ? a.recent_keys : a.recent_values;
        if (a.recent_bf16)
          for (int c = 0; c < a.hd; ++c) buf[c] = to_float(static_cast<const uint16_t*>(ring)[at + c]);
        else
          std::memcpy(buf, static_cast<const float*>(ring) + at, sizeof(float) * a.hd);
      }
      return buf;
    }
    const uint8_t* codes = static_cast<const uint8_t*>(keys ? a.keys : a.values) + slot * code_bytes(a.hd, a.code_bits);
    const uint16_t* params = (keys ? a.key_params : a.value_params) + slot * param_halves(a.hd, a.code_group);
    dequantize_row(codes, params, a.hd, a.code_bits, a.code_group, buf);
    if (keys && key_offset && a.key_offset)
      for (int c = 0; c < a.hd; ++c) buf[c] += a.key_offset[c];
    return buf;
  } else {
    return static_cast<const K*>(keys ? a.keys : a.values) + slot * a.hd;
  }
}

// key(s) rotated by its rank: x * cos + rotate_half(x) * sin, in float32 (the arena's Rope, Hugging Face layout).
template <class K>
inline void rotate_key(const AttnChunk& a, const K* k, int rank, float* out) {
  const int half = a.hd / 2;
  const float* c = a.cos + (long)rank * a.hd;
  const float* s = a.sin + (long)rank * a.hd;
  for (int j = 0; j < half; ++j) out[j] = to_float(k[j]) * c[j] + (-to_float(k[j + half])) * s[j];
  for (int j = half; j < a.hd; ++j) out[j] = to_float(k[j]) * c[j] + to_float(k[j - half]) * s[j];
}

// max_out[g] = the largest logit of the chunk (-inf if it sees none).
inline void chunk_max(const AttnChunk& a, int s0, int s1, float* max_out) {
  for (int g = 0; g < a.group; ++g) {
    const float* x = a.logits + g * a.lds;
    float best = -std::numeric_limits<float>::infinity();
#ifdef ATTN_VEC
    typename Vec::T vbest = Vec::set1(best);
    int s = s0;
    for (; s + Vec::W <= s1; s += Vec::W) vbest = Vec::max(vbest, Vec::load(x + s));
    alignas(64) float lanes[Vec::W];
    Vec::store(lanes, vbest);
    for (int l = 0; l < Vec::W; ++l) best = std::max(best, lanes[l]);
    for (; s < s1; ++s) best = std::max(best, x[s]);
#else
    for (int s = s0; s < s1; ++s) best = std::max(best, x[s]);
#endif
    max_out[g] = best;
  }
}

#ifdef ATTN_VEC
// Logits of four slots (rows[i]: their key rows, float or bf16) for the query heads [g0, g0 + nb), nb <= GB: each
// key register is widened once and serves every head of the pass (GB * 4 sums, 4 keys and a query in registers);
// per head and slot the dot is q[0] * k[0], then fma over the head_dim's registers in order, reduced by hsum4 (each
// slot's lanes in the same fixed order, whatever its neighbours or the heads beside it).
template <int NV, int GB, class P>
inline void quad_logits(const AttnChunk& a, const P* const* rows, int g0, int nb, float (*sums)[4]) {
  using T = typename Vec::T;
  T acc[GB][4];
  for (int v = 0; v < NV; ++v) {
    T k[4];
    for (int i = 0; i < 4; ++i) k[i] = Vec::load(rows[i] + v * Vec::W);
    for (int b = 0; b < GB; ++b) {
      if (b >= nb) break;
      const T qv = Vec::load(a.q + (g0 + b) * a.ldq + v * Vec::W);
      for (int i = 0; i < 4; ++i) acc[b][i] = v == 0 ? Vec::mul(qv, k[i]) : Vec::fma(qv, k[i], acc[b][i]);
    }
  }
  for (int b = 0; b < nb; ++b) Vec::hsum4(acc[b], sums[b]);
}

// rotate_key for head_dim = NV registers, with the key offset (quantized keys' offset, or null) added first as
// entry_row adds it: the same float operations lane by lane (x * c - x' * s is x * c + (-x') * s), in registers.
template <int NV, class P>
inline void rotate_key_fixed(const AttnChunk& a, const P* k, const float* offset, int rank, float* out) {
  using T = typename Vec::T;
  constexpr int H = NV / 2;
  const float* c = a.cos + (long)rank * a.hd;
  const float* s = a.sin + (long)rank * a.hd;
  T lo[H], hi[H];
  for (int v = 0; v < H; ++v) {
    lo[v] = Vec::load(k + v * Vec::W);
    hi[v] = Vec::load(k + (v + H) * Vec::W);
    if (offset) {
      lo[v] = Vec::add(lo[v], Vec::load(offset + v * Vec::W));
      hi[v] = Vec::add(hi[v], Vec::load(offset + (v + H) * Vec::W));
    }
  }
  for (int v = 0; v < H; ++v) {  // the tables' halves are equal (attention.h): each register serves both
    const int j = v * Vec::W, jh = (v + H) * Vec::W;
    const T cv = Vec::load(c + j), sv = Vec::load(s + j);
    Vec::store(out + j, Vec::sub(Vec::mul(lo[v], cv), Vec::mul(hi[v], sv)));
    Vec::store(out + jh, Vec::add(Vec::mul(hi[v], cv), Vec::mul(lo[v], sv)));
  }
}

// head_dim = NV registers: slots four at a time (keys rotated by rank first in the in-cache mode, the key offset
// added in the same pass), GB query heads per pass over their key registers.
template <class K, int NV>
void logits_fixed(const AttnChunk& a, int s0, int s1, float* max_out) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr int GB = std::clamp((Vec::R - 5) / 4, 1, 8);
  alignas(64) float rotated[4][kAttnMaxHeadDim];
  alignas(64) float dequantized[4][kAttnMaxHeadDim];
  float sums[GB][4];
  for (int s = s0; s < s1; s += 4) {
    const int n = std::min(4, s1 - s);
    bool seen[4];
    const Row<K>* raw[4];
    const float* rot[4];
    for (int i = 0; i < 4; ++i) {
      const int slot = s + std::min(i, n - 1);  // past the chunk's end: repeat its last slot (result unused)
      seen[i] = i < n && sees(a, slot);
      raw[i] = entry_row<K>(a, true, slot, dequantized[i], !a.ranks);
      rot[i] = rotated[i];
      if (a.ranks) {
        const float* offset = std::is_same_v<K, Codes> && !in_recent_window(a, slot) ? a.key_offset : nullptr;
        if (seen[i]) rotate_key_fixed<NV>(a, raw[i], offset, a.ranks[phys(a, slot)], rotated[i]);
        else std::fill(rotated[i], rotated[i] + a.hd, 0.0f);
      }
    }
    if constexpr (!std::is_same_v<K, Codes>) {  // the keys of the quad after next
      for (int ahead = s + 8; ahead < std::min(s + 12, s1); ++ahead) {
        const char* from = reinterpret_cast<const char*>(static_cast<const K*>(a.keys) + (long)phys(a, ahead) * a.hd);
        for (int byte = 0; byte < a.hd * (int)sizeof(K); byte += 64) __builtin_prefetch(from + byte);
      }
    }
    for (int g0 = 0; g0 < a.group; g0 += GB) {
      const int nb = std::min(GB, a.group - g0);
      if (a.ranks) quad_logits<NV, GB>(a, rot, g0, nb, sums);
      else quad_logits<NV, GB>(a, raw, g0, nb, sums);
      for (int b = 0; b < nb; ++b)
        for (int i = 0; i < n; ++i) a.logits[(g0 + b) * a.lds + s + i] = seen[i] ? sums[b][i] * a.scale : kNegInf;
    }
  }
  chunk_max(a, s0, s1, max_out);
}

// head_dim = NV registers: the value sums in tiles of VB registers of head_dim for GB query heads, kept in registers
// (GB * VB sums and VB values), slots in order: each value register is widened once per tile and added into every
// head's sum of the tile (fma(p, value, sum)). Quantized values are dequantized once per slot, a span of kSpan slots
// at a time into a buffer the tiles then read; the sums go through `out` between spans, which changes no value (the
// same additions in slot order).
template <class K, int NV>
void exp_values_fixed(const AttnChunk& a, int s0, int s1, const float* m, float* sum_out, float* out) {
  using T = typename Vec::T;
  constexpr int VB = std::min(NV, Vec::R / 8);
  constexpr int GB = std::clamp((Vec::R - 2 - VB) / VB, 1, 16);
  constexpr bool kCodes = std::is_same_v<K, Codes>;
  constexpr int kSpan = kCodes ? 32 : kAttnChunk;
  constexpr int kAhead = 4;  // slots between a value row's prefetch and its use
  alignas(64) float dequantized[kCodes ? kSpan * NV * Vec::W : 1];
  int seen[kSpan + kAhead];
  for (int g = 0; g < a.group; ++g) sum_out[g] = exp_sum(a.logits + g * a.lds + s0, s1 - s0, m[g]);
  for (int t0 = s0; t0 < s1; t0 += kSpan) {
    const int t1 = std::min(s1, t0 + kSpan);
    int n_seen = 0;
    for (int s = t0; s < t1; ++s)
      if (sees(a, s)) seen[n_seen++] = s;
    if (n_seen == 0 && t0 != s0) continue;
    for (int j = n_seen; j < n_seen + kAhead; ++j) seen[j] = n_seen ? seen[n_seen - 1] : t0;
    if constexpr (kCodes)
      for (int j = 0; j < n_seen; ++j) entry_row<K>(a, false, seen[j], dequantized + (seen[j] - t0) * a.hd);
    for (int v0 = 0; v0 < NV; v0 += VB)
      for (int g0 = 0; g0 < a.group; g0 += GB) {
        const int nb = std::min(GB, a.group - g0);
        const float* p = a.logits + g0 * a.lds;
        float* o = out + g0 * a.hd + v0 * Vec::W;
        T acc[GB][VB];
        for (int b = 0; b < nb; ++b)
          for (int v = 0; v < VB; ++v) acc[b][v] = t0 == s0 ? Vec::set1(0.0f) : Vec::load(o + b * a.hd + v * Vec::W);
        for (int j = 0; j < n_seen; ++j) {
          const int s = seen[j];
          const Row<K>* row;
          if constexpr (kCodes) {
            row = dequantized + (s - t0) * a.hd;
          } else {
            row = static_cast<const K*>(a.values) + (long)phys(a, s) * a.hd;
            const char* ahead = reinterpret_cast<const char*>(static_cast<const K*>(a.values) +
                                                              (long)phys(a, seen[j + kAhead]) * a.hd + v0 * Vec::W);
            for (int byte = 0; byte < VB * Vec::W * (int)sizeof(K); byte += 64) __builtin_prefetch(ahead + byte);
          }
          T x[VB];
          for (int v = 0; v < VB; ++v) x[v] = Vec::load(row + (v0 + v) * Vec::W);
          for (int b = 0; b < GB; ++b) {
            if (b >= nb) break;
            const T pb = Vec::set1(p[b * a.lds + s]);
            for (int v = 0; v < VB; ++v) acc[b][v] = Vec::fma(pb, x[v], acc[b][v]);
          }
        }
        for (int b = 0; b < nb; ++b)
          for (int v = 0; v < VB; ++v) Vec::store(o + b * a.hd + v * Vec::W, acc[b][v]);
      }
  }
}

// Calls f.template operator()<NV>() for head_dim = NV registers of a supported size; false otherwise.
template <class F>
bool dispatch_fixed(int hd, F&& f) {
  if (hd % Vec::W) return false;
  switch (hd / Vec::W) {
    case 2: f.template operator()<2>(); return true;
    case 4: f.template operator()<4>(); return true;
    case 8: f.template operator()<8>(); return true;
    case 16: f.template operator()<16>(); return true;
    default: return false;
  }
}
#endif

template <class K>
void logits_impl(const AttnChunk& a, int s0, int s1, float* max_out) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  alignas(64) float rotated[kAttnMaxHeadDim];
  alignas(64) float dequantized[kAttnMaxHeadDim];
  for (int s = s0; s < s1; ++s) {
    if (!sees(a, s)) {
      for (int g = 0; g < a.group; ++g) a.logits[g * a.lds + s] = kNegInf;
      continue;
    }
    const Row<K>* k = entry_row<K>(a, true, s, dequantized);
    for (int g = 0; g < a.group; ++g) {
      float logit;
      if (a.ranks) {
        if (g == 0) rotate_key(a, k, a.ranks[phys(a, s)], rotated);
        logit = dot(a.q + g * a.ldq, rotated, a.hd) * a.scale;
      } else {
        logit = dot(a.q + g * a.ldq, k, a.hd) * a.scale;
      }
      a.logits[g * a.lds + s] = logit;
    }
  }
  chunk_max(a, s0, s1, max_out);
}

template <class K>
void exp_values_impl(const AttnChunk& a, int s0, int s1, const float* m, float* sum_out, float* out) {
  alignas(64) float dequantized[kAttnMaxHeadDim];
  for (int g = 0; g < a.group; ++g) sum_out[g] = exp_sum(a.logits + g * a.lds + s0, s1 - s0, m[g]);
  std::memset(out, 0, sizeof(float) * a.group * a.hd);
  for (int s = s0; s < s1; ++s) {
    if (!sees(a, s)) continue;
    const Row<K>* v = entry_row<K>(a, false, s, dequantized);
    for (int g = 0; g < a.group; ++g) axpy(a.logits[g * a.lds + s], v, out + g * a.hd, a.hd);
  }
}

template <class K>
void logits_any(const AttnChunk& a, int s0, int s1, float* max_out) {
#ifdef ATTN_VEC
  if (dispatch_fixed(a.hd, [&]<int NV>() { logits_fixed<K, NV>(a, s0, s1, max_out); })) return;
#endif
  logits_impl<K>(a, s0, s1, max_out);
}

template <class K>
void exp_values_any(const AttnChunk& a, int s0, int s1, const float* m, float* sum_out, float* out) {
#ifdef ATTN_VEC
  if (dispatch_fixed(a.hd, [&]<int NV>() { exp_values_fixed<K, NV>(a, s0, s1, m, sum_out, out); })) return;
#endif
  exp_values_impl<K>(a, s0, s1, m, sum_out, out);
}

inline void logits_chunk(const AttnChunk& a, int s0, int s1, float* max_out) {
  if (a.code_bits) logits_any<Codes>(a, s0, s1, max_out);
  else if (a.bf16) logits_any<uint16_t>(a, s0, s1, max_out);
  else logits_any<float>(a, s0, s1, max_out);
}

inline void exp_values_chunk(const AttnChunk& a, int s0, int s1, const float* m, float* sum_out, float* out) {
  if (a.code_bits) exp_values_any<Codes>(a, s0, s1, m, sum_out, out);
  else if (a.bf16) exp_values_any<uint16_t>(a, s0, s1, m, sum_out, out);
  else exp_values_any<float>(a, s0, s1, m, sum_out, out);
}

}  // namespace ATTN_ISA
}  // namespace sparsespec
