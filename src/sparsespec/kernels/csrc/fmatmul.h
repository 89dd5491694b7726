// Matmul on the repacked GGUF blocks with float activations: the weights are dequantized in registers and multiply
// the activations as they are, where qmatmul.h quantizes the activations to 8 bits first: the arithmetic of a float32
// model with the file's weights, for a few percent of a small model's decode speed where the host multiplies floats
// at AVX-512's width (more on AVX2): benchmarks/RESULTS.md#small-model-numerics
//
// Row layout only (qmatmul.h's chunks of 256 inputs; the column-tile types are not read here). Canonical
// arithmetic, which every instruction set reproduces bit for bit (so a result never depends on the instruction
// set, the thread split or how many rows share the call): per output column n and activation row r, 16 float lanes
// acc[L] = 0; for each chunk, quarter p and group t = 0 .. 3 of 16 inputs in order (g = 4p + t, the chunk's group;
// a[g], c[g] from formats.h's decode_scales):
//     w = fma(float(code of input 64p + 16t + L), a[g], c[g])      (the weight as the GGUF dequantizes it)
//     acc[L] = fma(w, x[r, chunk * 256 + 64p + 16t + L], acc[L])
// y = canonical_hsum(acc) (+ bias[n]). A float weight type (F32, F16, BF16) is read the same way, w being the
// stored value: acc[L] = fma(w[16j + L], x[r, 16j + L], acc[L]) for the groups j of 16 inputs in order.
#pragma once

#include <cstdint>

namespace sparsespec {

// out[r, n] = sum_k w[n, k] * x[r, k] (+ bias[n]) for weight rows n in [n_begin, n_end) and activation rows
// r in [0, m): x float32 [m, k] with row stride ldx, out with row stride ldo. `type` a row-layout block type or a
// float type.
void fmatmul_rows(int isa, int type, const uint8_t* w, int k, int n_begin, int n_end, const float* x, int m,
                  long ldx, const float* bias, float* out, long ldo);

// Per instruction set (fmatmul_<isa>.cpp; fmatmul.cpp holds the portable one).
void fmatmul_rows_scalar(int type, const uint8_t* w, int k, int n_begin, int n_end, const float* x, int m, long ldx,
                         const float* bias, float* out, long ldo);
void fmatmul_rows_avx2(int type, const uint8_t* w, int k, int n_begin, int n_end, const float* x, int m, long ldx,
                       const float* bias, float* out, long ldo);
void fmatmul_rows_avx512(int type, const uint8_t* w, int k, int n_begin, int n_end, const float* x, int m, long ldx,
                         const float* bias, float* out, long ldo);
void fmatmul_rows_neon(int type, const uint8_t* w, int k, int n_begin, int n_end, const float* x, int m, long ldx,
                       const float* bias, float* out, long ldo);

}  // namespace sparsespec
