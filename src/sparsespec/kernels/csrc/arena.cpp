// The KV arena's commit (arena.h).
#include "arena.h"

#include <algorithm>
#include <cstring>

#include "parallel.h"

namespace sparsespec {

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

// Bytes of one slot's stored vector (codes, or float32 / bfloat16 channels) and of its quantization params.
long vector_bytes(const ArenaStorage& a) {
  return a.code_bits ? code_bytes(a.hd, a.code_bits) : (long)a.hd * (a.bf16 ? 2 : 4);
}
long params_bytes(const ArenaStorage& a) { return a.code_bits ? 2 * param_halves(a.hd, a.code_group) : 0; }

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
