// The KV arena's bookkeeping (sparsespec/cache/arena.py): where a commit leaves each entry, and the commit itself.
//
// One rule lays the arena out: a commit of m rows leaves the entries as m one-row commits would, each filling the
// holes its evictions left (ReadingOrder::commit_row). The attention op reads a verification row's slots in that
// order (attention.h), and commit_arena moves the entries into it, so the layout, and with it every later sum, is
// a function of the committed entries alone, whatever mix of blocks delivered them.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "attention.h"

namespace sparsespec {

// What a KV arena's memory holds (cache/arena.py's layout): n_layers x n_kv heads of cap slots of hd channels; the
// entries as float32 or (bf16) bfloat16, or as code_bits 8 or 4 codes with float16 params per group of code_group
// channels (and, key_offset, the model's key bias that quantized keys are stored minus); heavy-hitter scores
// (scores: the scores, the committed ones and row_score_rows snapshots); what each of row_evicted_rows tree rows
// evicted; the full-precision ring of recent_slots entries serving recent_window positions, in bfloat16
// (recent_bf16) or float32.
struct ArenaLayout {
  int n_layers = 0, n_kv = 0, hd = 0, cap = 0;
  int code_bits = 0, code_group = 0;
  bool bf16 = false, key_offset = false, scores = false;
  int row_score_rows = 0, row_evicted_rows = 0;
  int recent_window = 0, recent_slots = 0;
  bool recent_bf16 = false;
};

// The reason an arena cannot have `layout`, or "".
std::string check_arena_layout(const ArenaLayout& layout);

// A block of zeroed bytes, aligned for any vector load, that copies deeply.
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(std::size_t bytes);
  Buffer(const Buffer& other);
  Buffer(Buffer&&) noexcept = default;
  Buffer& operator=(Buffer other) noexcept {
    std::swap(bytes_, other.bytes_);
    std::swap(data_, other.data_);
    return *this;
  }
  template <class T>
  T* as() const {
    return reinterpret_cast<T*>(data_.get());
  }
  std::size_t bytes() const { return bytes_; }

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::size_t bytes_ = 0;
  std::unique_ptr<char, Free> data_;
};

// One KV arena's memory, every buffer ArenaStorage points into (attention.h gives their shapes), owned here: a new
// arena's slots are empty (zeros, every slot alive, no tree row's eviction kept).
struct ArenaMemory {
  ArenaLayout layout;
  Buffer keys, values, key_params, value_params, key_offset, positions, evicted_at, scores, committed_scores,
      row_scores, row_evicted, recent_keys, recent_values;

  explicit ArenaMemory(const ArenaLayout& layout);  // check_arena_layout first
  // Point storage's buffers here (its policy and cold tier are the caller's).
  void point(ArenaStorage& storage) const;
  // This memory with `cap` slots per KV head, slots [0, keep) kept (entries, params, positions, both scores), the
  // ring as it is, the rest empty; keep <= both capacities.
  ArenaMemory resized(int cap, int keep) const;
  // Every slot alive again (the arena forgets its tokens; stale slots are written before they are read).
  void forget();
  // Bytes of the KV cache proper (entries, params, the ring) and of the per-slot bookkeeping (positions, eviction
  // marks, scores and their snapshots).
  std::size_t entry_bytes() const;
  std::size_t bookkeeping_bytes() const;
};

// The reading order of a row-by-row block's rows in one KV head (attention.h): slot_of lists the arena slot at each
// place of an autoregressive step's arena, the row's own last; commit_row() moves the entries as that step's
// commit would (commit_arena below): of the n + 1 places, the n_after that stay are the first ones,
// each evicted place below n_after taken, in order, by the next surviving entry from n_after up.
struct ReadingOrder {
  std::vector<int32_t> slot_of;  // [start + T] arena slot at each place
  std::vector<int32_t> place;    // [start + T] place of each arena slot
  int start = 0, n = 0;          // the block's first slot; places filled before the next row

  ReadingOrder(int start_, int T) : slot_of((std::size_t)start_ + T), place(slot_of.size()), start(start_), n(start_) {
    for (int s = 0; s < start; ++s) slot_of[s] = place[s] = s;
  }
  // Before row i attends: the row at the next place, which is the last it reads.
  int add_row(int i) {
    slot_of[n] = start + i;
    place[start + i] = n;
    return n;
  }
  // After the row added last evicted the arena slots `evicted`.
  void commit_row(const std::vector<int>& evicted) {
    std::vector<int> gone;
    for (int s : evicted) gone.push_back(place[s]);
    std::sort(gone.begin(), gone.end());
    const int n_after = n + 1 - (int)gone.size();
    std::size_t hole = 0;  // the holes are gone's entries below n_after: as many as the movers
    for (int from = n_after; from <= n; ++from) {
      if (std::binary_search(gone.begin(), gone.end(), from)) continue;
      const int to = gone[hole++];
      slot_of[to] = slot_of[from];
      place[slot_of[to]] = to;
    }
    n = n_after;
  }
};

// A commit: the arena holds `committed` committed entries in slots [0, committed) and n_inflight in-flight rows in
// the slots after them; the first n_rows rows are accepted, the rest dropped, and `survivors` entries stay (the
// caller's count: every KV head must end with as many).
struct ArenaCommit {
  int committed = 0, n_rows = 0, n_inflight = 0, survivors = 0;
};

// The reason `commit` cannot run on `arena`, or "" (checked before commit_arena touches memory).
std::string check_arena_commit(const ArenaStorage& arena, const ArenaCommit& commit);

// Accept the commit's rows (cache/arena.py: KVArena.commit), in every layer and KV head: the scores become those
// after the last accepted row (the row's snapshot, or the committed scores for none), the evictions of the dropped
// rows are undone, and the surviving entries (keys, values, their params, positions, scores) move to the places
// ReadingOrder gives them, in slots [0, survivors); committed_scores then equal the scores and every slot is alive.
// Returns "" or the reason a KV head disagreed with the caller's survivors (the arena is then left unchanged in
// that head and must be reset).
std::string commit_arena(const ArenaStorage& arena, const ArenaCommit& commit);

// A tree block's accepted path (attention.h): `path` lists in-flight rows of the block staged after `committed`
// (n_inflight rows in all), a root first and each the parent of the next. The reason it cannot be committed, or "".
std::string check_arena_path(const ArenaStorage& arena, int committed, const std::vector<int>& path, int n_inflight);

// Accept a tree block's path: its rows' entries move to the slots a chain of them would have had, [committed,
// committed + m), the evictions they made (row_evicted) are marked as that chain's rows would have marked them, and
// the scores become the last one's snapshot; commit_arena then commits the chain, every other row dropped. The
// arena ends as the autoregressive steps along the path would leave it.
std::string commit_arena_path(const ArenaStorage& arena, int committed, const std::vector<int>& path, int n_inflight,
                              int survivors);

}  // namespace sparsespec
