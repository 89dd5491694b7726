// Python bindings of the native kernels: the ops, and facts about the build.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstring>
#include <vector>

#include "attention.h"
#include "elementwise.h"
#include "fmatmul.h"
#include "qmatmul.h"
#include "recall.h"

namespace sparsespec {
namespace {

// Scratch memory reused across calls (per calling thread): the quantized activations, and float rows.
struct Scratch {
  std::vector<float> x, out, dx, ds, dxl, d256;
  std::vector<int8_t> q, q256;
  std::vector<int32_t> bsum, xsum;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// The ops read host memory: every tensor they get must live there.
void check_cpu(const char* op, std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) TORCH_CHECK(!t->defined() || t->is_cpu(), op, ": tensors must be on the CPU");
}

// y [m, sum(rows)] = x [m, k] @ W^T for a weight stored as segments (each a repacked GGUF tensor of rows[s] rows
// and type types[s]; e.g. q, k and v of one layer), plus a float32 bias [sum(rows)] if given. x is float32 or
// bfloat16 (contiguous); y has x's dtype (computed in float32, rounded once at the end). The activations are
// quantized to 8 bits (qmatmul.h), or with float_activations multiply as they are (fmatmul.h; row layouts only).
// With a residual [m, sum(rows)] in x's dtype, y = residual + x @ W^T, bit for bit the add of the two tensors (the
// decoder's skip connections, without a pass of their own over the rows).
at::Tensor gguf_linear(const at::Tensor& x, const std::vector<at::Tensor>& weights, const std::vector<int64_t>& types,
                       const std::vector<int64_t>& rows, int64_t k, const c10::optional<at::Tensor>& bias,
                       int64_t isa, bool float_activations, const c10::optional<at::Tensor>& residual) {
  check_cpu("gguf_linear", {&x});
  for (const auto& w : weights) check_cpu("gguf_linear", {&w});
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "gguf_linear: x must be [m, ", k, "]");
  TORCH_CHECK(k % kQuarter == 0, "gguf_linear: k must be a multiple of ", kQuarter, " (repacked rows)");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "gguf_linear: x must be float32 or bfloat16");
  TORCH_CHECK(weights.size() == types.size() && weights.size() == rows.size(), "gguf_linear: segment lists differ");
  TORCH_CHECK(isa == kAuto || isa_available((int)isa), "gguf_linear: instruction set ", isa, " not available");
  const at::Tensor xc = x.contiguous();
  const int m = (int)xc.size(0);
  const int k_pad = padded_k((int)k);
  int64_t n_total = 0;
  std::vector<int64_t> first_row;
  bool any_k = false, any_32 = false;  // which quantized activations the segments read (none: float ones)
  for (std::size_t s = 0; s < weights.size(); ++s) {
    if (!float_activations) (is_k_quant((int)types[s]) ? any_k : any_32) = true;
    TORCH_CHECK(supported_type((int)types[s]), "gguf_linear: unsupported block type ", types[s]);
    TORCH_CHECK(!float_activations || !is_tiled((int)types[s]),
                "gguf_linear: float activations read the row layout, not the column tiles of type ", types[s]);
    TORCH_CHECK(weights[s].dtype() == at::kByte && weights[s].is_contiguous(), "gguf_linear: weights must be uint8");
    TORCH_CHECK(!is_tiled((int)types[s]) || k % tile_span((int)types[s]) == 0,
                "gguf_linear: a tiled weight of type ", types[s], " needs k a multiple of ", tile_span((int)types[s]));
    // The K-quant row kernels read whole 256-input chunks (a GGUF K-quant row is made of them).
    TORCH_CHECK(!is_k_quant((int)types[s]) || k % kChunk == 0, "gguf_linear: a weight of K-quant type ", types[s],
                " needs k a multiple of ", kChunk);
    TORCH_CHECK((std::size_t)weights[s].numel() == weight_bytes((int)types[s], (int)k, rows[s]),
                "gguf_linear: segment ", s, " has ", weights[s].numel(), " bytes, not ",
                weight_bytes((int)types[s], (int)k, rows[s]));
    first_row.push_back(n_total);
    n_total += rows[s];
  }
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n_total,
                "gguf_linear: bias must be float32 [", n_total, "]");
    bias_ptr = bias->data_ptr<float>();
  }
  Scratch& sc = scratch();
  const float* xf = nullptr;
  if (xc.scalar_type() == at::kFloat) {
    xf = xc.data_ptr<float>();
  } else {  // bfloat16 -> float32 is exact
    sc.x.resize((std::size_t)m * k);
    const c10::BFloat16* src = xc.data_ptr<c10::BFloat16>();
    for (std::size_t i = 0; i < sc.x.size(); ++i) sc.x[i] = (float)src[i];
    xf = sc.x.data();
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
    quantize_activations((int)isa, xf, m, (int)k, k, sc.q.data(), sc.dx.data(), sc.ds.data(), sc.dxl.data(),
                         sc.xsum.data());
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
    quantize_activations_256((int)isa, xf, m, (int)k, k, sc.q256.data(), sc.d256.data(), sc.bsum.data());
    act.q256 = sc.q256.data();
    act.d256 = sc.d256.data();
    act.bsum = sc.bsum.data();
  }
  auto out = at::empty({m, n_total}, xc.options());
  const bool bf16_out = xc.scalar_type() != at::kFloat;
  float* out_ptr;
  c10::BFloat16* bf16_ptr = nullptr;
  if (!bf16_out) {
    out_ptr = out.data_ptr<float>();
  } else {
    sc.out.resize((std::size_t)m * n_total);
    out_ptr = sc.out.data();
    bf16_ptr = out.data_ptr<c10::BFloat16>();
  }
  at::Tensor residual_c;  // the rows the product is added to, if any
  if (residual.has_value() && residual->defined()) {
    check_cpu("gguf_linear", {&*residual});
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == m && residual->size(1) == n_total &&
                    residual->scalar_type() == xc.scalar_type(),
                "gguf_linear: residual must be [", m, ", ", n_total, "] in the dtype of x");
    residual_c = residual->contiguous();
  }
  const float* res_f32 = residual_c.defined() && !bf16_out ? residual_c.data_ptr<float>() : nullptr;
  const c10::BFloat16* res_bf16 = residual_c.defined() && bf16_out ? residual_c.data_ptr<c10::BFloat16>() : nullptr;
  std::vector<const uint8_t*> weight_ptrs;
  for (const auto& w : weights) weight_ptrs.push_back(w.data_ptr<uint8_t>());
  // Output columns split across threads; each column's value never depends on the split. Each thread rounds its
  // own columns to bfloat16 (nearest even, as Tensor.to does) and adds their residual, so no thread waits on a
  // serial pass over them.
  at::parallel_for(0, n_total, 16, [&](int64_t begin, int64_t end) {
    for (std::size_t s = 0; s < weights.size(); ++s) {
      const int64_t lo = std::max(begin, first_row[s]), hi = std::min(end, first_row[s] + rows[s]);
      if (lo >= hi) continue;
      const float* segment_bias = bias_ptr ? bias_ptr + first_row[s] : nullptr;
      if (float_activations)
        fmatmul_rows((int)isa, (int)types[s], weight_ptrs[s], (int)k, (int)(lo - first_row[s]),
                     (int)(hi - first_row[s]), xf, m, k, segment_bias, out_ptr + first_row[s], n_total);
      else
        qmatmul_rows((int)isa, (int)types[s], weight_ptrs[s], (int)k, (int)(lo - first_row[s]),
                     (int)(hi - first_row[s]), act, segment_bias, out_ptr + first_row[s], n_total);
    }
    if (bf16_out || res_f32)
      for (int r = 0; r < m; ++r)
        for (int64_t c = begin; c < end; ++c) {
          const int64_t i = r * n_total + c;
          if (bf16_out)  // the product rounded, then the sum rounded: what a bfloat16 add after the product gives
            bf16_ptr[i] = res_bf16 ? c10::BFloat16((float)res_bf16[i] + (float)c10::BFloat16(out_ptr[i]))
                                   : c10::BFloat16(out_ptr[i]);
          else
            out_ptr[i] += res_f32[i];
        }
  });
  return out;
}

