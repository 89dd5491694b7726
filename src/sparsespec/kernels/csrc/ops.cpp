// Torch bindings of the native kernels: ops under torch.ops.sparsespec, and facts about the build for Python.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <vector>

#include "qmatmul.h"

namespace sparsespec {
namespace {

// y [m, sum(rows)] = x [m, k] @ W^T for a weight stored as segments (each a repacked GGUF tensor of rows[s] rows
// and type types[s]; e.g. q, k and v of one layer), plus bias [sum(rows)] if given. float32 result.
at::Tensor gguf_linear(const at::Tensor& x, const std::vector<at::Tensor>& weights, const std::vector<int64_t>& types,
                       const std::vector<int64_t>& rows, int64_t k, const c10::optional<at::Tensor>& bias,
                       int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "gguf_linear: x must be [m, ", k, "]");
  TORCH_CHECK(weights.size() == types.size() && weights.size() == rows.size(), "gguf_linear: segment lists differ");
  TORCH_CHECK(isa == kAuto || isa_available((int)isa), "gguf_linear: instruction set ", isa, " not available");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int m = (int)xf.size(0);
  const int k_pad = padded_k((int)k);
  int64_t n_total = 0;
  std::vector<int64_t> first_row;
  for (std::size_t s = 0; s < weights.size(); ++s) {
    TORCH_CHECK(supported_type((int)types[s]), "gguf_linear: unsupported block type ", types[s]);
    TORCH_CHECK(weights[s].dtype() == at::kByte && weights[s].is_contiguous(), "gguf_linear: weights must be uint8");
    TORCH_CHECK((std::size_t)weights[s].numel() == row_bytes((int)types[s], (int)k) * (std::size_t)rows[s],
                "gguf_linear: segment ", s, " has ", weights[s].numel(), " bytes, not ",
                row_bytes((int)types[s], (int)k) * rows[s]);
    first_row.push_back(n_total);
    n_total += rows[s];
  }
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_f.numel() == n_total, "gguf_linear: bias must have ", n_total, " values");
  }
  auto out = at::empty({m, n_total}, xf.options());
  auto q = at::empty({m, k_pad}, xf.options().dtype(at::kChar));
  auto dx = at::empty({m, k_pad / kActBlock}, xf.options());
  auto ds = at::empty({m, k_pad / 16}, xf.options());
  auto dxl = at::empty({m, k_pad / 4}, xf.options());
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    quantize_activations(xf.data_ptr<float>() + begin * k, (int)(end - begin), (int)k, k,
                         q.data_ptr<int8_t>() + begin * k_pad, dx.data_ptr<float>() + begin * (k_pad / kActBlock),
                         ds.data_ptr<float>() + begin * (k_pad / 16), dxl.data_ptr<float>() + begin * (k_pad / 4));
  });
  const Activations act{m, k_pad, q.data_ptr<int8_t>(), dx.data_ptr<float>(), ds.data_ptr<float>(),
                        dxl.data_ptr<float>()};
  float* out_ptr = out.data_ptr<float>();
  const float* bias_ptr = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
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
