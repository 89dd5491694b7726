"""Native CPU kernels: build, load, and the Python face of the ops (the rest of the engine calls only this module).

The C++ sources in ``csrc/`` are compiled with ``torch.utils.cpp_extension`` (ninja and the system C++ compiler)
into ``$SPARSESPEC_HOME/kernels/<hash of sources and toolchain>/``, so a later start loads the built library at once:
by ``sparsespec fetch`` (the set-up command), else on first use, each time with a line saying so. The instruction
set is chosen at run time from what the CPU offers (AVX-512 VNNI, AVX2, NEON dot product, else portable scalar
code). Every path of the matmul computes the same canonical sums, bit for bit, for a given weight layout
(``csrc/qmatmul.h``); the attention op's paths each agree with the naive reference decoder
(``tests/test_arena_reference.py``) to float rounding, not with one another bit for bit (``csrc/attention.h``).

The KV cache attends through these kernels alone (their portable scalar code is the fallback where no vector path
runs). Without a compiler :func:`available` is False and one warning line says why: nothing decodes (the cache
refuses in one sentence, ``cache/arena.py``).

``SPARSESPEC_KERNELS`` set to an instruction set's name (``scalar``, ``avx2``, ``avx512-vnni``, ``avx512-vnni+amx``,
``neon-dotprod``) runs the native kernels on that one instead of the best (A/B runs: the matmul's results are the
same bit for bit, the attention's to float rounding, and ``scalar`` also loads the weights in rows rather than column
tiles, which sum in another order).

Ops (functions of the extension module, called here: not through the torch dispatcher, which adds a fixed cost to
every call; benchmarks/history/source-notes.md#kernels-dispatcher):

* ``gguf_linear(x [m, k], weights, types, rows, k, bias, isa) -> [m, n]`` (x's dtype): ``x`` times the transpose of a
  weight kept in GGUF block formats (repacked by :mod:`.repack`, in rows or, for Q4_K, Q6_K and Q5_0 on x86, in tiles
  of 16 columns), activations quantized to 8 bits per block of 32 (256 for the K-quants); or in a float type (F32,
  F16, BF16: rows as stored), which multiplies the activations as they are.
* ``gguf_dequantize(weight, type, k, index [j]) -> [j, k] float32``: rows of such a weight as floats.
* ``native_arena(...)``: a KV arena owning its memory, with its policy, its counts and the rules of its blocks
  (``csrc/ledger.h``), as a handle; ``begin`` / ``end`` a block, ``commit`` accepts in-flight rows and compacts the
  buffers (``csrc/arena.h``), moving what they evicted into the arena's cold tier (``cold_tier(...)``, which owns its
  memory too: ``csrc/recall.h``). ``rope_rows(...)``: the RoPE rows every rotation reads (``csrc/rope.h``).
* ``arena_attention(arena, layer, q, k, v) -> [T, n_heads * head_dim]``: a block of rows entering one layer of
  the KV arena (RoPE, stored keys and values) and attending over it, with the cache policy's scores and evictions
  (:func:`arena_attention`; ``csrc/attention.h``). AVX-512, AVX2 and scalar paths (scalar on ARM); each row's float
  steps never depend on the rows beside it.
* ``rms_norm(x, weight, eps)`` and ``gated(gate_up, gelu)``: the decoder's element-wise steps in one op each (the
  decode step of a small model is otherwise dominated by per-op overhead).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
import warnings
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import torch

KERNELS_ENV = "SPARSESPEC_KERNELS"
CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    "ops.cpp", "ops_layer.cpp", "qmatmul_scalar.cpp", "qmatmul_avx2.cpp", "qmatmul_avx512.cpp", "qmatmul_amx.cpp",
    "qmatmul_neon.cpp", "fmatmul.cpp", "fmatmul_avx2.cpp", "fmatmul_avx512.cpp", "fmatmul_neon.cpp", "project.cpp",
    "attention.cpp", "attention_scalar.cpp", "attention_avx2.cpp", "attention_avx512.cpp", "elementwise.cpp",
    "norm.cpp", "recall.cpp", "arena.cpp", "ledger.cpp", "model.cpp",
)
ISA_AUTO, ISA_SCALAR, ISA_AVX2, ISA_AVX512, ISA_NEON, ISA_AMX = -1, 0, 1, 2, 3, 4
CFLAGS = ["-O3", "-std=c++20", "-ffp-contract=off", "-fopenmp"]


def _build_dir() -> Path:
    from ..loading.fixtures import cache_dir

    digest = hashlib.sha256()
    for name in sorted(p.name for p in CSRC.iterdir()):
        digest.update(name.encode() + b"\0" + (CSRC / name).read_bytes())
    # The sources' location too: torch's builder rebuilds a folder whenever the paths it was built from change, so
    # two installs sharing one folder would rebuild it (a minute) each time they take turns.
    digest.update(f"{torch.__version__}\0{sys.version_info[:2]}\0{' '.join(CFLAGS)}\0{CSRC.resolve()}".encode())
    return cache_dir() / "kernels" / digest.hexdigest()[:16]


# No build takes this long (about a minute here); a build lock this old was left by a process that was killed.
STALE_LOCK_SECONDS = 15 * 60


def wait_for_other_build(folder: Path, stale_after: float = STALE_LOCK_SECONDS) -> None:
    """Wait while another process builds into ``folder`` (torch's ``folder/lock``), but not on a lock older than
    ``stale_after`` seconds: a build killed outright (SIGKILL, a power cut) leaves its lock behind, and torch
    would make every later start wait on it forever. Such a lock is removed with a warning."""
    lock = folder / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > stale_after:
            print(f"sparsespec: warning: removing a build lock left {age / 60:.0f} minutes ago by an interrupted "
                  f"build ({lock}).", file=sys.stderr)
            lock.unlink(missing_ok=True)
            return
        time.sleep(1.0)


ISA_NAMES = {"scalar": ISA_SCALAR, "avx2": ISA_AVX2, "avx512-vnni": ISA_AVX512, "avx512-vnni+amx": ISA_AMX,
             "neon-dotprod": ISA_NEON}


def _chosen_isa() -> int:
    """The instruction set ``SPARSESPEC_KERNELS`` names (ISA_AUTO when unset or ``native``)."""
    from ..errors import UserError

    value = os.environ.get(KERNELS_ENV, "").strip().lower()
    if value in ("", "native"):
        return ISA_AUTO
    if value not in ISA_NAMES:
        raise UserError(f"{KERNELS_ENV}={value} names no kernels; use native or one of {', '.join(ISA_NAMES)}.")
    return ISA_NAMES[value]


def _failure_reason(exc: Exception) -> str:
    """The line of a failed build that says why: a failed build's message is ninja's log, which ends in "ninja:
    build stopped", so the compiler's first error, else the log's last other line (a shell's "not found")."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if len(lines) > 1 and lines[-1].startswith("ninja: build stopped"):
        lines.pop()
    return next((line for line in lines if "error:" in line), lines[-1])


LIBRARY = "sparsespec_kernels.so"  # what a finished build leaves in its folder


def built() -> bool:
    """Whether the kernels for these sources and this toolchain are already built (loading them takes no build)."""
    return (_build_dir() / LIBRARY).is_file()


def _import_finished_build(folder: Path):
    """The extension in ``folder`` when a finished build left it there, else None.

    The folder's name keys these sources, toolchain and location (:func:`_build_dir`), so a library in it is current:
    importing it directly skips importing the builder and its up-to-date check, a cost every start would pay:
    benchmarks/history/source-notes.md#kernels-direct-import"""
    import importlib.machinery
    import importlib.util

    path = folder / LIBRARY
    loader = importlib.machinery.ExtensionFileLoader("sparsespec_kernels", str(path))
    try:
        module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(path.stem, path, loader=loader))
        loader.exec_module(module)
    except ImportError:  # damaged or foreign: the builder rebuilds it
        return None
    return module


