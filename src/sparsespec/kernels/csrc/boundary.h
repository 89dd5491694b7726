// What every op of the Python bindings shares: the checks at the boundary, and the ops a layer-by-layer pass calls
// one at a time (ops_layer.cpp), bound beside the rest of the module (ops.cpp).
#pragma once

#include <torch/extension.h>

#include <initializer_list>

namespace sparsespec {

// The ops read host memory: every tensor they get must live there.
inline void check_cpu(const char* op, std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) TORCH_CHECK(!t->defined() || t->is_cpu(), op, ": tensors must be on the CPU");
}

inline bool float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

// Adds gguf_linear, gguf_dequantize, rms_norm and gated to the module (ops_layer.cpp).
void bind_layer_ops(pybind11::module_& module);

}  // namespace sparsespec
