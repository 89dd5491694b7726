// A projection: activations times the transpose of a weight kept in GGUF block formats, as segments stacked along
// the outputs (q, k and v of one layer), quantizing the activations once for every segment (qmatmul.h), or with
// float activations multiplying them as they are (fmatmul.h; always so for a segment of float weights). Torch-free
// core of the gguf_linear op and of the native forward pass (model.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sparsespec {

struct Projection {
  std::vector<const uint8_t*> blobs;  // each segment's repacked bytes (qmatmul.h's layouts)
  std::vector<int> types;             // its kernel type (GGML type, or a column-tile layout)
  std::vector<long> rows;             // its output rows
  int k = 0;                          // inputs per row (a multiple of 64; the caller pads x to it)
  long n_out = 0;                     // sum of rows
  const float* bias = nullptr;        // [n_out] float32, or null
  bool float_activations = false;     // multiply the activations as they are (row layouts only)
};

// The reason `p` cannot run (its sizes, types, or a segment of `bytes[s]` bytes that is not its layout's), or "".
std::string check_projection(const Projection& p, const std::vector<std::size_t>& bytes);

// out [m, n_out] = residual + x [m, k] @ W^T (+ bias), x, residual and out contiguous in float32, or bfloat16 when
// bf16 (computed in float32; bfloat16 results rounded once, to nearest even, and with a residual the product is
// rounded before the add and the sum after: what a bfloat16 add of the two tensors gives). residual may be null.
// A row's result never depends on the other rows, the thread split or the instruction set.
void project(int isa, const Projection& p, const void* x, int m, bool bf16, const void* residual, void* out);

}  // namespace sparsespec