// Rows `index` of a repacked weight [n, k], dequantized: float32 [len(index), k] (embedding lookups, tests).
at::Tensor gguf_dequantize(const at::Tensor& weight, int64_t type, int64_t k, const at::Tensor& index) {
  check_cpu("gguf_dequantize", {&weight, &index});
  TORCH_CHECK(supported_type((int)type), "gguf_dequantize: unsupported block type ", type);
  // Rows (tiles) of k inputs have whole quarters (chunks); below one they would have 0 bytes to divide by.
  TORCH_CHECK(k > 0 && k % kQuarter == 0 && (!is_tiled((int)type) || k % tile_span((int)type) == 0),
              "gguf_dequantize: k must be a positive multiple of ", kQuarter,
              is_tiled((int)type) ? " and of the tiles' span" : "", ", not ", k);
  const at::Tensor idx = index.to(at::kLong).contiguous();
  const int64_t n = is_tiled((int)type) ? weight.numel() / (int64_t)tile_bytes((int)type, (int)k) * kTileColumns
                                         : weight.numel() / (int64_t)row_bytes((int)type, (int)k);
  TORCH_CHECK(idx.numel() == 0 || (idx.min().item<int64_t>() >= 0 && idx.max().item<int64_t>() < n),
              "gguf_dequantize: row index out of range");
  auto out = at::empty({idx.numel(), k}, weight.options().dtype(at::kFloat));
  dequantize_rows((int)type, weight.data_ptr<uint8_t>(), (int)k, idx.data_ptr<int64_t>(), (int)idx.numel(),
                  out.data_ptr<float>());
  return out;
}

