// Python bindings of the native kernels: the ops, and facts about the build.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "arena.h"
#include "attention.h"
#include "boundary.h"
#include "elementwise.h"
#include "ledger.h"
#include "fmatmul.h"
#include "model.h"
#include "project.h"
#include "qmatmul.h"
#include "recall.h"

namespace sparsespec {
namespace {

// t [d0, d1, d2] (float32 or bfloat16, any strides) as contiguous float32 (widening is exact), without torch ops.
std::vector<float> widened(const at::Tensor& t) {
  const int64_t d0 = t.size(0), d1 = t.size(1), d2 = t.size(2);
  const int64_t s0 = t.stride(0), s1 = t.stride(1), s2 = t.stride(2);
  std::vector<float> out((std::size_t)(d0 * d1 * d2));
  const bool bf16 = t.scalar_type() == at::kBFloat16;
  const void* data = t.data_ptr();
  std::size_t o = 0;
  for (int64_t a = 0; a < d0; ++a)
    for (int64_t b = 0; b < d1; ++b)
      for (int64_t c = 0; c < d2; ++c) {
        const int64_t at = a * s0 + b * s1 + c * s2;
        out[o++] = bf16 ? bf16_to_float(static_cast<const uint16_t*>(data)[at]) : static_cast<const float*>(data)[at];
      }
  return out;
}

// ------------------------------------------------------------------------------------------ the KV arena
// Throws std::invalid_argument (Python's ValueError) with `problem` where it is not "": a verb the arena's state or
// rules refuse (ledger.h), as cache/arena.py raised them.
void refuse(const char* op, const std::string& problem) {
  if (!problem.empty()) throw std::invalid_argument(std::string(op) + ": " + problem);
}

// One KV arena (cache/arena.py): its memory (arena.h: ArenaMemory), the ArenaStorage that points into it with the
// policy, its cold tier, its RoPE rows, its ledger (ledger.h: the counts and the open block) and the verbs that
// change them. Python holds it as a handle; `buffer` gives torch views of its buffers (for tests and inspection),
// each keeping the memory it views alive, also across a resize.
struct NativeArena {
  ArenaStorage storage;
  std::shared_ptr<ArenaMemory> memory;
  std::shared_ptr<ColdTier> cold;  // or null
  // RoPE (rope.h): by rank from 0 in the in-cache mode (up to the slots in use), else the open block's positions.
  RopeTables rope;
  ArenaLedger ledger;
  ArenaPass block;              // the open block's (ledger.block_open), its parents in ledger.tree
  std::size_t peak_nbytes = 0;  // the most bytes the entries have held since restart_peak

  // storage's buffers and tier, after the memory or the tier changed.
  void bind() {
    memory->point(storage);
    storage.cold = cold.get();
    ledger.capacity = storage.cap;
    peak_nbytes = std::max(peak_nbytes, memory->entry_bytes());
  }

  // Begin a block of n_rows new tokens (KVArena.begin): per_block, a prefill chunk that evicts at its end; parents,
  // a tree block (one per row, -1 a root) or None: a chain. The ledger decides what the rows do in every layer.
  void begin(int64_t n_rows, bool per_block, const c10::optional<std::vector<int64_t>>& parents) {
    const char* op = "NativeArena.begin";
    TORCH_CHECK(n_rows >= 1 && n_rows <= INT32_MAX, op, ": a block of ", n_rows, " rows");
    std::vector<int32_t> tree;
    if (parents.has_value()) {
      for (int64_t parent : *parents) tree.push_back(parent >= -1 && parent < n_rows ? (int32_t)parent : INT32_MAX);
    }
    ArenaPass p;
    refuse(op, ledger.begin((int)n_rows, per_block, parents.has_value() ? &tree : nullptr, p));
    // Ranks stay below start + n_rows (a row sees at most the slots up to its own); positions are the rows' own.
    if (p.in_cache)
      rope.cover((int64_t)p.start + n_rows);
    else
      rope.hold(p.first_position, n_rows);
    p.cos = rope.cos.data();
    p.sin = rope.sin.data();
    p.table_rows = rope.rows;
    p.table_offset = rope.first;
    p.parents = ledger.tree.empty() ? nullptr : ledger.tree.data();
    block = p;
  }

  // End the open block (KVArena.end): its rows are in flight.
  void end() {
    refuse("NativeArena.end", ledger.block_open ? "" : "no block is open");
    ledger.end();
    block = ArenaPass();
  }

  // Accept the first n_rows in-flight rows, drop the rest (0: a rollback) and compact the buffers (arena.h:
  // commit_arena): the arena then equals the arena of an autoregressive run that fed exactly those rows.
  void commit(int64_t n_rows) {
    const char* op = "NativeArena.commit";
    TORCH_CHECK(n_rows >= 0 && n_rows <= INT32_MAX, op, ": ", n_rows, " rows");
    refuse(op, ledger.check_commit((int)n_rows));
    const int survivors = ledger.survivors_after((int)n_rows - 1);
    // The full cache evicts nothing: dropped rows are simply written over later. A tree block is rolled back like a
    // chain: its rows' evictions were never marked.
    if (ledger.rules.budget >= 0) {
      const ArenaCommit c{ledger.committed, (int)n_rows, ledger.inflight(), survivors};
      std::string problem = check_arena_commit(storage, c);
      TORCH_CHECK(problem.empty(), op, ": ", problem);
      {
        pybind11::gil_scoped_release unlocked;
        // What the kept rows evicted moves to the cold tier (with recall) before compaction writes over it.
        if (cold) problem = retire_evicted(*cold, storage, c.n_rows, c.committed + c.n_rows);
        if (problem.empty()) problem = commit_arena(storage, c);
      }
      TORCH_CHECK(problem.empty(), op, ": ", problem);
    }
    ledger.committed_rows((int)n_rows, survivors);
    grow_if_full();
  }

