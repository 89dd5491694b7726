// The KV arena's commit (arena.h).
#include "arena.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <new>

#include "parallel.h"

namespace sparsespec {

std::string check_arena_layout(const ArenaLayout& l) {
  if (l.n_layers < 1 || l.n_kv < 1) return "an arena of no layers or no KV heads";
  if (l.hd < 2 || l.hd % 2 || l.hd > kAttnMaxHeadDim)
    return "heads of an even size from 2 to " + std::to_string(kAttnMaxHeadDim) + ", not " + std::to_string(l.hd);
  if (l.cap < 1) return "an arena of no slots";
  if (l.code_bits != 0 && l.code_bits != 4 && l.code_bits != 8) return "codes of 8 or 4 bits, or none";
  if (l.code_bits && (l.code_group < 1 || l.hd % l.code_group))
    return "quantization groups that divide the heads' " + std::to_string(l.hd) + " channels";
  if (l.key_offset && !l.code_bits) return "a key offset needs quantized keys";
  if (l.row_score_rows < 0 || l.row_evicted_rows < 0 || (l.row_score_rows && !l.scores))
    return "score snapshots need scores, and row counts >= 0";
  if (l.recent_window < 0 || l.recent_slots < l.recent_window || (l.recent_window > 0) != (l.recent_slots > 0) ||
      (l.recent_window && !l.code_bits))
    return "a full-precision window needs quantized entries and a ring of at least its positions";
  return "";
}

Buffer::Buffer(std::size_t bytes) : bytes_(bytes) {
  if (!bytes) return;
  constexpr std::size_t kAlign = 64;
  data_.reset(static_cast<char*>(std::aligned_alloc(kAlign, (bytes + kAlign - 1) / kAlign * kAlign)));
  if (!data_) throw std::bad_alloc();
  std::memset(data_.get(), 0, bytes);
}

Buffer::Buffer(const Buffer& other) : Buffer(other.bytes_) {
  if (bytes_) std::memcpy(data_.get(), other.data_.get(), bytes_);
}

namespace {

// Bytes of one slot's stored vector (codes, or float32 / bfloat16 channels) and of its quantization params.
long vector_bytes(int hd, int code_bits, bool bf16) {
  return code_bits ? code_bytes(hd, code_bits) : (long)hd * (bf16 ? 2 : 4);
}
long params_bytes(int hd, int code_bits, int code_group) {
  return code_bits ? 2 * param_halves(hd, code_group) : 0;
}
long vector_bytes(const ArenaStorage& a) { return vector_bytes(a.hd, a.code_bits, a.bf16); }
long params_bytes(const ArenaStorage& a) { return params_bytes(a.hd, a.code_bits, a.code_group); }

}  // namespace

ArenaMemory::ArenaMemory(const ArenaLayout& l) : layout(l) {
  const std::size_t heads = (std::size_t)l.n_layers * l.n_kv, slots = heads * l.cap;
  const std::size_t vec = vector_bytes(l.hd, l.code_bits, l.bf16);
  const std::size_t par = params_bytes(l.hd, l.code_bits, l.code_group);
  keys = Buffer(slots * vec);
  values = Buffer(slots * vec);
  key_params = Buffer(slots * par);
  value_params = Buffer(slots * par);
  if (l.key_offset) key_offset = Buffer(heads * l.hd * sizeof(float));
  positions = Buffer(slots * sizeof(int64_t));
  evicted_at = Buffer(slots * sizeof(int32_t));
  if (l.scores) {
    scores = Buffer(slots * sizeof(float));
    committed_scores = Buffer(slots * sizeof(float));
    row_scores = Buffer(l.row_score_rows * slots * sizeof(float));
  }
  row_evicted = Buffer(l.row_evicted_rows * heads * sizeof(int32_t));
  const std::size_t ring = heads * l.recent_slots * l.hd * (l.recent_bf16 ? 2 : 4);
  recent_keys = Buffer(ring);
  recent_values = Buffer(ring);
  forget();
  std::fill(row_evicted.as<int32_t>(), row_evicted.as<int32_t>() + l.row_evicted_rows * heads, -1);
}

void ArenaMemory::point(ArenaStorage& a) const {
  const ArenaLayout& l = layout;
  a.n_layers = l.n_layers;
  a.n_kv = l.n_kv;
  a.cap = l.cap;
  a.hd = l.hd;
  a.keys = keys.as<void>();
  a.values = values.as<void>();
  a.bf16 = l.bf16;
  a.code_bits = l.code_bits;
  a.code_group = l.code_group;
  a.key_params = key_params.as<uint16_t>();
  a.value_params = value_params.as<uint16_t>();
  a.key_offset = key_offset.as<const float>();
  a.positions = positions.as<int64_t>();
  a.evicted_at = evicted_at.as<int32_t>();
  a.scores = scores.as<float>();
  a.committed_scores = committed_scores.as<float>();
  a.row_scores = row_scores.as<float>();
  a.row_score_rows = l.row_score_rows;
  a.row_evicted = row_evicted.as<int32_t>();
  a.row_evicted_rows = l.row_evicted_rows;
  a.recent_keys = recent_keys.as<void>();
  a.recent_values = recent_values.as<void>();
  a.recent_bf16 = l.recent_bf16;
  a.recent_window = l.recent_window;
  a.recent_slots = l.recent_slots;
}

ArenaMemory ArenaMemory::resized(int cap, int keep) const {
  ArenaLayout l = layout;
  l.cap = cap;
  ArenaMemory out(l);
  const long heads = (long)l.n_layers * l.n_kv;
  const long vec = vector_bytes(l.hd, l.code_bits, l.bf16);
  const long par = params_bytes(l.hd, l.code_bits, l.code_group);
  // Each per-slot buffer with its bytes per slot: the kept slots of every KV head move to the new head's start.
  const std::pair<const Buffer*, Buffer*> kept[] = {{&keys, &out.keys}, {&values, &out.values},
                                                    {&key_params, &out.key_params}, {&value_params, &out.value_params},
                                                    {&positions, &out.positions}, {&scores, &out.scores},
                                                    {&committed_scores, &out.committed_scores}};
  const long widths[] = {vec, vec, par, par, (long)sizeof(int64_t), (long)sizeof(float), (long)sizeof(float)};
  for (std::size_t b = 0; b < std::size(kept); ++b) {
    if (!kept[b].first->bytes()) continue;
    for (long lh = 0; lh < heads; ++lh)
      std::memcpy(kept[b].second->as<char>() + lh * cap * widths[b],
                  kept[b].first->as<char>() + lh * layout.cap * widths[b], (std::size_t)keep * widths[b]);
  }
  out.key_offset = key_offset;
  out.recent_keys = recent_keys;
  out.recent_values = recent_values;
  return out;
}

void ArenaMemory::forget() {
  int32_t* marks = evicted_at.as<int32_t>();
  std::fill(marks, marks + evicted_at.bytes() / sizeof(int32_t), kNever);
}

std::size_t ArenaMemory::entry_bytes() const {
  return keys.bytes() + values.bytes() + key_params.bytes() + value_params.bytes() + recent_keys.bytes() +
         recent_values.bytes();
}

std::size_t ArenaMemory::bookkeeping_bytes() const {
  return positions.bytes() + evicted_at.bytes() + scores.bytes() + committed_scores.bytes() + row_scores.bytes();
}

std::string check_arena_commit(const ArenaStorage& a, const ArenaCommit& c) {
  if (c.committed < 0 || c.n_inflight < 0 || (long)c.committed + c.n_inflight > a.cap)
    return "committed and in-flight rows past the arena's capacity";
  if (c.n_rows < 0 || c.n_rows > c.n_inflight) return "more rows accepted than are in flight";
  if (c.survivors < 0 || c.survivors > c.committed + c.n_rows) return "more survivors than entries";
  if (a.scores) {
    if (!a.committed_scores) return "heavy-hitter scores without the committed scores";
    if (c.n_rows > 0 && c.n_rows < c.n_inflight && c.n_rows > a.row_score_rows)
      return "a partial commit past the rows that keep score snapshots";
  }
  return "";
}

namespace {

// One per-slot array of a KV head: its base and the bytes of one slot.
struct SlotArray {
  char* base;
  long width;
};

// The per-slot arrays of KV head lh (layer * n_kv + head) that move with an entry, scores aside: keys, values,
// positions, and the quantization params.
std::vector<SlotArray> entry_arrays(const ArenaStorage& a, long lh) {
  const long vec = vector_bytes(a), par = params_bytes(a);
  std::vector<SlotArray> arrays = {{static_cast<char*>(a.keys) + lh * a.cap * vec, vec},
                                   {static_cast<char*>(a.values) + lh * a.cap * vec, vec},
                                   {reinterpret_cast<char*>(a.positions + lh * a.cap), sizeof(int64_t)}};
  if (par) {
    arrays.push_back({reinterpret_cast<char*>(a.key_params) + lh * a.cap * par, par});
    arrays.push_back({reinterpret_cast<char*>(a.value_params) + lh * a.cap * par, par});
  }
  return arrays;
}

// Moves slot_of[p] -> p for the places p whose entry moves, through a copy of the movers (a destination may be
// another mover's source).
void move_entries(const std::vector<SlotArray>& arrays, const std::vector<std::pair<int, int>>& moves) {
  std::vector<char> held;
  for (const SlotArray& arr : arrays) {
    held.resize(moves.size() * (std::size_t)arr.width);
    for (std::size_t i = 0; i < moves.size(); ++i)
      std::memcpy(held.data() + i * arr.width, arr.base + (long)moves[i].second * arr.width, arr.width);
    for (std::size_t i = 0; i < moves.size(); ++i)
      std::memcpy(arr.base + (long)moves[i].first * arr.width, held.data() + i * arr.width, arr.width);
  }
}

}  // namespace

std::string commit_arena(const ArenaStorage& a, const ArenaCommit& c) {
  const int extent = c.committed + c.n_rows;
  const long heads = (long)a.n_layers * a.n_kv;
  const long plane = heads * a.cap;  // one [L, n_kv, cap] array
  std::vector<char> disagrees(heads, 0);
  parallel_for(0, heads, 4, [&](int64_t h0, int64_t h1) {
    std::vector<std::vector<int>> evicted_by(c.n_rows);
    std::vector<std::pair<int, int>> moves;
    for (int64_t lh = h0; lh < h1; ++lh) {
      int32_t* evicted_at = a.evicted_at + lh * a.cap;
      for (auto& e : evicted_by) e.clear();
      for (int s = 0; s < extent; ++s)
        if (evicted_at[s] < c.n_rows) evicted_by[evicted_at[s]].push_back(s);
      ReadingOrder order(c.committed, c.n_rows);
      for (int r = 0; r < c.n_rows; ++r) {
        order.add_row(r);
        order.commit_row(evicted_by[r]);
      }
      if (order.n != c.survivors) {
        disagrees[lh] = 1;
        continue;
      }
      float* scores = a.scores ? a.scores + lh * a.cap : nullptr;
      if (scores) {
        const float* final_scores = c.n_rows == c.n_inflight ? scores
                                    : c.n_rows ? a.row_scores + (long)(c.n_rows - 1) * plane + lh * a.cap
                                               : a.committed_scores + lh * a.cap;
        if (final_scores != scores) std::memcpy(scores, final_scores, sizeof(float) * extent);
      }
      moves.clear();
      for (int p = 0; p < c.survivors; ++p)
        if (order.slot_of[p] != p) moves.emplace_back(p, order.slot_of[p]);
      if (!moves.empty()) {
        std::vector<SlotArray> arrays = entry_arrays(a, lh);
        if (scores) arrays.push_back({reinterpret_cast<char*>(scores), sizeof(float)});
        move_entries(arrays, moves);
      }
      if (scores) std::memcpy(a.committed_scores + lh * a.cap, scores, sizeof(float) * c.survivors);
      std::fill(evicted_at, evicted_at + extent, kNever);
    }
  });
  for (long lh = 0; lh < heads; ++lh)
    if (disagrees[lh])
      return "KV head " + std::to_string(lh % a.n_kv) + " of layer " + std::to_string(lh / a.n_kv) + " keeps another "
             "number of entries than " + std::to_string(c.survivors);
  return "";
}

std::string check_arena_path(const ArenaStorage& a, int committed, const std::vector<int>& path, int n_inflight) {
  if (committed < 0 || n_inflight < 0 || (long)committed + n_inflight > a.cap)
    return "committed and in-flight rows past the arena's capacity";
  if (path.empty()) return "an empty path (a rollback commits no rows)";
  for (std::size_t k = 0; k < path.size(); ++k)
    if (path[k] < 0 || path[k] >= n_inflight || (k && path[k] <= path[k - 1]))
      return "a path of in-flight rows in increasing order (each row's parent precedes it)";
  if (path.back() >= a.row_evicted_rows) return "a path past the rows whose evictions the arena keeps";
  if (a.scores && (path.back() >= a.row_score_rows || !a.committed_scores))
    return "a path past the rows that keep score snapshots";
  return "";
}

std::string commit_arena_path(const ArenaStorage& a, int committed, const std::vector<int>& path, int n_inflight,
                              int survivors) {
  const int m = (int)path.size();
  const long heads = (long)a.n_layers * a.n_kv;
  const long plane = heads * a.cap;
  std::vector<char> astray(heads, 0);
  parallel_for(0, heads, 4, [&](int64_t h0, int64_t h1) {
    for (int64_t lh = h0; lh < h1; ++lh) {
      // The path's rows into the chain's slots, in order: row path[k] >= k, so no source is written over before it
      // is read.
      const std::vector<SlotArray> arrays = entry_arrays(a, lh);
      for (int k = 0; k < m; ++k)
        if (path[k] != k)
          for (const SlotArray& arr : arrays)
            std::memcpy(arr.base + (long)(committed + k) * arr.width, arr.base + (long)(committed + path[k]) * arr.width,
                        arr.width);
      if (a.scores) {  // the last row's snapshot, its in-flight slots in the chain's order
        const float* last = a.row_scores + (long)path.back() * plane + lh * a.cap;
        float* scores = a.scores + lh * a.cap;
        std::memcpy(scores, last, sizeof(float) * committed);
        for (int k = 0; k < m; ++k) scores[committed + k] = last[committed + path[k]];
      }
      int32_t* evicted_at = a.evicted_at + lh * a.cap;
      const long layer = lh / a.n_kv, head = lh % a.n_kv;
      for (int k = 0; k < m; ++k) {
        int s = a.row_evicted[((long)path[k] * a.n_layers + layer) * a.n_kv + head];
        if (s < 0) continue;
        if (s >= committed) {  // an in-flight row: one of the path's, before this one
          const auto at = std::find(path.begin(), path.begin() + k + 1, s - committed);
          if (at == path.begin() + k + 1) {
            astray[lh] = 1;
            break;
          }
          s = committed + (int)(at - path.begin());
        }
        evicted_at[s] = k;
      }
    }
  });
  for (long lh = 0; lh < heads; ++lh)
    if (astray[lh])
      return "KV head " + std::to_string(lh % a.n_kv) + " of layer " + std::to_string(lh / a.n_kv) + " holds an "
             "eviction of a row off the path";
  return commit_arena(a, ArenaCommit{committed, m, m, survivors});
}

}  // namespace sparsespec