// t [d0, d1, d2] (float32 or bfloat16, any strides) as contiguous float32 (widening is exact), without torch ops.
std::vector<float> widened(const at::Tensor& t) {
  const int64_t d0 = t.size(0), d1 = t.size(1), d2 = t.size(2);
  const int64_t s0 = t.stride(0), s1 = t.stride(1), s2 = t.stride(2);
  std::vector<float> out((std::size_t)(d0 * d1 * d2));
  const bool bf16 = t.scalar_type() == at::kBFloat16;
  const void* data = t.data_ptr();
  std::size_t o = 0;
  for (int64_t a = 0; a < d0; ++a)
    for (int64_t b = 0; b < d1; ++b)
      for (int64_t c = 0; c < d2; ++c) {
        const int64_t at = a * s0 + b * s1 + c * s2;
        out[o++] = bf16 ? bf16_to_float(static_cast<const uint16_t*>(data)[at]) : static_cast<const float*>(data)[at];
      }
  return out;
}

// Element i of a contiguous float32 or bfloat16 buffer, as float.
inline float element(const void* data, bool bf16, int64_t i) {
  return bf16 ? bf16_to_float(static_cast<const uint16_t*>(data)[i]) : static_cast<const float*>(data)[i];
}

// Store y at element i of a contiguous float32 or bfloat16 buffer (rounded to nearest even for bfloat16).
inline void put(void* data, bool bf16, int64_t i, float y) {
  if (bf16)
    static_cast<uint16_t*>(data)[i] = float_to_bf16(y);
  else
    static_cast<float*>(data)[i] = y;
}

bool float_or_bf16(const at::Tensor& t) { return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16; }

