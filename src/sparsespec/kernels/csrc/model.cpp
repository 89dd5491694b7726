// The decoder's forward pass in one call (model.h). Activations live in buffers of the compute dtype (bfloat16 bits,
// or float32), exactly as the tensors of model.py's forward_blocks hold them, and every step is the core of the op
// that forward_blocks calls for it: project (gguf_linear), rms_norm_rows (rms_norm), gated_rows (gated),
// attend_arena_layer (arena_attention).
#include "model.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <set>

#include "elementwise.h"
#include "qmatmul.h"

namespace sparsespec {
namespace {

// A row-major matrix of the compute dtype.
struct Rows {
  std::vector<char> bytes;
  long cols = 0;
  std::size_t elt = 4;

  void shape(long rows, long columns, bool bf16) {
    cols = columns;
    elt = bf16 ? 2 : 4;
    bytes.resize((std::size_t)rows * columns * elt);
  }
  char* row(long r) { return bytes.data() + (std::size_t)r * cols * elt; }
  void* data() { return bytes.data(); }
};

float widen(const void* data, bool bf16, long i) {
  return bf16 ? bf16_to_float(static_cast<const uint16_t*>(data)[i]) : static_cast<const float*>(data)[i];
}

void narrow_into(void* data, bool bf16, long i, float y) {
  if (bf16)
    static_cast<uint16_t*>(data)[i] = float_to_bf16(y);
  else
    static_cast<float*>(data)[i] = y;
}

// Scratch memory reused from pass to pass (per calling thread).
struct PassScratch {
  Rows x, x_next, normed, padded, qkv, attn, gate_up, act, branch, branch_normed, heads, heads_normed, scored;
  std::vector<float> q, k, v, embedding;
};

PassScratch& pass_scratch() {
  thread_local PassScratch s;
  return s;
}

// out = p(x) (+ residual), x [m, width] padded with zeros to p.k where the weight's rows are longer (NativeLinear's
// F.pad), every matrix in the compute dtype.
void apply(int isa, const Projection& p, Rows& x, long m, bool bf16, const void* residual, Rows& out, Rows& padded) {
  const void* input = x.data();
  if (p.k != x.cols) {
    padded.shape(m, p.k, bf16);
    std::fill(padded.bytes.begin(), padded.bytes.end(), 0);
    for (long r = 0; r < m; ++r) std::memcpy(padded.row(r), x.row(r), (std::size_t)x.cols * x.elt);
    input = padded.data();
  }
  out.shape(m, p.n_out, bf16);
  project(isa, p, input, (int)m, bf16, residual, out.data());
}

void norm(const NormWeight& w, Rows& x, long m, float eps, bool bf16, Rows& out) {
  out.shape(m, x.cols, bf16);
  rms_norm_rows(x.data(), m, x.cols, bf16, w.weight, w.bf16, eps, out.data());
}

// x + normed branch, each element rounded to the dtype (a bfloat16 add of two tensors): Gemma's post-norm skips.
void add_into(Rows& x, Rows& branch, long m, bool bf16) {
  for (long i = 0; i < m * x.cols; ++i)
    narrow_into(x.data(), bf16, i, widen(x.data(), bf16, i) + widen(branch.data(), bf16, i));
}

// Heads [n, rows, hd] of a block's rows of the q/k/v projection (column offset `column`), as float32, each head
// vector RMS-normed first (q/k norms) when `w` has a weight: the model's q.reshape(-1, hd) through rms_norm.
void gather_heads(Rows& qkv, long row0, int T, int n, long column, int hd, bool bf16, const NormWeight& w, float eps,
                  PassScratch& s, std::vector<float>& out) {
  out.resize((std::size_t)n * T * hd);
  if (!w.weight) {
    for (int h = 0; h < n; ++h)
      for (int i = 0; i < T; ++i) {
        const char* src = qkv.row(row0 + i) + (column + (long)h * hd) * qkv.elt;
        for (int d = 0; d < hd; ++d) out[((std::size_t)h * T + i) * hd + d] = widen(src, bf16, d);
      }
    return;
  }
  s.heads.shape((long)n * T, hd, bf16);
  for (int h = 0; h < n; ++h)
    for (int i = 0; i < T; ++i)
      std::memcpy(s.heads.row((long)h * T + i), qkv.row(row0 + i) + (column + (long)h * hd) * qkv.elt,
                  (std::size_t)hd * qkv.elt);
  norm(w, s.heads, (long)n * T, eps, bf16, s.heads_normed);
  for (std::size_t j = 0; j < out.size(); ++j) out[j] = widen(s.heads_normed.data(), bf16, (long)j);
}

// s.x += p(input), the branch normed by post_norm first where the model has one (Gemma 3), else the add done by the
// projection's write-back (model.py's _skip).
void skip(int isa, const Projection& p, Rows& input, const NormWeight& post_norm, long m, float eps, bool bf16,
          PassScratch& s) {
  if (!post_norm.weight) {
    apply(isa, p, input, m, bf16, s.x.data(), s.x_next, s.padded);
    std::swap(s.x, s.x_next);
    return;
  }
  apply(isa, p, input, m, bf16, nullptr, s.branch, s.padded);
  norm(post_norm, s.branch, m, eps, bf16, s.branch_normed);
  add_into(s.x, s.branch_normed, m, bf16);
}

std::string check_norm(const NormWeight& w, const char* what) {
  return w.weight ? "" : std::string("the model lacks its ") + what;
}

}  // namespace

std::string check_model(const ModelWeights& m) {
  auto str = [](long x) { return std::to_string(x); };
  if (m.hidden < 1 || m.n_heads < 1 || m.n_kv < 1 || m.head_dim < 2 || m.head_dim % 2 || m.intermediate < 1 ||
      m.vocab < 1 || m.n_heads % m.n_kv || m.head_dim > kAttnMaxHeadDim || m.n_heads / m.n_kv > kAttnMaxGroup)
    return "impossible shapes";
  if (m.layers.empty()) return "a model without layers";
  const long width = (long)(m.n_heads + 2 * m.n_kv) * m.head_dim;
  auto fits = [&](const Projection& p, long in, long out, const std::string& what) -> std::string {
    if (p.k < in || p.n_out != out)
      return what + " maps [" + str(p.k) + "] to [" + str(p.n_out) + "], not [" + str(in) + "] to [" + str(out) + "]";
    return "";
  };
  std::string problem;
  if (!m.dense_embed) {
    if (m.embed.types.size() != 1) return "an embedding is one segment";
    if (!(problem = fits(m.embed, m.hidden, m.vocab, "the embedding")).empty()) return problem;
  }
  if (m.head.n_out < 1 || m.head.n_out > m.vocab) return "a head of " + str(m.head.n_out) + " rows";
  if (!(problem = fits(m.head, m.hidden, m.head.n_out, "the head")).empty()) return problem;
  if (!(problem = check_norm(m.final_norm, "final norm")).empty()) return problem;
  for (std::size_t l = 0; l < m.layers.size(); ++l) {
    const LayerWeights& w = m.layers[l];
    const std::string at = "layer " + str((long)l) + "'s ";
    if (!(problem = fits(w.qkv, m.hidden, width, at + "q/k/v projection")).empty() ||
        !(problem = fits(w.o_proj, (long)m.n_heads * m.head_dim, m.hidden, at + "output projection")).empty() ||
        !(problem = fits(w.gate_up, m.hidden, 2L * m.intermediate, at + "gate/up projection")).empty() ||
        !(problem = fits(w.down, m.intermediate, m.hidden, at + "down projection")).empty())
      return problem;
    if (!w.attn_norm.weight || !w.mlp_norm.weight) return at + "norms are missing";
    if (!w.q_norm.weight != !w.k_norm.weight) return at + "q and k norms come together";
    if (!w.attn_post_norm.weight != !w.mlp_post_norm.weight) return at + "post-norms come together";
  }
  return "";
}

std::string check_blocks(const ModelWeights& m, const std::vector<BlockPass>& blocks) {
  if (blocks.empty()) return "no blocks";
  std::set<const ArenaStorage*> seen;
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    const BlockPass& block = blocks[b];
    const std::string at = "block " + std::to_string(b) + ": ";
    if (block.tokens.empty() || block.tokens.size() > (std::size_t)INT32_MAX) return at + "no tokens";
    for (int64_t t : block.tokens)
      if (t < 0 || t >= m.vocab) return at + "token id " + std::to_string(t) + " outside the vocabulary";
    if (block.route.size() != m.layers.size()) return at + "a route of another length than the layers";
    for (const auto& [storage, pass] : block.arenas) {
      if (!storage || !seen.insert(storage).second) return at + "an arena missing, or in two blocks";
      if (storage->n_kv != m.n_kv || storage->hd != m.head_dim) return at + "an arena of other heads";
      const std::string problem = check_arena_pass(*storage, pass, (int)block.tokens.size(), m.n_heads);
      if (!problem.empty()) return at + problem;
    }
    for (const auto& [arena, layer] : block.route)
      if (arena < 0 || arena >= (int)block.arenas.size() || layer < 0 ||
          layer >= block.arenas[(std::size_t)arena].first->n_layers)
        return at + "a layer routed outside its arenas";
  }
  return "";
}

