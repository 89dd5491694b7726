// Attention of a block of rows over one layer of the KV arena (sparsespec/cache/arena.py), torch-free core.
//
// Arena layout of the layer: keys, values [n_kv, cap, hd] (float32 or bfloat16), positions [n_kv, cap] int64,
// evicted_at [n_kv, cap] int32 (kNever = alive), scores [n_kv, cap] float32 (heavy-hitter policies only).
// The block's rows occupy slots [start, start + T); row i sees the slots s <= start + i that are alive.
//
// The float steps of a row (they never depend on how many rows share the block, nor on the thread count):
//   slots are cut into chunks of kAttnChunk from slot 0; per KV head h, chunk c and query head g of the group:
//     logit[g, s] = dot(q[g], key(s)) * scale           (key rotated by its rank first in the in-cache mode)
//     m[g] = max over s;  e[g, s] = exp(logit - m);  part_sum[c][g] = sum of e over the chunk, in slot order
//     part_out[c][g] = sum over the chunk of e[g, s] * value(s), in slot order
//   total[g] = part_sum[0][g] + part_sum[1][g] + ...;  out[g] = (part_out[0][g] + part_out[1][g] + ...) / total[g]
//   p[g, s] = e[g, s] / total[g];  scores[s] += (p[0, s] + p[1, s] + ...)
// Each instruction set evaluates dot, exp and the chunk sums in its own fixed order (the scalar path in plain
// sequence), so results agree across instruction sets to float rounding, and bit for bit on one machine.
#pragma once

#include <cstdint>

namespace sparsespec {

constexpr int kAttnChunk = 256;
constexpr int kAttnMaxGroup = 64;  // query heads per KV head
constexpr int kAttnMaxHeadDim = 256;
constexpr int32_t kNever = 0x7fffffff;  // evicted_at of an alive slot

// One chunk of slots [s0, s1) of one KV head, for one row.
struct AttnChunk {
  int group = 0, hd = 0;
  const float* q = nullptr;      // [group, hd] rotated queries of the row (row stride ldq)
  long ldq = 0;
  const void* keys = nullptr;    // [cap, hd] of this head, float32 or bf16 (bf16 = true)
  const void* values = nullptr;  // [cap, hd]
  bool bf16 = false;
  const int32_t* evicted_at = nullptr;  // [cap]
  int last_slot = 0;                    // slots s <= last_slot are in the row's causal range
  const int32_t* ranks = nullptr;       // [cap] rank of each alive slot (in-cache mode), else null
  const float* cos = nullptr;           // [>= cap, hd] RoPE tables for ranks (in-cache mode)
  const float* sin = nullptr;
  float scale = 1.0f;
  float* logits = nullptr;  // [group, lds]: logits, then exponentials (-inf / 0 for slots the row does not see)
  long lds = 0;
};

// Per instruction set chunk kernels (defined in attention_<isa>.cpp from attention_chunk.h).
struct AttnKernels {
  // logits of the chunk's slots; max_out[g] = the chunk's largest logit (-inf if it sees none).
  void (*logits)(const AttnChunk& a, int s0, int s1, float* max_out);
  // e = exp(logit - m[g]) in place; sum_out[g] = sum of e; out[g, :] = sum of e * value (zeroed first).
  void (*exp_values)(const AttnChunk& a, int s0, int s1, const float* m, float* sum_out, float* out);
};

const AttnKernels& attention_kernels_scalar();
const AttnKernels& attention_kernels_avx2();
const AttnKernels& attention_kernels_avx512();
const AttnKernels& attention_kernels(int isa);  // kAuto = the best this CPU runs

// Rows of a block over one layer; see arena_attention in ops.cpp for the meaning of each field.
struct AttnBlock {
  int n_kv = 0, group = 0, hd = 0, T = 0, cap = 0;
  const float* q = nullptr;  // [n_kv * group, T, hd] rotated queries
  void* keys = nullptr;    // [n_kv, cap, hd]
  void* values = nullptr;
  bool bf16 = false;
  int64_t* positions = nullptr;        // [n_kv, cap]
  int32_t* evicted_at = nullptr;       // [n_kv, cap]
  float* scores = nullptr;             // [n_kv, cap] or null
  float* row_scores = nullptr;         // [snapshots, n_kv, cap] (rows first..), row stride row_stride, or null
  long row_stride = 0;
  int snapshot_rows = 0;               // rows 0..snapshot_rows-1 of the block store their score snapshots
  const float* cos = nullptr;          // in-cache mode: RoPE tables by rank; null in the original mode
  const float* sin = nullptr;
  int start = 0, first = 0, visible_before = 0;
  int64_t first_position = 0;
  bool per_row = false;  // evict after every row (else, if over budget, once after the block)
  int budget = -1, sinks = 0, heavy = 0, window = 0;  // budget -1: the full cache
  float scale = 1.0f;
  float* out = nullptr;  // [T, n_kv * group * hd]
};

void attend_block(int isa, const AttnBlock& b);

// The block's new rows entering one layer of the arena, before attend_block (the arena's torch path does the same in
// these steps: KVArena.attend, Rope.rotate): queries rotated in float32 by true position (original mode) or by rank
// (the tokens visible before the row); keys rotated by true position in the original mode, else stored as they are;
// keys and values stored at slots [start, start + T) in the arena's dtype, positions set, evicted_at = kNever,
// scores 0. A rotation is x * cos + rotate_half(x) * sin, each product and the sum rounded as in the dtype of x
// (bf16_keys: keys came in as bfloat16, so with bfloat16-rounded tables and bfloat16 rounding after every step).
struct StageRows {
  int n_heads = 0, n_kv = 0, hd = 0, T = 0;
  const float* q = nullptr;  // [n_heads, T, hd] queries as given (widened to float32)
  const float* k = nullptr;  // [n_kv, T, hd] keys as given (widened)
  const float* v = nullptr;  // [n_kv, T, hd]
  bool bf16_keys = false;
  const float* cos = nullptr;  // [P, hd] RoPE tables; row p - table_offset serves position (or rank) p
  const float* sin = nullptr;
  int64_t table_offset = 0;
  bool in_cache = false;
  float* q_rotated = nullptr;  // [n_heads, T, hd] out
};

void stage_rows(const StageRows& st, const AttnBlock& b);

}  // namespace sparsespec
