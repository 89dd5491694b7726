// Torch bindings of the native kernels: ops under torch.ops.sparsespec, and facts about the build for Python.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <vector>

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

}  // namespace
}  // namespace sparsespec

TORCH_LIBRARY(sparsespec, m) {
  m.def("gguf_linear(Tensor x, Tensor[] weights, int[] types, int[] rows, int k, Tensor? bias, int isa) -> Tensor");
  m.def("gguf_dequantize(Tensor weight, int type, int k, Tensor index) -> Tensor");
}

TORCH_LIBRARY_IMPL(sparsespec, CPU, m) {
  m.impl("gguf_linear", &sparsespec::gguf_linear);
  m.impl("gguf_dequantize", &sparsespec::gguf_dequantize);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("best_isa", &sparsespec::best_isa);
  module.def("isa_available", &sparsespec::isa_available);
  module.def("isa_name", &sparsespec::isa_name);
  module.def("row_bytes", &sparsespec::row_bytes);
  module.def("supported_type", &sparsespec::supported_type);
}