  // Accept the rows `path` of the tree block in flight (a root first, each the parent of the next), drop the others
  // (arena.h: commit_arena_path): the arena then equals the arena of an autoregressive run that fed the path.
  void commit_path(const std::vector<int64_t>& path) {
    const char* op = "NativeArena.commit_path";
    std::vector<int> rows;
    for (int64_t r : path) rows.push_back(r >= 0 && r <= INT32_MAX ? (int)r : -1);
    refuse(op, ledger.check_path(rows));
    const int survivors = ledger.survivors_after(rows.back());
    std::string problem = check_arena_path(storage, ledger.committed, rows, ledger.inflight());
    TORCH_CHECK(problem.empty(), op, ": ", problem);
    {
      pybind11::gil_scoped_release unlocked;
      problem = commit_arena_path(storage, ledger.committed, rows, ledger.inflight(), survivors);
    }
    TORCH_CHECK(problem.empty(), op, ": ", problem);
    ledger.committed_rows((int)rows.size(), survivors);
    grow_if_full();
  }

  // Read the next n_tokens prompt rows with nothing evicted, their last window_rows the observation window whose
  // chunk ends by selecting what stays (retention.py; KVArena.hold): the buffers grow to hold them all.
  void hold(int64_t n_tokens, int64_t window_rows) {
    const char* op = "NativeArena.hold";
    TORCH_CHECK(n_tokens >= 1 && n_tokens <= INT32_MAX && window_rows >= 1 && window_rows <= INT32_MAX, op,
                ": a hold of ", n_tokens, " rows with a window of ", window_rows);
    refuse(op, ledger.check_hold((int)n_tokens, (int)window_rows));
    const int steady = storage.cap;
    if (ledger.committed + n_tokens > steady) resize((int)(ledger.committed + n_tokens));
    ledger.hold_left = (int)n_tokens;
    ledger.window_rows = (int)window_rows;
    ledger.steady_capacity = steady;
  }

  // Leave the open hold: the buffers shrink back; a hold left early (rows still to come or in flight) empties the
  // arena.
  void release_hold() {
    refuse("NativeArena.release_hold", ledger.steady_capacity ? "" : "no hold is open");
    const int steady = ledger.steady_capacity;
    if (ledger.hold_left || ledger.inflight() || ledger.committed > steady) reset();
    ledger.hold_left = 0;
    ledger.steady_capacity = 0;
    if (storage.cap != steady) resize(steady);
  }

  // Take slots [0, committed) as committed tokens and next_position as the next token's position, for a caller
  // that wrote the arena's buffers itself (tests, tools); refused unless the arena is empty.
  void assume(int64_t committed, int64_t next_position) {
    const char* op = "NativeArena.assume";
    refuse(op, ledger.committed || ledger.inflight() || ledger.block_open ? "the arena is not empty" : "");
    TORCH_CHECK(committed >= 0 && committed <= storage.cap && next_position >= committed &&
                    next_position <= INT64_MAX / 4,
                op, ": ", committed, " committed slots of ", storage.cap, " before position ", next_position);
    ledger.committed = (int)committed;
    ledger.next_position = next_position;
  }

  // The open block's pass for a call of T rows (the block's).
  const ArenaPass& open_block(const char* op, int64_t T) const {
    TORCH_CHECK(ledger.block_open, op, ": the arena has no block open");
    TORCH_CHECK(T == ledger.block_rows, op, ": ", T, " rows for a block of ", ledger.block_rows);
    return block;
  }

  // A full cache that started below its max_tokens doubles its room once the committed tokens leave less than a
  // staging's worth (so the next block always fits), up to max_tokens.
  void grow_if_full() {
    const int capacity = ledger.grown_capacity();
    if (capacity != storage.cap) resize(capacity);
  }

  // `capacity` slots per KV head from now on, the committed entries kept (ArenaMemory::resized); nothing in flight.
  void resize(int capacity) {
    memory = std::make_shared<ArenaMemory>(memory->resized(capacity, ledger.committed));
    bind();
  }

  // Forget every token, keeping the memory (cold tier included): the arena is as freshly built (stale slots are
  // never read, since every slot is written when its row is staged).
  void reset() {
    block = ArenaPass();
    ledger.reset();
    memory->forget();
    if (cold) cold->count = 0;
  }

  // A copy with memory and a cold tier of its own.
  std::shared_ptr<NativeArena> copy() const {
    auto out = std::make_shared<NativeArena>(*this);
    out->memory = std::make_shared<ArenaMemory>(*memory);
    if (cold) out->cold = std::make_shared<ColdTier>(*cold);
    out->bind();
    if (out->block.parents) out->block.parents = out->ledger.tree.data();
    if (out->ledger.block_open) {
      out->block.cos = out->rope.cos.data();
      out->block.sin = out->rope.sin.data();
    }
    return out;
  }

  // One of the memory's buffers with the shape and dtype it has (attention.h: ArenaStorage).
  struct View {
    const Buffer* buffer;
    std::vector<int64_t> sizes;
    at::ScalarType dtype;
  };

