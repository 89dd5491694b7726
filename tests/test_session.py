"""Sessions: arenas kept between runs, prefix reuse, and the arena reset they rely on (tiny random models)."""

from __future__ import annotations

import pytest
import torch

from sparsespec.cache import KVArena, make_policy
from sparsespec.engine import CacheOptions, DraftOptions, RunStats, Session, run_generation
from sparsespec.generate import generate_tokens
from sparsespec.loading.load import LoadedModel
from sparsespec.sampling import SamplingParams

from conftest import tiny_model

GREEDY = SamplingParams()


def tiny_loaded(seed: int = 0) -> LoadedModel:
    model = tiny_model(seed=seed)
    return LoadedModel("tiny", None, model.config, model, tokenizer=None)


def prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_arena_reset_equals_a_new_arena():
    model = tiny_model()
    policy = make_policy("hybrid", 12)
    used = KVArena(model.config, policy, dtype=torch.float32, max_block=8)
    list(generate_tokens(model, used, prompt(30, seed=2), max_new_tokens=10, sampling=GREEDY, prefill_chunk=8))
    used.reset()
    fresh = KVArena(model.config, policy, dtype=torch.float32, max_block=8)
    runs = [list(generate_tokens(model, arena, prompt(25), max_new_tokens=20, sampling=GREEDY, prefill_chunk=8))
            for arena in (used, fresh)]
    assert runs[0] == runs[1]
    assert used.evicted_tokens == fresh.evicted_tokens > 0


def three_turns(
    session: Session, first: list[int], max_new: int = 12, reread: bool = False
) -> tuple[list[list[int]], list[RunStats]]:
    """A conversation: each prompt is the previous prompt, its answer and a few new tokens (``reread``: each
    turn starts from empty arenas)."""
    outputs, all_stats, ids = [], [], list(first)
    for turn in range(3):
        if turn:
            ids = ids + outputs[-1] + prompt(5, seed=10 + turn)
        if reread:
            session.reset()
        stats = RunStats()
        outputs.append(list(session.run(ids, max_new_tokens=max_new, sampling=GREEDY, stats=stats)))
        all_stats.append(stats)
    return outputs, all_stats


def test_full_cache_prefix_reuse_equals_reading_the_whole_history():
    loaded = tiny_loaded()
    session = Session(loaded, CacheOptions(prefill_chunk=8), capacity=256)
    outputs, stats = three_turns(session, prompt(20))
    assert stats[0].reused_tokens == 0
    # The arenas held the prompt and every answer token but the last (never fed back).
    assert stats[1].reused_tokens == 20 + 12 - 1
    assert stats[2].reused_tokens == stats[1].prompt_tokens + 12 - 1
    reread, reread_stats = three_turns(Session(loaded, CacheOptions(prefill_chunk=8)), prompt(20), reread=True)
    assert outputs == reread
    assert [s.reused_tokens for s in reread_stats] == [0, 0, 0]
    # The same histories read from scratch by run_generation.
    ids = prompt(20) + outputs[0] + prompt(5, seed=11) + outputs[1] + prompt(5, seed=12)
    reference = run_generation(loaded, ids, max_new_tokens=12, sampling=GREEDY, cache=CacheOptions(prefill_chunk=8))
    assert list(reference) == outputs[2]


def test_a_conversations_full_cache_grows_with_it(monkeypatch):
    """A session bounded by a capacity starts its full cache small and doubles it as the turns fill it; the turns
    equal those of a session whose cache had all of its capacity from the start."""
    import sparsespec.engine as engine

    loaded = tiny_loaded()
    sized = Session(loaded, CacheOptions(prefill_chunk=8), capacity=256)
    expected, _ = three_turns(sized, prompt(20))
    monkeypatch.setattr(engine, "CONVERSATION_CACHE_START", 16)
    growing = Session(loaded, CacheOptions(prefill_chunk=8), capacity=256)
    outputs, stats = three_turns(growing, prompt(20))
    assert outputs == expected
    assert all(s.reused_tokens > 0 for s in stats[1:])  # growing kept the conversation
    arena = growing.arenas[0]
    assert 16 + arena.staging < arena.capacity < sized.arenas[0].capacity
    assert growing.kv_cache_bytes < sized.kv_cache_bytes


