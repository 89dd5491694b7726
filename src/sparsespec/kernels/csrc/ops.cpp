// Torch bindings of the native kernels: ops under torch.ops.sparsespec, and facts about the build for Python.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <vector>

#include "attention.h"
#include "qmatmul.h"

namespace sparsespec {
namespace {

// Scratch memory reused across calls (per calling thread): the quantized activations, and float rows.
struct Scratch {
  std::vector<float> x, out, dx, ds, dxl, d256;
  std::vector<int8_t> q, q256;
  std::vector<int32_t> bsum;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// y [m, sum(rows)] = x [m, k] @ W^T for a weight stored as segments (each a repacked GGUF tensor of rows[s] rows
// and type types[s]; e.g. q, k and v of one layer), plus a float32 bias [sum(rows)] if given. x is float32 or
// bfloat16 (contiguous); y has x's dtype (computed in float32, rounded once at the end).
at::Tensor gguf_linear(const at::Tensor& x, const std::vector<at::Tensor>& weights, const std::vector<int64_t>& types,
                       const std::vector<int64_t>& rows, int64_t k, const c10::optional<at::Tensor>& bias,
                       int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "gguf_linear: x must be [m, ", k, "]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "gguf_linear: x must be float32 or bfloat16");
  TORCH_CHECK(weights.size() == types.size() && weights.size() == rows.size(), "gguf_linear: segment lists differ");
  TORCH_CHECK(isa == kAuto || isa_available((int)isa), "gguf_linear: instruction set ", isa, " not available");
  const at::Tensor xc = x.contiguous();
  const int m = (int)xc.size(0);
  const int k_pad = padded_k((int)k);
  int64_t n_total = 0;
  std::vector<int64_t> first_row;
  bool any_k = false, any_32 = false;
  for (std::size_t s = 0; s < weights.size(); ++s) {
    (is_k_quant((int)types[s]) ? any_k : any_32) = true;
    TORCH_CHECK(supported_type((int)types[s]), "gguf_linear: unsupported block type ", types[s]);
    TORCH_CHECK(weights[s].dtype() == at::kByte && weights[s].is_contiguous(), "gguf_linear: weights must be uint8");
    TORCH_CHECK((std::size_t)weights[s].numel() == row_bytes((int)types[s], (int)k) * (std::size_t)rows[s],
                "gguf_linear: segment ", s, " has ", weights[s].numel(), " bytes, not ",
                row_bytes((int)types[s], (int)k) * rows[s]);
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
    quantize_activations(xf, m, (int)k, k, sc.q.data(), sc.dx.data(), sc.ds.data(), sc.dxl.data());
    act.q = sc.q.data();
    act.dx = sc.dx.data();
    act.ds = sc.ds.data();
    act.dxl = sc.dxl.data();
  }
  if (any_k) {  // per-256 activations for the K-quants
    sc.q256.resize((std::size_t)m * k_pad);
    sc.d256.resize((std::size_t)m * k_pad / kChunk);
    sc.bsum.resize((std::size_t)m * k_pad / 16);
    quantize_activations_256(xf, m, (int)k, k, sc.q256.data(), sc.d256.data(), sc.bsum.data());
    act.q256 = sc.q256.data();
    act.d256 = sc.d256.data();
    act.bsum = sc.bsum.data();
  }
  auto out = at::empty({m, n_total}, xc.options());
  float* out_ptr;
  if (xc.scalar_type() == at::kFloat) {
    out_ptr = out.data_ptr<float>();
  } else {
    sc.out.resize((std::size_t)m * n_total);
    out_ptr = sc.out.data();
  }
  // Output columns split across threads; each column's value never depends on the split.
  at::parallel_for(0, n_total, 16, [&](int64_t begin, int64_t end) {
    for (std::size_t s = 0; s < weights.size(); ++s) {
      const int64_t lo = std::max(begin, first_row[s]), hi = std::min(end, first_row[s] + rows[s]);
      if (lo >= hi) continue;
      qmatmul_rows((int)isa, (int)types[s], weights[s].data_ptr<uint8_t>(), (int)k, (int)(lo - first_row[s]),
                   (int)(hi - first_row[s]), act, bias_ptr ? bias_ptr + first_row[s] : nullptr,
                   out_ptr + first_row[s], n_total);
    }
  });
  if (xc.scalar_type() != at::kFloat) {  // round once to bfloat16 (nearest even, as Tensor.to does)
    c10::BFloat16* dst = out.data_ptr<c10::BFloat16>();
    for (std::size_t i = 0; i < sc.out.size(); ++i) dst[i] = c10::BFloat16(sc.out[i]);
  }
  return out;
}

// Rows `index` of a repacked weight [n, k], dequantized: float32 [len(index), k] (embedding lookups, tests).
at::Tensor gguf_dequantize(const at::Tensor& weight, int64_t type, int64_t k, const at::Tensor& index) {
  TORCH_CHECK(supported_type((int)type), "gguf_dequantize: unsupported block type ", type);
  const at::Tensor idx = index.to(at::kLong).contiguous();
  const int64_t n = weight.numel() / (int64_t)row_bytes((int)type, (int)k);
  TORCH_CHECK(idx.numel() == 0 || (idx.min().item<int64_t>() >= 0 && idx.max().item<int64_t>() < n),
              "gguf_dequantize: row index out of range");
  auto out = at::empty({idx.numel(), k}, weight.options().dtype(at::kFloat));
  dequantize_rows((int)type, weight.data_ptr<uint8_t>(), (int)k, idx.data_ptr<int64_t>(), (int)idx.numel(),
                  out.data_ptr<float>());
  return out;
}

// Attention of the open block's T rows over one layer of the KV arena (see attention.h and
// sparsespec/cache/arena.py): q [n_heads, T, hd] float32 queries already rotated (by true position, or by their
// rank in the in-cache mode); keys, values [n_kv, cap, hd] float32 or bfloat16 with the block's rows written at
// slots [start, start + T); positions [n_kv, cap] int64; evicted_at [n_kv, cap] int32, updated with the evictions
// (row `first + i` for row i); scores [n_kv, cap] float32, updated (heavy-hitter policies, else None);
// row_scores [r, n_kv, cap] float32, row i's scores copied there for i < r (else None); cos, sin [>= start + T, hd]
// float32 RoPE tables for rotating keys by rank (in-cache mode, else None). per_row: the policy evicts after every
// row (else once after the block, if visible_before + T exceeds the budget); budget -1: the full cache.
// Returns [T, n_heads * hd] float32.
at::Tensor arena_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& positions, at::Tensor evicted_at, const c10::optional<at::Tensor>& scores,
                           const c10::optional<at::Tensor>& row_scores, const c10::optional<at::Tensor>& cos,
                           const c10::optional<at::Tensor>& sin, int64_t start, int64_t first, int64_t visible_before,
                           int64_t first_position, bool per_row, int64_t budget, int64_t sinks, int64_t heavy,
                           int64_t window, double scale, int64_t isa) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "arena_attention: q must be contiguous float32 [n_heads, T, hd]");
  TORCH_CHECK(keys.dim() == 3 && keys.is_contiguous() && values.is_contiguous() && values.sizes() == keys.sizes() &&
                  values.scalar_type() == keys.scalar_type() &&
                  (keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kBFloat16),
              "arena_attention: keys and values must be contiguous float32 or bfloat16 [n_kv, cap, hd] alike");
  const int64_t n_kv = keys.size(0), cap = keys.size(1), hd = keys.size(2), T = q.size(1);
  TORCH_CHECK(q.size(2) == hd && q.size(0) % n_kv == 0 && q.size(0) / n_kv <= kAttnMaxGroup && hd % 2 == 0 &&
                  hd <= 256, "arena_attention: q must be [n_kv * group, T, ", hd, "] (group <= 64, even hd <= 256)");
  TORCH_CHECK(T >= 1 && start >= 0 && start + T <= cap, "arena_attention: rows [", start, ", ", start + T,
              ") outside the arena's ", cap, " slots");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.sizes() == at::IntArrayRef({n_kv, cap}),
              "arena_attention: positions must be contiguous int64 [n_kv, cap]");
  TORCH_CHECK(evicted_at.scalar_type() == at::kInt && evicted_at.is_contiguous() &&
                  evicted_at.sizes() == at::IntArrayRef({n_kv, cap}),
              "arena_attention: evicted_at must be contiguous int32 [n_kv, cap]");
  TORCH_CHECK(isa == kAuto || isa_available((int)isa), "arena_attention: instruction set ", isa, " not available");
  AttnBlock b;
  b.n_kv = (int)n_kv;
  b.group = (int)(q.size(0) / n_kv);
  b.hd = (int)hd;
  b.T = (int)T;
  b.cap = (int)cap;
  b.q = q.data_ptr<float>();
  b.keys = keys.data_ptr();
  b.values = values.data_ptr();
  b.bf16 = keys.scalar_type() == at::kBFloat16;
  b.positions = positions.data_ptr<int64_t>();
  b.evicted_at = evicted_at.data_ptr<int32_t>();
  if (scores.has_value() && scores->defined()) {
    TORCH_CHECK(scores->scalar_type() == at::kFloat && scores->is_contiguous() &&
                    scores->sizes() == at::IntArrayRef({n_kv, cap}),
                "arena_attention: scores must be contiguous float32 [n_kv, cap]");
    b.scores = scores->data_ptr<float>();
  }
  if (row_scores.has_value() && row_scores->defined() && row_scores->size(0) > 0) {
    TORCH_CHECK(b.scores && row_scores->scalar_type() == at::kFloat && row_scores->dim() == 3 &&
                    row_scores->size(0) <= T && row_scores->size(1) == n_kv && row_scores->size(2) == cap &&
                    row_scores->stride(1) == cap && row_scores->stride(2) == 1,
                "arena_attention: row_scores must be float32 [<= T, n_kv, cap] with rows of cap contiguous slots");
    b.row_scores = row_scores->data_ptr<float>();
    b.row_stride = row_scores->stride(0);
    b.snapshot_rows = (int)row_scores->size(0);
  }
  const bool in_cache = cos.has_value() && cos->defined();
  if (in_cache) {
    TORCH_CHECK(sin.has_value() && sin->defined() && cos->scalar_type() == at::kFloat &&
                    sin->scalar_type() == at::kFloat && cos->is_contiguous() && sin->is_contiguous() &&
                    cos->dim() == 2 && cos->sizes() == sin->sizes() && cos->size(0) >= start + T &&
                    cos->size(1) == hd,
                "arena_attention: cos and sin must be contiguous float32 [>= ", start + T, ", ", hd, "]");
    b.cos = cos->data_ptr<float>();
    b.sin = sin->data_ptr<float>();
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
  b.scale = (float)scale;
  auto out = at::empty({T, q.size(0) * hd}, q.options());
  b.out = out.data_ptr<float>();
  attend_block((int)isa, b);
  return out;
}

}  // namespace
}  // namespace sparsespec

TORCH_LIBRARY(sparsespec, m) {
  m.def("gguf_linear(Tensor x, Tensor[] weights, int[] types, int[] rows, int k, Tensor? bias, int isa) -> Tensor");
  m.def("gguf_dequantize(Tensor weight, int type, int k, Tensor index) -> Tensor");
  m.def(
      "arena_attention(Tensor q, Tensor keys, Tensor values, Tensor positions, Tensor(a!) evicted_at, "
      "Tensor(b!)? scores, Tensor(c!)? row_scores, Tensor? cos, Tensor? sin, int start, int first, "
      "int visible_before, int first_position, bool per_row, int budget, int sinks, int heavy, int window, "
      "float scale, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(sparsespec, CPU, m) {
  m.impl("gguf_linear", &sparsespec::gguf_linear);
  m.impl("gguf_dequantize", &sparsespec::gguf_dequantize);
  m.impl("arena_attention", &sparsespec::arena_attention);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("best_isa", &sparsespec::best_isa);
  module.def("isa_available", &sparsespec::isa_available);
  module.def("isa_name", &sparsespec::isa_name);
  module.def("row_bytes", &sparsespec::row_bytes);
  module.def("supported_type", &sparsespec::supported_type);
}
