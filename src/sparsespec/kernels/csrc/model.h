// The decoder's forward pass in one call (torch-free core): embedding, every layer (norms, the fused q/k/v
// projection with its bias, q/k norms, attention over the KV arenas, the output projection, the gated MLP,
// residuals, Gemma 3's norms after attention and MLP), the final norm and the head, for the rows of one or several
// sequences. The steps, their order and their roundings are those of sparsespec/model.py's Transformer.forward_blocks
// on native weights, so a pass here gives the same bits as that one (tests/test_native_pass.py).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "attention.h"
#include "project.h"

namespace sparsespec {

// A norm's weight [n], float32 or bfloat16; null where the model has no such norm.
struct NormWeight {
  const void* weight = nullptr;
  bool bf16 = false;
};

struct LayerWeights {
  NormWeight attn_norm, mlp_norm;
  NormWeight q_norm, k_norm;                  // per head [head_dim] (Qwen3, Gemma 3)
  NormWeight attn_post_norm, mlp_post_norm;   // of the attention's and the MLP's outputs (Gemma 3)
  Projection qkv;      // [hidden] -> [(n_heads + 2 n_kv) head_dim]
  Projection o_proj;   // [n_heads head_dim] -> [hidden]
  Projection gate_up;  // [hidden] -> [2 intermediate], gate then up
  Projection down;     // [intermediate] -> [hidden]
};

struct ModelWeights {
  int hidden = 0, n_heads = 0, n_kv = 0, head_dim = 0, intermediate = 0, vocab = 0;
  float eps = 1e-6f;
  bool bf16 = false;   // the compute dtype: activations rounded to bfloat16 between steps (else float32)
  bool gelu = false;   // the MLP's gate: GELU with the tanh approximation (Gemma), else SiLU
  bool embed_scaled = false;
  float embed_scale = 1.0f;  // Gemma: embeddings times this (already rounded to the compute dtype)
  Projection embed;          // one segment: a token's row, its first `hidden` values the embedding; or
  const void* dense_embed = nullptr;  // [vocab, hidden] in the compute dtype (then `embed` is unused)
  NormWeight final_norm;
  Projection head;           // [hidden] -> the first head.n_out token ids (a draft's cut); the rest get -inf
  std::vector<LayerWeights> layers;
};

// The reason `m` cannot run (sizes that disagree), or "".
std::string check_model(const ModelWeights& m);

// One sequence's rows in a pass: its tokens, whether only its last row gets logits, and per model layer the arena
// (an index into `arenas`) and that arena's layer that holds it (Gemma 3 keeps its sliding-window layers in an
// arena of their own: cache/layered.py).
struct BlockPass {
  std::vector<int64_t> tokens;
  bool last_only = false;
  std::vector<std::pair<const ArenaStorage*, ArenaPass>> arenas;
  std::vector<std::pair<int, int>> route;  // [n_layers] (arena index, layer in that arena)
};

// The reason `blocks` cannot run through `m` (token ids, routes, arena passes), or "".
std::string check_blocks(const ModelWeights& m, const std::vector<BlockPass>& blocks);

// Rows that get logits: each block's rows, or its last with last_only.
long scored_rows(const std::vector<BlockPass>& blocks);

// Run the blocks through the model: their rows enter the arenas (as KVArena.attend stores and evicts them) and
// logits [scored_rows, vocab] float32 come out, the blocks' in order.
void forward(int isa, const ModelWeights& m, const std::vector<BlockPass>& blocks, float* logits);

}  // namespace sparsespec
