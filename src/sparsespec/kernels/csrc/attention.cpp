// Rows of a block over one layer of the KV arena: per-row visibility (chains and trees), ranks (in-cache mode), the
// chunked softmax of attention.h, heavy-hitter scores and their per-row snapshots, the policy's evictions
// (sparsespec/cache/policy.py says which entries each policy keeps), row by row, and retention's selection at a
// prompt's end (sparsespec/cache/retention.py).
#include "attention.h"
#include "arena.h"
#include "parallel.h"
#include "recall.h"
#include "elementwise.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "qmatmul.h"

namespace sparsespec {

const AttnKernels& attention_kernels(int isa) {
  if (isa == kAuto) isa = best_isa();
  switch (isa) {
    case kAmx:  // the attention op has no tile multiply: AMX hosts run its AVX-512 path
    case kAvx512: return attention_kernels_avx512();
    case kAvx2: return attention_kernels_avx2();
    default: return attention_kernels_scalar();
  }
}

namespace {

bool alive(const AttnBlock& b, int h, int s) { return b.evicted_at[(long)h * b.cap + s] == kNever; }

// Row i's depth in its block (a chain's row i: i), true position, and rank in the cache: the tokens visible before
// it, each row before it on its path having evicted down to the budget (per_row).
int depth_of(const AttnBlock& b, int i) { return b.depths ? b.depths[i] : i; }
int64_t position_of(const AttnBlock& b, int i) { return b.first_position + depth_of(b, i); }
int64_t rank_of(const AttnBlock& b, int i) { return row_rank(b.visible_before, depth_of(b, i), b.per_row, b.budget); }

// A row at position `newest` sees only positions in [0, newest]: the ranks' bitmap and the full-precision window
// index by position, so a slot holding any other (a corrupt arena) is an error, not a write or read astray.
void check_position(int h, int s, int64_t position, int64_t newest) {
  TORCH_CHECK(position >= 0 && position <= newest, "arena_attention: slot ", s, " of KV head ", h,
              " holds position ", position, ", outside [0, ", newest, "] of the row attending");
}

// ranks[s] for the slots s <= last alive in head h: the number of such slots with a smaller position.
void compute_ranks(const AttnBlock& b, int h, int last, int64_t newest, int32_t* ranks) {
  std::vector<uint64_t> bits((std::size_t)(newest >> 6) + 1, 0);
  const int64_t* pos = b.positions + (long)h * b.cap;
  for (int s = 0; s <= last; ++s)
    if (alive(b, h, s)) {
      check_position(h, s, pos[s], newest);
      bits[pos[s] >> 6] |= 1ull << (pos[s] & 63);
    }
  std::vector<int32_t> before(bits.size());
  int32_t count = 0;
  for (std::size_t w = 0; w < bits.size(); ++w) {
    before[w] = count;
    count += __builtin_popcountll(bits[w]);
  }
  for (int s = 0; s <= last; ++s) {
    if (!alive(b, h, s)) continue;
    const int64_t p = pos[s];
    ranks[s] = before[p >> 6] + __builtin_popcountll(bits[p >> 6] & ((1ull << (p & 63)) - 1));
  }
}

// What one eviction keeps in a KV head: `budget` entries, heavy hitters ranked by `scores` ([cap] of the head),
// each divided by its age when age_normalised.
struct Ranking {
  const float* scores;
  bool age_normalised;
  int budget;
};

// The policy's ranking in head h: its scores and budget.
Ranking policy_ranking(const AttnBlock& b, int h) {
  return {b.scores ? b.scores + (long)h * b.cap : nullptr, b.age_normalised, b.budget};
}

// Retention's ranking scores of head h (AttnBlock::pool): each visible slot below `stop` gets the largest score among
// the `pool` visible slots nearest it in position order (slots are not stored in position order); others 0.
std::vector<float> pool_by_position(const AttnBlock& b, int h, int stop) {
  const int64_t* pos = b.positions + (long)h * b.cap;
  const float* score = b.scores + (long)h * b.cap;
  std::vector<int> order;
  for (int s = 0; s < stop; ++s)
    if (alive(b, h, s)) order.push_back(s);
  std::sort(order.begin(), order.end(), [&](int x, int y) { return pos[x] < pos[y]; });
  std::vector<float> pooled(b.cap, 0.0f);
  const int n = (int)order.size(), reach = b.pool / 2;
  for (int k = 0; k < n; ++k) {
    float best = score[order[k]];
    for (int j = std::max(0, k - reach); j <= std::min(n - 1, k + reach); ++j) best = std::max(best, score[order[j]]);
    pooled[order[k]] = best;
  }
  return pooled;
}

// The policy's evictions in head h once n_visible tokens are visible (slots <= last alive), newest at `newest`:
// sinks and window protected; with heavy hitters the lowest ranked go (ties: the older position), otherwise every
// unprotected token goes. age_normalised (hybrid-age, cache/hybrid_age.py): the score divided by the token's age,
// max(newest + 1 - position, 1), in float32. Evicted slots get evicted_at = row; returns them.
std::vector<int> evict(const AttnBlock& b, const Ranking& rank, int h, int last, int64_t newest, int n_visible,
                       int row) {
  const int n_evict = n_visible - rank.budget;
  if (rank.budget < 0 || n_evict <= 0) return {};
  const int64_t* pos = b.positions + (long)h * b.cap;
  int32_t* evicted_at = b.evicted_at + (long)h * b.cap;
  std::vector<int> candidates;
  for (int s = 0; s <= last; ++s)
    if (evicted_at[s] == kNever && !(pos[s] < b.sinks || pos[s] > newest - b.window)) candidates.push_back(s);
  if (b.heavy > 0 && (int)candidates.size() > n_evict) {
    const float* key = rank.scores;  // the ranking key: the score, or the score per row of age
    std::vector<float> per_age;
    if (rank.age_normalised) {
      per_age.resize(b.cap);
      for (int s : candidates) per_age[s] = key[s] / (float)std::max<int64_t>(newest + 1 - pos[s], 1);
      key = per_age.data();
    }
    // A NaN key would break the strict weak order nth_element relies on (undefined behaviour).
    for (int s : candidates)
      TORCH_CHECK(!std::isnan(key[s]), "arena_attention: the heavy-hitter score of slot ", s, " of KV head ", h,
                  " is NaN");
    auto lower = [&](int x, int y) { return key[x] < key[y] || (key[x] == key[y] && pos[x] < pos[y]); };
    std::nth_element(candidates.begin(), candidates.begin() + (n_evict - 1), candidates.end(), lower);
    candidates.resize(n_evict);
  }
  for (int s : candidates) evicted_at[s] = row;
  return candidates;
}

// out = x * cos + rotate_half(x) * sin for one head vector; bf16: tables, products and sum rounded to bfloat16.
void rope(const float* x, const float* c, const float* s, int hd, bool bf16, float* out) {
  const int half = hd / 2;
  for (int j = 0; j < hd; ++j) {
    const float r = j < half ? -x[j + half] : x[j - half];
    if (bf16)
      out[j] = round_bf16(round_bf16(x[j] * round_bf16(c[j])) + round_bf16(r * round_bf16(s[j])));
    else
      out[j] = x[j] * c[j] + r * s[j];
  }
}

void store(const float* x, int hd, bool bf16, void* dst) {
  if (!bf16) {
    std::memcpy(dst, x, sizeof(float) * hd);
    return;
  }
  uint16_t* out = static_cast<uint16_t*>(dst);
  for (int j = 0; j < hd; ++j) {
    const float r = round_bf16(x[j]);
    uint32_t bits;
    std::memcpy(&bits, &r, 4);
    out[j] = (uint16_t)(bits >> 16);
  }
}

// One head vector x [hd] into slot `slot` of the keys (or values) and their params, in the block's format; offset
// [hd] (quantized keys, or null) is subtracted before quantizing.
void store_entry(const AttnBlock& b, const float* x, const float* offset, void* entries, uint16_t* params,
                 long slot) {
  if (b.code_bits) {
    float shifted[kAttnMaxHeadDim];
    if (offset) {
      for (int c = 0; c < b.hd; ++c) shifted[c] = x[c] - offset[c];
      x = shifted;
    }
    quantize_row(x, b.hd, b.code_bits, b.code_group,
                 static_cast<uint8_t*>(entries) + slot * code_bytes(b.hd, b.code_bits),
                 params + slot * param_halves(b.hd, b.code_group));
  } else {
    store(x, b.hd, b.bf16, static_cast<char*>(entries) + slot * b.hd * (b.bf16 ? 2 : 4));
  }
}

}  // namespace

void quantize_row(const float* x, int hd, int bits, int code_group, uint8_t* codes, uint16_t* params) {
  const float levels = (float)((1 << bits) - 1);
  uint8_t q[kAttnMaxHeadDim];
  for (int g = 0; g < hd / code_group; ++g) {
    const float* xs = x + g * code_group;
    float low = xs[0], high = xs[0];
    for (int c = 1; c < code_group; ++c) {
      low = std::min(low, xs[c]);
      high = std::max(high, xs[c]);
    }
    params[2 * g] = float_to_half(std::max((high - low) / levels, kMinCodeScale));
    params[2 * g + 1] = float_to_half(low);
    const float scale = half_to_float(params[2 * g]), zero = half_to_float(params[2 * g + 1]);
    for (int c = 0; c < code_group; ++c)
      q[g * code_group + c] = (uint8_t)std::clamp(std::nearbyint((xs[c] - zero) / scale), 0.0f, levels);
  }
  if (bits == 8) {
    std::memcpy(codes, q, hd);
  } else {
    for (int c = 0; c < hd / 2; ++c) codes[c] = (uint8_t)(q[c] | (q[c + hd / 2] << 4));
  }
}

void stage_rows(const StageRows& st, const AttnBlock& b) {
  const int hd = st.hd, T = st.T;
  auto table_row = [&](const float* table, int64_t p) { return table + (p - st.table_offset) * hd; };
  for (int i = 0; i < T; ++i) {
    const int64_t p = st.in_cache ? rank_of(b, i) : position_of(b, i);
    for (int h = 0; h < st.n_heads; ++h) {
      const long at = ((long)h * T + i) * hd;
      rope(st.q + at, table_row(st.cos, p), table_row(st.sin, p), hd, false, st.q_rotated + at);
    }
  }
  float rotated[kAttnMaxHeadDim];
  for (int h = 0; h < st.n_kv; ++h)
    for (int i = 0; i < T; ++i) {
      const long at = ((long)h * T + i) * hd;
      const long slot = (long)h * b.cap + b.start + i;
      const int64_t position = position_of(b, i);
      const float* key = st.k + at;
      if (!st.in_cache) {
        rope(key, table_row(st.cos, position), table_row(st.sin, position), hd, st.bf16_keys, rotated);
        key = rotated;
      }
      store_entry(b, key, b.key_offset ? b.key_offset + (long)h * hd : nullptr, b.keys, b.key_params, slot);
      store_entry(b, st.v + at, nullptr, b.values, b.value_params, slot);
      if (b.recent_window)
        for (int c = 0; c < hd; ++c) {
          b.block_keys[at + c] = b.recent_bf16 ? round_bf16(key[c]) : key[c];
          b.block_values[at + c] = b.recent_bf16 ? round_bf16(st.v[at + c]) : st.v[at + c];
        }
      b.positions[slot] = position;
      b.evicted_at[slot] = kNever;
      if (b.scores) b.scores[slot] = 0.0f;
    }
}

void attend_block(int isa, const AttnBlock& b) {
  const AttnKernels& kernels = attention_kernels(isa);
  const int H = b.n_kv, G = b.group, hd = b.hd;
  const int stop = b.start + b.T;
  const long lds = stop;
  const int max_chunks = (stop + kAttnChunk - 1) / kAttnChunk;
  // Bytes of one head's entries, and float16 values of its params (quantized entries).
  const long head_bytes = (long)b.cap * (b.code_bits ? code_bytes(hd, b.code_bits) : (long)hd * (b.bf16 ? 2 : 4));
  const long head_params = b.code_bits ? (long)b.cap * param_halves(hd, b.code_group) : 0;
  std::vector<float> logits((std::size_t)H * G * lds);
  std::vector<float> chunk_max((std::size_t)H * max_chunks * G), chunk_sum(chunk_max.size());
  std::vector<float> chunk_out(chunk_max.size() * hd);
  std::vector<int32_t> ranks(b.cos ? (std::size_t)H * b.cap : 0);
  std::vector<float> m((std::size_t)H * G);
  const long out_stride = (long)H * G * hd;
  // Row-by-row blocks read in an autoregressive step's order (attention.h); other blocks in slot order.
  const bool tree = b.parents != nullptr;
  const bool reorder = (b.per_row && b.T > 1) || tree;
  std::vector<ReadingOrder> order;
  if (reorder) order.assign(H, ReadingOrder(b.start, b.T));
  // Tree blocks: per KV head, the reading order after each row and the slots each row evicted; per row, which
  // earlier rows are its ancestors.
  std::vector<ReadingOrder> order_after(tree ? (std::size_t)H * b.T : 0, ReadingOrder(0, 0));
  std::vector<std::vector<int>> evicted_by(tree ? (std::size_t)H * b.T : 0);
  std::vector<char> ancestor(tree ? (std::size_t)b.T * b.T : 0);  // [i * T + j]: j is i or an ancestor of i
  for (int i = 0; tree && i < b.T; ++i)
    for (int j = i; j >= 0; j = b.parents[j]) ancestor[(std::size_t)i * b.T + j] = 1;
  // Before tree row i attends in head h: the evictions and rows of its path marked, the others lifted; its reading
  // order and scores its parent's (the committed ones for a root).
  auto enter_path = [&](int h, int i) {
    int32_t* evicted_at = b.evicted_at + (long)h * b.cap;
    for (int j = 0; j < i; ++j)
      for (int s : evicted_by[(std::size_t)h * b.T + j]) evicted_at[s] = kNever;
    for (int j = 0; j < i; ++j) evicted_at[b.start + j] = ancestor[(std::size_t)i * b.T + j] ? kNever : kOffPath;
    for (int j = b.parents[i]; j >= 0; j = b.parents[j])
      for (int s : evicted_by[(std::size_t)h * b.T + j]) evicted_at[s] = j;
    const int parent = b.parents[i];
    order[h] = parent < 0 ? ReadingOrder(b.start, b.T) : order_after[(std::size_t)h * b.T + parent];
    if (b.scores) {
      float* score = b.scores + (long)h * b.cap;
      const float* from = parent < 0 ? b.committed_scores + (long)h * b.cap
                                     : b.row_scores + parent * b.row_stride + (long)h * b.cap;
      std::memcpy(score, from, sizeof(float) * stop);
      if (parent < 0) std::fill(score + b.start, score + stop, 0.0f);
      score[b.start + i] = 0.0f;
    }
  };
  std::vector<int> last_read(H);  // per head, the last place the current row reads
  auto last_of = [&](int h, int i) { return reorder ? last_read[h] : b.start + i; };

  auto chunk_args = [&](int h, int row) {
    AttnChunk a;
    a.group = G;
    a.hd = hd;
    a.q = b.q + ((long)h * G * b.T + row) * hd;
    a.ldq = (long)b.T * hd;
    a.keys = static_cast<const char*>(b.keys) + h * head_bytes;
    a.values = static_cast<const char*>(b.values) + h * head_bytes;
    a.bf16 = b.bf16;
    a.code_bits = b.code_bits;
    a.code_group = b.code_group;
    if (b.code_bits) {
      a.key_params = b.key_params + h * head_params;
      a.value_params = b.value_params + h * head_params;
      a.key_offset = b.key_offset ? b.key_offset + (long)h * hd : nullptr;
    }
    a.evicted_at = b.evicted_at + (long)h * b.cap;
    a.last_slot = last_of(h, row);
    a.slot_of = reorder ? order[h].slot_of.data() : nullptr;
    a.ranks = b.cos ? ranks.data() + (long)h * b.cap : nullptr;
    a.cos = b.cos;
    a.sin = b.sin;
    a.scale = b.scale;
    a.logits = logits.data() + (long)h * G * lds;
    a.lds = lds;
    if (b.recent_window) {
      const long ring_bytes = (long)b.recent_slots * hd * (b.recent_bf16 ? 2 : 4);
      a.positions = b.positions + (long)h * b.cap;
      a.newest = position_of(b, row);
      a.first_position = b.first_position;
      a.recent_window = b.recent_window;
      a.recent_slots = b.recent_slots;
      a.recent_keys = static_cast<const char*>(b.recent_keys) + h * ring_bytes;
      a.recent_values = static_cast<const char*>(b.recent_values) + h * ring_bytes;
      a.recent_bf16 = b.recent_bf16;
      a.block_keys = b.block_keys + (long)h * b.T * hd;
      a.block_values = b.block_values + (long)h * b.T * hd;
    }
    return a;
  };

  // The steps of row i in head h, in order. A head's steps touch only its own state and its own regions of the
  // buffers above (chunk c of head h at h * max_chunks + c), so heads at different rows never share a float.
  auto chunks_of = [&](int h, int i) { return last_of(h, i) / kAttnChunk + 1; };
  auto chunk_end = [&](int h, int i, int c) { return std::min(last_of(h, i) + 1, (c + 1) * kAttnChunk); };
  // The row's first step in a head: its place in the reading order, the ranks (in-cache mode), the window's check.
  auto head_ranks = [&](int h, int i) {
    if (tree) enter_path(h, i);
    if (reorder) last_read[h] = order[h].add_row(i);
    if (b.cos) compute_ranks(b, h, b.start + i, position_of(b, i), ranks.data() + (long)h * b.cap);
    // The window reads every slot the row covers (alive or not) from the ring or the block, by position.
    if (b.recent_window)
      for (int s = 0; s <= b.start + i; ++s)
        check_position(h, s, b.positions[(long)h * b.cap + s], b.first_position + i);
  };
  auto chunk_logits = [&](int h, int i, int c) {
    kernels.logits(chunk_args(h, i), c * kAttnChunk, chunk_end(h, i, c),
                   chunk_max.data() + ((long)h * max_chunks + c) * G);
  };
  auto head_max = [&](int h, int i) {
    const int n_chunks = chunks_of(h, i);
    for (int g = 0; g < G; ++g) {
      float best = -std::numeric_limits<float>::infinity();
      for (int c = 0; c < n_chunks; ++c) best = std::max(best, chunk_max[((long)h * max_chunks + c) * G + g]);
      m[(long)h * G + g] = best;
    }
  };
  auto chunk_exp_values = [&](int h, int i, int c) {
    const long w = (long)h * max_chunks + c;
    kernels.exp_values(chunk_args(h, i), c * kAttnChunk, chunk_end(h, i, c), m.data() + (long)h * G,
                       chunk_sum.data() + w * G, chunk_out.data() + w * G * hd);
  };
  auto head_output_scores = [&](int h, int i) {
    const int n_chunks = chunks_of(h, i), last = last_of(h, i);
    float total[kAttnMaxGroup];
    for (int g = 0; g < G; ++g) {
      float sum = chunk_sum[((long)h * max_chunks) * G + g];
      for (int c = 1; c < n_chunks; ++c) sum += chunk_sum[((long)h * max_chunks + c) * G + g];
      total[g] = sum;
      float* o = b.out + i * out_stride + ((long)h * G + g) * hd;
      const float* part = chunk_out.data() + (((long)h * max_chunks) * G + g) * hd;
      for (int d = 0; d < hd; ++d) o[d] = part[d];
      for (int c = 1; c < n_chunks; ++c) {
        part = chunk_out.data() + (((long)h * max_chunks + c) * G + g) * hd;
        for (int d = 0; d < hd; ++d) o[d] += part[d];
      }
      for (int d = 0; d < hd; ++d) o[d] /= sum;
      if (b.lse) b.lse[(long)i * H * G + (long)h * G + g] = m[(long)h * G + g] + std::log(sum);
    }
    if (!b.scores) return;
    float* score = b.scores + (long)h * b.cap;
    const float* e = logits.data() + (long)h * G * lds;
    if (b.score_decay != 1.0f && !b.pool)  // every slot up to the row's
      for (int s = 0; s <= b.start + i; ++s) score[s] *= b.score_decay;
    for (int r = 0; r <= last; ++r) {
      const int s = reorder ? order[h].slot_of[r] : r;
      if (!alive(b, h, s)) continue;
      float received = e[r] / total[0];
      for (int g = 1; g < G; ++g) received += e[g * lds + r] / total[g];
      score[s] += received;
    }
  };
  // After row i: the per-row evictions (down to the budget from the tokens visible to it, itself included), and
  // the row's score snapshot.
  auto head_after_row = [&](int h, int i) {
    if (b.per_row) {
      const std::vector<int> evicted =
          evict(b, policy_ranking(b, h), h, b.start + i, position_of(b, i), (int)rank_of(b, i) + 1, b.first + i);
      if (reorder) order[h].commit_row(evicted);
      if (tree) {
        evicted_by[(std::size_t)h * b.T + i] = evicted;
        b.row_evicted[i * b.evicted_stride + h] = evicted.empty() ? -1 : evicted[0];
      }
    } else if (tree) {  // nothing evicted: the row takes the next place
      order[h].commit_row({});
      b.row_evicted[i * b.evicted_stride + h] = -1;
    }
    if (tree) order_after[(std::size_t)h * b.T + i] = order[h];
    if (i < b.snapshot_rows)
      std::memcpy(b.row_scores + i * b.row_stride + (long)h * b.cap, b.scores + (long)h * b.cap,
                  sizeof(float) * stop);
  };

  // Schedule. By heads: each thread takes whole heads through every row of the block, and no thread waits for
  // another until the block ends; used when the heads share the threads evenly, or (at most as many threads as
  // heads) a head's slots are few, where the waits would cost more than the uneven share. By chunks: every step
  // spread over (head, chunk) items, the threads meeting after each step.
  if (b.pool)  // the window's scores are its own attention
    for (int h = 0; h < H; ++h) std::fill(b.scores + (long)h * b.cap, b.scores + (long)h * b.cap + stop, 0.0f);
  const int threads = num_threads();
  if (H % threads == 0 || (threads < H && stop < 4096)) {
    parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
      for (int h = (int)h0; h < (int)h1; ++h)
        for (int i = 0; i < b.T; ++i) {
          head_ranks(h, i);
          for (int c = 0; c < chunks_of(h, i); ++c) chunk_logits(h, i, c);
          head_max(h, i);
          for (int c = 0; c < chunks_of(h, i); ++c) chunk_exp_values(h, i, c);
          head_output_scores(h, i);
          head_after_row(h, i);
        }
    });
  } else {
    for (int i = 0; i < b.T; ++i) {
      auto each_head = [&](auto&& step) {
        parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
          for (int64_t h = h0; h < h1; ++h) step((int)h);
        });
      };
      each_head([&](int h) { head_ranks(h, i); });
      int n_chunks = 0;  // the most any head's row reads (the same in every head unless a policy runs short)
      for (int h = 0; h < H; ++h) n_chunks = std::max(n_chunks, chunks_of(h, i));
      auto each_chunk = [&](auto&& step) {
        parallel_for(0, (int64_t)H * n_chunks, 4, [&](int64_t w0, int64_t w1) {
          for (int64_t w = w0; w < w1; ++w) {
            const int h = (int)(w / n_chunks), c = (int)(w % n_chunks);
            if (c < chunks_of(h, i)) step(h, c);
          }
        });
      };
      each_chunk([&](int h, int c) { chunk_logits(h, i, c); });
      for (int h = 0; h < H; ++h) head_max(h, i);
      each_chunk([&](int h, int c) { chunk_exp_values(h, i, c); });
      each_head([&](int h) {
        head_output_scores(h, i);
        head_after_row(h, i);
      });
    }
  }
  // A tree block leaves no eviction marked and every row alive: what its rows evicted waits in row_evicted for the
  // commit of the accepted path (arena.h).
  if (tree)
    for (int h = 0; h < H; ++h)
      for (int j = 0; j < b.T; ++j) {
        for (int s : evicted_by[(std::size_t)h * b.T + j]) b.evicted_at[(long)h * b.cap + s] = kNever;
        b.evicted_at[(long)h * b.cap + b.start + j] = kNever;
      }
  if (b.pool)
    for (int h = 0; h < H; ++h) {
      const std::vector<float> pooled = pool_by_position(b, h, stop);
      evict(b, Ranking{pooled.data(), false, b.select_budget}, h, stop - 1, b.first_position + b.T - 1,
            b.visible_before + b.T, b.first + b.T - 1);
    }
  if (!tree && !b.per_row && b.budget >= 0 && b.visible_before + b.T > b.budget) {
    for (int h = 0; h < H; ++h)
      evict(b, policy_ranking(b, h), h, stop - 1, b.first_position + b.T - 1, b.visible_before + b.T,
            b.first + b.T - 1);
  }
  // The block's rows enter the ring (only its last recent_slots rows survive there).
  if (b.recent_window) {
    const long row_bytes = (long)hd * (b.recent_bf16 ? 2 : 4), ring_bytes = b.recent_slots * row_bytes;
    for (int h = 0; h < H; ++h)
      for (int i = std::max(0, b.T - b.recent_slots); i < b.T; ++i) {
        const long at = ((long)h * b.T + i) * hd;
        const long to = h * ring_bytes + (b.first_position + i) % b.recent_slots * row_bytes;
        store(b.block_keys + at, hd, b.recent_bf16, static_cast<char*>(b.recent_keys) + to);
        store(b.block_values + at, hd, b.recent_bf16, static_cast<char*>(b.recent_values) + to);
      }
  }
}