// The open block's T rows entering and attending over one layer of the KV arena (see attention.h and
// sparsespec/cache/arena.py). q [n_heads, T, hd], k, v [n_kv, T, hd]: the block's queries, keys and values before
// RoPE (float32 or bfloat16, any strides). Arena tensors, whole (all layers): keys, values [L, n_kv, cap, hd]
// float32 or bfloat16, or (code_bits 8 or 4) uint8 codes [L, n_kv, cap, hd * code_bits / 8] with key_params,
// value_params [L, n_kv, cap, hd / group, 2] float16 (attention.h), key_offset [L, n_kv, hd] float32 or None
// (quantized keys are stored minus it and read plus it); positions [L, n_kv, cap] int64; evicted_at
// [L, n_kv, cap] int32 (evictions marked with row `first + i` for row i); scores [L, n_kv, cap] float32
// (heavy-hitter policies, else None); row_scores [R, L, n_kv, cap] float32 (row i's scores copied to
// row_scores[first + i] for i < snapshots, else None). cos, sin [P, hd] float32 RoPE tables, row p - table_offset
// for position (original mode) or rank (in-cache mode, table_offset 0). age_normalised: heavy hitters ranked by
// score / age (hybrid-age). score_decay: every row multiplies the scores by it before adding its attention
// (hybrid-decay; 1 elsewhere). per_row: the policy evicts after every row (else once after the block, if
// visible_before + T exceeds the budget); budget -1: the full cache. Returns [T, n_heads * hd] in q's dtype.
at::Tensor arena_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor keys,
                           at::Tensor values, at::Tensor positions, at::Tensor evicted_at,
                           const c10::optional<at::Tensor>& scores, const c10::optional<at::Tensor>& row_scores,
                           const at::Tensor& cos, const at::Tensor& sin, int64_t table_offset, bool in_cache,
                           int64_t layer, int64_t start, int64_t first, int64_t visible_before, int64_t first_position,
                           int64_t snapshots, bool per_row, int64_t budget, int64_t sinks, int64_t heavy,
                           int64_t window, bool age_normalised, double score_decay, double scale,
                           const c10::optional<at::Tensor>& key_params,
                           const c10::optional<at::Tensor>& value_params, int64_t code_bits,
                           const c10::optional<at::Tensor>& key_offset,
                           const c10::optional<at::Tensor>& recent_keys,
                           const c10::optional<at::Tensor>& recent_values, int64_t recent_window,
                           const c10::optional<at::Tensor>& row_lse, int64_t isa) {
  check_cpu("arena_attention", {&q, &k, &v, &keys, &values, &positions, &evicted_at, &cos, &sin});
  for (const auto* t : {&scores, &row_scores, &key_params, &value_params, &key_offset, &recent_keys, &recent_values,
                        &row_lse})
    if (t->has_value()) check_cpu("arena_attention", {&t->value()});
  const bool quantized = code_bits != 0;
  TORCH_CHECK(keys.dim() == 4 && keys.is_contiguous() && values.is_contiguous() && values.sizes() == keys.sizes() &&
                  values.scalar_type() == keys.scalar_type() &&
                  (quantized ? keys.scalar_type() == at::kByte : float_or_bf16(keys)),
              "arena_attention: keys and values must be contiguous float32 or bfloat16 [L, n_kv, cap, hd] alike, or "
              "uint8 codes with code_bits");
  TORCH_CHECK(q.dim() == 3, "arena_attention: q must be [n_heads, T, hd]");
  const int64_t n_layers = keys.size(0), n_kv = keys.size(1), cap = keys.size(2), hd = q.size(2);
  const int64_t T = q.size(1);
  int64_t code_group = 0;
  if (quantized) {
    TORCH_CHECK((code_bits == 8 || code_bits == 4) && keys.size(3) == code_bytes((int)hd, (int)code_bits),
                "arena_attention: code_bits must be 8 or 4 with codes [L, n_kv, cap, hd * code_bits / 8]");
    TORCH_CHECK(key_params.has_value() && value_params.has_value() && key_params->defined() &&
                    value_params->defined(), "arena_attention: quantized entries need key_params and value_params");
    const at::Tensor& kp = *key_params;
    TORCH_CHECK(kp.scalar_type() == at::kHalf && kp.is_contiguous() && value_params->is_contiguous() &&
                    value_params->sizes() == kp.sizes() && value_params->scalar_type() == at::kHalf &&
                    kp.dim() == 5 && kp.size(0) == n_layers && kp.size(1) == n_kv && kp.size(2) == cap &&
                    kp.size(4) == 2 && kp.size(3) >= 1 && hd % kp.size(3) == 0,
                "arena_attention: key_params and value_params must be contiguous float16 [L, n_kv, cap, groups, 2]");
    code_group = hd / kp.size(3);
  } else {
    TORCH_CHECK(keys.size(3) == hd, "arena_attention: keys must be [L, n_kv, cap, ", hd, "]");
  }
  TORCH_CHECK(layer >= 0 && layer < n_layers, "arena_attention: layer ", layer, " outside the arena");
  TORCH_CHECK(float_or_bf16(q) && n_kv >= 1 && q.size(0) % n_kv == 0 && q.size(0) >= n_kv &&
                  q.size(0) / n_kv <= kAttnMaxGroup && hd >= 2 && hd % 2 == 0 && hd <= kAttnMaxHeadDim,
              "arena_attention: q must be float32 or bfloat16 [n_kv * group, T, hd] with n_kv >= 1 KV heads, "
              "1 <= group <= 64 and even 2 <= hd <= 256, not [", q.size(0), ", ", q.size(1), ", ", hd, "] for ", n_kv,
              " KV heads");
  TORCH_CHECK(k.sizes() == at::IntArrayRef({n_kv, T, hd}) && v.sizes() == k.sizes() && float_or_bf16(k) &&
                  float_or_bf16(v), "arena_attention: k and v must be float32 or bfloat16 [", n_kv, ", ", T, ", ", hd,
              "]");
  TORCH_CHECK(T >= 1 && start >= 0 && start + T <= cap, "arena_attention: rows [", start, ", ", start + T,
              ") outside the arena's ", cap, " slots");
  // Positions and ranks index the ranks' bitmap, the RoPE tables and the full-precision window's ring.
  TORCH_CHECK(first_position >= 0 && visible_before >= 0, "arena_attention: first_position (", first_position,
              ") and visible_before (", visible_before, ") must be >= 0");
  TORCH_CHECK(!per_row || budget >= 0, "arena_attention: per_row evictions need a budget");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.sizes() == at::IntArrayRef({n_layers, n_kv, cap}),
              "arena_attention: positions must be contiguous int64 [L, n_kv, cap]");
  TORCH_CHECK(evicted_at.scalar_type() == at::kInt && evicted_at.is_contiguous() &&
                  evicted_at.sizes() == at::IntArrayRef({n_layers, n_kv, cap}),
              "arena_attention: evicted_at must be contiguous int32 [L, n_kv, cap]");
  const int64_t newest_row = in_cache ? visible_before + T : first_position + T;
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == hd &&
                  (!in_cache || table_offset == 0) && table_offset >= 0 &&
                  table_offset <= (in_cache ? 0 : first_position) &&
                  cos.size(0) + table_offset >= std::max<int64_t>(newest_row, in_cache ? start + T : 0),
              "arena_attention: cos and sin must be contiguous float32 [P, ", hd, "] covering the block's rows");
  TORCH_CHECK(isa == kAuto || isa_available((int)isa), "arena_attention: instruction set ", isa, " not available");
  const long layer_slots = (long)n_kv * cap;
  AttnBlock b;
  b.n_kv = (int)n_kv;
  b.group = (int)(q.size(0) / n_kv);
  b.hd = (int)hd;
  b.T = (int)T;
  b.cap = (int)cap;
  b.bf16 = keys.scalar_type() == at::kBFloat16;
  const long layer_bytes = layer_slots * keys.size(3) * (long)keys.element_size();
  b.keys = static_cast<char*>(keys.data_ptr()) + layer * layer_bytes;
  b.values = static_cast<char*>(values.data_ptr()) + layer * layer_bytes;
  if (quantized) {
    const long layer_params = layer_slots * param_halves((int)hd, (int)code_group);
    b.code_bits = (int)code_bits;
    b.code_group = (int)code_group;
    b.key_params = reinterpret_cast<uint16_t*>(key_params->data_ptr<at::Half>()) + layer * layer_params;
    b.value_params = reinterpret_cast<uint16_t*>(value_params->data_ptr<at::Half>()) + layer * layer_params;
    if (key_offset.has_value() && key_offset->defined()) {
      TORCH_CHECK(key_offset->scalar_type() == at::kFloat && key_offset->is_contiguous() &&
                      key_offset->sizes() == at::IntArrayRef({n_layers, n_kv, hd}),
                  "arena_attention: key_offset must be contiguous float32 [L, n_kv, hd]");
      b.key_offset = key_offset->data_ptr<float>() + layer * n_kv * hd;
    }
  }
  std::vector<float> block_keys, block_values;
  if (recent_window > 0) {
    TORCH_CHECK(quantized && recent_keys.has_value() && recent_values.has_value() && recent_keys->defined() &&
                    recent_values->defined(), "arena_attention: a full-precision window needs quantized entries and "
                    "recent_keys and recent_values");
    const at::Tensor& rk = *recent_keys;
    TORCH_CHECK(rk.dim() == 4 && rk.is_contiguous() && recent_values->is_contiguous() && float_or_bf16(rk) &&
                    recent_values->sizes() == rk.sizes() && recent_values->scalar_type() == rk.scalar_type() &&
                    rk.size(0) == n_layers && rk.size(1) == n_kv && rk.size(2) >= recent_window && rk.size(3) == hd,
                "arena_attention: recent_keys and recent_values must be contiguous float32 or bfloat16 [L, n_kv, R, ",
                hd, "] alike with R >= recent_window");
    const long layer_ring = (long)n_kv * rk.size(2) * hd * (long)rk.element_size();
    b.recent_keys = static_cast<char*>(rk.data_ptr()) + layer * layer_ring;
    b.recent_values = static_cast<char*>(recent_values->data_ptr()) + layer * layer_ring;
    b.recent_bf16 = rk.scalar_type() == at::kBFloat16;
    b.recent_window = (int)recent_window;
    b.recent_slots = (int)rk.size(2);
    block_keys.resize((std::size_t)(n_kv * T * hd));
    block_values.resize(block_keys.size());
    b.block_keys = block_keys.data();
    b.block_values = block_values.data();
  }
  b.positions = positions.data_ptr<int64_t>() + layer * layer_slots;
  b.evicted_at = evicted_at.data_ptr<int32_t>() + layer * layer_slots;
  if (scores.has_value() && scores->defined()) {
    TORCH_CHECK(scores->scalar_type() == at::kFloat && scores->is_contiguous() &&
                    scores->sizes() == at::IntArrayRef({n_layers, n_kv, cap}),
                "arena_attention: scores must be contiguous float32 [L, n_kv, cap]");
    b.scores = scores->data_ptr<float>() + layer * layer_slots;
  }
  if (snapshots > 0) {
    TORCH_CHECK(b.scores && row_scores.has_value() && row_scores->defined() &&
                    row_scores->scalar_type() == at::kFloat && row_scores->is_contiguous() &&
                    row_scores->dim() == 4 && row_scores->size(1) == n_layers && row_scores->size(2) == n_kv &&
                    row_scores->size(3) == cap && snapshots <= T && first >= 0 &&
                    first + snapshots <= row_scores->size(0),
                "arena_attention: row_scores must be contiguous float32 [R, L, n_kv, cap] with R >= first + ",
                snapshots);
    b.row_stride = (long)n_layers * layer_slots;
    b.row_scores = row_scores->data_ptr<float>() + first * b.row_stride + layer * layer_slots;
    b.snapshot_rows = (int)snapshots;
  }
  TORCH_CHECK(heavy == 0 || b.scores, "arena_attention: a policy with heavy hitters needs scores");
  b.start = (int)start;
  b.first = (int)first;
  b.visible_before = (int)visible_before;
  b.first_position = first_position;
  b.per_row = per_row;
  b.budget = (int)budget;
  b.sinks = (int)sinks;
  b.heavy = (int)heavy;
  b.window = (int)window;
  b.age_normalised = age_normalised;
  b.score_decay = (float)score_decay;
  b.scale = (float)scale;
  if (in_cache) {
    b.cos = cos.data_ptr<float>();
    b.sin = sin.data_ptr<float>();
  }
  const std::vector<float> qf = widened(q), kf = widened(k), vf = widened(v);
  std::vector<float> q_rotated(qf.size());
  StageRows st;
  st.n_heads = (int)q.size(0);
  st.n_kv = (int)n_kv;
  st.hd = (int)hd;
  st.T = (int)T;
  st.q = qf.data();
  st.k = kf.data();
  st.v = vf.data();
  st.bf16_keys = k.scalar_type() == at::kBFloat16;
  st.cos = cos.data_ptr<float>();
  st.sin = sin.data_ptr<float>();
  st.table_offset = table_offset;
  st.in_cache = in_cache;
  st.q_rotated = q_rotated.data();
  stage_rows(st, b);
  b.q = q_rotated.data();
  at::Tensor out = at::empty({T, q.size(0) * hd}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const bool bf16_out = q.scalar_type() == at::kBFloat16;
  std::vector<float> out_f(bf16_out ? (std::size_t)out.numel() : 0);
  b.out = bf16_out ? out_f.data() : out.data_ptr<float>();
  if (row_lse.has_value() && row_lse->defined()) {
    TORCH_CHECK(row_lse->scalar_type() == at::kFloat && row_lse->is_contiguous() &&
                    row_lse->sizes() == at::IntArrayRef({T, q.size(0)}),
                "arena_attention: row_lse must be contiguous float32 [T, n_heads]");
    b.lse = row_lse->data_ptr<float>();
  }
  attend_block((int)isa, b);
  void* out_data = out.data_ptr();  // once: data_ptr() checks the storage on every call
  for (std::size_t i = 0; i < out_f.size(); ++i) put(out_data, true, (int64_t)i, out_f[i]);
  return out;
}

