"""Several sequences decoded together: ``Transformer.forward_blocks`` runs their rows in one pass, and
``passes.Batch`` drives several decoding programs through such shared passes (what ``serve --parallel`` does).

In the default configuration (bfloat16, native weights) a row's result does not depend on the rows beside it, so a
sequence decodes the same tokens alone and in a batch, evicting caches and speculation included: these tests hold
that to the bit, on SmolLM2-135M.
"""

from __future__ import annotations

import pytest
import torch

from sparsespec.cache import KVArena, make_policy
from sparsespec.generate import decode_steps, prefill
from sparsespec.model import Block, Transformer
from sparsespec.passes import Batch, run_alone
from sparsespec.sampling import SamplingParams
from sparsespec.speculative import draft_inflight_rows, speculative_steps, target_inflight_rows

pytestmark = pytest.mark.usefixtures("native_kernels")

TEXTS = (
    "The keeper of the lighthouse wrote in his log that the storm",
    "def binary_search(items, target):",
    "Once upon a time, in a village at the edge of the forest, there lived",
)


def arena(model: Transformer, policy=None, inflight: int = 8, positions: str = "original") -> KVArena:
    return KVArena(model.config, policy or make_policy("full"), dtype=model.dtype, max_tokens=256, max_block=8,
                   max_inflight=inflight, positions=positions)


def test_rows_of_a_shared_pass_equal_each_sequence_alone(smollm2_default):
    """A decode row, a verification block and a prefill chunk over three arenas in one pass: each block's logits
    and what its arena holds afterwards equal the block run by itself, bit for bit."""
    model = smollm2_default.model
    tokenizer = smollm2_default.tokenizer
    histories = [tokenizer.encode(" ".join([text] * 3)) for text in TEXTS]  # 40 tokens and more: past the budgets
    blocks = [dict(tokens=[464]), dict(tokens=[13, 314, 262, 1110]),
              dict(tokens=list(range(300, 307)), per_block=True, last_only=True)]

    def arenas():
        made = [arena(model), arena(model, make_policy("hybrid", 24, sinks=4, heavy=10), positions="in-cache"),
                arena(model, make_policy("streaming", 16, sinks=2))]
        for cache, history in zip(made, histories):
            prefill(model, cache, history, 8)
        return made

    alone_arenas, shared_arenas = arenas(), arenas()
    evicted_before = shared_arenas[1].evicted_tokens
    alone = [model.forward(torch.tensor(b["tokens"]), cache, per_block=b.get("per_block", False),
                           last_only=b.get("last_only", False)) for b, cache in zip(blocks, alone_arenas)]
    shared = model.forward_blocks([Block(torch.tensor(b["tokens"]), cache, b.get("per_block", False),
                                         b.get("last_only", False)) for b, cache in zip(blocks, shared_arenas)])
    assert [tuple(x.shape) for x in shared] == [(1, model.config.vocab_size), (4, model.config.vocab_size),
                                                 (1, model.config.vocab_size)]
    for a, s in zip(alone, shared):
        assert torch.equal(a, s)
    for a_cache, s_cache, b in zip(alone_arenas, shared_arenas, blocks):
        a_cache.commit(len(b["tokens"]))
        s_cache.commit(len(b["tokens"]))
        nxt = torch.tensor([42])
        assert torch.equal(model.forward(nxt, a_cache), model.forward(nxt, s_cache))
    assert shared_arenas[1].evicted_tokens > evicted_before  # the budgeted arena evicted in the shared pass


def programs(model: Transformer, prompts: list[list[int]]) -> tuple[list, dict[str, KVArena]]:
    """Five decoding programs over fresh arenas: plain decoding with a full, a hybrid (in-cache positions) and a
    streaming cache, and two greedy self-speculations (γ = 3, streaming drafts) over a hybrid and a full target.
    Returns them and the speculations' arenas by name."""
    greedy = dict(max_new_tokens=24, sampling=SamplingParams(), prefill_chunk=8)
    hybrid = make_policy("hybrid", 24, sinks=4, heavy=10)
    drafting = {name: arena(model, make_policy("streaming", 12, sinks=2), draft_inflight_rows(3))
                for name in ("draft 1", "draft 2")}
    verifying = {"target 1": arena(model, hybrid, target_inflight_rows(3)),
                 "target 2": arena(model, inflight=target_inflight_rows(3))}
    made = [
        decode_steps(model, arena(model, inflight=1), prompts[0], **greedy),
        decode_steps(model, arena(model, hybrid, inflight=1, positions="in-cache"), prompts[1], **greedy),
        decode_steps(model, arena(model, make_policy("streaming", 16, sinks=2), inflight=1), prompts[2], **greedy),
        speculative_steps(model, verifying["target 1"], model, drafting["draft 1"], prompts[0], gamma=3, **greedy),
        speculative_steps(model, verifying["target 2"], model, drafting["draft 2"], prompts[2], gamma=3, **greedy),
    ]
    return made, drafting | verifying


