// The KV arena's counts and the rules of its blocks (sparsespec/cache/arena.py tells the life of a block): what is
// committed, what is in flight and what each in-flight row leaves visible, the open block and what its rows do in
// every layer, a retention hold. The native arena (ops.cpp: NativeArena) asks the ledger before it touches its
// memory; every verb here that can refuse checks first and changes nothing when it does.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attention.h"

namespace sparsespec {

// What the arena's policy and its owner fixed when it was made.
struct ArenaRules {
  int budget = -1;              // the policy's budget; -1: the full cache, which evicts nothing
  bool scores = false;          // heavy hitters: row-by-row rows keep score snapshots
  int row_score_rows = 0;       // snapshots kept (the rows a partial commit can end on)
  int max_inflight = 1;         // rows in flight that a commit may keep part of
  int staging = 1;              // the most rows in flight: max(max_block, max_inflight)
  int64_t max_tokens = -1;      // the full cache's most tokens (it grows to max_tokens + staging slots); -1: budgeted
  int pool = 0;                 // retention's pooling width (0: no retention)
  bool recall = false;          // a cold tier takes what commits evict, and row-by-row rows recall from it
  bool recent_window = false;   // quantized entries with a full-precision window
  bool in_cache = false;        // keys stored unrotated, queries and keys rotated by rank
};

// What the open block's rows do as they attend: evict as the policy says, hold (a retention hold's chunks: nothing
// evicted), or select (the chunk that ends a hold: retention chooses what stays after it).
enum class BlockMode { evict, hold, select };

struct ArenaLedger {
  ArenaRules rules;
  int capacity = 0;                 // slots per KV head
  int committed = 0;                // slots [0, committed) hold committed tokens
  int64_t next_position = 0;        // true position of the next token to be committed
  int64_t evicted_tokens = 0;       // tokens evicted (per layer and head) by committed rows
  std::vector<int> alive_after_row;  // tokens visible after each in-flight row
  bool per_block_inflight = false;  // the block begun last is a per-block chunk (committed whole or not at all)
  std::vector<int32_t> tree;        // parents of the in-flight tree block's rows; empty: a chain
  int hold_left = 0;                // prompt rows still to come in the open hold; 0: none open
  int window_rows = 0;              // rows of the open hold's observation window
  int steady_capacity = 0;          // the capacity a hold returns to
  bool block_open = false;          // begin() to end()
  int block_rows = 0;               // the open block's rows
  BlockMode mode = BlockMode::evict;
  bool evicts_per_row = false;      // whether the block opened last evicts between its rows

  int inflight() const { return (int)alive_after_row.size(); }
  // Tokens visible to the next row: the committed survivors, then the in-flight ones.
  int visible() const { return alive_after_row.empty() ? committed : alive_after_row.back(); }
  // Slots still free for in-flight rows.
  int room() const { return capacity - committed - inflight(); }

  // Why a tree block of n_rows rows cannot begin now, or "".
  std::string tree_refusal(int n_rows) const;
  // Begin a block of n_rows rows, per_block (a prefill chunk evicting once, at its end) or row by row, a tree
  // (parents: one per row, -1 a root, each before its children) or a chain (null): checked, then `pass` says what
  // its rows do in every layer (its RoPE rows are the caller's) and the ledger counts it open.
  std::string begin(int n_rows, bool per_block, const std::vector<int32_t>* parents, ArenaPass& pass);
  // The open block's rows are in flight: what each leaves visible.
  void end();
  // Why commit(n_rows) cannot run now, or "".
  std::string check_commit(int n_rows) const;
  // Why `path` (in-flight rows of the tree block, a root first, each the parent of the next) cannot be committed, or
  // "".
  std::string check_path(const std::vector<int>& path) const;
  // Tokens left after keeping n_rows in-flight rows (after_row: the last row kept, or -1 for none).
  int survivors_after(int after_row) const { return after_row < 0 ? committed : alive_after_row[after_row]; }
  // The kept rows (n_rows of them, leaving `survivors`) are committed; nothing is in flight.
  void committed_rows(int n_rows, int survivors);
  // The full cache's capacity once a commit left less than a staging's room (doubled, up to max_tokens +
  // staging), else the capacity it has.
  int grown_capacity() const;
  // Why a hold of n_tokens prompt rows, whose last window_rows rows are its observation window, cannot open now,
  // or "".
  std::string check_hold(int n_tokens, int window_rows) const;
  // Forget every token and what is in flight (a hold's count stays: its owner ends it).
  void reset();
};

}  // namespace sparsespec