def test_a_prompt_that_does_not_extend_the_text_starts_from_empty_arenas():
    loaded = tiny_loaded()
    session = Session(loaded, CacheOptions(prefill_chunk=8), capacity=256)
    first = list(session.run(prompt(20), max_new_tokens=6, sampling=GREEDY))
    stats = RunStats()
    other = prompt(20, seed=5)
    assert list(session.run(other, max_new_tokens=6, sampling=GREEDY, stats=stats)) == list(
        run_generation(loaded, other, max_new_tokens=6, sampling=GREEDY, cache=CacheOptions(prefill_chunk=8)))
    assert stats.reused_tokens == 0
    # Nor does a prompt that differs inside the held text.
    changed = prompt(20) + first
    changed[3] = (changed[3] + 1) % 97
    assert session.reusable(changed) == 0


def test_self_speculation_resumes_and_stops_its_arenas_at_an_accepted_eos():
    """With γ = 4 and a draft that agrees, an EOS arrives mid-round; the tokens after it must not be committed."""
    loaded = tiny_loaded()
    draft = DraftOptions(loaded, CacheOptions(make_policy("streaming", 16), prefill_chunk=8), gamma=4, is_self=True)
    first = prompt(20)
    plain = list(run_generation(loaded, first, max_new_tokens=12, sampling=GREEDY, cache=CacheOptions(prefill_chunk=8)))
    eos = {plain[5]}
    session = Session(loaded, CacheOptions(prefill_chunk=8), draft, capacity=256)
    stats = RunStats()
    answer = list(session.run(first, max_new_tokens=12, sampling=GREEDY, eos_ids=eos, stats=stats))
    assert answer == plain[: plain.index(plain[5]) + 1]
    assert stats.speculative.accepted > 0
    assert session.held_tokens == len(first) + len(answer) - 1
    follow = first + answer + prompt(5, seed=7)
    assert session.reusable(follow) == session.held_tokens
    resumed = list(session.run(follow, max_new_tokens=12, sampling=GREEDY))
    assert resumed == list(run_generation(loaded, follow, max_new_tokens=12, sampling=GREEDY,
                                          cache=CacheOptions(prefill_chunk=8), draft=draft))


def test_budget_reuse_reports_evictions_and_equals_fresh_until_the_budget_fills():
    loaded = tiny_loaded()
    cache = CacheOptions(make_policy("hybrid", 40), "in-cache", prefill_chunk=8)
    session = Session(loaded, cache)
    outputs, stats = three_turns(session, prompt(10), max_new=8)
    reread, _ = three_turns(Session(loaded, cache), prompt(10), max_new=8, reread=True)
    # Turn 1 (18 tokens) and turn 2 (31 tokens) fit in 40: nothing evicted, resumed == re-read.
    assert [s.evicted_tokens for s in stats[:2]] == [0, 0]
    assert outputs[:2] == reread[:2]
    # Turn 3 outgrows the budget: the resumed cache evicts while decoding and says how many.
    assert stats[2].reused_tokens > 0 and stats[2].evicted_tokens > 0
    assert session.evicted_tokens == sum(s.evicted_tokens for s in stats)


def test_a_run_that_fails_inside_a_pass_is_not_resumed_from(monkeypatch):
    loaded = tiny_loaded()
    session = Session(loaded, CacheOptions(prefill_chunk=8), capacity=256)
    forward_blocks = loaded.model.forward_blocks
    calls = []

    def failing(blocks):
        calls.append(1)
        if len(calls) == 6:
            blocks[0].cache.begin(1)  # the arena is left with an open block, as an interrupted pass leaves it
            raise KeyboardInterrupt
        return forward_blocks(blocks)

    monkeypatch.setattr(loaded.model, "forward_blocks", failing)
    answer = []
    with pytest.raises(KeyboardInterrupt):
        for token in session.run(prompt(20), max_new_tokens=10, sampling=GREEDY):
            answer.append(token)
    monkeypatch.undo()
    assert len(answer) == 2
    follow = prompt(20) + answer + prompt(5, seed=3)  # extends the text, but the arena is broken
    assert session.reusable(follow) == 0
    expected = run_generation(loaded, follow, max_new_tokens=6, sampling=GREEDY, cache=CacheOptions(prefill_chunk=8))
    assert list(session.run(follow, max_new_tokens=6, sampling=GREEDY)) == list(expected)