std::string check_arena_pass(const ArenaStorage& a, const ArenaPass& p, int T, int n_heads) {
  auto str = [](int64_t x) { return std::to_string(x); };
  if (T < 1 || p.start < 0 || (int64_t)p.start + T > a.cap)
    return "rows [" + str(p.start) + ", " + str((int64_t)p.start + T) + ") outside the arena's " + str(a.cap) +
           " slots";
  if (n_heads < a.n_kv || n_heads % a.n_kv || n_heads / a.n_kv > kAttnMaxGroup)
    return str(n_heads) + " query heads for " + str(a.n_kv) + " KV heads";
  // Positions and ranks index the ranks' bitmap, the RoPE tables and the full-precision window's ring.
  if (p.first_position < 0 || p.visible_before < 0 || p.first < 0)
    return "first_position, visible_before and first must be >= 0";
  if (p.per_row && p.budget < 0) return "per_row evictions need a budget";
  if (p.snapshots < 0 || p.snapshots > T || (p.snapshots && (!a.scores || !a.row_scores ||
                                                              p.first + p.snapshots > a.row_score_rows)))
    return "score snapshots of rows past the arena's row_scores";
  if (a.heavy > 0 && !a.scores) return "a policy with heavy hitters needs scores";
  if (p.pool && (p.pool < 1 || p.pool % 2 == 0 || p.select_budget < 0 || !a.scores || p.budget >= 0 || p.per_row ||
                 p.parents))
    return "a retention window needs an odd pool, a budget of its own, scores, and no eviction of the policy's";
  if (p.recall && (!a.cold || p.parents || (a.cold->rank >= 0) != p.in_cache))
    return "recall needs the arena's cold tier, a chain, and the tier's position mode";
  if (p.parents) {
    int deepest = 0;
    std::vector<int> depth(T);
    for (int i = 0; i < T; ++i) {
      if (p.parents[i] < -1 || p.parents[i] >= i)
        return "row " + str(i) + " of a tree block names parent " + str(p.parents[i]) + ", not an earlier row or -1";
      depth[i] = p.parents[i] < 0 ? 0 : depth[p.parents[i]] + 1;
      deepest = std::max(deepest, depth[i]);
    }
    if (p.first != 0) return "a tree block must start from a committed state";
    if (a.recent_window > 0) return "a tree block cannot keep a full-precision window";
    if (T > a.row_evicted_rows) return "a tree block of more rows than the arena keeps evictions for";
    if (a.scores && (p.snapshots != T || !a.committed_scores))
      return "a tree block keeps every row's score snapshot and starts from the committed scores";
    if (!p.per_row && p.budget >= 0 && (int64_t)p.visible_before + deepest + 1 > p.budget)
      return "a tree block that fills the budget must evict row by row";
  }
  const int64_t newest_row = p.in_cache ? (int64_t)p.visible_before + T : p.first_position + T;
  if (!p.cos || !p.sin || p.table_offset < 0 || (p.in_cache && p.table_offset != 0) ||
      p.table_offset > (p.in_cache ? 0 : p.first_position) ||
      p.table_rows + p.table_offset < std::max<int64_t>(newest_row, p.in_cache ? (int64_t)p.start + T : 0))
    return "the RoPE tables do not cover the block's rows";
  return "";
}

