// Quantized matmul on GGUF block formats, repacked per 256-weight chunk (torch-free core).
//
// Weight layout (built by sparsespec/kernels/repack.py from the GGUF's own blocks, losslessly):
//   a weight [N, K] is N rows; a row is ceil(K / 256) chunks; a chunk covers 256 consecutive inputs (the last one
//   may cover fewer, in whole quarters of 64) and is
//       [scale section: SCALE_BYTES[type]] [quarter 0] [quarter 1] ... (n_quarters of them)
//   A quarter holds 64 codes: 32 bytes of nibbles (byte j: code j in the low nibble, code j + 32 in the high one),
//   then the high bits (5-bit codes: one 64-bit plane, bit j = bit 4 of code j; 6-bit codes: two planes, bits 4 and
//   5), or, for 8-bit codes, 64 signed bytes instead. Scale sections (fp16 = IEEE half):
//       Q4_0, Q5_0, Q8_0: d[8] fp16                     w = d_b * (q - 8 | q - 16 | q)
//       Q4_1, Q5_1:       d[8] fp16, m[8] fp16          w = d_b * q + m_b
//       Q4_K, Q5_K:       d, dmin fp16, sc[8], mn[8] u8 w = d * sc_j * q - dmin * mn_j   (sub-block j of 32)
//       Q6_K:             d fp16, sc[16] int8           w = d * sc_g * (q - 32)         (group g of 16)
//   Every format is thus w = a_g * q + c_g per group g of 16 inputs, with integer codes q.
//
// The canonical arithmetic (every instruction set reproduces it bit for bit, so a result never depends on the
// instruction set, the thread split, or how many rows share the call). Lane L of a quarter covers inputs
// 4L .. 4L+3; hsum adds lanes i and i+8, then i and i+4, i and i+2, i and i+1.
//
// 32-weight formats (Q4_0 ... Q8_0): activations quantized per row in blocks of 32, xq = round(x / dx) in
// [-127, 127], dx = max|x| / 127, and ds_g = dx * sum(xq over group g of 16). Every such format is w = a_g q + c_g
// per group g of 16 inputs. Then
//   for each chunk, quarter p, lane L: i = exact dot of the lane's 4 codes and activations
//       acc[L] = fma(float(i), a[4p + L/4] * dx[block of the lane], acc[L])
//   for each chunk with offsets (c != 0), for g in 0..15: off[g] = fma(c[g], ds[g], off[g])
//   y = hsum(acc) + hsum(off) (+ bias)
//
// K-quants (Q4_K, Q5_K, Q6_K), as llama.cpp's Q8_K: activations quantized per row in blocks of 256 (one scale D per
// chunk), with integer sums b_g over groups of 16. Their sub-block scales are integers, so a whole chunk
// accumulates exactly in int32:
//   for each chunk: isum[L] = sum over quarters p of dot[p][L] * s[4p + L/4]  (s: sc of the lane's sub-block / group)
//       acc[L] = fma(float(isum[L]), d * D, acc[L])
//       for g in 0..15: off[g] = fma(float(o_g * b_g), f, off[g])   (exact integer products, below 2^24)
//           Q4_K, Q5_K: o_g = mn of the group's sub-block, f = (-dmin) * D;  Q6_K: o_g = -32 sc_g, f = d * D
//   y = hsum(acc) + hsum(off) (+ bias)
//
// Column tiles (Q4_K_T16, Q6_K_T16, Q5_0_T16: the types a multi-row pass streams on the Qwen models). The
// weight's rows (output columns) in tiles of 16, the last one zero padded; a tile is K / span chunks (span: 256
// inputs for the K-quants, 32 for Q5_0), each holding that chunk's data for the 16 columns side by side, so one
// 64-byte vector holds 4 inputs of 16 columns (byte 4c + b: column c, input b) and a single integer dot serves 16
// columns per activation row:
//   Q4_K_T16 chunk: d[16], dmin[16] fp16; sc[8][16], mn[8][16] u8 (sub-block j, column c at 16 j + c); then 32
//     pairs of 64 bytes: pair j, byte 4c + b = code(c, 8j + b) | code(c, 8j + 4 + b) << 4.
//   Q6_K_T16 chunk: d[16] fp16; sc[16][16] int8 (group g, column c); then per group g of 16 inputs 192 bytes:
//     pairs 2g and 2g + 1 of the codes' low nibbles as above, then 64 bytes of high bits: byte 4c + b, bits 2i,
//     2i + 1 = code(c, 16g + 4i + b) >> 4 (a chunk reads front to back, one stream for the prefetcher).
//   Q5_0_T16 chunk (one GGUF block of 32 inputs): d[16] fp16; 4 pairs of 64 bytes as above (pair j: inputs 8j + b
//     and 8j + 4 + b); then 64 bytes of high bits: byte 4c + b, bit v = bit 4 of code(c, 4v + b).
// Canonical arithmetic, per column and activation row (the Q8_K activations above; dot_j: exact integer dot of
// the column's codes of sub-block / group j and the row's q256; b_g: the row's group sums):
//   Q4_K_T16, each chunk: isum = sum_j sc_j dot_j,  osum = sum_j mn_j (b_2j + b_2j+1)   (exact int32)
//       acc = fma(float(isum), d * D, acc);  off = fma(float(osum), (-dmin) * D, off)
//   Q6_K_T16, each chunk: isum = sum_g sc_g (dot_g - 32 b_g);  acc = fma(float(isum), d * D, acc);  off stays 0
//   y = acc + off (+ bias)
// Q5_0_T16 reads the 32-weight formats' activations (xq per block of 32 with its dx, s = the block's sum of xq):
//   each chunk: isum = dot - 16 s (exact int32);  acc = fma(float(isum), d * dx, acc);  y = acc (+ bias)
// The scale multiplies once per sub-block and column rather than once per 4 inputs, and the float steps run once
// per chunk for 16 columns: a pass of several rows costs little more integer work per row than the dots.
#pragma once