def test_each_turn_that_outgrows_the_budget_is_held_and_selected_and_reports_its_peak():
    """Retention applies to every prompt a session reads: a follow-up's new tokens are held beside the entries kept
    from before and chosen from together; each run reports its own peak."""
    loaded = tiny_loaded()
    session = Session(loaded, CacheOptions(make_policy("hybrid", 24, sinks=2), "in-cache", prefill_chunk=8))
    target = []
    history = prompt(60)
    peaks = []
    for turn in range(3):
        stats = RunStats()
        target = list(session.run(history, max_new_tokens=4, sampling=GREEDY, stats=stats))
        peaks.append((stats.kv_peak_bytes, stats.kv_cache_bytes))
        history = history + target + prompt(20 if turn == 0 else 3, seed=turn + 2)
    arena = session.arenas[0]
    assert arena.n_committed == 24 and arena.capacity == 24 + 8
    # Turn 1 held its 60-token prompt, turn 2 its 24 kept entries plus the 23 tokens it had not read; turn 3's few
    # new tokens fit in the staging slots, so its hold needed no room: each run reports its own peak.
    steady = peaks[0][1]
    assert all(cache == steady for _, cache in peaks)
    assert peaks[0][0] > peaks[1][0] > steady and peaks[2][0] == steady


class ScriptedGamma:
    """A controller whose rounds draft 3, 3, then sit out 40 plain steps, then draft again: the draft misses more
    than ``CATCH_UP_TOKENS`` and restarts from the end of what it missed."""

    gamma_max = 3

    def __init__(self):
        self.script = [3, 3] + [0] * 40 + [3] * 200
        self.gamma = self.script.pop(0)

    def update(self, drafted, accepted, draft_s, target_s):
        self.gamma = self.script.pop(0)


def test_a_restarted_draft_resumes_the_next_turn_from_the_text_it_holds(monkeypatch):
    """After a turn whose draft restarted, the next turn feeds the draft only the text after what it holds (not the
    whole prompt again), and both turns decode the target's own tokens."""
    import sparsespec.engine as engine

    loaded = tiny_loaded()
    monkeypatch.setattr(engine, "DraftWhileFaster", lambda gamma, start_drafting: ScriptedGamma())
    draft = DraftOptions(loaded, CacheOptions(make_policy("streaming", 16), prefill_chunk=8), gamma=3, is_self=True,
                         only_while_faster=True)
    session = Session(loaded, CacheOptions(prefill_chunk=8), draft, capacity=512)
    first = prompt(20)
    stats = RunStats()
    answer = list(session.run(first, max_new_tokens=80, sampling=GREEDY, stats=stats))
    assert answer == list(run_generation(loaded, first, max_new_tokens=80, sampling=GREEDY,
                                         cache=CacheOptions(prefill_chunk=8)))
    assert stats.speculative.draft_restarts == 1 and stats.speculative.draft_origin_shift > 0
    fed = []
    prefill_steps = engine.prefill_steps
    monkeypatch.setattr(engine, "prefill_steps",
                        lambda model, arena, ids, chunk, draft=False: fed.append((draft, len(ids)))
                        or prefill_steps(model, arena, ids, chunk, draft=draft))
    follow = first + answer + prompt(5, seed=7)
    resumed = list(session.run(follow, max_new_tokens=12, sampling=GREEDY))
    assert resumed == list(run_generation(loaded, follow, max_new_tokens=12, sampling=GREEDY,
                                          cache=CacheOptions(prefill_chunk=8)))
    draft_fed = [n for is_draft, n in fed if is_draft]
    assert draft_fed and draft_fed[0] < 10  # the new tokens of the turn, not the ~100-token history