void attend_arena_layer(int isa, const ArenaStorage& a, const ArenaPass& p, int layer, int n_heads, int T,
                        const float* q, const float* k, const float* v, bool bf16_keys, void* out, bool out_bf16) {
  const int hd = a.hd;
  const long layer_slots = (long)a.n_kv * a.cap;
  const long entry_bytes = a.code_bits ? code_bytes(hd, a.code_bits) : (long)hd * (a.bf16 ? 2 : 4);
  AttnBlock b;
  b.n_kv = a.n_kv;
  b.group = n_heads / a.n_kv;
  b.hd = hd;
  b.T = T;
  b.cap = a.cap;
  b.bf16 = a.bf16;
  b.keys = static_cast<char*>(a.keys) + layer * layer_slots * entry_bytes;
  b.values = static_cast<char*>(a.values) + layer * layer_slots * entry_bytes;
  if (a.code_bits) {
    const long layer_params = layer_slots * param_halves(hd, a.code_group);
    b.code_bits = a.code_bits;
    b.code_group = a.code_group;
    b.key_params = a.key_params + layer * layer_params;
    b.value_params = a.value_params + layer * layer_params;
    if (a.key_offset) b.key_offset = a.key_offset + (long)layer * a.n_kv * hd;
  }
  std::vector<float> block_keys, block_values;
  if (a.recent_window > 0) {
    const long layer_ring = (long)a.n_kv * a.recent_slots * hd * (a.recent_bf16 ? 2 : 4);
    b.recent_keys = static_cast<char*>(a.recent_keys) + layer * layer_ring;
    b.recent_values = static_cast<char*>(a.recent_values) + layer * layer_ring;
    b.recent_bf16 = a.recent_bf16;
    b.recent_window = a.recent_window;
    b.recent_slots = a.recent_slots;
    block_keys.resize((std::size_t)a.n_kv * T * hd);
    block_values.resize(block_keys.size());
    b.block_keys = block_keys.data();
    b.block_values = block_values.data();
  }
  b.positions = a.positions + layer * layer_slots;
  b.evicted_at = a.evicted_at + layer * layer_slots;
  if (a.scores) b.scores = a.scores + layer * layer_slots;
  if (p.snapshots > 0) {
    b.row_stride = (long)a.n_layers * layer_slots;
    b.row_scores = a.row_scores + p.first * b.row_stride + layer * layer_slots;
    b.snapshot_rows = p.snapshots;
  }
  b.start = p.start;
  b.first = p.first;
  b.visible_before = p.visible_before;
  b.first_position = p.first_position;
  b.per_row = p.per_row;
  b.budget = p.budget;
  b.sinks = a.sinks;
  b.heavy = a.heavy;
  b.window = a.window;
  b.age_normalised = a.age_normalised;
  b.score_decay = a.score_decay;
  b.scale = a.scale;
  if (p.in_cache) {
    b.cos = p.cos;
    b.sin = p.sin;
  }
  b.pool = p.pool;
  b.select_budget = p.select_budget;
  std::vector<int32_t> depths;
  if (p.parents) {
    for (int i = 0; i < T; ++i) depths.push_back(p.parents[i] < 0 ? 0 : depths[p.parents[i]] + 1);
    b.parents = p.parents;
    b.depths = depths.data();
    b.committed_scores = a.committed_scores ? a.committed_scores + layer * layer_slots : nullptr;
    b.row_evicted = a.row_evicted + (long)layer * a.n_kv;
    b.evicted_stride = (long)a.n_layers * a.n_kv;
  }
  std::vector<float> q_rotated((std::size_t)n_heads * T * hd);
  StageRows st;
  st.n_heads = n_heads;
  st.n_kv = a.n_kv;
  st.hd = hd;
  st.T = T;
  st.q = q;
  st.k = k;
  st.v = v;
  st.bf16_keys = bf16_keys;
  st.cos = p.cos;
  st.sin = p.sin;
  st.table_offset = p.table_offset;
  st.in_cache = p.in_cache;
  st.q_rotated = q_rotated.data();
  stage_rows(st, b);
  b.q = q_rotated.data();
  std::vector<float> out_f(out_bf16 ? (std::size_t)T * n_heads * hd : 0);
  b.out = out_bf16 ? out_f.data() : static_cast<float*>(out);
  std::vector<float> resident_lse(p.recall ? (std::size_t)T * n_heads : 0);  // what recall merges by
  b.lse = p.recall ? resident_lse.data() : nullptr;
  attend_block(isa, b);
  if (p.recall) recall_rows(*a.cold, a, p, layer, n_heads, T, q, b.out, b.lse);
  for (std::size_t i = 0; i < out_f.size(); ++i) static_cast<uint16_t*>(out)[i] = float_to_bf16(out_f[i]);
}

}  // namespace sparsespec