// One row's attention over the pages it recalls from one layer of the cold tier (recall.h), merged into the row's
// attention over the resident entries: out_row [n_kv * group * hd] (float32 or bfloat16) with its log-sum-exps
// lse_row [n_kv * group] (float32), in place. query [n_kv, group, hd] float32 before RoPE, rotated by table row
// query_row.
void recall_attention(const at::Tensor& query, int64_t query_row, const at::Tensor& entries,
                                         const at::Tensor& positions, const at::Tensor& summaries, int64_t total,
                                         const c10::optional<at::Tensor>& extra,
                                         const c10::optional<at::Tensor>& extra_positions,
                                         const c10::optional<at::Tensor>& extra_summaries, int64_t extra_start,
                                         const c10::optional<at::Tensor>& key_offset, const at::Tensor& cos,
                                         const at::Tensor& sin, int64_t rank, int64_t pages, int64_t page_size,
                                         double scale, at::Tensor out_row, const at::Tensor& lse_row) {
  check_cpu("recall_attention", {&query, &entries, &positions, &summaries, &cos, &sin, &out_row, &lse_row});
  for (const auto* t : {&extra, &extra_positions, &extra_summaries, &key_offset})
    if (t->has_value()) check_cpu("recall_attention", {&t->value()});
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat && query.is_contiguous(),
              "recall_attention: query must be contiguous float32 [n_kv, group, hd]");
  const int64_t n_kv = query.size(0), group = query.size(1), hd = query.size(2);
  const int64_t width = entries.dim() == 3 ? entries.size(2) : 0;
  const int64_t code_group = std::min<int64_t>(16, hd);
  TORCH_CHECK(hd >= 8 && hd % 8 == 0 && hd % code_group == 0 && width == hd + 2 * (hd / code_group) * 4,
              "recall_attention: heads of a multiple of 8 channels, whose entries are ", hd + 2 * (hd / code_group) * 4,
              " bytes");
  TORCH_CHECK(entries.scalar_type() == at::kByte && entries.is_contiguous() && entries.size(1) == n_kv &&
                  positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.sizes() == at::IntArrayRef({entries.size(0), n_kv}),
              "recall_attention: entries must be contiguous uint8 [N, n_kv, width] with int64 positions [N, n_kv]");
  TORCH_CHECK(page_size >= 1 && pages >= 1 && total >= 0, "recall_attention: page_size, pages and total");
  const bool has_extra = extra.has_value() && extra->defined();
  const int64_t extra_rows = has_extra ? extra->size(0) : 0;
  if (has_extra) {
    TORCH_CHECK(extra->scalar_type() == at::kByte && extra->is_contiguous() &&
                    extra->sizes() == at::IntArrayRef({extra_rows, n_kv, width}) && extra_positions.has_value() &&
                    extra_positions->scalar_type() == at::kLong && extra_positions->is_contiguous() &&
                    extra_positions->sizes() == at::IntArrayRef({extra_rows, n_kv}) && extra_start >= 0 &&
                    extra_start % page_size == 0 && extra_start <= entries.size(0) && extra_start + extra_rows == total,
                "recall_attention: extra entries [E, n_kv, width] with positions [E, n_kv] must end the view");
  } else {
    TORCH_CHECK(total <= entries.size(0), "recall_attention: ", total, " entries past the tier's ", entries.size(0));
  }
  const int64_t stored_pages = (has_extra ? extra_start : total) / page_size;
  const int64_t extra_pages = has_extra ? total / page_size - stored_pages : 0;
  TORCH_CHECK(summaries.scalar_type() == at::kFloat && summaries.is_contiguous() && summaries.dim() == 3 &&
                  summaries.size(0) >= stored_pages && summaries.size(1) == n_kv && summaries.size(2) == 2 * hd,
              "recall_attention: summaries must be contiguous float32 [pages, n_kv, 2 * hd]");
  if (extra_pages) {
    TORCH_CHECK(extra_summaries.has_value() && extra_summaries->scalar_type() == at::kFloat &&
                    extra_summaries->is_contiguous() &&
                    extra_summaries->sizes() == at::IntArrayRef({extra_pages, n_kv, 2 * hd}),
                "recall_attention: extra_summaries must be contiguous float32 [", extra_pages, ", n_kv, 2 * hd]");
  }
  if (key_offset.has_value() && key_offset->defined())
    TORCH_CHECK(key_offset->scalar_type() == at::kFloat && key_offset->is_contiguous() &&
                    key_offset->sizes() == at::IntArrayRef({n_kv, hd}),
                "recall_attention: key_offset must be contiguous float32 [n_kv, hd]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == hd,
              "recall_attention: cos and sin must be contiguous float32 [rows, hd]");
  // Every rotation must fall inside the tables: the ranks from `rank` on, or every position of the view.
  int64_t highest = rank >= 0 ? rank + pages * page_size + page_size : -1;
  if (rank < 0) {
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t n_stored = has_extra ? extra_start : total;
    for (int64_t i = 0; i < n_stored * n_kv; ++i) highest = std::max(highest, pos[i]);
    if (has_extra) {
      const int64_t* more = extra_positions->data_ptr<int64_t>();
      for (int64_t i = 0; i < extra_rows * n_kv; ++i) highest = std::max(highest, more[i]);
    }
  }
  TORCH_CHECK(highest >= 0 || total == 0, "recall_attention: a negative position or rank");
  TORCH_CHECK(query_row >= 0 && std::max(highest, query_row) < cos.size(0),
              "recall_attention: the RoPE tables end before row ", std::max(highest, query_row));
  TORCH_CHECK(float_or_bf16(out_row) && out_row.is_contiguous() && out_row.numel() == n_kv * group * hd &&
                  lse_row.scalar_type() == at::kFloat && lse_row.is_contiguous() && lse_row.numel() == n_kv * group,
              "recall_attention: out_row must be contiguous float32 or bfloat16 [n_kv * group * hd] and lse_row "
              "float32 [n_kv * group]");
  RecallRow r;
  r.n_kv = (int)n_kv;
  r.group = (int)group;
  r.hd = (int)hd;
  r.code_group = (int)code_group;
  r.width = (int)width;
  r.page_size = (int)page_size;
  r.pages = (int)pages;
  r.total = (int)total;
  r.query = query.data_ptr<float>();
  r.query_row = query_row;
  r.entries = entries.data_ptr<uint8_t>();
  r.positions = positions.data_ptr<int64_t>();
  r.summaries = summaries.data_ptr<float>();
  if (has_extra) {
    r.extra = extra->data_ptr<uint8_t>();
    r.extra_positions = extra_positions->data_ptr<int64_t>();
    r.extra_summaries = extra_pages ? extra_summaries->data_ptr<float>() : nullptr;
    r.extra_start = (int)extra_start;
  }
  if (key_offset.has_value() && key_offset->defined()) r.key_offset = key_offset->data_ptr<float>();
  r.cos = cos.data_ptr<float>();
  r.sin = sin.data_ptr<float>();
  r.rank = rank;
  r.scale = (float)scale;
  r.out = out_row.data_ptr();
  r.out_bf16 = out_row.scalar_type() == at::kBFloat16;
  r.lse = lse_row.data_ptr<float>();
  if (total) recall_row(r);
}

