"""The static KV arena: fixed buffers for every layer, staged rows, commit / rollback / compaction.

The arena is a native object (``kernels.native_arena``): its memory (``csrc/arena.h``: ``ArenaMemory``) owns every
buffer below, its ledger (``csrc/ledger.h``) keeps the counts (committed, in flight, positions, a hold's rows) and
decides what each block's rows do, and its verbs (begin, end, commit, hold, reset, copy) change them; the class here
holds it as :attr:`handle`, says what its owner chose (policy, sizes, retention, recall) once, and turns a block past
the arena's room into a :class:`UserError`. Python reads a buffer only through a view (:meth:`buffer`), for tests
and inspection. Layout (allocated once; only a retention hold, below, grows it for the length of a prompt,
and a full cache built with ``initial_tokens`` grows as it fills)::

    keys, values   [n_layers, n_kv_heads, capacity, head_dim]   kv_dtype: the compute dtype, bfloat16, or int8 /
                                                                int4 codes with per-group scales (``quant.py``)
    positions      [n_layers, n_kv_heads, capacity]             int64, original token positions
    scores         [n_layers, n_kv_heads, capacity]             float32, accumulated attention (H2O), if needed
    evicted_at     [n_layers, n_kv_heads, capacity]             int32, in-flight row that evicted the slot

``capacity = budget + staging`` for a budgeted policy, where staging is the most rows ever in flight (a prefill
chunk, or γ+1 verification rows); for the full cache it is the total number of tokens the caller asked for
(``max_tokens``) plus staging, or, with ``initial_tokens``, that many to start with: each commit that leaves less
than a staging's room doubles it (keeping the entries), up to ``max_tokens``. A conversation's cache then holds
what the conversation has used, not the model's whole context.

Life of a block of T new tokens (rows):

1. ``begin(T)``: the rows are *staged* in the slots after everything already in the arena.
2. ``attend(layer, q, k, v)`` for each layer: rows attend to what is visible to them. Row i sees exactly what an
   autoregressive step i would see: the committed tokens minus those evicted by earlier rows, plus rows ≤ i.
   After each row the policy may evict one token; eviction is only *logical* (``evicted_at``), nothing is
   overwritten while rows are in flight.
3. ``end()``; more blocks may follow (a draft model stages one row per step).
4. ``commit(m)``: keep the first m in-flight rows (m = 0 is a rollback). Scores and evictions of the dropped rows
   are undone and the buffers are compacted: surviving staged slots move into the holes left by evicted ones,
   row by row as one-row commits would place them, so the layout depends on the committed entries alone, not on
   how blocks delivered them. Slots are therefore not ordered by position; every rule here works from the stored
   positions. The commit runs in native code (``kernels/csrc/arena.h``), where the attention op finds the same
   layout rule (a verification row reads the slots in the order the commits before it would leave them).

Prefill chunks may instead evict once per block (``per_block=True``): all rows of the chunk see the cache as it
was before the chunk plus the causal part of the chunk, and eviction down to the budget happens at its end. This
is cheaper but not identical to token-by-token decoding (chunk size 1 is).

With retention (``retention.py``) a prompt's last tokens are read inside :meth:`hold`: the buffers grow to take
them all, their chunks evict nothing, and the chunk that ends the hold (the observation window) evicts down to the
budget by the attention its rows pay each entry; the buffers then shrink back to ``budget + staging`` slots.

With recall (``recall.py``) the entries a commit evicts move to a cold tier of int4 pages instead of being lost (the
native commit moves them; the tier is a native object owning its memory), and every row of a row-by-row block (not
a prefill chunk) also attends to the pages its query points at: the native op merges its attention over the resident
slots with its attention over the recalled entries by their log-sum-exps. Recall changes outputs only: scores,
evictions and slots are those of the arena without it.

Position modes: ``original`` rotates keys by their true positions when they are written (H2O); ``in-cache`` stores
keys unrotated and rotates them at attention time by their rank inside the cache (StreamingLLM), so no position
ever reaches ``budget + staging``. Quantized keys in the ``in-cache`` mode are stored minus the model's key bias
(``key_offset``; ``quant.py`` says why), which is a fixed vector there; in the ``original`` mode it has been rotated
with the key and stays in. The full cache, where the two modes coincide, stores keys rotated (``original``) except
int4 keys of a model with a key bias (``in-cache``).

int4 arenas also keep the most recent entries in full precision (``quant.RECENT_WINDOW``, 32 positions;
``quant.py`` says why): every row is kept, besides its codes, in the compute dtype (keys as the arena stores them
before quantizing: rotated in the original mode, else unrotated with the key bias in) in a ring of
``recent_slots`` entries per layer and KV head, at ``position % recent_slots``::

    recent_keys, recent_values   [n_layers, n_kv_heads, recent_slots, head_dim]   the compute dtype

and the row at position P reads the entries of positions above ``P - recent_window`` from there (its own block's
rows from the block, which reaches the ring when the block ends), the others from their codes. The rule is the
row's own, so a row reads the same entries in a prefill chunk, a decode step or a verification block.
``recent_slots = recent_window + max_inflight - 1``: a commit that drops up to ``max_inflight`` in-flight rows
leaves the window of the next row intact (dropping more rows is refused). The ring moves with positions, not slots,
so compaction leaves it alone; its bytes are part of :attr:`nbytes`.

The attention is a native op, the same code inside the native pass and alone as
:func:`sparsespec.kernels.arena_attention` (one call per layer and block; it also stores the block's rows,
quantizing them, and rotates queries and keys), for every KV dtype and policy; its portable
scalar path is the fallback on CPUs without the vector paths. Where the native kernels are not available (no
compiler, a failed build) no arena can be built: the constructor says so in one sentence (:func:`require_kernels`).
The op follows the rules above, and its one reference is the naive decoder of ``tests/test_arena_reference.py``,
which shares no code with the library.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from ..config import ModelConfig
from .. import kernels
from ..errors import ConfigError, UserError
from ..rope import Rope
from .policy import CachePolicy
from .quant import BITS, bytes_per_vector, check_kv_dtype, group_size, recent_window_for, storage_dtype
from .recall import Recall, cold_tier
from .retention import Retention

POSITION_MODES = ("original", "in-cache")
NEVER = torch.iinfo(torch.int32).max  # evicted_at value of a slot that is alive
# The refusal without the native kernels (tests/conftest.py skips a test that meets it where they may be missing).
NEEDS_KERNELS = "The KV cache's attention runs in the native kernels, which are not available here"


def require_kernels() -> None:
    """Raise :class:`ConfigError` in one sentence, naming why, where the native kernels are not available: the KV
    cache attends through them alone."""
    if not kernels.available():
        raise ConfigError(NEEDS_KERNELS + " ({reason}).", reason=kernels.unavailable_reason())


def check_key_storage(policy: CachePolicy, positions: str, kv_dtype: str, key_bias: bool) -> None:
    """Raise :class:`ConfigError` for int4 keys that would keep the model's key bias in: a budgeted cache in the
    original mode stores keys rotated, the bias with them, and the bias's large channels widen every group past
    what 4 bits resolve (``quant.py``)."""
    if key_bias and kv_dtype == "int4" and positions == "original" and not policy.is_full:
        raise ConfigError("int4 keys in the original position mode keep this model's key bias in, which breaks it "
                          "(perplexity over 1,000 on qwen2.5-coder-1.5b); use {positions} in-cache or int8 keys.")


class KVArena:
    """Fixed-size KV memory for all layers of one model, driven by a :class:`CachePolicy`."""

    def __init__(
        self,
        config: ModelConfig,
        policy: CachePolicy,
        *,
        dtype: torch.dtype,
        max_tokens: int | None = None,
        max_block: int = 1,
        max_inflight: int = 1,
        positions: str = "original",
        kv_dtype: str = "auto",
        key_offset: torch.Tensor | None = None,
        recent_window: int | None = None,
        retention: Retention | None = None,
        recall: Recall | None = None,
        initial_tokens: int | None = None,
    ) -> None:
        """
        Args:
            config: the model's shapes.
            policy: which entries to keep.
            dtype: the model's compute dtype (what attention reads the keys and values in).
            max_tokens: the full cache's capacity in tokens (required for ``policy.is_full``, ignored otherwise).
            max_block: the largest block of rows staged in one call (the prefill chunk).
            max_inflight: the most rows in flight before a commit (γ + 2 for speculative decoding); only these
                can be partially committed.
            positions: ``"original"`` or ``"in-cache"``.
            kv_dtype: how keys and values are stored: ``auto`` (in ``dtype``), ``bf16``, ``int8`` or ``int4``
                (see ``quant.py``). Quantization happens once, when a row is written; every reader sees the
                same stored entries, so commit / rollback / compaction and the row-by-row semantics are unchanged.
            key_offset: ``[n_layers, n_kv_heads, head_dim]``, the model's key bias (None without one): quantized
                keys are stored minus it (``quant.py``) where keys are stored before RoPE, the in-cache mode (which
                the full cache takes for int4 keys). In the original mode the stored keys are rotated, the bias
                with them, so it is not taken out there.
            recent_window: positions read in full precision (see the top); None: ``quant.RECENT_WINDOW``'s for
                ``kv_dtype`` (32 for int4, else 0). Only quantized entries can have one.
            retention: query-aware selection at the end of each prompt (``retention.py``, :meth:`hold`); None:
                prompts evict chunk by chunk as the policy says. Needs a policy with heavy hitters.
            recall: keep what is evicted in a cold tier that decode rows read back from (``recall.py``); None:
                evicted entries are gone. Needs a budgeted policy.
            initial_tokens: the full cache's room to start with (it grows as commits fill it, up to
                ``max_tokens``); None: all of ``max_tokens`` at once. Ignored by budgeted policies.
        """
        require_kernels()
        if positions not in POSITION_MODES:
            raise UserError(f"Unknown position mode {positions!r}; choose original or in-cache.")
        self.config = config
        self.policy = policy
        self.dtype = dtype
        # With nothing ever evicted, ranks inside the cache equal true positions: the modes coincide, and the full
        # cache rotates each key once, when it is written (original), unless its keys are int4 and the model has a
        # key bias: only keys stored before RoPE can be stored without the bias, and int4 keys with it in fail
        # (quant.py), so those take the in-cache mode, which rotates every key at every step (a cost in the attention's
        # time at long context; int8 keys keep the bias, at a small cost in perplexity):
        # benchmarks/history/source-notes.md#arena-full-cache-int4-keys
        if policy.is_full:
            positions = "in-cache" if key_offset is not None and kv_dtype == "int4" else "original"
        check_key_storage(policy, positions, kv_dtype, key_offset is not None)
        if retention is not None and not policy.needs_scores:
            raise ValueError("retention needs a policy with heavy hitters")
        self.retention = retention
        self.positions_mode = positions
        self.max_block = max_block
        self.max_inflight = max_inflight
        self.staging = max(max_block, max_inflight)
        self.max_tokens = max_tokens if policy.is_full else None  # the full cache's limit (it may start below)
        if policy.is_full:
            if max_tokens is None:
                raise ValueError("the full cache needs max_tokens")
            start = max_tokens if initial_tokens is None else max(1, min(initial_tokens, max_tokens))
            capacity = start + self.staging
        else:
            capacity = policy.budget + self.staging

        n_layers, n_kv, hd = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        self.kv_dtype = check_kv_dtype(kv_dtype)
        bits = BITS.get(kv_dtype)
        self.recent_window = recent_window_for(kv_dtype, recent_window)
        if self.recent_window < 0 or (self.recent_window and bits is None):
            raise ValueError(f"a full-precision window needs quantized entries and a size >= 0 "
                             f"(got {self.recent_window} with kv_dtype {kv_dtype})")
        self.recent_slots = self.ring_slots(self.recent_window, max_inflight)
        self.rope = Rope.for_model(config)
        self.scale = 1.0 / math.sqrt(config.query_pre_attn_scalar or hd)
        if recall is not None and policy.is_full:
            raise ValueError("recall needs a budgeted policy")
        # Recalled keys rotate by their true positions, or (in-cache) by the rank just after the sinks.
        cold = None if recall is None else cold_tier(
            n_layers, n_kv, hd, self.rope, self.scale, key_offset,
            rank=policy.sinks if self.positions_mode == "in-cache" else None, recall=recall)
        # Score snapshots after each in-flight row that a partial commit can end on (never the last possible row).
        row_score_rows = max(max_inflight - 1, 0) if policy.needs_scores else 0
        # Keys are stored before RoPE only in the in-cache mode: only there is the bias a fixed offset per channel.
        offset = key_offset if bits is not None and self.positions_mode == "in-cache" else None
        if offset is not None and tuple(offset.shape) != (n_layers, n_kv, hd):
            raise ValueError(f"key_offset must be [n_layers, n_kv_heads, head_dim], got {tuple(offset.shape)}")
        # The native arena (kernels.native_arena): the memory, the policy, and the verbs that change them.
        self.handle = kernels.native_arena(
            n_layers=n_layers, n_kv=n_kv, head_dim=hd, capacity=capacity, code_bits=bits or 0,
            code_group=group_size(hd, bits) if bits else 0,
            bf16=storage_dtype(kv_dtype, dtype) == torch.bfloat16,
            key_offset=None if offset is None else offset.float(), scores=policy.needs_scores,
            row_score_rows=row_score_rows, row_evicted_rows=max(max_inflight, 1),
            recent_window=self.recent_window, recent_slots=self.recent_slots, recent_bf16=dtype == torch.bfloat16,
            sinks=policy.sinks, heavy=policy.heavy, window=policy.window, age_normalised=policy.age_normalised,
            score_decay=policy.score_decay, scale=self.scale, inv_freq=self.rope.inv_freq,
            attention_factor=self.rope.attention_factor, cold=cold, budget=policy.budget,
            max_inflight=max_inflight, staging=self.staging, max_tokens=self.max_tokens,
            pool=retention.pool if retention is not None else 0, in_cache=self.positions_mode == "in-cache")

    @property
    def cold(self):
        """The cold tier (``kernels.cold_tier``) that commits retire evicted entries into, or None without recall."""
        return self.handle.cold

    def buffer(self, name: str) -> torch.Tensor:
        """A view of one of the arena's native buffers (``kernels.native_arena`` names them): for tests and
        inspection; writing into it changes the arena, and a resize leaves it viewing the old memory."""
        return self.handle.buffer(name)

    def buffers(self) -> dict[str, torch.Tensor]:
        """Views of every buffer this arena keeps, by name (:meth:`buffer`)."""
        return {name: self.handle.buffer(name) for name in self.handle.buffers}

    # ---------------------------------------------------------------------------------------------- retention
    def tokens_to_hold(self, n_prompt: int) -> int:
        """How many of the next ``n_prompt`` prompt tokens to read under :meth:`hold` (the last ones): none without
        retention or when the cache would evict nothing, else up to ``retention.max_held``."""
        if self.retention is None or self.n_visible + n_prompt <= self.policy.budget:
            return 0
        return min(n_prompt, self.retention.max_held)

    def observation_rows(self, n_held: int) -> int:
        """Rows of the observation window that ends a hold of ``n_held`` rows: ``retention.observation_rows``, or
        fewer where the hold or a block (``max_block``) is shorter."""
        return min(self.retention.observation_rows, n_held, self.max_block)

    @contextmanager
    def hold(self, n_tokens: int):
        """Read the next ``n_tokens`` prompt rows with nothing evicted, then choose what stays with the attention of
        the last of them (``retention.py``).

        Inside, the caller feeds the rows as per-block chunks and commits each; the block that completes the
        ``n_tokens`` is the observation window (it must hold :meth:`observation_rows` rows or more) and
        ends by evicting down to the budget. The arena grows to hold the rows and shrinks back to ``budget +
        staging`` slots on leaving (:attr:`peak_nbytes` records the peak); left early (an error), it is emptied.
        """
        if self.retention is None:
            raise ValueError("hold needs retention and a committed arena with no hold open")
        self.handle.hold(n_tokens, self.observation_rows(n_tokens))
        try:
            yield
        finally:
            self.handle.release_hold()

    # ----------------------------------------------------------------------------------------------- accounting
    # The counts are the native arena's (``csrc/ledger.h``).
    @property
    def n_committed(self) -> int:
        """Slots ``[0, n_committed)`` hold committed tokens."""
        return self.handle.committed

    @property
    def n_inflight(self) -> int:
        """Rows staged and not yet committed or dropped."""
        return self.handle.inflight

    @property
    def n_visible(self) -> int:
        """Tokens visible to the next row: committed survivors plus in-flight survivors."""
        return self.handle.visible

    @property
    def next_position(self) -> int:
        """True position of the next token to be committed."""
        return self.handle.next_position

    @property
    def evicted_tokens(self) -> int:
        """Tokens evicted (per layer and KV head) by committed rows."""
        return self.handle.evicted_tokens

    @property
    def capacity(self) -> int:
        """Slots per layer and KV head (``budget + staging``; a hold or a growing full cache changes it)."""
        return self.handle.capacity

    @property
    def evicts_per_row(self) -> bool:
        """Whether the block begun last has its rows evict between them (not once, after the block)."""
        return self.handle.evicts_per_row

    @property
    def block_mode(self) -> str:
        """What the block begun last does as it attends: ``evict`` (as the policy says), ``hold`` (a hold's chunk:
        nothing) or ``select`` (the chunk that ends a hold: retention chooses what stays)."""
        return self.handle.block_mode

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value buffers (the KV cache proper), staging slots, quantization scales and the
        full-precision ring included: ``n_layers * n_kv_heads * (capacity * bytes_per_slot(config, kv_dtype, dtype)
        + recent_slots * bytes_per_slot(config, "auto", dtype))``."""
        return self.handle.nbytes

    @property
    def peak_nbytes(self) -> int:
        """The most bytes the KV buffers have held (:attr:`nbytes`; retention holds whole prompts) since the arena was
        made or :meth:`restart_peak`."""
        return self.handle.peak_nbytes

    def restart_peak(self) -> None:
        """Make :attr:`peak_nbytes` count from now (a run's own peak)."""
        self.handle.restart_peak()

    @staticmethod
    def bytes_per_slot(config: ModelConfig, kv_dtype: str, dtype: torch.dtype) -> int:
        """Bytes of one slot's key and value in one layer and KV head."""
        return 2 * bytes_per_vector(kv_dtype, config.head_dim, dtype)

    @staticmethod
    def ring_slots(recent_window: int, max_inflight: int) -> int:
        """Entries of the full-precision ring per layer and KV head (0 without a window)."""
        return recent_window + max(max_inflight, 1) - 1 if recent_window else 0

    @classmethod
    def nbytes_for(cls, config: ModelConfig, kv_dtype: str, dtype: torch.dtype, slots: int, max_inflight: int = 1,
                   recent_window: int | None = None) -> int:
        """:attr:`nbytes` of an arena of ``slots`` slots (budget + staging) with the full-precision ring of
        ``recent_window`` positions (None: ``kv_dtype``'s default) for ``max_inflight`` rows in flight."""
        heads = config.num_hidden_layers * config.num_key_value_heads
        ring_slots = cls.ring_slots(recent_window_for(kv_dtype, recent_window), max_inflight)
        ring = ring_slots * cls.bytes_per_slot(config, "auto", dtype)
        return heads * (slots * cls.bytes_per_slot(config, kv_dtype, dtype) + ring)

    @classmethod
    def budget_for_bytes(cls, config: ModelConfig, kv_dtype: str, dtype: torch.dtype, nbytes: int,
                         staging: int, max_inflight: int = 1, recent_window: int | None = None) -> int:
        """The largest budget whose arena of ``budget + staging`` slots (:meth:`nbytes_for`) keeps :attr:`nbytes`
        within ``nbytes`` (may be below 1 when even the staging slots do not fit)."""
        fixed = cls.nbytes_for(config, kv_dtype, dtype, 0, max_inflight, recent_window)
        per_slot = cls.bytes_per_slot(config, kv_dtype, dtype) * config.num_hidden_layers * config.num_key_value_heads
        return (nbytes - fixed) // per_slot - staging

    @property
    def metadata_nbytes(self) -> int:
        """Bytes of the per-slot bookkeeping (positions, scores, eviction marks, row snapshots)."""
        return self.handle.metadata_nbytes

    # ------------------------------------------------------------------------------------------------- blocks
    def begin(self, n_rows: int, per_block: bool = False, parents: list[int] | None = None) -> None:
        """Stage ``n_rows`` new tokens (the model's forward pass calls this before its layers).

        ``parents``: a tree block (``kernels/csrc/attention.h``): row ``i`` follows row ``parents[i]`` of the block
        (-1: the committed tokens; a parent precedes its children), sees the committed tokens and its ancestors, and
        computes what the autoregressive step along its path computes; :meth:`commit_path` then keeps one path. A
        tree block starts from a committed state and is the only block in flight until then.

        The native arena's ledger (``csrc/ledger.h``) decides what the rows do in every layer (their slots, what they
        see, whether the policy evicts between them, retention's selection, recall) and raises ValueError for a
        block its state or rules refuse; a block past the arena's room is the caller's :class:`UserError`."""
        if n_rows > self.handle.room:
            raise UserError(
                f"The KV cache holds {self.capacity} tokens and this run needs more; "
                "use a budgeted policy or a shorter prompt / fewer new tokens."
            )
        self.handle.begin(n_rows, per_block, parents)

    def takes_tree(self, n_rows: int) -> bool:
        """Whether a tree block of ``n_rows`` rows can begin now."""
        return self.handle.tree_refusal(n_rows) is None

    def native_pass(self) -> tuple[list, list[tuple[int, int]]]:
        """The open block as the native forward pass takes it (``kernels.native_model``): ``([native arena],
        route)``, the route each model layer's place in it."""
        return [self.handle], self._route

    @property
    def _route(self) -> list[tuple[int, int]]:
        """Every layer of the model in this arena, under its own index."""
        return [(0, layer) for layer in range(self.config.num_hidden_layers)]

    def end(self) -> None:
        """Close the block opened by :meth:`begin` (after the last layer): its rows are in flight."""
        self.handle.end()

    def commit(self, n_rows: int) -> None:
        """Accept the first ``n_rows`` in-flight rows, drop the rest, and compact the buffers.

        After ``commit(m)`` the arena equals the arena of an autoregressive run that fed exactly those rows. The
        native commit (``kernels/csrc/arena.h``) moves what the kept rows evicted to the cold tier (with recall),
        makes the scores the last kept row's and lays the survivors out as one-row commits would; a full cache that
        started below its ``max_tokens`` then doubles its room once less than a staging's worth is left.
        """
        self.handle.commit(n_rows)

    def commit_path(self, path: list[int]) -> None:
        """Accept the rows ``path`` of the tree block in flight (a root first, each the parent of the next), drop the
        others: the arena then equals the arena of an autoregressive run that fed the path's tokens."""
        self.handle.commit_path(path)

    def reset(self) -> None:
        """Forget every token, keeping the buffers: the arena is as freshly built (stale slots are never read, since
        every slot is written when its row is staged)."""
        self.handle.reset()

    def rollback(self) -> None:
        """Drop every in-flight row, restoring the committed state exactly."""
        self.commit(0)

    # ---------------------------------------------------------------------------------------------- attention
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of the open block's rows in one layer, updating that layer's scores and evictions: the native
        pass's attention step as one call, for the per-op reference pass of the tests and for timing the op alone.

        Args:
            layer: layer index.
            q: ``[n_heads, T, head_dim]`` queries, not yet rotated.
            k: ``[n_kv_heads, T, head_dim]`` keys of the new rows, not yet rotated.
            v: ``[n_kv_heads, T, head_dim]`` values of the new rows.

        Returns:
            ``[T, n_heads * head_dim]`` attention output.
        """
        return kernels.arena_attention(self.handle, layer, q, k, v)