  // The memory's buffers by name (ArenaMemory's members).
  std::vector<std::pair<std::string, View>> views() const {
    const ArenaLayout& l = memory->layout;
    const int64_t L = l.n_layers, H = l.n_kv, C = l.cap, hd = l.hd;
    const at::ScalarType entry = l.code_bits ? at::kByte : l.bf16 ? at::kBFloat16 : at::kFloat;
    const at::ScalarType ring = l.recent_bf16 ? at::kBFloat16 : at::kFloat;
    const int64_t width = l.code_bits ? code_bytes(l.hd, l.code_bits) : hd;
    const int64_t groups = l.code_bits ? hd / l.code_group : 0;
    const ArenaMemory& m = *memory;
    return {{"keys", {&m.keys, {L, H, C, width}, entry}},
            {"values", {&m.values, {L, H, C, width}, entry}},
            {"key_params", {&m.key_params, {L, H, C, groups, 2}, at::kHalf}},
            {"value_params", {&m.value_params, {L, H, C, groups, 2}, at::kHalf}},
            {"key_offset", {&m.key_offset, {L, H, hd}, at::kFloat}},
            {"positions", {&m.positions, {L, H, C}, at::kLong}},
            {"evicted_at", {&m.evicted_at, {L, H, C}, at::kInt}},
            {"scores", {&m.scores, {L, H, C}, at::kFloat}},
            {"committed_scores", {&m.committed_scores, {L, H, C}, at::kFloat}},
            {"row_scores", {&m.row_scores, {l.row_score_rows, L, H, C}, at::kFloat}},
            {"row_evicted", {&m.row_evicted, {l.row_evicted_rows, L, H}, at::kInt}},
            {"recent_keys", {&m.recent_keys, {L, H, l.recent_slots, hd}, ring}},
            {"recent_values", {&m.recent_values, {L, H, l.recent_slots, hd}, ring}}};
  }

  // The names of the buffers this arena keeps (memory allocated).
  std::vector<std::string> kept_buffers() const {
    std::vector<std::string> names;
    for (const auto& [name, view] : views())
      if (view.buffer->bytes()) names.push_back(name);
    return names;
  }