// RMS norm of each row of x [m, n] (float32 or bfloat16) with weight [n] (float32 or bfloat16), as torch's fused
// rms_norm computes it: in float32, y = x * rsqrt(mean(x^2) + eps) * weight, rounded once to x's dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_cpu("rms_norm", {&x, &weight});
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && float_or_bf16(x) && weight.dim() == 1 &&
                  weight.size(0) == x.size(1) && weight.is_contiguous() && float_or_bf16(weight),
              "rms_norm: x must be contiguous float32 or bfloat16 [m, n] and weight [n]");
  const bool bf16 = x.scalar_type() == at::kBFloat16, w_bf16 = weight.scalar_type() == at::kBFloat16;
  const int64_t m = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({m, n}, x.options());
  const void* src = x.data_ptr();
  const void* w = weight.data_ptr();
  void* dst = out.data_ptr();
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> row((std::size_t)n);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t j = 0; j < n; ++j) row[j] = element(src, bf16, r * n + j);
      float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // fixed order: lane l sums elements l, l + 8, ...; then in turn
      int64_t j = 0;
      for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; ++l) lanes[l] += row[j + l] * row[j + l];
      float sum = 0.0f;
      for (int l = 0; l < 8; ++l) sum += lanes[l];
      for (; j < n; ++j) sum += row[j] * row[j];
      const float inv = 1.0f / std::sqrt(sum / (float)n + (float)eps);
      for (j = 0; j < n; ++j) put(dst, bf16, r * n + j, row[j] * inv * element(w, w_bf16, j));
    }
  });
  return out;
}

