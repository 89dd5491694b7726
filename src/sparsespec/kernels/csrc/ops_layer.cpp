// The ops a layer-by-layer pass calls one at a time, each the core of a step of the native pass (model.h): a
// projection, a weight's rows dequantized (embedding lookups), an RMS norm, the gated activation. The tests' per-op
// reference pass and the benchmarks that time one op call them; each releases the GIL while it runs.
#include <torch/extension.h>

#include "boundary.h"
#include "elementwise.h"
#include "project.h"
#include "qmatmul.h"

namespace sparsespec {
namespace {

// y [m, sum(rows)] = x [m, k] @ W^T for a weight stored as segments (each a repacked GGUF tensor of rows[s] rows
// and type types[s]; e.g. q, k and v of one layer), plus a float32 bias [sum(rows)] if given, plus a residual
// [m, sum(rows)] if given (the decoder's skip connections, without a pass of their own over the rows): project.h.
// x is float32 or bfloat16; y has x's dtype.
at::Tensor gguf_linear(const at::Tensor& x, const std::vector<at::Tensor>& weights, const std::vector<int64_t>& types,
                       const std::vector<int64_t>& rows, int64_t k, const c10::optional<at::Tensor>& bias,
                       int64_t isa, bool float_activations, const c10::optional<at::Tensor>& residual) {
  check_cpu("gguf_linear", {&x});
  for (const auto& w : weights) check_cpu("gguf_linear", {&w});
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "gguf_linear: x must be [m, ", k, "]");
  TORCH_CHECK(float_or_bf16(x), "gguf_linear: x must be float32 or bfloat16");
  TORCH_CHECK(isa == kAuto || isa_available((int)isa), "gguf_linear: instruction set ", isa, " not available");
  Projection p;
  p.k = (int)k;
  p.float_activations = float_activations;
  std::vector<std::size_t> bytes;
  for (std::size_t s = 0; s < weights.size(); ++s) {
    TORCH_CHECK(weights[s].dtype() == at::kByte && weights[s].is_contiguous(), "gguf_linear: weights must be uint8");
    p.blobs.push_back(weights[s].data_ptr<uint8_t>());
    bytes.push_back((std::size_t)weights[s].numel());
  }
  for (int64_t t : types) p.types.push_back((int)t);
  for (int64_t r : rows) {
    p.rows.push_back((long)r);
    p.n_out += (long)r;
  }
  const std::string problem = check_projection(p, bytes);
  TORCH_CHECK(problem.empty(), "gguf_linear: ", problem);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == p.n_out,
                "gguf_linear: bias must be float32 [", p.n_out, "]");
    p.bias = bias->data_ptr<float>();
  }
  const at::Tensor xc = x.contiguous();
  const int m = (int)xc.size(0);
  at::Tensor residual_c;  // the rows the product is added to, if any
  if (residual.has_value() && residual->defined()) {
    check_cpu("gguf_linear", {&*residual});
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == m && residual->size(1) == p.n_out &&
                    residual->scalar_type() == xc.scalar_type(),
                "gguf_linear: residual must be [", m, ", ", p.n_out, "] in the dtype of x");
    residual_c = residual->contiguous();
  }
  auto out = at::empty({m, p.n_out}, xc.options());
  project((int)isa, p, xc.data_ptr(), m, xc.scalar_type() == at::kBFloat16,
          residual_c.defined() ? residual_c.data_ptr() : nullptr, out.data_ptr());
  return out;
}

// Rows `index` of a repacked weight [n, k], dequantized: float32 [len(index), k] (embedding lookups, tests).
at::Tensor gguf_dequantize(const at::Tensor& weight, int64_t type, int64_t k, const at::Tensor& index) {
  check_cpu("gguf_dequantize", {&weight, &index});
  TORCH_CHECK(supported_type((int)type), "gguf_dequantize: unsupported block type ", type);
  // Rows (tiles) of k inputs have whole quarters, groups or chunks; below one they would have 0 bytes to divide by.
  TORCH_CHECK(k > 0 && k % k_multiple((int)type) == 0 && (!is_tiled((int)type) || k % tile_span((int)type) == 0),
              "gguf_dequantize: k must be a positive multiple of ", k_multiple((int)type),
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

// RMS norm of each row of x [m, n] (float32 or bfloat16) with weight [n] (float32 or bfloat16): elementwise.h.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_cpu("rms_norm", {&x, &weight});
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && float_or_bf16(x) && weight.dim() == 1 &&
                  weight.size(0) == x.size(1) && weight.is_contiguous() && float_or_bf16(weight),
              "rms_norm: x must be contiguous float32 or bfloat16 [m, n] and weight [n]");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  rms_norm_rows(x.data_ptr(), x.size(0), x.size(1), x.scalar_type() == at::kBFloat16, weight.data_ptr(),
                weight.scalar_type() == at::kBFloat16, (float)eps, out.data_ptr());
  return out;
}

// act(gate) * up for gate_up [m, 2i] (the two halves, float32 or bfloat16) -> [m, i], act SiLU or (gelu) GELU with
// the tanh approximation, each step rounded to the dtype as torch's activation and mul do (elementwise.h).
at::Tensor gated(const at::Tensor& gate_up, bool gelu) {
  check_cpu("gated", {&gate_up});
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.is_contiguous() && float_or_bf16(gate_up),
              "gated: gate_up must be contiguous float32 or bfloat16 [m, 2 i]");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  gated_rows(gate_up.data_ptr(), gate_up.size(0), gate_up.size(1) / 2, gate_up.scalar_type() == at::kBFloat16, gelu,
             out.data_ptr());
  return out;
}

}  // namespace

void bind_layer_ops(pybind11::module_& module) {
  const auto unlocked = pybind11::call_guard<pybind11::gil_scoped_release>();
  module.def("gguf_linear", &gguf_linear, unlocked);
  module.def("gguf_dequantize", &gguf_dequantize, unlocked);
  module.def("rms_norm", &rms_norm, unlocked);
  module.def("gated", &gated, unlocked);
}

}  // namespace sparsespec