  // A view of the buffer `name`, keeping the memory alive (empty where the arena keeps none of it, e.g. no
  // snapshot rows; an error where it keeps no such buffer at all).
  at::Tensor buffer(const std::string& name) const {
    for (const auto& [known, v] : views()) {
      if (known != name) continue;
      if (std::find(v.sizes.begin(), v.sizes.end(), 0) != v.sizes.end())
        return at::empty(v.sizes, at::TensorOptions().dtype(v.dtype));
      TORCH_CHECK(v.buffer->bytes(), "NativeArena.buffer: this arena keeps no ", name);
      std::shared_ptr<ArenaMemory> owner = memory;
      return torch::from_blob(v.buffer->as<void>(), v.sizes, [owner](void*) {}, at::TensorOptions().dtype(v.dtype));
    }
    TORCH_CHECK(false, "NativeArena.buffer: no buffer is named ", name);
  }
};

// A KV arena of n_layers x n_kv heads of `capacity` slots of hd channels (arena.h: ArenaLayout gives the rest of the
// layout) and its policy: sinks, heavy, window, age_normalised (hybrid-age: heavy hitters ranked by score / age),
// score_decay (hybrid-decay: every row multiplies the scores by it first; 1 elsewhere), and the attention's scale.
// key_offset: [n_layers, n_kv, hd] float32 that quantized keys are stored minus, or None. inv_freq [hd / 2] and
// attention_factor: the model's RoPE (rope.h). cold: the tier that receives what commits evict (recall.h), or None.
// The rules of its blocks (ledger.h: ArenaRules): budget (-1: the full cache), max_inflight, staging, max_tokens (the
// full cache's most tokens; -1: budgeted), pool (retention's; 0: none), in_cache (the position mode).
std::shared_ptr<NativeArena> native_arena(int64_t n_layers, int64_t n_kv, int64_t hd, int64_t capacity,
                                          int64_t code_bits, int64_t code_group, bool bf16,
                                          const c10::optional<at::Tensor>& key_offset, bool scores,
                                          int64_t row_score_rows, int64_t row_evicted_rows, int64_t recent_window,
                                          int64_t recent_slots, bool recent_bf16, int64_t sinks, int64_t heavy,
                                          int64_t window, bool age_normalised, double score_decay, double scale,
                                          const std::vector<float>& inv_freq, double attention_factor,
                                          std::shared_ptr<ColdTier> cold, int64_t budget, int64_t max_inflight,
                                          int64_t staging, int64_t max_tokens, int64_t pool, bool in_cache) {
  const char* op = "NativeArena";
  for (int64_t n : {n_layers, n_kv, hd, capacity, code_bits, code_group, row_score_rows, row_evicted_rows,
                    recent_window, recent_slots, sinks, heavy, window, max_inflight, staging, pool})
    TORCH_CHECK(n >= 0 && n <= INT32_MAX, op, ": sizes and counts from 0 to 2^31 - 1, not ", n);
  ArenaLayout l;
  l.n_layers = (int)n_layers;
  l.n_kv = (int)n_kv;
  l.hd = (int)hd;
  l.cap = (int)capacity;
  l.code_bits = (int)code_bits;
  l.code_group = (int)code_group;
  l.bf16 = bf16;
  l.key_offset = key_offset.has_value() && key_offset->defined();
  l.scores = scores;
  l.row_score_rows = (int)row_score_rows;
  l.row_evicted_rows = (int)row_evicted_rows;
  l.recent_window = (int)recent_window;
  l.recent_slots = (int)recent_slots;
  l.recent_bf16 = recent_bf16;
  const std::string problem = check_arena_layout(l);
  TORCH_CHECK(problem.empty(), op, ": ", problem);
  TORCH_CHECK(heavy == 0 || scores, op, ": a policy with heavy hitters needs scores");
  const std::string rope_problem = RopeTables::check((int)hd, inv_freq, attention_factor);
  TORCH_CHECK(rope_problem.empty(), op, ": ", rope_problem);
  if (l.key_offset) {
    check_cpu(op, {&*key_offset});
    TORCH_CHECK(key_offset->scalar_type() == at::kFloat && key_offset->sizes() == at::IntArrayRef({n_layers, n_kv, hd}),
                op, ": key_offset must be float32 [", n_layers, ", ", n_kv, ", ", hd, "]");
  }
  if (cold)
    TORCH_CHECK(cold->n_layers == n_layers && cold->n_kv == n_kv && cold->hd == hd,
                op, ": the cold tier's layers, KV heads and head size are not the arena's");
  TORCH_CHECK(staging >= 1 && staging >= max_inflight && staging <= capacity, op, ": a staging of ", staging,
              " rows for ", max_inflight, " in flight and ", capacity, " slots");
  TORCH_CHECK(budget >= -1 && budget <= capacity - staging, op, ": a budget of ", budget, " and a staging of ",
              staging, " in ", capacity, " slots");
  TORCH_CHECK(max_tokens >= -1 && max_tokens <= INT32_MAX && (budget < 0) == (max_tokens >= 0), op,
              ": the full cache (budget -1), and it alone, has max_tokens");
  TORCH_CHECK(pool == 0 || (budget >= 0 && scores), op, ": retention needs a budget and heavy-hitter scores");
  TORCH_CHECK(!cold || budget >= 0, op, ": recall needs a budget");
  auto arena = std::make_shared<NativeArena>();
  ArenaRules& rules = arena->ledger.rules;
  rules.budget = (int)budget;
  rules.scores = scores;
  rules.row_score_rows = (int)row_score_rows;
  rules.max_inflight = (int)max_inflight;
  rules.staging = (int)staging;
  rules.max_tokens = max_tokens;
  rules.pool = (int)pool;
  rules.recall = cold != nullptr;
  rules.recent_window = recent_window > 0;
  rules.in_cache = in_cache;
  arena->memory = std::make_shared<ArenaMemory>(l);
  if (l.key_offset) {
    const at::Tensor offset = key_offset->contiguous();
    std::memcpy(arena->memory->key_offset.as<void>(), offset.data_ptr<float>(), arena->memory->key_offset.bytes());
  }
  arena->cold = cold;
  arena->rope = RopeTables((int)hd, inv_freq, (float)attention_factor);
  arena->bind();
  ArenaStorage& a = arena->storage;
  a.sinks = (int)sinks;
  a.heavy = (int)heavy;
  a.window = (int)window;
  a.age_normalised = age_normalised;
  a.score_decay = (float)score_decay;
  a.scale = (float)scale;
  return arena;
}

// The open block of the arena `item` (a NativeArena) for a call of T rows; the arena is kept in `arenas`, alive
// while the pass runs.
const ArenaPass& arena_pass(const char* op, const pybind11::handle& item, int64_t T,
                            std::vector<std::shared_ptr<NativeArena>>& arenas) {
  arenas.push_back(item.cast<std::shared_ptr<NativeArena>>());
  return arenas.back()->open_block(op, T);
}

// The open block's T rows entering and attending over one layer of the KV arena (attention.h; cache/arena.py):
// q [n_heads, T, hd], k, v [n_kv, T, hd] the block's queries, keys and values before
// RoPE (float32 or bfloat16, any strides). Returns [T, n_heads * hd] in q's dtype.
at::Tensor arena_attention(const pybind11::handle& native_arena, int64_t layer, const at::Tensor& q,
                           const at::Tensor& k, const at::Tensor& v, int64_t isa) {
  const char* op = "arena_attention";
  check_cpu(op, {&q, &k, &v});
  TORCH_CHECK(q.dim() == 3 && float_or_bf16(q), op, ": q must be float32 or bfloat16 [n_heads, T, hd]");
  const int64_t hd = q.size(2), T = q.size(1);
  std::vector<std::shared_ptr<NativeArena>> arenas;
  const ArenaPass& p = arena_pass(op, native_arena, T, arenas);
  const ArenaStorage& arena = arenas.back()->storage;
  TORCH_CHECK(hd == arena.hd, op, ": q's heads are not the arena's size ", arena.hd);
  TORCH_CHECK(layer >= 0 && layer < arena.n_layers, op, ": layer ", layer, " outside the arena");
  TORCH_CHECK(k.sizes() == at::IntArrayRef({arena.n_kv, T, hd}) && v.sizes() == k.sizes() && float_or_bf16(k) &&
                  float_or_bf16(v), op, ": k and v must be float32 or bfloat16 [", arena.n_kv, ", ", T, ", ", hd,
              "]");
  TORCH_CHECK(isa == kAuto || isa_available((int)isa), op, ": instruction set ", isa, " not available");
  TORCH_CHECK(T <= INT32_MAX, op, ": a block past the arena's sizes");
  const std::string problem = check_arena_pass(arena, p, (int)T, (int)q.size(0));
  TORCH_CHECK(problem.empty(), op, ": ", problem);
  at::Tensor out = at::empty({T, q.size(0) * hd}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const std::vector<float> qf = widened(q), kf = widened(k), vf = widened(v);
  pybind11::gil_scoped_release unlocked;
  attend_arena_layer((int)isa, arena, p, (int)layer, (int)q.size(0), (int)T, qf.data(), kf.data(), vf.data(),
                     k.scalar_type() == at::kBFloat16, out.data_ptr(), q.scalar_type() == at::kBFloat16);
  return out;
}

// Rows [first, first + count) of the RoPE tables the kernels rotate by (rope.h), as float32 cos and sin [count, hd]:
// for checking them (against transformers' rotary embedding, in the tests) and for inspection.
std::vector<at::Tensor> rope_rows(const std::vector<float>& inv_freq, double attention_factor, int64_t first,
                                  int64_t count) {
  const int hd = 2 * (int)inv_freq.size();
  const std::string problem = RopeTables::check(hd, inv_freq, attention_factor);
  TORCH_CHECK(problem.empty(), "rope_rows: ", problem);
  TORCH_CHECK(first >= 0 && count >= 0 && count <= (1 << 24) && first <= INT64_MAX / 2, "rope_rows: rows ", first,
              " to ", first + count, " out of range");
  RopeTables rope(hd, inv_freq, (float)attention_factor);
  rope.hold(first, count);
  at::Tensor cos = at::empty({count, hd}, at::kFloat), sin = at::empty({count, hd}, at::kFloat);
  if (count) {
    std::memcpy(cos.data_ptr<float>(), rope.cos_row(first), (std::size_t)count * hd * sizeof(float));
    std::memcpy(sin.data_ptr<float>(), rope.sin_row(first), (std::size_t)count * hd * sizeof(float));
  }
  return {cos, sin};
}

// ------------------------------------------------------------------------------------------- the cold tier
// A cold tier (recall.h) for an arena of n_layers x n_kv heads of hd channels: inv_freq [hd / 2] float32 and
// attention_factor its RoPE (rope.py), key_offset [n_layers, n_kv, hd] float32 or None, rank >= 0 the in-cache
// mode's first rank (-1: true positions), `pages` pages of page_size entries recalled per row.
std::shared_ptr<ColdTier> cold_tier(int64_t n_layers, int64_t n_kv, int64_t hd, const std::vector<float>& inv_freq,
                                    double attention_factor, double scale, const c10::optional<at::Tensor>& key_offset,
                                    int64_t rank, int64_t pages, int64_t page_size) {
  const char* op = "cold_tier";
  const int64_t code_group = std::min<int64_t>(16, hd);
  TORCH_CHECK(n_layers >= 1 && n_layers <= 4096 && n_kv >= 1 && n_kv <= 4096, op, ": 1 to 4096 layers and KV heads");
  TORCH_CHECK(hd >= 8 && hd <= kAttnMaxHeadDim && hd % 8 == 0 && hd % code_group == 0, op,
              ": heads of a multiple of 8 channels, at most ", kAttnMaxHeadDim);
  TORCH_CHECK(page_size >= 1 && page_size <= 4096 && pages >= 1 && pages <= 65536 && rank >= -1 &&
                  rank <= INT32_MAX, op, ": pages, page_size and rank out of range");
  TORCH_CHECK(std::isfinite(scale), op, ": scale must be finite");
  const std::string rope_problem = RopeTables::check((int)hd, inv_freq, attention_factor);
  TORCH_CHECK(rope_problem.empty(), op, ": ", rope_problem);
  auto tier = std::make_shared<ColdTier>();
  tier->n_layers = (int)n_layers;
  tier->n_kv = (int)n_kv;
  tier->hd = (int)hd;
  tier->code_group = (int)code_group;
  tier->width = (int)(hd + 2 * (hd / code_group) * 4);
  tier->page_size = (int)page_size;
  tier->pages = (int)pages;
  tier->rank = rank;
  tier->scale = (float)scale;
  tier->rope = RopeTables((int)hd, inv_freq, (float)attention_factor);
  if (key_offset.has_value() && key_offset->defined()) {
    check_cpu(op, {&*key_offset});
    TORCH_CHECK(key_offset->scalar_type() == at::kFloat && key_offset->is_contiguous() &&
                    key_offset->sizes() == at::IntArrayRef({n_layers, n_kv, hd}),
                op, ": key_offset must be contiguous float32 [", n_layers, ", ", n_kv, ", ", hd, "]");
    tier->key_offset.assign(key_offset->data_ptr<float>(), key_offset->data_ptr<float>() + key_offset->numel());
  }
  return tier;
}

// Entries into the tier: keys, values [n_layers, n, n_kv, hd] float32 (keys unrotated, the key bias in), positions
// [n_layers, n, n_kv] int64 >= 0 (ColdTier::append).
void cold_append(ColdTier& t, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& positions) {
  const char* op = "ColdTier.append";
  check_cpu(op, {&keys, &values, &positions});
  TORCH_CHECK(keys.dim() == 4 && keys.size(0) == t.n_layers && keys.size(2) == t.n_kv && keys.size(3) == t.hd &&
                  keys.scalar_type() == at::kFloat && keys.is_contiguous() && values.sizes() == keys.sizes() &&
                  values.scalar_type() == at::kFloat && values.is_contiguous(),
              op, ": keys and values must be contiguous float32 [", t.n_layers, ", n, ", t.n_kv, ", ", t.hd, "]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.sizes() == keys.sizes().slice(0, 3),
              op, ": positions must be contiguous int64 [", t.n_layers, ", n, ", t.n_kv, "]");
  TORCH_CHECK(positions.numel() == 0 || positions.min().item<int64_t>() >= 0, op, ": negative positions");
  TORCH_CHECK(positions.numel() == 0 || positions.max().item<int64_t>() < (int64_t)1 << 40, op,
              ": positions past 2^40");
  const std::string problem = t.check_append(keys.size(1));
  TORCH_CHECK(problem.empty(), op, ": ", problem);
  pybind11::gil_scoped_release unlocked;
  t.append((int)keys.size(1), keys.data_ptr<float>(), values.data_ptr<float>(), positions.data_ptr<int64_t>());
}

// One row's recall from the stored entries of `layer` (recall.h: recall_row), merged into its attention over other
// entries: query [n_kv, group, hd] float32 before RoPE, rotated by table row query_row (its position, or its rank in
// the in-cache mode); out [n_kv * group * hd] float32 and its log-sum-exps lse [n_kv * group], merged in place.
void cold_recall_row(ColdTier& t, int64_t layer, const at::Tensor& query, int64_t query_row, at::Tensor out,
                     const at::Tensor& lse) {
  const char* op = "ColdTier.recall_row";
  check_cpu(op, {&query, &out, &lse});
  TORCH_CHECK(layer >= 0 && layer < t.n_layers, op, ": layer ", layer, " outside the tier");
  TORCH_CHECK(query.dim() == 3 && query.size(0) == t.n_kv && query.size(1) >= 1 &&
                  query.size(1) <= kAttnMaxGroup && query.size(2) == t.hd && query.scalar_type() == at::kFloat &&
                  query.is_contiguous(), op, ": query must be contiguous float32 [", t.n_kv, ", group, ", t.hd, "]");
  TORCH_CHECK(query_row >= 0 && query_row < (int64_t)1 << 40, op, ": query_row out of range");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == query.numel() &&
                  lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.numel() == t.n_kv * query.size(1),
              op, ": out must be contiguous float32 [n_kv * group * hd] and lse [n_kv * group]");
  if (!t.count) return;
  pybind11::gil_scoped_release unlocked;
  const int64_t highest = t.rank >= 0 ? t.rank + (int64_t)t.pages * t.page_size + t.page_size : t.highest_position;
  t.cover(std::max(highest, query_row) + 1);
  RecallRow r = t.stored_view((int)layer, (int)query.size(1));
  r.query = query.data_ptr<float>();
  r.query_row = query_row;
  r.out = out.data_ptr<float>();
  r.lse = lse.data_ptr<float>();
  recall_row(r);
}

// A copy of `layer`'s first `count` rows of one of the tier's buffers ([count, ...] per layer, `per_row` items).
template <class T>
at::Tensor cold_rows(const ColdTier& t, const std::vector<T>& buffer, int64_t layer, long rows_per_layer, long row,
                     long count, std::vector<int64_t> shape, at::ScalarType type) {
  TORCH_CHECK(layer >= 0 && layer < t.n_layers, "ColdTier: layer ", layer, " outside the tier");
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(type));
  if (count) std::memcpy(out.data_ptr(), buffer.data() + (long)layer * rows_per_layer * row, count * row * sizeof(T));
  return out;
}

// ------------------------------------------------------------------------------------------ the native pass
// A model's weights for the native pass (model.h), with the tensors they point into kept alive. Built from a spec
// (kernels/__init__.py: native_model): shapes, the compute dtype, and each projection as (blocks, types, rows, k,
// bias or None, float activations), each norm as a tensor or None.
struct NativeModel {
  ModelWeights weights;
  std::vector<at::Tensor> tensors;