long scored_rows(const std::vector<BlockPass>& blocks) {
  long n = 0;
  for (const BlockPass& b : blocks) n += b.last_only ? 1 : (long)b.tokens.size();
  return n;
}

void forward(int isa, const ModelWeights& m, const std::vector<BlockPass>& blocks, float* logits) {
  PassScratch& s = pass_scratch();
  const bool bf16 = m.bf16;
  const int hd = m.head_dim;
  long M = 0;
  for (const BlockPass& b : blocks) M += (long)b.tokens.size();

  // Embeddings: each token's row dequantized, cut to the hidden size, rounded to the dtype (and scaled, Gemma).
  s.x.shape(M, m.hidden, bf16);
  s.embedding.resize((std::size_t)std::max(m.embed.k, m.hidden));
  long r = 0;
  for (const BlockPass& b : blocks)
    for (int64_t token : b.tokens) {
      if (m.dense_embed)
        for (int j = 0; j < m.hidden; ++j) s.embedding[j] = widen(m.dense_embed, bf16, token * m.hidden + j);
      else
        dequantize_rows(m.embed.types[0], m.embed.blobs[0], m.embed.k, &token, 1, s.embedding.data());
      for (int j = 0; j < m.hidden; ++j) {
        float e = s.embedding[j];
        if (bf16) e = round_bf16(e);
        narrow_into(s.x.row(r), bf16, j, m.embed_scaled ? e * m.embed_scale : e);
      }
      ++r;
    }

  for (std::size_t l = 0; l < m.layers.size(); ++l) {
    const LayerWeights& w = m.layers[l];
    norm(w.attn_norm, s.x, M, m.eps, bf16, s.normed);
    apply(isa, w.qkv, s.normed, M, bf16, nullptr, s.qkv, s.padded);
    s.attn.shape(M, (long)m.n_heads * hd, bf16);
    long row0 = 0;
    for (const BlockPass& b : blocks) {
      const int T = (int)b.tokens.size();
      gather_heads(s.qkv, row0, T, m.n_heads, 0, hd, bf16, w.q_norm, m.eps, s, s.q);
      gather_heads(s.qkv, row0, T, m.n_kv, (long)m.n_heads * hd, hd, bf16, w.k_norm, m.eps, s, s.k);
      gather_heads(s.qkv, row0, T, m.n_kv, (long)(m.n_heads + m.n_kv) * hd, hd, bf16, NormWeight{}, m.eps, s, s.v);
      const auto& [arena, layer] = b.route[l];
      const auto& [storage, pass] = b.arenas[(std::size_t)arena];
      attend_arena_layer(isa, *storage, pass, layer, m.n_heads, T, s.q.data(), s.k.data(), s.v.data(), bf16,
                         s.attn.row(row0), bf16);
      row0 += T;
    }
    skip(isa, w.o_proj, s.attn, w.attn_post_norm, M, m.eps, bf16, s);
    norm(w.mlp_norm, s.x, M, m.eps, bf16, s.normed);
    apply(isa, w.gate_up, s.normed, M, bf16, nullptr, s.gate_up, s.padded);
    s.act.shape(M, m.intermediate, bf16);
    gated_rows(s.gate_up.data(), M, m.intermediate, bf16, m.gelu, s.act.data());
    skip(isa, w.down, s.act, w.mlp_post_norm, M, m.eps, bf16, s);
  }

  // The rows that get logits, the final norm, the head; ids past the head's rows (a draft's cut) get -inf.
  const long R = scored_rows(blocks);
  s.scored.shape(R, m.hidden, bf16);
  long out_row = 0, row0 = 0;
  for (const BlockPass& b : blocks) {
    const long T = (long)b.tokens.size();
    for (long i = b.last_only ? T - 1 : 0; i < T; ++i)
      std::memcpy(s.scored.row(out_row++), s.x.row(row0 + i), (std::size_t)m.hidden * s.x.elt);
    row0 += T;
  }
  norm(m.final_norm, s.scored, R, m.eps, bf16, s.normed);
  apply(isa, m.head, s.normed, R, bf16, nullptr, s.branch, s.padded);
  const long n = m.head.n_out;
  for (long i = 0; i < R; ++i) {
    float* row = logits + i * m.vocab;
    for (long j = 0; j < n; ++j) row[j] = widen(s.branch.data(), bf16, i * n + j);
    std::fill(row + n, row + m.vocab, -std::numeric_limits<float>::infinity());
  }
}

}  // namespace sparsespec
