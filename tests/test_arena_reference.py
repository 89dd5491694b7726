"""The KV arena + model against a deliberately naive reference decoder.

The reference keeps a full-length float32 cache of every token ever seen (keys unrotated), a boolean ``kept`` mask
and accumulated scores per layer and KV head over all positions, recomputes every attention mask from ``kept`` at
every step, and applies the eviction rule written out plainly (a Python sort of the candidates by
``(score, position)``). It shares no code with the library: not the arena, not the eviction rule, not the model,
not the RoPE helper. Both sides read the same Hugging Face-named state dict (``random_state``).

It is the one reference of the arena's attention, the native op (every KV dtype, every instruction set the CPU
runs); ``test_attention_native.py`` drives it below the model too, with random rows, blocks and commits.

Semantics implemented by the reference:

* a decode row (one token) attends to the kept tokens plus itself, adds the softmax probability it gave each token
  (summed over the query heads of the KV group) to that token's score, then evicts while more than ``budget``
  tokens are kept: sinks (position < S) and window (position > newest - L) are protected; for policies with heavy
  hitters the lowest score goes first (ties towards the older position); otherwise every unprotected token goes;
* a prefill chunk (``per_block=True``): every row attends causally to (kept before the chunk + the chunk), all
  rows add their probabilities, and eviction down to the budget happens once, after the last row;
* positions ``original``: RoPE by true position; ``in-cache``: RoPE by the rank of each key among the tokens the
  row sees (ordered by position), the query at rank (number of visible tokens - 1).

Quantized caches (``kv_dtype`` int8 / int4): the reference takes the entries the arena stored for each new row
(codes and group parameters, recorded as they are written) and dequantizes them with its own plain loop; it checks
that they are its own keys (rotated by position in the original mode; minus the layer's key bias in the in-cache
mode, where keys are stored before RoPE) and values within half a quantization step, and then runs the same naive
attention and eviction over them. Entries stored in a float format (bfloat16 ones, in ``test_attention_native.py``)
are taken alike, checked to be its own to the rounding of that format. With a full-precision window of W positions
(int4's default, or one given), the row at position p reads the entries of positions above p - W as its own float32
keys and values instead.
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch

from sparsespec.cache.arena import KVArena
from sparsespec.cache.policy import make_policy
from sparsespec.model import Transformer

from conftest import random_state, tiny_config

# Skipped without the kernels, failed where they must build (conftest.py: native_kernels).
pytestmark = pytest.mark.usefixtures("native_kernels")

PROMPT_LEN = 40
CHUNK = 8
DECODE_STEPS = 300
BUDGET = 20
POLICY_NAMES = ("full", "window", "streaming", "h2o", "hybrid", "hybrid-age", "hybrid-decay")
MODES = ("original", "in-cache")
REL_TOL = 1e-4  # logits: atol = REL_TOL * max |logit| of the step


# --------------------------------------------------------------------------------------------- naive reference
class NaiveDecoder:
    """Reference decoder: full-length cache, explicit masks, plain eviction rule."""

    def __init__(self, config, state, *, sinks, heavy, window, budget, mode, max_tokens, stored_rows=None,
                 age=False, decay=1.0, recent_window=0):
        """``stored_rows(layer, n) -> (k, v, bits)``, if given, returns the next ``n`` rows the arena stored in
        ``layer``, each as ``(codes, params)`` (``[n_kv, n, ...]``; ``bits`` 8 or 4) or, for a float format, as
        ``(entries, None)`` (``bits`` None); they replace the reference's own float32 entries once checked."""
        self.cfg = config
        self.stored_rows = stored_rows
        # The arena stores keys rotated by position in the original mode; quantized in-cache keys minus the key bias.
        self.rotated_keys = stored_rows is not None and mode == "original"
        self.bias_out = stored_rows is not None and mode == "in-cache" and config.attention_bias
        self.state = {name: t.float() for name, t in state.items()}
        self.sinks, self.heavy, self.window, self.budget = sinks, heavy, window, budget
        self.age = age  # rank heavy hitters by score / (rows that saw the token) (hybrid-age)
        self.decay = decay  # each row: scores *= decay, then += attention (hybrid-decay)
        self.mode = mode
        self.recent_window = recent_window  # positions above (row's position - this) are read as own_k / own_v
        n_layers, n_kv, hd = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        self.k = torch.zeros(n_layers, n_kv, max_tokens, hd)  # keys as stored (see rotated_keys), by position
        self.v = torch.zeros(n_layers, n_kv, max_tokens, hd)
        self.own_k = torch.zeros(n_layers, n_kv, max_tokens, hd)  # the same before quantization
        self.own_v = torch.zeros(n_layers, n_kv, max_tokens, hd)
        self.kept = torch.zeros(n_layers, n_kv, max_tokens, dtype=torch.bool)
        self.scores = torch.zeros(n_layers, n_kv, max_tokens, dtype=torch.float32)
        self.length = 0  # tokens seen so far (= next position)
        # RoPE tables for every position the run can reach, float32 angles as in Hugging Face.
        half = torch.arange(0, hd, 2, dtype=torch.float32) / hd
        inv_freq = 1.0 / (config.rope_theta**half)
        angles = torch.arange(max_tokens, dtype=torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        self.cos, self.sin = angles.double().cos().float(), angles.double().sin().float()  # correctly rounded

    # -- state snapshots (for blocks whose later rows get rolled back)
    def snapshot(self):
        return copy.deepcopy((self.k, self.v, self.own_k, self.own_v, self.kept, self.scores, self.length))

    def restore(self, snap):
        self.k, self.v, self.own_k, self.own_v, self.kept, self.scores, self.length = copy.deepcopy(snap)

    # -- pieces
    def _weight(self, name):
        return self.state[name]

    def _linear(self, x, prefix, bias):
        y = x @ self._weight(prefix + ".weight").T
        if bias:
            y = y + self._weight(prefix + ".bias")
        return y

    def _rms(self, x, weight):
        var = (x * x).mean(dim=-1, keepdim=True)
        return x * torch.rsqrt(var + self.cfg.rms_norm_eps) * weight

    def _rope(self, x, positions):
        """Rotate rows ``x: [n, hd]`` by integer ``positions: [n]`` (rotate-half layout)."""
        h = x.shape[-1] // 2
        rotated = torch.cat((-x[:, h:], x[:, :h]), dim=-1)
        return x * self.cos[positions] + rotated * self.sin[positions]

    def _evict(self, layer, head, newest):
        kept_positions = self.kept[layer, head].nonzero().flatten().tolist()
        if self.budget is None or len(kept_positions) <= self.budget:
            return
        n_evict = len(kept_positions) - self.budget
        candidates = [p for p in kept_positions if not (p < self.sinks or p > newest - self.window)]
        if self.heavy == 0:
            chosen = candidates
        else:
            scores = self.scores[layer, head]
            if self.age:
                chosen = sorted(candidates, key=lambda p: (float(scores[p]) / (newest - p + 1), p))[:n_evict]
            else:
                chosen = sorted(candidates, key=lambda p: (float(scores[p]), p))[:n_evict]
        for p in chosen:
            self.kept[layer, head, p] = False

    def _attention(self, layer, q, k, v, per_block):
        """``q: [T, n_heads, hd]``, ``k, v: [T, n_kv, hd]`` for rows at positions length .. length+T-1."""
        cfg = self.cfg
        n_rows = q.shape[0]
        n_kv, hd = cfg.num_key_value_heads, cfg.head_dim
        group = cfg.num_attention_heads // n_kv
        p0 = self.length
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [n_kv, T, hd]
        if self.stored_rows is not None:
            if self.rotated_keys:
                k = torch.stack([self._rope(k[h], torch.arange(p0, p0 + n_rows)) for h in range(n_kv)])
            self.own_k[layer, :, p0 : p0 + n_rows] = k
            self.own_v[layer, :, p0 : p0 + n_rows] = v
            (k_codes, k_params), (v_codes, v_params), bits = self.stored_rows(layer, n_rows)
            bias = 0.0
            if self.bias_out and bits is not None:
                bias = self._weight(f"model.layers.{layer}.self_attn.k_proj.bias").view(n_kv, 1, hd)
            k = _checked_stored(k_codes, k_params, bits, k - bias, "keys") + bias
            v = _checked_stored(v_codes, v_params, bits, v, "values")
        self.k[layer, :, p0 : p0 + n_rows] = k
        self.v[layer, :, p0 : p0 + n_rows] = v
        self.kept[layer, :, p0 : p0 + n_rows] = True
        self.scores[layer, :, p0 : p0 + n_rows] = 0.0
        out = torch.zeros(n_rows, cfg.num_attention_heads, hd)
        for head in range(n_kv):
            for i in range(n_rows):
                p = p0 + i
                # Visible: kept tokens up to and including this row (in a per-block chunk nothing is evicted
                # before the chunk's end, so the same expression gives "before chunk + causal chunk part").
                seen = self.kept[layer, head, : p + 1].nonzero().flatten()
                if self.mode == "original":
                    key_pos, q_pos = seen, torch.tensor([p])
                else:
                    key_pos, q_pos = torch.arange(len(seen)), torch.tensor([len(seen) - 1])
                keys = self.k[layer, head, seen]
                values = self.v[layer, head, seen]
                if self.recent_window:
                    recent = (seen > p - self.recent_window)[:, None]
                    keys = torch.where(recent, self.own_k[layer, head, seen], keys)
                    values = torch.where(recent, self.own_v[layer, head, seen], values)
                if not self.rotated_keys:
                    keys = self._rope(keys, key_pos)
                heads = slice(head * group, (head + 1) * group)  # the query heads of this KV head
                queries = self._rope(q[i, heads], q_pos.expand(group))
                probs = torch.softmax((queries @ keys.T) / math.sqrt(hd), dim=-1)  # [group, visible]
                out[i, heads] = probs @ values
                self.scores[layer, head] *= self.decay
                self.scores[layer, head, seen] += probs.sum(dim=0)
                if not per_block:
                    self._evict(layer, head, newest=p)
            if per_block:
                self._evict(layer, head, newest=p0 + n_rows - 1)
        return out.reshape(n_rows, -1)

    def forward(self, tokens, per_block=False):
        """Logits ``[T, vocab]`` for ``tokens`` (one decode row when ``per_block`` is False)."""
        cfg = self.cfg
        assert per_block or len(tokens) == 1
        n_heads, n_kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        n_rows = len(tokens)
        x = self._weight("model.embed_tokens.weight")[torch.tensor(tokens)]
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}."
            h = self._rms(x, self._weight(p + "input_layernorm.weight"))
            q = self._linear(h, p + "self_attn.q_proj", cfg.attention_bias).view(n_rows, n_heads, hd)
            k = self._linear(h, p + "self_attn.k_proj", cfg.attention_bias).view(n_rows, n_kv, hd)
            v = self._linear(h, p + "self_attn.v_proj", cfg.attention_bias).view(n_rows, n_kv, hd)
            attn = self._attention(layer, q, k, v, per_block)
            x = x + self._linear(attn, p + "self_attn.o_proj", False)
            h = self._rms(x, self._weight(p + "post_attention_layernorm.weight"))
            gate = self._linear(h, p + "mlp.gate_proj", False)
            up = self._linear(h, p + "mlp.up_proj", False)
            x = x + self._linear(gate * torch.sigmoid(gate) * up, p + "mlp.down_proj", False)
        self.length += n_rows
        x = self._rms(x, self._weight("model.norm.weight"))
        head = self.state.get("lm_head.weight")
        if head is None or cfg.tie_word_embeddings:
            head = self._weight("model.embed_tokens.weight")
        return x @ head.T