  const void* keep(const at::Tensor& t, bool& bf16) {
    TORCH_CHECK(t.is_cpu() && t.is_contiguous() && float_or_bf16(t), "NativeModel: norms must be contiguous float32 "
                "or bfloat16 CPU tensors");
    tensors.push_back(t);
    bf16 = t.scalar_type() == at::kBFloat16;
    return t.data_ptr();
  }

  NormWeight norm(const pybind11::handle& spec, long size) {
    NormWeight w;
    if (spec.is_none()) return w;
    const at::Tensor t = spec.cast<at::Tensor>();
    TORCH_CHECK(t.dim() == 1 && t.size(0) == size, "NativeModel: a norm of ", t.numel(), " values, not ", size);
    w.weight = keep(t, w.bf16);
    return w;
  }

  Projection projection(const pybind11::handle& spec, const char* what) {
    const auto parts = spec.cast<pybind11::tuple>();
    TORCH_CHECK(parts.size() == 6, "NativeModel: ", what, " is (blocks, types, rows, k, bias, float activations)");
    Projection p;
    std::vector<std::size_t> bytes;
    for (const auto& blob : parts[0].cast<pybind11::list>()) {
      const at::Tensor t = blob.cast<at::Tensor>();
      TORCH_CHECK(t.is_cpu() && t.dtype() == at::kByte && t.is_contiguous(), "NativeModel: ", what,
                  "'s blocks must be contiguous uint8 CPU tensors");
      tensors.push_back(t);
      p.blobs.push_back(t.data_ptr<uint8_t>());
      bytes.push_back((std::size_t)t.numel());
    }
    for (const auto& type : parts[1].cast<pybind11::list>()) p.types.push_back(type.cast<int>());
    for (const auto& rows : parts[2].cast<pybind11::list>()) {
      p.rows.push_back(rows.cast<long>());
      p.n_out += p.rows.back();
    }
    p.k = parts[3].cast<int>();
    p.float_activations = parts[5].cast<bool>();
    const std::string problem = check_projection(p, bytes);
    TORCH_CHECK(problem.empty(), "NativeModel: ", what, ": ", problem);
    if (!parts[4].is_none()) {
      const at::Tensor bias = parts[4].cast<at::Tensor>();
      TORCH_CHECK(bias.is_cpu() && bias.scalar_type() == at::kFloat && bias.is_contiguous() &&
                      bias.numel() == p.n_out, "NativeModel: ", what, "'s bias must be float32 [", p.n_out, "]");
      tensors.push_back(bias);
      p.bias = bias.data_ptr<float>();
    }
    return p;
  }

