"""One compact Llama-family decoder: Llama / SmolLM2, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm), Phi-3
(q/k/v and gate/up stored fused) and Gemma 3 (scaled embeddings, norms after attention and MLP, GELU(tanh) gate,
sliding-window layers), grouped-query attention.

A pass is one call into the native model (``kernels/csrc/model.h``) that runs every layer over the blocks' KV
arenas; the model knows nothing about caching policy: the arena stores each layer's keys and values and computes
attention (see ``cache/arena.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from . import kernels
from .cache.arena import KVArena
from .config import ModelConfig
from .errors import UserError
from .linear import NativeEmbedding, NativeLinear, make_linear, resolve_format


@dataclass(frozen=True)
class Block:
    """The rows one sequence feeds through a pass: ``tokens [T]`` (int64) staged in its own ``cache``.

    ``per_block``: evict once at the end of the block (prefill chunks) instead of after every row; ``last_only``:
    logits for the last row only (prefill); ``parents``: a tree of rows (``KVArena.begin``), None: a chain."""

    tokens: torch.Tensor
    cache: KVArena
    per_block: bool = False
    last_only: bool = False
    parents: list[int] | None = None


@dataclass
class DecoderLayer:
    """Weights of one block. ``qkv`` maps ``[T, hidden]`` to ``[T, (n_heads + 2 n_kv) head_dim]``;
    ``gate_up`` maps ``[T, hidden]`` to ``[T, 2 intermediate]``; ``q_norm`` / ``k_norm`` ``[head_dim]`` (Qwen3,
    Gemma 3; None elsewhere) RMS-normalise each query and key head before RoPE; ``attn_post_norm`` /
    ``mlp_post_norm`` ``[hidden]`` (Gemma 3) normalise the attention's and the MLP's outputs before the residual."""

    attn_norm: torch.Tensor
    qkv: object
    o_proj: object
    mlp_norm: torch.Tensor
    gate_up: object
    down: object
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_post_norm: torch.Tensor | None = None
    mlp_post_norm: torch.Tensor | None = None


def layer_norms(config: ModelConfig) -> tuple[tuple[str, str, str], ...]:
    """The norms of the config's layers: (:class:`DecoderLayer` field, Hugging Face name inside ``model.layers.{i}.``
    and GGUF name inside ``blk.{i}.``, both before ``.weight``). Llama's ``post_attention_layernorm`` is the norm
    before the MLP; Gemma's is the norm of the attention's output."""
    if config.gemma:
        norms = (("attn_norm", "input_layernorm", "attn_norm"),
                 ("attn_post_norm", "post_attention_layernorm", "post_attention_norm"),
                 ("mlp_norm", "pre_feedforward_layernorm", "ffn_norm"),
                 ("mlp_post_norm", "post_feedforward_layernorm", "post_ffw_norm"))
    else:
        norms = (("attn_norm", "input_layernorm", "attn_norm"), ("mlp_norm", "post_attention_layernorm", "ffn_norm"))
    if config.qk_norm:
        norms += (("q_norm", "self_attn.q_norm", "attn_q_norm"), ("k_norm", "self_attn.k_norm", "attn_k_norm"))
    return norms


class Transformer:
    """A decoder-only transformer with weights in ``dtype`` (float32 or bfloat16)."""

    def __init__(
        self,
        config: ModelConfig,
        state: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        weights: str = "dense",
        *,
        role: str = "target",
        linear_options: Mapping | None = None,
        linears: Mapping[str, object] | None = None,
    ):
        """Build from a Hugging Face-named state dict (``model.layers.0.self_attn.q_proj.weight`` …).

        ``weights`` selects the format of the large projections (see ``linear.py``): ``dense`` (alias ``bf16``),
        ``int8``, ``int4``, ``native`` or ``auto`` (chosen by ``role``, ``"target"`` or ``"draft"``; see
        :func:`~sparsespec.linear.auto_format`). Norms and the embedding stay in ``dtype``. ``linear_options`` go
        to :func:`~sparsespec.linear.make_linear` (``ggml_type`` for ``native``).

        ``linears`` holds projections built beforehand (the on-disk weight store, or the GGUF's own blocks for
        ``native``), keyed ``layers.{i}.qkv``, ``layers.{i}.o_proj``, ``layers.{i}.gate_up``, ``layers.{i}.down``,
        ``lm_head`` and optionally ``embed`` (an object indexed by token ids, e.g.
        :class:`~sparsespec.linear.NativeEmbedding`); those are used as they are and ``state`` needs only the norms
        (and the embedding unless given). :meth:`linear_items` lists them under the
        same keys.
        """
        self.config = config
        self.dtype = dtype
        self.vocab_limit = config.vocab_size  # token ids the head scores (see limit_vocabulary)
        self._native = None  # (what it was made of, the native pass's weights): native_model
        weights = resolve_format(weights, role)
        self.weights_format = weights
        options = dict(linear_options or {})
        prebuilt = dict(linears or {})

        def tensor(name: str) -> torch.Tensor:
            return state[name].to(dtype)

        def fused(key: str, names: list[str], bias: bool) -> object:
            if key in prebuilt:
                return prebuilt[key]
            w = torch.cat([state[n + ".weight"] for n in names], dim=0)
            b = torch.cat([state[n + ".bias"] for n in names], dim=0) if bias else None
            return make_linear(w, b, dtype, weights, **options)

        self.embed = prebuilt["embed"] if "embed" in prebuilt else tensor("model.embed_tokens.weight")
        self.layers: list[DecoderLayer] = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            if config.fused_projections:  # stored as the fused projections the layer computes
                attn, mlp = [p + "self_attn.qkv_proj"], [p + "mlp.gate_up_proj"]
            else:
                attn = [p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"]
                mlp = [p + "mlp.gate_proj", p + "mlp.up_proj"]
            norms = {field: tensor(f"{p}{name}.weight") for field, name, _ in layer_norms(config)}
            self.layers.append(
                DecoderLayer(
                    qkv=fused(f"layers.{i}.qkv", attn, config.attention_bias),
                    o_proj=fused(f"layers.{i}.o_proj", [p + "self_attn.o_proj"], False),
                    gate_up=fused(f"layers.{i}.gate_up", mlp, False),
                    down=fused(f"layers.{i}.down", [p + "mlp.down_proj"], False),
                    **norms,
                )
            )
        # Gemma scales embeddings by √hidden, rounded to the compute dtype as transformers does.
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5, dtype=dtype) if config.gemma else None
        self.norm = tensor("model.norm.weight")
        head = state.get("lm_head.weight")
        if "lm_head" in prebuilt:
            self.lm_head = prebuilt["lm_head"]
        elif (head is None or config.tie_word_embeddings) and weights == "dense":
            self.lm_head = make_linear(self.embed, None, dtype, weights)
            self.embed = NativeEmbedding(self.lm_head, dtype)  # the embedding reads the head's rows: one copy
        else:
            if head is None or config.tie_word_embeddings:
                head = state["model.embed_tokens.weight"]
            self.lm_head = make_linear(head, None, dtype, weights, **options)

    def limit_vocabulary(self, n: int) -> None:
        """Score only token ids below ``n``; the others get logit -inf (probability 0).

        For a draft: its head then reads ``n`` of its rows, a quarter of the 0.5B Qwen draft's bytes at full size.
        BPE ids follow merge order, so the first ids are the frequent tokens. Speculative decoding stays exact: the
        draft's q is 0 outside the first ``n`` ids and rejection sampling corrects for any q.
        """
        vocab = self.config.vocab_size
        if not 0 < n <= vocab:
            raise UserError(f"The draft vocabulary limit must be between 1 and {vocab} (got {n}).")
        self.lm_head = self.lm_head.first_rows(n)
        self.vocab_limit = n

    def native_model(self):
        """The weights as the native forward pass takes them (``kernels.native_model``): made on first use and again
        whenever a projection or its activations changed (a draft's cut head, float activations)."""
        linears = [linear for _, linear in self.linear_items()]
        norms = [getattr(layer, field) for layer in self.layers for field, _, _ in layer_norms(self.config)]
        key = [self.dtype, id(self.embed), id(self.norm), *map(id, norms),
               *((id(linear), getattr(linear, "float_activations", None)) for linear in linears)]
        if self._native is not None and self._native[0] == key:
            return self._native[1]
        native = kernels.native_model(self._native_spec())
        self._native = (key, native)
        return native

    def _native_spec(self) -> dict:
        """:meth:`native_model`'s description of the weights (``kernels.native_model`` says its fields)."""
        cfg = self.config

        def projection(linear: NativeLinear) -> tuple:
            return linear.blobs, linear.types, linear.rows, linear.padded_in, linear.bias, linear.float_activations

        layers = [{field: getattr(layer, field) for field in ("attn_norm", "mlp_norm", "q_norm", "k_norm",
                                                              "attn_post_norm", "mlp_post_norm")}
                  | {part: projection(getattr(layer, part)) for part in ("qkv", "o_proj", "gate_up", "down")}
                  for layer in self.layers]
        return dict(hidden=cfg.hidden_size, n_heads=cfg.num_attention_heads, n_kv=cfg.num_key_value_heads,
                    head_dim=cfg.head_dim, intermediate=cfg.intermediate_size, vocab=cfg.vocab_size,
                    eps=cfg.rms_norm_eps, bf16=self.dtype == torch.bfloat16, gelu=cfg.gemma,
                    embed_scale=None if self.embed_scale is None else float(self.embed_scale),
                    embed=projection(self.embed.table) if isinstance(self.embed, NativeEmbedding)
                    else self.embed.contiguous(), final_norm=self.norm, head=projection(self.lm_head),
                    layers=layers)

    def linear_items(self) -> list[tuple[str, object]]:
        """Every projection with its key for the ``linears`` argument of :class:`Transformer`, in model order."""
        items = []
        for i, layer in enumerate(self.layers):
            for part in ("qkv", "o_proj", "gate_up", "down"):
                items.append((f"layers.{i}.{part}", getattr(layer, part)))
        items.append(("lm_head", self.lm_head))
        return items

    def projection_parameters(self) -> int:
        """Weights of every projection and the output head: the model's size but for an untied embedding table."""
        return sum(linear.out_features * linear.in_features for _, linear in self.linear_items())

    def key_biases(self) -> torch.Tensor | None:
        """``[n_layers, n_kv_heads, head_dim]`` float32: each layer's key bias (Qwen2), or None (no biases).

        The KV arena stores quantized keys minus it (``cache/quant.py``): it is the same for every token, and a few
        of its channels are large enough to set the quantization step of every key."""
        cfg = self.config
        if not cfg.attention_bias:
            return None
        q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        shape = (cfg.num_key_value_heads, cfg.head_dim)
        return torch.stack([layer.qkv.bias[q_size : q_size + kv_size].float().view(shape) for layer in self.layers])

    @property
    def weight_nbytes(self) -> int:
        """Bytes of all weights as stored for computation."""
        total = self.embed.nbytes + self.norm.nbytes + self.lm_head.nbytes
        for layer in self.layers:
            total += sum(getattr(layer, field).nbytes for field, _, _ in layer_norms(self.config))
            total += sum(lin.nbytes for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
        if self.head_shares_embedding:
            total -= self.lm_head.nbytes
        return total

    @property
    def head_shares_embedding(self) -> bool:
        """Whether the output head reads the embedding's storage (tied embeddings, dense or native weights)."""
        return getattr(self.embed, "table", None) is self.lm_head

    def bytes_read_per_token(self) -> int:
        """Weight bytes one decode step streams from memory (every projection plus the head; one embedding row)."""
        total = self.lm_head.nbytes
        for layer in self.layers:
            total += sum(lin.nbytes for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
        return total

    def forward(
        self, tokens: torch.Tensor, cache: KVArena, *, per_block: bool = False, last_only: bool = False,
        parents: list[int] | None = None,
    ) -> torch.Tensor:
        """Run ``tokens: [T]`` (int64) through the model, staging them in ``cache`` (commit is the caller's job).

        Args:
            tokens: the new tokens, in order.
            cache: the KV arena; the rows stay in flight until ``cache.commit``.
            per_block: evict once at the end of the block (prefill chunks) instead of after every row.
            last_only: compute logits for the last row only (prefill).
            parents: the rows as a tree: row ``i`` follows row ``parents[i]`` (-1: the cache), and its logits are
                those of the autoregressive step along its path (``KVArena.begin``); None: a chain.

        Returns:
            ``[T, vocab]`` float32 logits (``[1, vocab]`` with ``last_only``).
        """
        return self.forward_blocks([Block(tokens, cache, per_block, last_only, parents)])[0]

    @torch.inference_mode()
    def forward_blocks(self, blocks: Sequence[Block]) -> list[torch.Tensor]:
        """Run several sequences' blocks in one pass: every projection reads its weights once for the rows of all
        blocks; each block attends over its own arena only.

        A row's logits do not depend on the other rows of the pass (the native kernels compute each row on its own),
        so a request decodes the same text alone and beside others. Each arena must appear at most once.

        Returns one ``[T_i, vocab]`` float32 tensor per block (``[1, vocab]`` with its ``last_only``).
        """
        for block in blocks:
            block.cache.begin(block.tokens.shape[0], per_block=block.per_block, parents=block.parents)
        scored = [1 if block.last_only else block.tokens.shape[0] for block in blocks]  # rows given logits
        arenas = [block.cache.native_pass() for block in blocks]
        logits = self.native_model().forward(
            [(block.tokens, block.last_only, *arena) for block, arena in zip(blocks, arenas)], kernels.ISA_AUTO)
        for block in blocks:
            block.cache.end()
        return [logits] if len(blocks) == 1 else list(logits.split(scored))