def test_programs_decode_the_same_tokens_alone_and_in_a_batch(smollm2_default, monkeypatch):
    """Alone and in a batch, five programs decode the same tokens; the batch shared its passes, the two
    speculations' draft steps and verifications included."""
    model = smollm2_default.model
    prompts = [smollm2_default.tokenizer.encode(text) for text in TEXTS]
    alone = [list(run_alone(program)) for program in programs(model, prompts)[0]]

    arenas_per_pass: list[list[int]] = []  # the arenas (by id) each pass the batch ran attended over
    forward_blocks = Transformer.forward_blocks
    monkeypatch.setattr(Transformer, "forward_blocks", lambda self, blocks: (
        arenas_per_pass.append([id(b.cache) for b in blocks]), forward_blocks(self, blocks))[1])
    batch = Batch()
    made, arenas = programs(model, prompts)
    tokens: list[list[int]] = [[] for _ in made]
    ended: list[BaseException | None] = []
    for i, program in enumerate(made):
        batch.add(program, lambda token, i=i: tokens[i].append(token) is None, ended.append)
    while batch.running:
        batch.step()
    assert tokens == alone
    assert ended == [None] * len(made)
    assert all(len(t) == 24 for t in tokens)
    assert max(len(ids) for ids in arenas_per_pass) >= 4
    assert len(arenas_per_pass) < sum(len(t) for t in tokens)  # fewer passes than tokens
    for pair in (("draft 1", "draft 2"), ("target 1", "target 2")):
        assert any({id(arenas[name]) for name in pair} <= set(ids) for ids in arenas_per_pass), pair


def test_a_program_joins_between_steps_and_its_prompt_does_not_stall_the_others(smollm2_default):
    """A long prompt joining a decoding program is read in chunks, each in a pass with the other's decode row: the
    running program gains a token at every step while the new one prefills."""
    model = smollm2_default.model
    tokenizer = smollm2_default.tokenizer
    greedy = dict(sampling=SamplingParams(), prefill_chunk=8)
    batch = Batch()
    first: list[int] = []
    batch.add(decode_steps(model, arena(model, inflight=1), tokenizer.encode(TEXTS[0]), max_new_tokens=40, **greedy),
              lambda token: first.append(token) is None, lambda error: None)
    for _ in range(5):
        batch.step()
    long_prompt = tokenizer.encode(" ".join(TEXTS * 2))
    second: list[int] = []
    batch.add(decode_steps(model, arena(model, inflight=1), long_prompt, max_new_tokens=4, **greedy),
              lambda token: second.append(token) is None, lambda error: None)
    shared_steps = 0
    while not second:
        before = len(first)
        rows = batch.step()
        assert len(first) == before + 1 and 2 <= rows <= 9  # its decode row beside a prompt chunk of ≤ 8 rows
        shared_steps += 1
    assert shared_steps >= len(long_prompt) // 8
    assert batch.step() == 2


def test_a_program_stopped_by_its_listener_or_failing_leaves_the_others_running(smollm2_default, monkeypatch):
    model = smollm2_default.model
    prompt = smollm2_default.tokenizer.encode(TEXTS[1])
    greedy = dict(max_new_tokens=12, sampling=SamplingParams(), prefill_chunk=8)
    alone = list(run_alone(decode_steps(model, arena(model, inflight=1), prompt, **greedy)))
    batch = Batch()
    kept: list[int] = []
    stopped: list[int] = []
    ends: dict[str, BaseException | None] = {}
    batch.add(decode_steps(model, arena(model, inflight=1), prompt, **greedy),
              lambda token: kept.append(token) is None, lambda error: ends.setdefault("kept", error))
    batch.add(decode_steps(model, arena(model, inflight=1), prompt, **greedy),
              lambda token: stopped.append(token) is None and len(stopped) < 3,
              lambda error: ends.setdefault("stopped", error))
    while batch.running:
        batch.step()
    assert kept == alone and stopped == alone[:3]
    assert ends == {"kept": None, "stopped": None}

    real = Transformer.forward_blocks

    def failing(self, blocks):
        if len(blocks) > 1:
            raise RuntimeError("a failing pass")
        return real(self, blocks)

    monkeypatch.setattr(Transformer, "forward_blocks", failing)
    errors: list[BaseException | None] = []
    batch.add(decode_steps(model, arena(model, inflight=1), prompt, **greedy), lambda token: True, errors.append)
    batch.add(decode_steps(model, arena(model, inflight=1), prompt, **greedy), lambda token: True, errors.append)
    batch.step()
    assert [str(e) for e in errors] == ["a failing pass"] * 2 and not batch.running