  explicit NativeModel(const pybind11::dict& spec) {
    ModelWeights& m = weights;
    m.hidden = spec["hidden"].cast<int>();
    m.n_heads = spec["n_heads"].cast<int>();
    m.n_kv = spec["n_kv"].cast<int>();
    m.head_dim = spec["head_dim"].cast<int>();
    m.intermediate = spec["intermediate"].cast<int>();
    m.vocab = spec["vocab"].cast<int>();
    m.eps = spec["eps"].cast<float>();
    m.bf16 = spec["bf16"].cast<bool>();
    m.gelu = spec["gelu"].cast<bool>();
    if (!spec["embed_scale"].is_none()) {
      m.embed_scaled = true;
      m.embed_scale = spec["embed_scale"].cast<float>();
    }
    if (pybind11::isinstance<pybind11::tuple>(spec["embed"])) {
      m.embed = projection(spec["embed"], "the embedding");
    } else {  // a dense table in the compute dtype
      const at::Tensor table = spec["embed"].cast<at::Tensor>();
      TORCH_CHECK(table.dim() == 2 && table.size(0) == m.vocab && table.size(1) == m.hidden &&
                      table.scalar_type() == (m.bf16 ? at::kBFloat16 : at::kFloat),
                  "NativeModel: a dense embedding must be [vocab, hidden] in the compute dtype");
      bool table_bf16 = false;
      m.dense_embed = keep(table, table_bf16);
    }
    m.head = projection(spec["head"], "the head");
    m.final_norm = norm(spec["final_norm"], m.hidden);
    const long hd = m.head_dim;
    for (const auto& layer : spec["layers"].cast<pybind11::list>()) {
      const auto l = layer.cast<pybind11::dict>();
      LayerWeights w;
      w.attn_norm = norm(l["attn_norm"], m.hidden);
      w.mlp_norm = norm(l["mlp_norm"], m.hidden);
      w.q_norm = norm(l["q_norm"], hd);
      w.k_norm = norm(l["k_norm"], hd);
      w.attn_post_norm = norm(l["attn_post_norm"], m.hidden);
      w.mlp_post_norm = norm(l["mlp_post_norm"], m.hidden);
      w.qkv = projection(l["qkv"], "a q/k/v projection");
      w.o_proj = projection(l["o_proj"], "an output projection");
      w.gate_up = projection(l["gate_up"], "a gate/up projection");
      w.down = projection(l["down"], "a down projection");
      m.layers.push_back(w);
    }
    const std::string problem = check_model(m);
    TORCH_CHECK(problem.empty(), "NativeModel: ", problem);
  }