// silu(gate) * up for gate_up [m, 2i] (the two halves, float32 or bfloat16) -> [m, i], each step rounded to the
// dtype as torch's silu and mul do.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_cpu("silu_mul", {&gate_up});
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.is_contiguous() && float_or_bf16(gate_up),
              "silu_mul: gate_up must be contiguous float32 or bfloat16 [m, 2 i]");
  const bool bf16 = gate_up.scalar_type() == at::kBFloat16;
  const int64_t m = gate_up.size(0), half = gate_up.size(1) / 2;
  at::Tensor out = at::empty({m, half}, gate_up.options());
  const char* src = static_cast<const char*>(gate_up.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const std::size_t elt = bf16 ? 2 : 4;
  constexpr int64_t kSpan = 2048;  // elements per task
  const int64_t spans = (half + kSpan - 1) / kSpan;
  at::parallel_for(0, m * spans, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / spans, j0 = task % spans * kSpan, n = std::min(kSpan, half - j0);
      const char* gate = src + (r * 2 * half + j0) * elt;
      silu_mul_span(gate, gate + half * elt, dst + (r * half + j0) * elt, (int)n, bf16);
    }
  });
  return out;
}

}  // namespace
}  // namespace sparsespec

// The ops are plain Python functions of the extension module, not torch.ops: a call through the dispatcher costs
// about 1 us more, and a decode step makes ~200 of them. Each releases the GIL while it runs (a server's HTTP
// thread goes on during a pass). Each op checks that its tensors are on the CPU (check_cpu): no dispatcher routes
// them by device.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  const auto unlocked = pybind11::call_guard<pybind11::gil_scoped_release>();
  module.def("gguf_linear", &sparsespec::gguf_linear, unlocked);
  module.def("gguf_dequantize", &sparsespec::gguf_dequantize, unlocked);
  module.def("arena_attention", &sparsespec::arena_attention, unlocked);
  module.def("recall_attention", &sparsespec::recall_attention, unlocked);
  module.def("rms_norm", &sparsespec::rms_norm, unlocked);
  module.def("silu_mul", &sparsespec::silu_mul, unlocked);
  module.def("best_isa", &sparsespec::best_isa);
  module.def("set_isa", &sparsespec::set_isa);
  module.def("amx_tile_passes", &sparsespec::amx_tile_passes);
  module.def("isa_available", &sparsespec::isa_available);
  module.def("isa_name", &sparsespec::isa_name);
  module.def("row_bytes", &sparsespec::row_bytes);
  module.def("weight_bytes", &sparsespec::weight_bytes);
  module.def("supported_type", &sparsespec::supported_type);
}
