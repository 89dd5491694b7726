// Projections on GGUF blocks (project.h): the activations quantized once per call, the output columns split across
// the thread team.
#include "project.h"

#include <algorithm>
#include <vector>

#include "elementwise.h"
#include "fmatmul.h"
#include "parallel.h"
#include "qmatmul.h"

namespace sparsespec {
namespace {

// Scratch memory reused across calls (per calling thread): the widened and quantized activations, float rows.
struct Scratch {
  std::vector<float> x, out, dx, ds, dxl, d256;
  std::vector<int8_t> q, q256;
  std::vector<int32_t> bsum, xsum;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

}  // namespace

std::string check_projection(const Projection& p, const std::vector<std::size_t>& bytes) {
  if (p.types.empty() || p.blobs.size() != p.types.size() || p.rows.size() != p.types.size() ||
      bytes.size() != p.types.size())
    return "the segment lists differ in length";
  int multiple = kFloatGroup;
  for (int type : p.types) multiple = std::max(multiple, k_multiple(type));
  if (p.k <= 0 || p.k % multiple) return "k must be a positive multiple of " + std::to_string(multiple);
  long total = 0;
  for (std::size_t s = 0; s < p.types.size(); ++s) {
    const int type = p.types[s];
    if (!supported_type(type)) return "unsupported block type " + std::to_string(type);
    if (p.rows[s] < 1) return "a segment has no rows";
    if (p.float_activations && is_tiled(type))
      return "float activations read the row layout, not the column tiles of type " + std::to_string(type);
    if (is_tiled(type) && p.k % tile_span(type))
      return "a tiled weight of type " + std::to_string(type) + " needs k a multiple of " +
             std::to_string(tile_span(type));
    if (is_k_quant(type) && p.k % kChunk)
      return "a weight of K-quant type " + std::to_string(type) + " needs k a multiple of " + std::to_string(kChunk);
    if (bytes[s] != weight_bytes(type, p.k, p.rows[s]))
      return "segment " + std::to_string(s) + " has " + std::to_string(bytes[s]) + " bytes, not " +
             std::to_string(weight_bytes(type, p.k, p.rows[s]));
    total += p.rows[s];
  }
  if (total != p.n_out) return "the segments' rows do not add up to the outputs";
  return "";
}

void project(int isa, const Projection& p, const void* x, int m, bool bf16, const void* residual, void* out) {
  const int k = p.k, k_pad = padded_k(k);
  Scratch& sc = scratch();
  const float* xf;
  if (!bf16) {
    xf = static_cast<const float*>(x);
  } else {  // bfloat16 -> float32 is exact
    sc.x.resize((std::size_t)m * k);
    const uint16_t* src = static_cast<const uint16_t*>(x);
    for (std::size_t i = 0; i < sc.x.size(); ++i) sc.x[i] = bf16_to_float(src[i]);
    xf = sc.x.data();
  }
  bool any_k = false, any_32 = false;  // which quantized activations the segments read (none: float ones)
  std::vector<long> first_row;
  long n_total = 0;
  for (std::size_t s = 0; s < p.types.size(); ++s) {
    if (!p.float_activations && !is_float_type(p.types[s])) (is_k_quant(p.types[s]) ? any_k : any_32) = true;
    first_row.push_back(n_total);
    n_total += p.rows[s];
  }
  Activations act;
  act.m = m;
  act.k_pad = k_pad;
  if (any_32) {  // per-32 activations for the 32-weight formats
    sc.q.resize((std::size_t)m * k_pad);
    sc.dx.resize((std::size_t)m * k_pad / kActBlock);
    sc.ds.resize((std::size_t)m * k_pad / 16);
    sc.dxl.resize((std::size_t)m * k_pad / 4);
    sc.xsum.resize((std::size_t)m * k_pad / kActBlock);
    quantize_activations(isa, xf, m, k, k, sc.q.data(), sc.dx.data(), sc.ds.data(), sc.dxl.data(), sc.xsum.data());
    act.q = sc.q.data();
    act.dx = sc.dx.data();
    act.ds = sc.ds.data();
    act.dxl = sc.dxl.data();
    act.xsum = sc.xsum.data();
  }
  if (any_k) {  // per-256 activations for the K-quants
    sc.q256.resize((std::size_t)m * k_pad);
    sc.d256.resize((std::size_t)m * k_pad / kChunk);
    sc.bsum.resize((std::size_t)m * k_pad / 16);
    quantize_activations_256(isa, xf, m, k, k, sc.q256.data(), sc.d256.data(), sc.bsum.data());
    act.q256 = sc.q256.data();
    act.d256 = sc.d256.data();
    act.bsum = sc.bsum.data();
  }
  float* out_f32;
  if (!bf16) {
    out_f32 = static_cast<float*>(out);
  } else {
    sc.out.resize((std::size_t)m * n_total);
    out_f32 = sc.out.data();
  }
  const float* res_f32 = !bf16 ? static_cast<const float*>(residual) : nullptr;
  const uint16_t* res_bf16 = bf16 ? static_cast<const uint16_t*>(residual) : nullptr;
  uint16_t* out_bf16 = bf16 ? static_cast<uint16_t*>(out) : nullptr;
  // Output columns split across threads; each column's value never depends on the split. Each thread rounds its
  // own columns to bfloat16 and adds their residual, so no thread waits on a serial pass over them.
  parallel_for(0, n_total, 16, [&](int64_t begin, int64_t end) {
    for (std::size_t s = 0; s < p.types.size(); ++s) {
      const long lo = std::max<long>(begin, first_row[s]), hi = std::min<long>(end, first_row[s] + p.rows[s]);
      if (lo >= hi) continue;
      const float* segment_bias = p.bias ? p.bias + first_row[s] : nullptr;
      if (p.float_activations || is_float_type(p.types[s]))
        fmatmul_rows(isa, p.types[s], p.blobs[s], k, (int)(lo - first_row[s]), (int)(hi - first_row[s]), xf, m, k,
                     segment_bias, out_f32 + first_row[s], n_total);
      else
        qmatmul_rows(isa, p.types[s], p.blobs[s], k, (int)(lo - first_row[s]), (int)(hi - first_row[s]), act,
                     segment_bias, out_f32 + first_row[s], n_total);
    }
    if (bf16 || res_f32)
      for (int r = 0; r < m; ++r)
        for (int64_t c = begin; c < end; ++c) {
          const long i = (long)r * n_total + c;
          if (bf16)  // the product rounded, then the sum rounded: what a bfloat16 add after the product gives
            out_bf16[i] = res_bf16 ? float_to_bf16(bf16_to_float(res_bf16[i]) + round_bf16(out_f32[i]))
                                   : float_to_bf16(out_f32[i]);
          else
            out_f32[i] += res_f32[i];
        }
  });
}

}  // namespace sparsespec