#include <cstddef>
#include <cstdint>

namespace sparsespec {

// GGML type ids of the supported block formats.
enum QType : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
// The column-tile layouts of two of them (kernel type ids of this library, not GGML's).
constexpr int kTiled = 100;
enum TiledType : int { Q4_K_T16 = Q4_K + kTiled, Q6_K_T16 = Q6_K + kTiled, Q5_0_T16 = Q5_0 + kTiled };
constexpr int kTileColumns = 16;
inline bool is_tiled(int type) { return type == Q4_K_T16 || type == Q6_K_T16 || type == Q5_0_T16; }
// Float weights (GGML's ids): each row k values as they are, k padded with zeros to a multiple of 16 (one group of
// the canonical lanes). Only fmatmul.h multiplies them (float activations whatever the projection asks: there is
// nothing to quantize against).
enum FloatType : int { F32 = 0, F16 = 1, BF16 = 30 };
constexpr bool is_float_type(int type) { return type == F32 || type == F16 || type == BF16; }
constexpr int float_type_bytes(int type) { return type == F32 ? 4 : 2; }
constexpr int kFloatGroup = 16;

// Instruction sets of the kernel (runtime choice; kAuto = the best this CPU runs). kAmx is AVX-512 VNNI plus the
// AMX tile multiply for the column tiles' multi-row passes (everything else runs the AVX-512 path).
enum Isa : int { kAuto = -1, kScalar = 0, kAvx2 = 1, kAvx512 = 2, kNeon = 3, kAmx = 4 };

constexpr int kChunk = 256;
constexpr int kQuarter = 64;
constexpr int kActBlock = 32;
// What a weight's row length k must be a multiple of: whole quarters of a block type, whole groups of a float type.
inline int k_multiple(int type) { return is_float_type(type) ? kFloatGroup : kQuarter; }

bool supported_type(int type);
int code_bits(int type);         // 4, 5, 6 or 8
int scale_bytes(int type);       // bytes of a chunk's scale section
int quarter_bytes(int type);     // bytes of one quarter's codes
std::size_t row_bytes(int type, int k);   // bytes of one repacked row of k inputs (k_multiple)
int tile_span(int type);                   // inputs per chunk of a tiled type (256, or 32 for Q5_0_T16)
std::size_t tile_bytes(int type, int k);  // bytes of one 16-column tile of a tiled type (k a multiple of its span)
std::size_t weight_bytes(int type, int k, long rows);  // bytes of a repacked weight of `rows` rows, either layout

// Per-row quantized activations of an [m, k] float matrix; k_pad = k rounded up to 256, rows zero padded.
struct Activations {
  int m = 0, k_pad = 0;
  const int8_t* q = nullptr;   // [m, k_pad]
  const float* dx = nullptr;   // [m, k_pad / 32]
  const float* ds = nullptr;   // [m, k_pad / 16]
  const float* dxl = nullptr;  // [m, k_pad / 4]: dx of each lane of 4 inputs (what the vector paths load)
  const int32_t* xsum = nullptr;  // [m, k_pad / 32]: sum of q over each block of 32
  // The K-quants' activations: quantized per 256 inputs.
  const int8_t* q256 = nullptr;     // [m, k_pad]
  const float* d256 = nullptr;      // [m, k_pad / 256]
  const int32_t* bsum = nullptr;    // [m, k_pad / 16]: sum of q256 over each group of 16
};

inline bool is_k_quant(int type) {
  return type == Q4_K || type == Q5_K || type == Q6_K || type == Q4_K_T16 || type == Q6_K_T16;
}

int padded_k(int k);  // k rounded up to a multiple of 256
// Fill q [m, k_pad], dx [m, k_pad/32], ds [m, k_pad/16], dxl [m, k_pad/4], xsum [m, k_pad/32] from x [m, k]
// (row stride ldx). Every instruction set writes the same bytes (the portable path is the reference).
void quantize_activations(int isa, const float* x, int m, int k, long ldx, int8_t* q, float* dx, float* ds,
                          float* dxl, int32_t* xsum);
// Fill q [m, k_pad], d [m, k_pad/256], bsum [m, k_pad/16] (the K-quants' activations) from x [m, k].
void quantize_activations_256(int isa, const float* x, int m, int k, long ldx, int8_t* q, float* d, int32_t* bsum);
// The AVX-512 versions of the two (quantize_activations dispatches to them).
void quantize_activations_avx512(const float* x, int m, int k, long ldx, int8_t* q, float* dx, float* ds, float* dxl,
                                 int32_t* xsum);
void quantize_activations_256_avx512(const float* x, int m, int k, long ldx, int8_t* q, float* d, int32_t* bsum);

// out[r, col0 + n] = sum_k w[n, k] * x[r, k] (+ bias[n]) for rows n in [n_begin, n_end) of one weight.
void qmatmul_rows(int isa, int type, const uint8_t* w, int k, int n_begin, int n_end, const Activations& act,
                  const float* bias, float* out, long ldo);

// Dequantize rows of a repacked weight into floats: out [len(rows), k].
void dequantize_rows(int type, const uint8_t* w, int k, const int64_t* rows, int n_rows, float* out);

// The tiled types' kernels: columns [n_begin, n_end) of a tiled weight (each instruction set; qmatmul_rows
// dispatches to them).
void qmatmul_tiles_scalar(int type, const uint8_t* w, int k, int n_begin, int n_end, const Activations& act,
                          const float* bias, float* out, long ldo);
void qmatmul_tiles_avx2(int type, const uint8_t* w, int k, int n_begin, int n_end, const Activations& act,
                        const float* bias, float* out, long ldo);
void qmatmul_tiles_avx512(int type, const uint8_t* w, int k, int n_begin, int n_end, const Activations& act,
                          const float* bias, float* out, long ldo);
void qmatmul_tiles_amx(int type, const uint8_t* w, int k, int n_begin, int n_end, const Activations& act,
                       const float* bias, float* out, long ldo);
// Whether the CPU has AMX-INT8 and the kernel granted this process the tile registers (asked once).
bool amx_usable();
long amx_tile_passes();  // how many column ranges the AMX kernels have multiplied so far (the tests read it)

// Instruction sets compiled in and runnable here; best_isa: the one kAuto runs (the best, unless set_isa chose one).
int best_isa();
bool set_isa(int isa);  // what kAuto runs from now on (kAuto: the best again); false if isa cannot run here
bool isa_available(int isa);
const char* isa_name(int isa);

// Per instruction set entry points (defined in qmatmul_<isa>.cpp).
void qmatmul_rows_scalar(int type, const uint8_t* w, int k, int n_begin, int n_end, const Activations& act,
                         const float* bias, float* out, long ldo);
void qmatmul_rows_avx2(int type, const uint8_t* w, int k, int n_begin, int n_end, const Activations& act,
                       const float* bias, float* out, long ldo);
void qmatmul_rows_avx512(int type, const uint8_t* w, int k, int n_begin, int n_end, const Activations& act,
                         const float* bias, float* out, long ldo);
void qmatmul_rows_neon(int type, const uint8_t* w, int k, int n_begin, int n_end, const Activations& act,
                       const float* bias, float* out, long ldo);

}  // namespace sparsespec
