// Attention of a block of rows over one layer of the KV arena (sparsespec/cache/arena.py), torch-free core.
//
// Arena layout of the layer: keys, values [n_kv, cap, hd] (float32 or bfloat16) or their codes (below),
// positions [n_kv, cap] int64, evicted_at [n_kv, cap] int32 (kNever = alive), scores [n_kv, cap] float32
// (heavy-hitter policies only).
//
// Quantized entries (sparsespec/cache/quant.py): a key or value head vector is stored as codes [hd * bits / 8]
// uint8 plus params [hd / code_group, 2] float16 (scale, zero) per group of code_group consecutive channels; int8:
// one code per byte; int4: channel c in the low nibble of byte c, channel c + hd/2 in the high nibble. Written as
// quant.py writes them (quantize_row: the same float32 steps, so the same codes and params); read as
// fma(code, scale, zero) in float32 (dequantize_row), then used as a float32 entry. Keys may carry a key_offset
// [hd] per head (the model's key bias, quant.py's KVStore offset): stored as the codes of x - offset, read as
// fma(code, scale, zero) + offset, both in float32.
// A full-precision window (quantized entries only, recent_window W > 0; cache/arena.py says why): besides its
// codes, every row is kept in the compute dtype (keys as stored before quantizing, offset in) in a ring of
// recent_slots R >= W entries per KV head, indexed by position % R; the row at position P reads an entry of
// position p > P - W from there (or, while its block is in flight, from the block's own rows), every other entry
// from its codes.
// The block's rows occupy slots [start, start + T); row i sees the slots s <= start + i that are alive.
// A tree block (parents given; it starts from a committed state) names each row's parent row in the block (-1: the
// committed state; a parent precedes its children): row i is at depth d(i) (its ancestors' count), position
// first_position + d(i), and sees the committed entries and its ancestors' rows, minus what its ancestors evicted;
// its scores continue its parent's (snapshots of every row), and its evictions are its own (row_evicted). A row
// then computes exactly what the autoregressive step along its path computes. A chain is the tree whose row i has
// parent i - 1.
//
// Reading order. A row reads the slots it sees in slot order, except in a row-by-row block (per_row, T > 1: a
// verification block), whose row i reads them in the order an autoregressive step at its position would find them
// in: each earlier row of the block in the slot of the entry it evicted, as the arena's commit puts a committed
// row (arena.h: ReadingOrder, commit_arena), the row itself last. The steps below then add the same terms in the same
// order as that step, so a verification row's output, scores and evictions equal the autoregressive step's bit for
// bit. In a block that starts from a committed state the first rows' reading order is the slot order, unchanged.
//
// The float steps of a row (they never depend on how many rows share the block, nor on the thread count):
//   slots, in reading order, are cut into chunks of kAttnChunk from the first; per KV head h, chunk c and query
//   head g of the group:
//     logit[g, s] = dot(q[g], key(s)) * scale           (key rotated by its rank first in the in-cache mode)
//     m[g] = max over s;  e[g, s] = exp(logit - m);  part_sum[c][g] = sum of e over the chunk, in reading order
//     part_out[c][g] = sum over the chunk of e[g, s] * value(s), in reading order
//   total[g] = part_sum[0][g] + part_sum[1][g] + ...;  out[g] = (part_out[0][g] + part_out[1][g] + ...) / total[g]
//   p[g, s] = e[g, s] / total[g];  scores[s] += (p[0, s] + p[1, s] + ...)
// Each instruction set evaluates dot, exp and the chunk sums in its own fixed order (the scalar path in plain
// sequence), so results agree across instruction sets to float rounding, and bit for bit on one machine.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "elementwise.h"