  // blocks: (tokens int64 [T], last_only, [NativeArena, each with a block of T rows open], [(arena index, its
  // layer)] per model layer). Returns float32 logits [scored rows, vocab].
  at::Tensor forward(const pybind11::list& blocks, int64_t isa) {
    TORCH_CHECK(isa == kAuto || isa_available((int)isa), "native pass: instruction set ", isa, " not available");
    std::vector<BlockPass> passes;
    std::vector<std::shared_ptr<NativeArena>> arenas;  // alive until the pass ends
    for (const auto& item : blocks) {
      const auto block = item.cast<pybind11::tuple>();
      TORCH_CHECK(block.size() == 4, "native pass: a block is (tokens, last_only, arenas, route)");
      BlockPass pass;
      const at::Tensor tokens = block[0].cast<at::Tensor>();
      TORCH_CHECK(tokens.is_cpu() && tokens.dim() == 1 && tokens.scalar_type() == at::kLong,
                  "native pass: tokens must be an int64 vector");
      const at::Tensor ids = tokens.contiguous();
      pass.tokens.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
      pass.last_only = block[1].cast<bool>();
      for (const auto& a : block[2].cast<pybind11::list>()) {
        const ArenaPass& p = arena_pass("native pass", a, (int64_t)pass.tokens.size(), arenas);
        pass.arenas.emplace_back(&arenas.back()->storage, p);
      }
      for (const auto& r : block[3].cast<pybind11::list>()) {
        const auto pair = r.cast<pybind11::tuple>();
        pass.route.emplace_back(pair[0].cast<int>(), pair[1].cast<int>());
      }
      passes.push_back(std::move(pass));
    }
    const std::string problem = check_blocks(weights, passes);
    TORCH_CHECK(problem.empty(), "native pass: ", problem);
    at::Tensor logits = at::empty({scored_rows(passes), weights.vocab}, at::TensorOptions().dtype(at::kFloat));
    {
      pybind11::gil_scoped_release unlocked;
      sparsespec::forward((int)isa, weights, passes, logits.data_ptr<float>());
    }
    return logits;
  }
};

}  // namespace
}  // namespace sparsespec