# ------------------------------------------------------------------------------------------------ helpers
def _naive_dequantize(codes, params, bits):
    """``[..., hd]`` float32 from uint8 codes (int4: channel c in the low nibble of byte c, c + hd/2 in the high
    nibble) and float16 (scale, zero) per group of consecutive channels."""
    if bits == 4:
        codes = torch.cat((codes % 16, codes // 16), dim=-1)
    n_groups = params.shape[-2]
    per = codes.shape[-1] // n_groups
    out = torch.empty(codes.shape, dtype=torch.float32)
    for g in range(n_groups):
        scale, zero = params[..., g, 0:1].float(), params[..., g, 1:2].float()
        out[..., g * per : (g + 1) * per] = codes[..., g * per : (g + 1) * per].float() * scale + zero
    return out


def _checked_stored(codes, params, bits, own, what):
    """The stored rows dequantized, after checking they are ``own`` (``[n_kv, T, hd]``) within half a step; float
    entries (``bits`` None) as they are, after checking they are ``own`` to the rounding of their format: a few of
    its steps of the norm of each pair of channels (c, c + hd/2), which a key's rotation, computed in the arena's
    compute dtype, turns together and keeps the norm of."""
    if bits is None:
        stored = codes.float()
        half = own.shape[-1] // 2
        pair = (own[..., :half] ** 2 + own[..., half:] ** 2).sqrt()
        bound = 4 * torch.finfo(codes.dtype).eps * torch.cat((pair, pair), dim=-1)
        err = (stored - own).abs()
        assert (err <= bound).all(), f"stored {what} are not this row's {what}: error {float(err.max()):.3g}"
        return stored
    stored = _naive_dequantize(codes, params, bits)
    step = (own.amax(dim=-1) - own.amin(dim=-1)).max() / (2**bits - 1)
    err = float((stored - own).abs().max())
    assert err <= 0.51 * float(step) + 1e-4, f"stored {what} are not this row's {what}: error {err:.3g}"
    return stored


class RecordedRows:
    """Records the entries (codes and params, or float entries) the arena stored for a block's rows in every layer
    (read when the block ends); hands them out in order, layer by layer."""

    def __init__(self, arena: KVArena):
        self.arena = arena
        self.bits = {"int8": 8, "int4": 4}.get(arena.kv_dtype)
        self.rows: dict[int, list] = {}
        begin, end = arena.begin, arena.end
        block_rows = [0]

        def spy_begin(n_rows, *args, **kwargs):
            block_rows[0] = n_rows
            return begin(n_rows, *args, **kwargs)

        def spy_end():  # every layer has stored the block's rows; they enter the in-flight count at end()
            n_rows, start = block_rows[0], arena.n_committed + arena.n_inflight
            buffers = arena.buffers()
            for layer in range(buffers["keys"].shape[0]):
                self.rows[layer] = [(buffers[stored + "s"][layer, :, start : start + n_rows].clone(),
                                     buffers[stored + "_params"][layer, :, start : start + n_rows].clone()
                                     if self.bits else None)
                                    for stored in ("key", "value")] + [0]
            return end()

        arena.begin, arena.end = spy_begin, spy_end

    def __call__(self, layer, n):
        keys, values, used = self.rows[layer]
        self.rows[layer][2] = used + n
        take = lambda pair: tuple(None if t is None else t[:, used : used + n] for t in pair)  # noqa: E731
        return take(keys), take(values), self.bits


def _token_stream(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _assert_logits_close(actual, expected, what):
    scale = float(expected.abs().max())
    err = float((actual - expected).abs().max())
    assert err <= REL_TOL * max(scale, 1.0), f"{what}: max |diff| {err:.3g} (logit scale {scale:.3g})"


def _assert_same_cache(arena: KVArena, ref: NaiveDecoder, what):
    """Committed positions per layer/head equal the reference's kept set; scores match where they are kept."""
    n = arena.n_committed
    for layer in range(ref.cfg.num_hidden_layers):
        for head in range(ref.cfg.num_key_value_heads):
            positions = arena.buffer("positions")[layer, head, :n]
            order = positions.argsort()
            expected = ref.kept[layer, head].nonzero().flatten()
            assert torch.equal(positions[order], expected), (
                f"{what}: layer {layer} head {head} keeps {positions[order].tolist()}, expected {expected.tolist()}"
            )
            if arena.policy.needs_scores:
                got = arena.buffer("scores")[layer, head, :n][order]
                want = ref.scores[layer, head, expected]
                assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), f"{what}: scores differ in layer {layer}"


def _setup(architecture, policy_name, mode, *, max_inflight=1, n_layers=2, total=PROMPT_LEN + DECODE_STEPS + 8,
           kv_dtype="auto", key_bias_outliers=0.0, recent_window=None, **config_overrides):
    """``key_bias_outliers``: if set, channels 0 and 5 of every KV head's key bias get this value (Qwen2's layer-0
    keys carry biases of ±354 in a few channels), so keys quantized with the bias in would miss their bound.
    ``recent_window``: the arena's full-precision window (None: its default for ``kv_dtype``)."""
    config = tiny_config(architecture, num_hidden_layers=n_layers, **config_overrides)
    state = random_state(config, seed=1)
    if key_bias_outliers:
        for layer in range(n_layers):
            bias = state[f"model.layers.{layer}.self_attn.k_proj.bias"].view(config.num_key_value_heads, -1)
            bias[:, [0, 5]] = key_bias_outliers
    model = Transformer(config, state, torch.float32)
    policy = make_policy(policy_name, None if policy_name == "full" else BUDGET)
    arena = KVArena(
        config, policy, dtype=torch.float32, max_tokens=total, max_block=CHUNK, max_inflight=max_inflight,
        positions=mode, kv_dtype=kv_dtype, key_offset=model.key_biases(), recent_window=recent_window,
    )
    ref = NaiveDecoder(
        config, state, sinks=policy.sinks, heavy=policy.heavy, window=policy.window, budget=policy.budget,
        mode=mode, max_tokens=total + 8, stored_rows=None if kv_dtype == "auto" else RecordedRows(arena),
        age=policy.age_normalised, decay=policy.score_decay, recent_window=arena.recent_window,
    )
    return config, model, arena, ref


def _prefill_both(model, arena, ref, prompt):
    for start in range(0, len(prompt), CHUNK):
        chunk = prompt[start : start + CHUNK]
        got = model.forward(torch.tensor(chunk), arena, per_block=True)
        arena.commit(len(chunk))
        want = ref.forward(chunk, per_block=True)
        _assert_logits_close(got, want, f"prefill chunk at {start}")
        _assert_same_cache(arena, ref, f"after prefill chunk at {start}")


# -------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy_name", POLICY_NAMES)
def test_decode_matches_naive_reference(policy_name, mode):
    _check_decode(policy_name, mode, "auto")


@pytest.mark.parametrize(("policy_name", "mode", "kv_dtype"), [
    ("full", "original", "int8"), ("window", "in-cache", "int4"), ("streaming", "in-cache", "int8"),
    ("h2o", "original", "int4"), ("hybrid", "original", "int8"), ("hybrid", "in-cache", "int4"),
])
def test_quantized_decode_matches_naive_reference(policy_name, mode, kv_dtype):
    _check_decode(policy_name, mode, kv_dtype)


@pytest.mark.parametrize(("policy_name", "mode", "kv_dtype", "recent_window"), [
    ("hybrid", "in-cache", "int4", 5), ("hybrid-decay", "original", "int4", 0), ("h2o", "in-cache", "int8", 7),
    ("full", "original", "int4", 3),
])
def test_full_precision_window_decode_matches_naive_reference(policy_name, mode, kv_dtype, recent_window):
    """The row at position p reads positions above p - W in full precision, every other entry from its codes."""
    _check_decode(policy_name, mode, kv_dtype, recent_window)


@pytest.mark.parametrize(("kv_dtype", "recent_window"), [("int8", 0), ("int4", 0), ("int4", 3)])
@pytest.mark.parametrize("head_dim", [64, 8])
def test_every_instruction_set_reads_quantized_entries_as_the_naive_reference(monkeypatch, native_kernels, kv_dtype,
                                                                              recent_window, head_dim):
    """Every instruction set this CPU runs, through prefill chunks and decode steps that evict: head_dim 64 takes
    the vector dequantization (whole groups of 16 or 32 channels); 8, groups smaller than a vector, dequantized by
    the scalar loop inside every instruction set's path; with a full-precision window of 3 positions."""
    isas = [isa for isa in (native_kernels.ISA_SCALAR, native_kernels.ISA_AVX2, native_kernels.ISA_AVX512)
            if native_kernels.isa_available(isa)]
    real = native_kernels.arena_attention
    for isa in isas:
        monkeypatch.setattr(native_kernels, "arena_attention", functools.partial(real, isa=isa))
        _check_decode("hybrid", "in-cache", kv_dtype, recent_window, decode_steps=60, head_dim=head_dim,
                      num_attention_heads=4, num_key_value_heads=2)


def _decode_both(model, arena, ref, tokens, what, check_every=None):
    """Decode ``tokens`` one at a time on both sides: logits equal at every step; the caches equal every
    ``check_every`` steps (if given) and at the end."""
    for step, token in enumerate(tokens):
        got = model.forward(torch.tensor([token]), arena)[-1]
        arena.commit(1)
        want = ref.forward([token])[-1]
        _assert_logits_close(got, want, f"{what} decode step {step}")
        if check_every and step % check_every == 0:
            _assert_same_cache(arena, ref, f"{what} after decode step {step}")
    _assert_same_cache(arena, ref, f"{what} at the end")


def _check_decode(policy_name, mode, kv_dtype, recent_window=None, decode_steps=DECODE_STEPS, **config_overrides):
    config, model, arena, ref = _setup("llama", policy_name, mode, kv_dtype=kv_dtype, recent_window=recent_window,
                                       **config_overrides)
    stream = _token_stream(PROMPT_LEN + decode_steps, config.vocab_size, seed=7)
    _prefill_both(model, arena, ref, stream[:PROMPT_LEN])
    _decode_both(model, arena, ref, stream[PROMPT_LEN:], f"{policy_name}/{mode}/{kv_dtype}", check_every=25)
    budget = arena.policy.budget
    if budget is not None:
        assert arena.n_committed == budget
        assert int(ref.kept.sum(dim=-1).max()) == budget
        assert arena.evicted_tokens == PROMPT_LEN + decode_steps - budget
    else:
        assert arena.n_committed == PROMPT_LEN + decode_steps


@pytest.mark.parametrize(
    ("policy_name", "mode"), [("hybrid", "original"), ("h2o", "in-cache"), ("streaming", "in-cache")]
)
def test_qwen2_bias_decode_matches_naive_reference(policy_name, mode):
    config, model, arena, ref = _setup("qwen2", policy_name, mode, n_layers=1)
    assert config.attention_bias and not config.tie_word_embeddings
    stream = _token_stream(PROMPT_LEN + DECODE_STEPS, config.vocab_size, seed=11)
    _prefill_both(model, arena, ref, stream[:PROMPT_LEN])
    _decode_both(model, arena, ref, stream[PROMPT_LEN:], f"qwen2 {policy_name}/{mode}")


@pytest.mark.parametrize(("policy_name", "kv_dtype"), [
    ("hybrid", "int4"), ("h2o", "int8"), ("hybrid-decay", "int4"), ("full", "int4"),
])
def test_qwen2_quantized_keys_without_the_key_bias_match_naive_reference(policy_name, kv_dtype):
    """In the in-cache mode (and the full cache's int4 keys, whatever mode is asked for) quantized keys are stored
    minus the layer's key bias and read plus it: the reference checks each stored key against its own key minus the
    bias, within half a step of that range."""
    config, model, arena, ref = _setup("qwen2", policy_name, "in-cache", n_layers=1, kv_dtype=kv_dtype,
                                       key_bias_outliers=40.0)
    assert float(arena.buffer("key_offset").abs().max()) == 40.0
    stream = _token_stream(PROMPT_LEN + 120, config.vocab_size, seed=13)
    _prefill_both(model, arena, ref, stream[:PROMPT_LEN])
    _decode_both(model, arena, ref, stream[PROMPT_LEN:], f"qwen2 {policy_name}/{kv_dtype}")
    assert arena.evicted_tokens == (0 if arena.policy.is_full else PROMPT_LEN + 120 - BUDGET)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy_name", POLICY_NAMES)
def test_multi_row_blocks_with_partial_commits_match_naive_reference(policy_name, mode):
    """Verification-style blocks: row i of a block must equal autoregressive step i; commit(m) keeps m rows.

    The reference runs every row of a block one by one, snapshotting after each, and restores the snapshot of
    the last accepted row (teacher forcing: the next block starts at the first rejected token).
    """
    _check_blocks(policy_name, mode, "auto")


@pytest.mark.parametrize(("policy_name", "mode", "kv_dtype"), [
    ("h2o", "in-cache", "int8"), ("hybrid", "original", "int4"), ("streaming", "original", "int4"),
])
def test_quantized_multi_row_blocks_with_partial_commits_match_naive_reference(policy_name, mode, kv_dtype):
    _check_blocks(policy_name, mode, kv_dtype)


@pytest.mark.parametrize(("policy_name", "mode"), [("hybrid", "in-cache"), ("h2o", "original")])
def test_full_precision_window_survives_partial_commits(policy_name, mode):
    """Rolled-back rows wrote the ring too: the rows kept still read their window as autoregressive steps do."""
    _check_blocks(policy_name, mode, "int4", recent_window=4)


def _check_blocks(policy_name, mode, kv_dtype, recent_window=None):
    max_rows = 5
    config, model, arena, ref = _setup("llama", policy_name, mode, max_inflight=max_rows, n_layers=1,
                                       kv_dtype=kv_dtype, recent_window=recent_window)
    stream = _token_stream(PROMPT_LEN + 400, config.vocab_size, seed=3)
    _prefill_both(model, arena, ref, stream[:PROMPT_LEN])
    plan = torch.Generator().manual_seed(5)
    at = PROMPT_LEN
    blocks = 0
    while at < PROMPT_LEN + 250:
        n_rows = int(torch.randint(1, max_rows + 1, (1,), generator=plan))
        accept = int(torch.randint(0, n_rows + 1, (1,), generator=plan))
        block = stream[at : at + n_rows]
        got = model.forward(torch.tensor(block), arena)
        snaps = [ref.snapshot()]
        for i, token in enumerate(block):
            want = ref.forward([token])[-1]
            _assert_logits_close(got[i], want, f"{policy_name}/{mode} block {blocks} row {i}")
            snaps.append(ref.snapshot())
        arena.commit(accept)
        ref.restore(snaps[accept])
        _assert_same_cache(arena, ref, f"{policy_name}/{mode} after block {blocks} commit({accept}/{n_rows})")
        at += accept
        blocks += 1
    assert arena.evicted_tokens == (0 if arena.policy.is_full else at - arena.policy.budget)