@lru_cache(maxsize=1)
def _load():
    """The compiled extension module, or the reason it is unavailable (a string)."""
    isa = _chosen_isa()
    try:
        folder = _build_dir()
        folder.mkdir(parents=True, exist_ok=True)
        wait_for_other_build(folder)
        module = _import_finished_build(folder) if built() else None
        building = module is None
        if building:
            print(f"sparsespec: building native kernels (once, about a minute) in {folder}", file=sys.stderr)
            started = time.perf_counter()
            from torch.utils import cpp_extension

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = cpp_extension.load(
                    name="sparsespec_kernels",
                    sources=[str(CSRC / s) for s in SOURCES],
                    extra_cflags=CFLAGS,
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(folder),
                    verbose=False,
                )
    except Exception as exc:  # no compiler, no ninja, a failed build: said once; what needs the kernels refuses
        reason = _failure_reason(exc)
        print(f"sparsespec: warning: native kernels unavailable ({reason[:200]}); no model can decode without them.",
              file=sys.stderr)
        return reason
    if building:
        print(f"sparsespec: native kernels built in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    if not module.set_isa(isa):
        from ..errors import UserError

        raise UserError(f"{KERNELS_ENV}={os.environ[KERNELS_ENV].strip()}: this CPU does not run that instruction "
                        f"set (the best here is {module.isa_name(module.best_isa())}).")
    return module


def available() -> bool:
    """Whether the native kernels are built and loaded (building them on first call)."""
    return not isinstance(_load(), str)


def unavailable_reason() -> str | None:
    module = _load()
    return module if isinstance(module, str) else None


def isa_available(isa: int) -> bool:
    return available() and bool(_load().isa_available(isa))


def isa_name(isa: int = ISA_AUTO) -> str:
    module = _load()
    return module.isa_name(module.best_isa() if isa == ISA_AUTO else isa)


def tiles_preferred() -> bool:
    """Whether Q4_K / Q6_K / Q5_0 weights load as 16-column tiles (``repack.pack``): where an x86 vector path runs them
    (their ARM path is the scalar one, so ARM keeps the row layout and its NEON kernels)."""
    return available() and _load().best_isa() in (ISA_AVX2, ISA_AVX512, ISA_AMX)


def amx_tile_passes() -> int:
    """How many column ranges the AMX kernels have multiplied in this process (0 where AMX does not run)."""
    return int(_load().amx_tile_passes())


def weight_bytes(kernel_type: int, k: int, rows: int) -> int:
    """Bytes of a repacked weight of ``rows`` rows of ``k`` inputs (either layout)."""
    return int(_load().weight_bytes(kernel_type, k, rows))


def info() -> str:
    """One line: which kernels, which instruction set, how many threads, and where the native build is."""
    threads = torch.get_num_threads()
    if not available():
        return f"kernels: unavailable ({unavailable_reason()}), {threads} threads"
    return f"kernels: native ({isa_name()}), {threads} threads; built in {_build_dir()}"


def gguf_linear(x2d: torch.Tensor, weights: list[torch.Tensor], types: list[int], rows: list[int], k: int,
                bias: torch.Tensor | None = None, isa: int = ISA_AUTO, float_activations: bool = False,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """``[m, k] -> [m, sum(rows)]`` (the dtype of ``x``, float32 or bfloat16) through weights in repacked GGUF
    blocks (see :mod:`.repack`); ``bias`` float32 ``[sum(rows)]``. The activations are quantized to 8 bits per
    block (``csrc/qmatmul.h``), or with ``float_activations`` multiply as they are (``csrc/fmatmul.h``: row
    layouts only, no column tiles). ``residual [m, sum(rows)]`` (the dtype of ``x``) is added to the product as
    it is written, bit for bit ``residual + product``."""
    return _load().gguf_linear(x2d, weights, types, rows, k, bias, isa, float_activations, residual)


def gguf_dequantize(weight: torch.Tensor, ggml_type: int, k: int, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index [j]`` of a repacked weight as float32 ``[j, k]``."""
    return _load().gguf_dequantize(weight, ggml_type, k, index)


def arena_attention(arena, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    isa: int = ISA_AUTO) -> torch.Tensor:
    """The open block's ``T`` rows entering one layer of the KV arena and attending over it (see ``cache/arena.py``).

    The op stores the rows (keys rotated by true position in the original mode, else as given; values; positions
    ``first_position + i``; alive; scores 0) at slots ``[start, start + T)``, rotates the queries (true position, or
    rank in the cache: the tokens visible before the row), and attends: row ``i`` sees the slots ``s <= start + i``
    that are alive; after it (``per_row``) or after the block (if ``visible_before + T`` exceeds ``budget``) the
    policy's evictions are marked in ``evicted_at`` with the in-flight row index ``first + i``; row ``i``'s scores go
    to ``row_scores[first + i]`` for ``i < snapshots``. Quantized entries are written as ``cache/quant.py`` defines
    them and read as ``fma(code, scale, zero)`` (plus the key offset) in float32; with a full-precision window, each
    new row is also kept in the ring at ``position % R`` and row ``i`` reads the entries of positions above
    ``first_position + i - recent_window`` from there (its block's own rows from the block).

    Args:
        arena: a :func:`native_arena` with a block of ``T`` rows open (its ``begin``, which ``KVArena.begin``
            calls): its ledger (``csrc/ledger.h``) decided the block's slots and in-flight rows, whether the policy
            evicts after every row or after the block, the rows keeping score snapshots, a tree's parents,
            retention's observation window and recall; queries and keys rotate by the arena's own RoPE rows
            (:func:`rope_rows`).
        q: ``[n_heads, T, head_dim]``; k, v: ``[n_kv, T, head_dim]``: before RoPE, float32 or bfloat16, any strides.

    Returns:
        ``[T, n_heads * head_dim]`` attention output in the dtype of ``q``.
    """
    return _load().arena_attention(arena, layer, q, k, v, isa)


def cold_tier(n_layers: int, n_kv: int, head_dim: int, inv_freq: Sequence[float], attention_factor: float,
              scale: float, key_offset: torch.Tensor | None, rank: int, pages: int, page_size: int):
    """A cold tier for an arena of ``n_layers`` x ``n_kv`` heads of ``head_dim`` channels, owning its memory
    (``cache/recall.py`` describes it; ``csrc/recall.h``). Handed to :func:`native_arena`, it receives what each
    commit evicts, and the rows of row-by-row blocks recall from it.

    Args:
        inv_freq: ``head_dim / 2`` float32 values and ``attention_factor``: the model's RoPE (``rope.py``;
            :func:`rope_rows`).
        key_offset: float32 ``[n_layers, n_kv, head_dim]`` the model's key bias, or None.
        rank: the in-cache mode's first recalled rank, or -1: keys rotate by their true positions.
        pages: pages of ``page_size`` entries each row recalls.

    The handle's ``count``, ``nbytes``, ``reset()``, ``entries(layer)``, ``positions(layer)``, ``summaries(layer)``
    (copies of its buffers), ``append(keys, values, positions)`` (``[n_layers, n, n_kv, head_dim]`` float32, keys
    unrotated with the bias in; positions int64 ``[n_layers, n, n_kv]``) and ``recall_row(layer, query, query_row,
    out, lse)`` (one row's recall from the stored entries, merged into ``out`` by the log-sum-exps ``lse``).
    """
    return _load().cold_tier(n_layers, n_kv, head_dim, inv_freq, attention_factor, scale, key_offset, rank, pages,
                             page_size)


def native_arena(*, n_layers: int, n_kv: int, head_dim: int, capacity: int, code_bits: int = 0, code_group: int = 0,
                 bf16: bool = False, key_offset: torch.Tensor | None = None, scores: bool = False,
                 row_score_rows: int = 0, row_evicted_rows: int = 0, recent_window: int = 0, recent_slots: int = 0,
                 recent_bf16: bool = False, sinks: int = 0, heavy: int = 0, window: int = 0,
                 age_normalised: bool = False, score_decay: float = 1.0, scale: float = 1.0,
                 inv_freq: Sequence[float], attention_factor: float = 1.0, cold=None, budget: int | None = None,
                 max_inflight: int = 1, staging: int = 1, max_tokens: int | None = None, pool: int = 0,
                 in_cache: bool = False):
    """A KV arena owning its memory (``csrc/arena.h``: ``ArenaMemory``), every slot empty, its policy and the rules
    of its blocks (``csrc/ledger.h``), checked once. :func:`arena_attention` and the native pass attend through it.

    Args:
        n_layers, n_kv, head_dim, capacity: ``n_layers`` x ``n_kv`` heads of ``capacity`` slots of ``head_dim``
            channels.
        code_bits, code_group: entries stored as 8- or 4-bit codes with float16 params per group of ``code_group``
            channels (``cache/quant.py``); 0: as floats, bfloat16 where ``bf16`` else float32.
        key_offset: float32 ``[n_layers, n_kv, head_dim]`` or None (quantized keys only): keys are quantized minus
            it and read plus it.
        scores: keep heavy-hitter scores, the committed ones, and ``row_score_rows`` snapshots a partial commit ends
            on; ``row_evicted_rows``: rows of a tree block whose evictions are kept for the commit of its path.
        recent_window, recent_slots, recent_bf16: the full-precision window's positions and its ring (quantized
            entries only), bfloat16 or float32.
        sinks, heavy, window, age_normalised, score_decay: the policy (``cache/policy.py``); scale: the attention's.
        inv_freq, attention_factor: the model's RoPE (``head_dim / 2`` float32 values; :func:`rope_rows`).
        cold: a :func:`cold_tier` that each commit moves the evicted entries into (before compaction writes over
            them), or None: they are dropped.
        budget: the policy's (None: the full cache, which evicts nothing and grows up to ``max_tokens``, None:
            ``capacity - staging``); max_inflight: rows a commit may keep part of; staging: the most rows in flight;
            pool: retention's pooling width (0: no retention); in_cache: keys stored unrotated, rotated by rank.

    The handle's verbs (``cache/arena.py`` tells a block's life; a verb its state refuses raises ValueError and
    changes nothing): ``begin(n_rows, per_block, parents)``, ``end()``, ``commit(n_rows)`` (the first ``n_rows``
    in-flight rows kept, the buffers compacted; 0: a rollback), ``commit_path(path)`` (a tree block's), ``hold(n_tokens,
    window_rows)`` / ``release_hold()`` (retention), ``reset()``, ``assume(committed, next_position)`` (an empty
    arena takes its first slots as committed, for callers that wrote its buffers); its counts ``committed``,
    ``inflight``, ``visible``, ``room``, ``next_position``, ``evicted_tokens``, ``evicts_per_row``, ``block_mode``,
    ``tree_refusal(n_rows)`` (why a tree block cannot begin, or None), ``capacity``, ``nbytes`` (entries, params,
    ring), ``peak_nbytes`` / ``restart_peak()``, ``metadata_nbytes`` (positions, marks, scores), ``cold``, a deep
    copy (``copy.deepcopy``), and ``buffer(name)``: a torch view of one buffer (``keys``, ``values``,
    ``key_params``, ``value_params``, ``key_offset``, ``positions``, ``evicted_at``, ``scores``,
    ``committed_scores``, ``row_scores``, ``row_evicted``, ``recent_keys``, ``recent_values``; shapes in
    ``csrc/attention.h``'s ``ArenaStorage``).
    """
    return _load().native_arena(n_layers, n_kv, head_dim, capacity, code_bits, code_group, bf16, key_offset, scores,
                                row_score_rows, row_evicted_rows, recent_window, recent_slots, recent_bf16, sinks,
                                heavy, window, age_normalised, score_decay, scale, list(inv_freq),
                                attention_factor, cold, -1 if budget is None else budget, max_inflight, staging,
                                (capacity - staging if max_tokens is None else max_tokens) if budget is None else -1,
                                pool, in_cache)


def rope_rows(inv_freq: Sequence[float], attention_factor: float, first: int,
              count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[first, first + count)`` of the RoPE tables every rotation in the kernels reads (``csrc/rope.h``):
    float32 cos and sin ``[count, 2 * len(inv_freq)]``, row ``r`` the rotation by position (or rank) ``first + r``:
    the float32 angle ``(first + r) * inv_freq``, its cos and sin correctly rounded, times ``attention_factor``, in
    the rotate-half layout (both halves alike)."""
    cos, sin = _load().rope_rows(list(inv_freq), attention_factor, first, count)
    return cos, sin


def native_model(spec: dict):
    """A model's weights for the native forward pass (``csrc/model.h``): one call runs every layer.

    ``spec``: ``hidden``, ``n_heads``, ``n_kv``, ``head_dim``, ``intermediate``, ``vocab``, ``eps``, ``bf16`` (the
    compute dtype), ``gelu`` (Gemma's gate), ``embed_scale`` (a float, or None), ``embed`` and ``head`` projections,
    ``final_norm``, and ``layers``: dicts of the norms ``attn_norm``, ``mlp_norm``, ``q_norm``, ``k_norm``,
    ``attn_post_norm``, ``mlp_post_norm`` (tensors or None) and the projections ``qkv``, ``o_proj``, ``gate_up``,
    ``down``. A projection is ``(blocks, types, rows, k, bias or None, float_activations)`` as
    :func:`gguf_linear` takes them.

    The returned object's ``forward(blocks, isa)`` runs ``blocks``: ``(tokens int64 [T], last_only, native arenas,
    route)`` each, the last two from ``KVArena.native_pass`` (each arena with its block open); it returns float32
    logits ``[rows, vocab]`` (each block's rows, or its last with ``last_only``), ids past the head's rows at -inf.
    """
    return _load().NativeModel(spec)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of the rows of ``x [m, n]`` (float32 or bfloat16) times ``weight [n]``, in one op, computed as
    ``torch.nn.functional.rms_norm`` computes it (float32 inside, rounded to ``x``'s dtype)."""
    return _load().rms_norm(x, weight, eps)


def gated(gate_up: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """``act(gate) * up`` for ``gate_up [m, 2 i]`` holding the two halves side by side, in one op: ``act`` SiLU, or
    with ``gelu`` GELU with the tanh approximation (Gemma), each step rounded to the dtype as torch's would be."""
    return _load().gated(gate_up, gelu)