// The ops are plain Python functions of the extension module, not torch.ops: a call through the dispatcher costs
// about 1 us more, and a decode step makes ~200 of them. Each releases the GIL while it runs (a server's HTTP
// thread goes on during a pass). Each op checks that its tensors are on the CPU (check_cpu): no dispatcher routes
// them by device.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  sparsespec::bind_layer_ops(module);
  module.def("arena_attention", &sparsespec::arena_attention);
  using sparsespec::NativeArena;
  pybind11::class_<NativeArena, std::shared_ptr<NativeArena>>(module, "NativeArena")
      .def("begin", &NativeArena::begin)
      .def("end", &NativeArena::end)
      .def("commit", &NativeArena::commit)
      .def("commit_path", &NativeArena::commit_path)
      .def("hold", &NativeArena::hold)
      .def("release_hold", &NativeArena::release_hold)
      .def("assume", &NativeArena::assume)
      .def("reset", &NativeArena::reset)
      .def("tree_refusal", [](const NativeArena& a, int64_t n_rows) -> c10::optional<std::string> {
        const std::string reason = a.ledger.tree_refusal((int)std::clamp<int64_t>(n_rows, 0, INT32_MAX));
        return reason.empty() ? c10::nullopt : c10::optional<std::string>(reason);
      })
      .def("buffer", &NativeArena::buffer)
      .def_property_readonly("buffers", &NativeArena::kept_buffers)
      .def("__deepcopy__", [](const NativeArena& a, const pybind11::dict&) { return a.copy(); })
      .def_readonly("cold", &NativeArena::cold)
      .def_property_readonly("capacity", [](const NativeArena& a) { return a.storage.cap; })
      .def_property_readonly("committed", [](const NativeArena& a) { return a.ledger.committed; })
      .def_property_readonly("inflight", [](const NativeArena& a) { return a.ledger.inflight(); })
      .def_property_readonly("visible", [](const NativeArena& a) { return a.ledger.visible(); })
      .def_property_readonly("room", [](const NativeArena& a) { return a.ledger.room(); })
      .def_property_readonly("next_position", [](const NativeArena& a) { return a.ledger.next_position; })
      .def_property_readonly("evicted_tokens", [](const NativeArena& a) { return a.ledger.evicted_tokens; })
      .def_property_readonly("evicts_per_row", [](const NativeArena& a) { return a.ledger.evicts_per_row; })
      .def_property_readonly("block_mode", [](const NativeArena& a) {
        return a.ledger.mode == sparsespec::BlockMode::evict ? "evict"
               : a.ledger.mode == sparsespec::BlockMode::hold ? "hold" : "select";
      })
      .def_property_readonly("nbytes", [](const NativeArena& a) { return a.memory->entry_bytes(); })
      .def_property_readonly("peak_nbytes", [](const NativeArena& a) { return a.peak_nbytes; })
      .def("restart_peak", [](NativeArena& a) { a.peak_nbytes = a.memory->entry_bytes(); })
      .def_property_readonly("metadata_nbytes", [](const NativeArena& a) { return a.memory->bookkeeping_bytes(); });
  using pybind11::arg;
  module.def("native_arena", &sparsespec::native_arena, arg("n_layers"), arg("n_kv"), arg("head_dim"),
             arg("capacity"), arg("code_bits"), arg("code_group"), arg("bf16"), arg("key_offset"), arg("scores"),
             arg("row_score_rows"), arg("row_evicted_rows"), arg("recent_window"), arg("recent_slots"),
             arg("recent_bf16"), arg("sinks"), arg("heavy"), arg("window"), arg("age_normalised"),
             arg("score_decay"), arg("scale"), arg("inv_freq"), arg("attention_factor"), arg("cold"), arg("budget"),
             arg("max_inflight"), arg("staging"), arg("max_tokens"), arg("pool"), arg("in_cache"));
  using sparsespec::ColdTier;
  pybind11::class_<ColdTier, std::shared_ptr<ColdTier>>(module, "ColdTier")
      .def_readonly("count", &ColdTier::count)
      .def_property_readonly("nbytes", &ColdTier::nbytes)
      .def("reset", [](ColdTier& t) { t.count = 0; })
      .def("__deepcopy__", [](const ColdTier& t, const pybind11::dict&) { return std::make_shared<ColdTier>(t); })
      .def("append", &sparsespec::cold_append)
      .def("recall_row", &sparsespec::cold_recall_row)
      .def("entries", [](const ColdTier& t, int64_t layer) {
        return sparsespec::cold_rows(t, t.entries, layer, t.capacity, (long)t.n_kv * t.width, t.count,
                                     {t.count, t.n_kv, t.width}, at::kByte);
      })
      .def("positions", [](const ColdTier& t, int64_t layer) {
        return sparsespec::cold_rows(t, t.positions, layer, t.capacity, t.n_kv, t.count, {t.count, t.n_kv}, at::kLong);
      })
      .def("summaries", [](const ColdTier& t, int64_t layer) {
        const int pages = t.count / t.page_size;
        return sparsespec::cold_rows(t, t.summaries, layer, t.capacity / t.page_size, 2L * t.n_kv * t.hd, pages,
                                     {pages, t.n_kv, 2 * t.hd}, at::kFloat);
      });
  module.def("cold_tier", &sparsespec::cold_tier);
  module.def("rope_rows", &sparsespec::rope_rows);
  pybind11::class_<sparsespec::NativeModel>(module, "NativeModel")
      .def(pybind11::init<const pybind11::dict&>())
      .def("forward", &sparsespec::NativeModel::forward);
  module.def("best_isa", &sparsespec::best_isa);
  module.def("set_isa", &sparsespec::set_isa);
  module.def("amx_tile_passes", &sparsespec::amx_tile_passes);
  module.def("isa_available", &sparsespec::isa_available);
  module.def("isa_name", &sparsespec::isa_name);
  module.def("row_bytes", &sparsespec::row_bytes);
  module.def("weight_bytes", &sparsespec::weight_bytes);
  module.def("supported_type", &sparsespec::supported_type);
}