namespace sparsespec {

struct ColdTier;  // recall.h

constexpr int kAttnChunk = 256;
constexpr int kAttnMaxGroup = 64;  // query heads per KV head
constexpr int kAttnMaxHeadDim = 256;
constexpr int32_t kNever = 0x7fffffff;  // evicted_at of an alive slot
constexpr int32_t kOffPath = 0x7ffffffe;  // evicted_at, while a tree row attends, of a row not on its path
constexpr float kMinCodeScale = 0x1p-14f;  // quant.py's MIN_SCALE: the float16 scale of a constant group

// The rank of a row at `depth` in its block (in-cache mode): the tokens visible before it. Each row of a per_row
// path adds one and evicts down to the budget, so past the first row (which takes visible_before, even above the
// budget) it is min(visible_before + depth, budget).
inline int64_t row_rank(int64_t visible_before, int depth, bool per_row, int budget) {
  return per_row && depth ? std::min<int64_t>(visible_before + depth, budget) : visible_before + depth;
}

// Bytes of one stored head vector's codes, and float16 values of its params.
inline long code_bytes(int hd, int bits) { return (long)hd * bits / 8; }
inline long param_halves(int hd, int code_group) { return 2L * (hd / code_group); }

// x [hd] -> codes and params as quant.py's quantize: per group, scale = float16(max((max - min) / (2^bits - 1),
// 2^-14)), zero = float16(min), code = clamp(round_half_even((x - zero) / scale), 0, 2^bits - 1).
void quantize_row(const float* x, int hd, int bits, int code_group, uint8_t* codes, uint16_t* params);

// codes and params -> [hd] float32 entries, channel c = fma(code, scale, zero) (the scalar definition every
// instruction set's dequantize_row equals bit for bit). Internal linkage: each file compiles its own copy under
// its own instruction set, and no file may end up calling another's.
static inline void dequantize_row_scalar(const uint8_t* codes, const uint16_t* params, int hd, int bits, int code_group,
                                  float* out) {
  for (int g = 0; g < hd / code_group; ++g) {
    const float scale = half_to_float(params[2 * g]), zero = half_to_float(params[2 * g + 1]);
    for (int c = g * code_group; c < (g + 1) * code_group; ++c) {
      const int code = bits == 8 ? codes[c] : c < hd / 2 ? codes[c] & 15 : codes[c - hd / 2] >> 4;
      out[c] = std::fma((float)code, scale, zero);
    }
  }
}

// One chunk of slots [s0, s1) of one KV head, for one row.
struct AttnChunk {
  int group = 0, hd = 0;
  const float* q = nullptr;      // [group, hd] rotated queries of the row (row stride ldq)
  long ldq = 0;
  const void* keys = nullptr;    // [cap, hd] of this head, float32 or bf16 (bf16 = true)
  const void* values = nullptr;  // [cap, hd]
  bool bf16 = false;
  int code_bits = 0, code_group = 0;      // 8 or 4: keys and values are codes (see the top), 0: float entries
  const uint16_t* key_params = nullptr;   // [cap, hd / code_group, 2] float16 (quantized entries only)
  const uint16_t* value_params = nullptr;
  const float* key_offset = nullptr;      // [hd] added to every dequantized key, or null
  const int32_t* evicted_at = nullptr;  // [cap]
  int last_slot = 0;                    // the row reads its slots s = 0 .. last_slot (in reading order)
  const int32_t* slot_of = nullptr;     // [last_slot + 1] the arena slot of each, or null: slot s itself
  const int32_t* ranks = nullptr;       // [cap] rank of each alive arena slot (in-cache mode), else null
  const float* cos = nullptr;           // [>= cap, hd] RoPE tables for ranks (in-cache mode), Hugging Face
  const float* sin = nullptr;           // layout: a row's two halves are equal (the vector paths read the first)
  float scale = 1.0f;
  float* logits = nullptr;  // [group, lds] by reading order: logits, then exponentials (-inf / 0 for slots the
                            // row does not see)
  long lds = 0;
  // Full-precision window (see the top; recent_window 0: none). The row is at position newest; entries of
  // positions p > newest - recent_window are read from block_keys / block_values [T, hd] (row p - first_position)
  // when p >= first_position, else from the ring recent_keys / recent_values [recent_slots, hd] (row p % slots).
  const int64_t* positions = nullptr;  // [cap]
  int64_t newest = 0, first_position = 0;
  int recent_window = 0, recent_slots = 0;
  const void* recent_keys = nullptr;  // float32, or bfloat16 when recent_bf16
  const void* recent_values = nullptr;
  bool recent_bf16 = false;
  const float* block_keys = nullptr;
  const float* block_values = nullptr;
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
  void* keys = nullptr;    // [n_kv, cap, hd], or codes [n_kv, cap, hd * code_bits / 8]
  void* values = nullptr;
  bool bf16 = false;
  int code_bits = 0, code_group = 0;  // quantized entries: 8 or 4 bits, channels per group; 0: float entries
  uint16_t* key_params = nullptr;     // [n_kv, cap, hd / code_group, 2] float16
  uint16_t* value_params = nullptr;
  const float* key_offset = nullptr;  // [n_kv, hd] subtracted from keys before quantizing, added back after, or null
  int64_t* positions = nullptr;        // [n_kv, cap]
  int32_t* evicted_at = nullptr;       // [n_kv, cap]
  float* scores = nullptr;             // [n_kv, cap] or null
  float* row_scores = nullptr;         // [snapshots, n_kv, cap] (rows first..), row stride row_stride, or null
  long row_stride = 0;
  int snapshot_rows = 0;               // rows 0..snapshot_rows-1 of the block store their score snapshots
  const float* cos = nullptr;          // in-cache mode: RoPE tables by rank (AttnChunk); null in the original mode
  const float* sin = nullptr;
  int start = 0, first = 0, visible_before = 0;
  int64_t first_position = 0;
  // Tree blocks (see the top; null: a chain): parents [T]; depths [T]; committed_scores [n_kv, cap], what a root
  // row's scores start from; row_evicted, row i's evicted slot per KV head (or -1) at row_evicted[i * evicted_stride
  // + h]. Every row keeps its score snapshot (snapshot_rows = T).
  const int32_t* parents = nullptr;
  const int32_t* depths = nullptr;
  const float* committed_scores = nullptr;
  int32_t* row_evicted = nullptr;
  long evicted_stride = 0;
  bool per_row = false;  // evict after every row (else, if over budget, once after the block)
  // Retention's observation window (cache/retention.py; pool > 0): the block's scores start from 0 and add each
  // row's attention undecayed; after its last row every KV head keeps select_budget entries, the heavy hitters
  // ranked by those scores max-pooled over the `pool` visible entries nearest in position (ties: the older goes),
  // sinks and window kept; the kept entries' scores are the window's attention.
  int pool = 0, select_budget = 0;
  int budget = -1, sinks = 0, heavy = 0, window = 0;  // budget -1: the full cache
  bool age_normalised = false;  // heavy hitters ranked by score / age (hybrid-age), else by score
  float score_decay = 1.0f;     // each row: score = score * score_decay + attention received (hybrid-decay)
  float scale = 1.0f;
  float* out = nullptr;  // [T, n_kv * group * hd]
  float* lse = nullptr;  // [T, n_kv * group] each row's log-sum-exp of its scaled logits per query head, or null
  // Full-precision window (see the top; recent_window 0: none): the ring [n_kv, recent_slots, hd] in float32 or
  // bfloat16 (recent_bf16), written after the block's last row; block_keys / block_values [n_kv, T, hd], the
  // block's rows as the ring keeps them (rounded to bfloat16 when recent_bf16), written by stage_rows.
  void* recent_keys = nullptr;
  void* recent_values = nullptr;
  bool recent_bf16 = false;
  int recent_window = 0, recent_slots = 0;
  float* block_keys = nullptr;
  float* block_values = nullptr;
};

void attend_block(int isa, const AttnBlock& b);

// The block's new rows entering one layer of the arena, before attend_block (by the RoPE rows of rope.h): queries
// rotated in float32 by true position (original mode) or by rank
// (the tokens visible before the row); keys rotated by true position in the original mode, else stored as they are;
// keys and values stored at slots [start, start + T) in the arena's dtype (or quantize_row's codes), positions set,
// evicted_at = kNever, scores 0; with a full-precision window, the rows as the ring keeps them in block_keys /
// block_values. A rotation is x * cos + rotate_half(x) * sin, each product and the sum rounded as in
// the dtype of x
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

// One KV arena's memory for all its layers (owned by ArenaMemory, arena.h), and its policy (cache/arena.py): what
// stays the same from pass to pass.
// Per layer as AttnBlock describes one: keys, values [L, n_kv, cap, hd] (float32, bfloat16, or codes with params
// [L, n_kv, cap, hd / code_group, 2]); key_offset [L, n_kv, hd] or null; positions, evicted_at, scores,
// committed_scores (the scores as the last commit left them) [L, n_kv, cap] (both scores null without heavy
// hitters); row_scores [row_score_rows, L, n_kv, cap] or null; the
// full-precision ring [L, n_kv, recent_slots, hd] or null (recent_window 0).
struct ArenaStorage {
  int n_layers = 0, n_kv = 0, cap = 0, hd = 0;
  void* keys = nullptr;
  void* values = nullptr;
  bool bf16 = false;
  int code_bits = 0, code_group = 0;
  uint16_t* key_params = nullptr;
  uint16_t* value_params = nullptr;
  const float* key_offset = nullptr;
  int64_t* positions = nullptr;
  int32_t* evicted_at = nullptr;
  float* scores = nullptr;
  float* committed_scores = nullptr;
  float* row_scores = nullptr;
  int row_score_rows = 0;
  int32_t* row_evicted = nullptr;  // [row_evicted_rows, L, n_kv]: what each row of a tree block evicted
  int row_evicted_rows = 0;
  void* recent_keys = nullptr;
  void* recent_values = nullptr;
  bool recent_bf16 = false;
  int recent_window = 0, recent_slots = 0;
  int sinks = 0, heavy = 0, window = 0;
  bool age_normalised = false;
  float score_decay = 1.0f, scale = 1.0f;
  ColdTier* cold = nullptr;  // where evicted entries go (recall.h), or null: they are dropped
};

// What the arena's ledger (ledger.h: ArenaLedger::begin) works out once for a block, the same in every layer: the
// rows' slots, their first in-flight row and position, what they see, how the policy evicts (per_row, budget -1: the
// full cache), how many rows keep score snapshots, and the RoPE rows it rotates by (rope.h) [table_rows, hd] (row p -
// table_offset serves position, or in the in-cache mode rank, p; the arena makes them when it begins the block).
struct ArenaPass {
  int start = 0, first = 0, visible_before = 0, snapshots = 0, budget = -1;
  int64_t first_position = 0;
  bool per_row = false, in_cache = false;
  const int32_t* parents = nullptr;  // [T] a tree block's parents (AttnBlock), or null: a chain
  int pool = 0, select_budget = 0;   // retention's observation window (AttnBlock), pool 0: none
  bool recall = false;               // rows recall from the arena's cold tier (recall.h: recall_rows)
  const float* cos = nullptr;
  const float* sin = nullptr;
  int64_t table_rows = 0, table_offset = 0;
};

// The reason a block of T rows of n_heads query heads cannot run `pass` over `arena`, or "" (checked before
// attend_arena_layer touches memory).
std::string check_arena_pass(const ArenaStorage& arena, const ArenaPass& pass, int T, int n_heads);

// The block's rows entering layer `layer` of the arena and attending over it (stage_rows, then attend_block):
// q [n_heads, T, hd], k, v [n_kv, T, hd] float32 before RoPE (bf16_keys: the keys came in as bfloat16);
// out [T, n_heads * hd] float32, or bfloat16 when out_bf16. With pass.recall, each row's attention over the
// resident entries then merges in what it recalls from the cold tier (recall.h: recall_rows).
void attend_arena_layer(int isa, const ArenaStorage& arena, const ArenaPass& pass, int layer, int n_heads, int T,
                        const float* q, const float* k, const float* v, bool bf16_keys, void* out, bool out_bf16);

}  // namespace sparsespec
