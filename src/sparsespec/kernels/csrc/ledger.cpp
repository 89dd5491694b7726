// The KV arena's counts and the rules of its blocks (ledger.h).
#include "ledger.h"

#include <algorithm>

namespace sparsespec {

namespace {

std::string listed(const std::vector<int32_t>& values) {
  std::string out = "[";
  for (std::size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + std::to_string(values[i]);
  return out + "]";
}

}  // namespace

std::string ArenaLedger::tree_refusal(int n_rows) const {
  if (inflight() || hold_left || block_open)
    return "a tree block is a row-by-row block that starts from a committed state";
  if (rules.recall || rules.recent_window) return "tree blocks run without recall and without a full-precision window";
  // Every row of a tree keeps its score snapshot (its path may end on it).
  const int snapshots = rules.scores ? rules.row_score_rows : n_rows;
  if (n_rows > std::min({rules.max_inflight, snapshots, rules.staging}))
    return "a tree block of " + std::to_string(n_rows) + " rows needs max_inflight > " + std::to_string(n_rows) +
           " (every row keeps its score snapshot)";
  return "";
}

std::string ArenaLedger::begin(int n_rows, bool per_block, const std::vector<int32_t>* parents, ArenaPass& pass) {
  if (block_open) return "a block is open: end it first";
  if (!tree.empty()) return "a tree block is in flight: commit its path or roll it back first";
  if (n_rows < 1) return "a block of no rows";
  std::vector<int32_t> depths;
  if (parents) {
    bool ordered = (int)parents->size() == n_rows;
    for (int i = 0; ordered && i < n_rows; ++i) ordered = (*parents)[i] >= -1 && (*parents)[i] < i;
    if (!ordered)
      return "a tree block's parents name, for each of its " + std::to_string(n_rows) + " rows, an earlier row or -1";
    const std::string refusal = per_block ? "a tree block is a row-by-row block, not a prefill chunk"
                                          : tree_refusal(n_rows);
    if (!refusal.empty()) return refusal;
    for (int32_t parent : *parents) depths.push_back(parent < 0 ? 0 : depths[parent] + 1);
  }
  if (n_rows > rules.staging)
    return "block of " + std::to_string(n_rows) + " rows exceeds the arena's staging of " +
           std::to_string(rules.staging);
  if (per_block && inflight()) return "a per-block (prefill) chunk must start from a committed state";
  if (n_rows > room())
    return "a block of " + std::to_string(n_rows) + " rows does not fit the " + std::to_string(room()) +
           " slots left of the arena's " + std::to_string(capacity);
  BlockMode block_mode = BlockMode::evict;
  int left = hold_left;
  if (hold_left) {
    if (!per_block || n_rows > hold_left)
      return "a hold takes per-block chunks of its " + std::to_string(hold_left) + " remaining rows";
    left = hold_left - n_rows;
    block_mode = left ? BlockMode::hold : BlockMode::select;
    if (!left && n_rows < window_rows)
      return "the observation window needs its " + std::to_string(window_rows) + " rows in one block";
  }
  const int first = inflight();
  // Held and selecting blocks evict nothing as they attend; the selecting block chooses after it.
  const int budget = block_mode == BlockMode::evict ? rules.budget : -1;
  // A single row is its own block: evicting after it is the same as evicting after the block. A tree's rows evict
  // along their paths, which are as long as the tree is deep.
  const int depth = parents ? *std::max_element(depths.begin(), depths.end()) + 1 : n_rows;
  pass = ArenaPass();
  pass.start = committed + first;
  pass.first = first;
  pass.visible_before = visible();
  pass.first_position = next_position + first;
  pass.per_row = budget >= 0 && n_rows > 1 && !per_block && (int64_t)pass.visible_before + depth > budget;
  pass.budget = budget;
  pass.in_cache = rules.in_cache;
  // Snapshots after each in-flight row a partial commit can end on (never the last possible row); a tree's every row.
  if (rules.scores && !per_block)
    pass.snapshots = parents ? n_rows : std::max(0, std::min(n_rows, rules.max_inflight - 1 - first));
  pass.pool = block_mode == BlockMode::select ? rules.pool : 0;
  pass.select_budget = pass.pool ? rules.budget : 0;
  pass.recall = rules.recall && !per_block;
  hold_left = left;
  mode = block_mode;
  block_open = true;
  block_rows = n_rows;
  per_block_inflight = per_block;
  evicts_per_row = pass.per_row;
  if (parents) tree = *parents;
  return "";
}

void ArenaLedger::end() {
  int alive = visible();
  const int budget = mode == BlockMode::hold ? -1 : rules.budget;
  auto within_budget = [&](int seen) { return budget < 0 ? seen : std::min(seen, budget); };
  if (!tree.empty()) {  // along each row's path
    for (int32_t parent : tree)
      alive_after_row.push_back(within_budget((parent < 0 ? alive : alive_after_row[parent]) + 1));
  } else {
    for (int i = 0; i < block_rows; ++i) {
      alive = per_block_inflight ? alive + 1 : within_budget(alive + 1);
      alive_after_row.push_back(alive);
    }
    if (per_block_inflight) alive_after_row.back() = within_budget(alive);
  }
  block_open = false;
}

std::string ArenaLedger::check_commit(int n_rows) const {
  if (block_open) return "commit inside an open block";
  if (!tree.empty() && n_rows) return "a tree block commits a path (commit_path), or nothing";
  if (n_rows < 0 || n_rows > inflight())
    return "cannot commit " + std::to_string(n_rows) + " of " + std::to_string(inflight()) + " in-flight rows";
  if (n_rows > 0 && n_rows < inflight() && (n_rows >= rules.max_inflight || per_block_inflight))
    return "only the first max_inflight rows of row-by-row blocks can be committed partially";
  if (rules.recent_window && n_rows < inflight() && inflight() > rules.max_inflight)
    return "dropping rows with more than max_inflight = " + std::to_string(rules.max_inflight) +
           " in flight would overwrite the full-precision window of the rows kept";
  return "";
}

std::string ArenaLedger::check_path(const std::vector<int>& path) const {
  if (block_open || tree.empty()) return "commit_path takes the path of a tree block that has ended";
  bool on_tree = !path.empty();
  for (std::size_t k = 0; on_tree && k < path.size(); ++k)
    on_tree = path[k] >= 0 && path[k] < (int)tree.size() && tree[path[k]] == (k ? path[k - 1] : -1);
  if (!on_tree)
    return listed(std::vector<int32_t>(path.begin(), path.end())) + " is not a path from a root of the tree block " +
           "(parents " + listed(tree) + ")";
  return "";
}

void ArenaLedger::committed_rows(int n_rows, int survivors) {
  evicted_tokens += committed + n_rows - survivors;
  committed = survivors;
  next_position += n_rows;
  alive_after_row.clear();
  tree.clear();
}

int ArenaLedger::grown_capacity() const {
  if (rules.max_tokens < 0) return capacity;
  const int64_t limit = rules.max_tokens + rules.staging;
  if (capacity >= limit || committed + rules.staging <= capacity) return capacity;
  return (int)std::min<int64_t>(limit, std::max<int64_t>(2LL * capacity, committed + 2LL * rules.staging));
}

std::string ArenaLedger::check_hold(int n_tokens, int window) const {
  if (!rules.pool || inflight() || block_open || steady_capacity)
    return "hold needs retention and a committed arena with no hold open";
  if (n_tokens < 1 || window < 1 || window > n_tokens)
    return "a hold of " + std::to_string(n_tokens) + " rows cannot end with an observation window of " +
           std::to_string(window);
  if ((int64_t)committed + n_tokens > INT32_MAX - rules.staging)
    return "a hold of " + std::to_string(n_tokens) + " rows does not fit an arena";
  return "";
}

void ArenaLedger::reset() {
  committed = 0;
  next_position = 0;
  evicted_tokens = 0;
  alive_after_row.clear();
  block_open = false;
  per_block_inflight = false;
  tree.clear();
}

}  // namespace sparsespec
