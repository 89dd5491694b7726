"""The evaluation harness: streaming perplexity, the prompt set, the resumable sweep (retention axis and retrieval
included), the ppl/sweep arguments."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_config, tiny_model
from sparsespec.cache.arena import KVArena
from sparsespec.cache.policy import make_policy
from sparsespec.errors import UserError
from sparsespec.eval import needle, sweep
from sparsespec.eval.commands import add_ppl_arguments, add_sweep_arguments, run_ppl, run_sweep
from sparsespec.eval.needle import Answer, NeedlePrompt, NeedleSetup
from sparsespec.eval.perplexity import (
    moving_average,
    nll_from_logits,
    perplexity,
    plot_nll,
    streaming_nll,
    window_perplexities,
)
from sparsespec.eval.prompts import KINDS, load_prompts, parse_kinds
from sparsespec.eval.sweep import (
    RECORD_FIELDS,
    SweepEvaluator,
    SweepOptions,
    SweepPoint,
    _hybrid_gap_along_text,
    aggregate_stats,
    build_grid,
    describe_record,
    parse_draft,
    plot_sweep,
    read_records,
    retrieval_summary,
    run_grid,
    setup_id,
)

N_TOKENS = 160


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def token_ids(model):
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, model.config.vocab_size, (N_TOKENS,), generator=g).tolist()


def arena_for(model, policy, chunk, positions="original", max_tokens=N_TOKENS):
    return KVArena(model.config, policy, dtype=torch.float32, max_tokens=max_tokens, max_block=chunk,
                   positions=positions)


def autoregressive_nll(model, policy, token_ids, positions):
    """Per-token NLLs of a plain decoding loop: one token per forward pass, committed after each."""
    arena = arena_for(model, policy, 1, positions)
    out = []
    for i in range(len(token_ids) - 1):
        logits = model.forward(torch.tensor([token_ids[i]]), arena)
        arena.commit(1)
        out.append(-torch.log_softmax(logits[0].double(), dim=-1)[token_ids[i + 1]])
    return torch.stack(out)


# ------------------------------------------------------------------------------------------- perplexity
@pytest.mark.parametrize("chunk", [1, 13, N_TOKENS])
def test_full_cache_streaming_nll_equals_one_full_pass(model, token_ids, chunk):
    full = make_policy("full")
    logits = model.forward(torch.tensor(token_ids), arena_for(model, full, N_TOKENS))
    reference = nll_from_logits(logits, token_ids)
    nll = streaming_nll(model, arena_for(model, full, chunk), token_ids, chunk)
    assert nll.dtype == torch.float64 and nll.shape == (N_TOKENS - 1,)
    # Only float32 summation order differs between chunkings (NLLs here are ~30 nats).
    torch.testing.assert_close(nll, reference, rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("positions", ["original", "in-cache"])
def test_chunk_one_is_autoregressive_decoding_and_larger_chunks_differ(model, token_ids, positions):
    policy = make_policy("hybrid", 24)
    reference = autoregressive_nll(model, policy, token_ids, positions)
    exact = streaming_nll(model, arena_for(model, policy, 1, positions), token_ids, 1)
    torch.testing.assert_close(exact, reference, rtol=0, atol=1e-6)

    chunked = streaming_nll(model, arena_for(model, policy, 16, positions), token_ids, 16)
    # Before the budget fills, nothing is evicted, so the chunked run agrees there ...
    torch.testing.assert_close(chunked[:24], reference[:24], rtol=1e-6, atol=1e-4)
    # ... afterwards, tokens inside a chunk see up to 15 extra entries and evictions are chosen per chunk.
    later = (chunked[24:] - reference[24:]).abs()
    assert later.max() > 1e-2
    assert int((later > 1e-3).sum()) > 20


def test_streaming_nll_rejects_chunks_larger_than_the_arena_block(model, token_ids):
    with pytest.raises(ValueError, match="max_block"):
        streaming_nll(model, arena_for(model, make_policy("hybrid", 24), 4), token_ids, 8)


def test_summary_helpers():
    nll = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=torch.float64)
    assert perplexity(nll) == pytest.approx(math.exp(3.0))
    assert window_perplexities(nll, 2) == pytest.approx([math.exp(1.5), math.exp(3.5), math.exp(5.0)])
    torch.testing.assert_close(moving_average(nll, 2), torch.tensor([1.0, 1.5, 2.5, 3.5, 4.5], dtype=torch.float64))
    assert math.isnan(perplexity(torch.empty(0)))


def test_plot_nll_writes_a_png(tmp_path):
    path = plot_nll({"a": torch.rand(50), "b": torch.rand(40)}, tmp_path / "nll.png", window=8)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------- prompts
def test_prompt_set_has_the_required_kinds():
    prompts = load_prompts()
    counts = {kind: sum(p.kind == kind for p in prompts) for kind in KINDS}
    assert counts["code"] >= 6 and counts["prose"] >= 6 and counts["chat"] >= 3
    assert all(p.chat == (p.kind == "chat") for p in prompts)
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.text.strip() for p in prompts)
    assert {p.kind for p in load_prompts(["code", "chat"])} == {"code", "chat"}
    two_each = load_prompts(["code", "prose"], per_kind=2)
    assert [p.kind for p in two_each] == ["code", "code", "prose", "prose"]
    assert [p.id for p in two_each] == [p.id for p in prompts if p.kind == "code"][:2] + [
        p.id for p in prompts if p.kind == "prose"][:2]
    assert parse_kinds("all") is None and parse_kinds("code, prose") == ("code", "prose")
    with pytest.raises(UserError, match="Unknown prompt kind"):
        parse_kinds("code,poetry")


# ------------------------------------------------------------------------------------------------ sweep
def test_grid_collapses_axes_that_do_not_apply():
    points = build_grid(["full", "hybrid"], [32, 64], ["original", "in-cache"], [2, "auto"], [None, "self:16"])
    full = [p for p in points if p.policy == "full"]
    assert {(p.budget, p.positions) for p in full} == {(None, "original")}
    assert {(p.draft, p.gamma) for p in full} == {(None, None), ("self:16", 2), ("self:16", "auto")}
    assert len(points) == 3 + 2 * 2 * 3
    assert len({p.key("x") for p in points}) == len(points)
    assert parse_draft("self:16") == ("self", 16) and parse_draft("self") == ("self", None)
    with pytest.raises(UserError):
        build_grid(["hybrid"], [3], ["original"])  # too small for 4 sinks plus a window
    with pytest.raises(UserError):
        build_grid(["hybrid"], [32], ["sideways"])


def test_sweep_refuses_int4_keys_that_would_keep_the_key_bias_in_before_measuring():
    evaluator = SweepEvaluator(SimpleNamespace(config=tiny_config("qwen2"), name="tiny qwen2"),
                               SweepOptions(quality=False, speed=False))
    evaluator.check(SweepPoint("hybrid", 32, "in-cache", kv_dtype="int4"))
    evaluator.check(SweepPoint("full", None, "original", kv_dtype="int4"))
    with pytest.raises(UserError, match="int4 keys in the original position mode"):
        evaluator.check(SweepPoint("hybrid", 32, "original", kv_dtype="int4"))


def fake_result(point: SweepPoint) -> dict:
    budget = point.budget or 1000
    correct = 10 if point.retention == "auto" else min(budget // 16, 10)
    return {
        "cache": point.policy,
        "quality": {"ppl": 10 + 1000 / budget, "kv_cache_bytes": budget * 64,
                    "window": 8, "window_ppl": [10 + 1000 / budget + i for i in range(5)]},
        "speed": {"tokens_per_s": 50 - budget / 100,
                  **({"acceptance_rate": 0.5 + budget / 4000, "tokens_per_target_pass": 2.0} if point.draft else {})},
        "retrieval": {"task": "passkey", "cells": 10, "correct": correct, "fraction": correct / 10},
    }


def test_sweep_resumes_and_writes_each_key_once(tmp_path):
    out = tmp_path / "sweep.jsonl"
    points = build_grid(["full", "hybrid", "streaming"], [32, 64], ["original", "in-cache"], [4], [None, "self"])
    setup = {"model": "tiny", "max_tokens": 100}
    calls: list[SweepPoint] = []

    def evaluate(point):
        calls.append(point)
        return fake_result(point)

    first = run_grid(points, out, evaluate, setup)
    assert len(calls) == len(points) == len(first)
    lines = out.read_text().splitlines()
    assert len(lines) == len(points)

    # An interrupted run: two complete lines and a third cut short.
    out.write_text("\n".join(lines[:2]) + "\n" + lines[2][:20])
    calls.clear()
    seen = []
    records = run_grid(points, out, evaluate, setup, on_record=lambda r, reused: seen.append(reused))
    assert calls == points[2:]
    assert seen == [True, True] + [False] * (len(points) - 2)
    final = read_records(out)
    keys = [r["key"] for r in final]
    assert sorted(keys) == sorted(p.key(setup_id(setup)) for p in points)
    assert len(keys) == len(set(keys))
    assert [r["key"] for r in records] == [p.key(setup_id(setup)) for p in points]

    # Nothing left to do; a different setup measures everything again under new keys.
    calls.clear()
    run_grid(points, out, evaluate, setup)
    assert calls == []
    run_grid(points[:1], out, evaluate, {**setup, "max_tokens": 200})
    assert calls == points[:1]

    for line in out.read_text().splitlines()[2:]:
        record = json.loads(line)
        assert tuple(record) == RECORD_FIELDS
        assert record["setup_id"] == setup_id(record["setup"])
        assert record["key"].endswith(record["setup_id"])
        assert record["policy"] in ("full", "hybrid", "streaming")
        assert record["budget"] is None or isinstance(record["budget"], int)
        assert record["positions"] in ("original", "in-cache")
        assert record["gamma"] is None if record["draft"] is None else record["gamma"] == 4
        assert record["rss_peak_bytes"] >= record["rss_bytes"] > 0
        assert record["seconds"] >= 0 and record["finished_at"]
        assert isinstance(record["quality"], dict) and isinstance(record["speed"], dict)


def test_sweep_plots(tmp_path, monkeypatch):
    points = build_grid(["full", "streaming", "hybrid"], [32, 64, 128], ["original"], [4], [None, "self"],
                        retentions=["auto", "off"])
    records = run_grid(points, tmp_path / "s.jsonl", fake_result, {"m": 1})
    drawn = {}
    draw = sweep._draw

    def spy(path, title, xlabel, ylabel, series, flat, *args, **kwargs):
        drawn[path.name] = series, flat
        return draw(path, title, xlabel, ylabel, series, flat, *args, **kwargs)

    monkeypatch.setattr(sweep, "_draw", spy)
    written = plot_sweep(records, tmp_path / "plots")
    assert sorted(p.name for p in written) == [
        "acceptance_vs_budget.png", "ppl_gap_vs_position.png", "ppl_vs_budget.png", "ppl_vs_kv_bytes.png",
        "retrieval_vs_budget.png", "tokps_vs_budget.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in written)
    # Retrieval: a series per policy and retention (drafts answer as the target does), the full cache flat.
    series, flat = drawn["retrieval_vs_budget.png"]
    assert sorted(series) == ["hybrid (original)", "hybrid (original), retention off", "streaming (original)"]
    assert sorted(series["hybrid (original), retention off"]) == [(32, 0.2), (64, 0.4), (128, 0.8)]
    assert flat == {"full": 1.0}
    # Perplexity does not depend on retention: one series per policy.
    assert sorted(drawn["ppl_vs_budget.png"][0]) == ["hybrid (original)", "streaming (original)"]


def test_retention_axis_collapses_without_heavy_hitters_and_leaves_auto_keys_as_they_were():
    policies = ["full", "window", "streaming", "hybrid"]
    before = build_grid(policies, [32], ["original"])
    points = build_grid(policies, [32], ["original"], retentions=["auto", "off", "query"])
    assert [(p.policy, p.retention) for p in points] == [
        ("full", "auto"), ("window", "auto"), ("streaming", "auto"), ("hybrid", "auto"), ("hybrid", "off")]
    assert points[:4] == before  # query is auto's choice for heavy hitters; no heavy hitters, nothing to switch
    assert points[3].key("x") == "hybrid|budget=32|positions=original|draft=-|gamma=-|setup=x"
    assert points[4].key("x") == "hybrid|budget=32|positions=original|draft=-|gamma=-|retention=off|setup=x"
    assert points[4].label() == "hybrid@32/original retention off"
    cache = SweepEvaluator(None, SweepOptions()).cache_options(points[4])
    assert cache.retention == "off" and cache.policy.budget == 32
    with pytest.raises(UserError, match="Unknown retention 'sometimes' in retentions"):
        build_grid(["hybrid"], [32], ["original"], retentions=["auto", "sometimes"])
    with pytest.raises(UserError, match="retentions is empty"):
        build_grid(["hybrid"], [32], ["original"], retentions=[])


def needle_prompt(length: int, depth: float) -> NeedlePrompt:
    """A retrieval prompt of ``length`` made-up tokens, its 8-token needle ``depth`` percent of the way in."""
    at = round(depth / 100 * (length - 8))
    return NeedlePrompt(length=length, depth=float(depth), trial=0, ids=tuple(range(length)),
                        question="What is the secret passkey?", expected=str(10000 + length + int(depth)),
                        needle=(at, at + 8), document=(0, length))


def planted_answerer(calls: list):
    """A stand-in for ``needle.engine_answerer`` (same arguments), logging them to ``calls``, whose answers recall
    what the cache would still hold: every needle with the full cache or with retention on a heavy-hitter policy,
    else only a needle among the budget's newest tokens."""

    def make(target, cache, draft, max_new_tokens):
        calls.append((cache, draft, max_new_tokens))
        policy = cache.policy

        def answer(prompt: NeedlePrompt) -> Answer:
            kept = (policy.is_full or (policy.needs_scores and cache.retention != "off")
                    or len(prompt.ids) - prompt.needle[0] <= policy.budget)
            return Answer(f"The passkey is {prompt.expected}." if kept else "I do not remember it.")

        return answer

    return make


def test_sweep_records_retrieval_per_point_from_a_planted_answerer(tmp_path):
    setup = NeedleSetup(lengths=(300, 600), depths=(0, 50, 100), chat=False)
    calls = []
    evaluator = SweepEvaluator(SimpleNamespace(config=tiny_config(), name="tiny"),
                               SweepOptions(quality=False, speed=False, retrieval=setup, answer_tokens=7),
                               needle_prompts=[needle_prompt(n, d) for n, d, _ in setup.cells()],
                               answerer=planted_answerer(calls))
    points = build_grid(["full", "hybrid"], [160], ["original"], retentions=["auto", "off"])
    for point in points:
        evaluator.check(point)
    records = run_grid(points, tmp_path / "s.jsonl", evaluator, {"m": 1})
    assert read_records(tmp_path / "s.jsonl") == records
    assert [(r["policy"], r["retention"]) for r in records] == [("full", "auto"), ("hybrid", "auto"),
                                                                 ("hybrid", "off")]
    # Each point's answers came from its own target cache, without a draft, at most answer_tokens long.
    assert [(cache.policy.budget, cache.retention, draft, n) for cache, draft, n in calls] == [
        (None, "auto", None, 7), (160, "auto", None, 7), (160, "off", None, 7)]
    for record in records:
        assert tuple(record) == RECORD_FIELDS and record["quality"] is None and record["speed"] is None
    assert records[0]["retrieval"]["correct"] == records[1]["retrieval"]["correct"] == 6
    # Without retention only the needles within the newest 160 tokens are recalled: depth 100 everywhere, and
    # depth 50 of the 300-token prompts (154 tokens from the end).
    assert records[2]["retrieval"] == {
        "task": "passkey", "lengths": [300, 600], "depths": [0.0, 50.0, 100.0], "cells": 6, "correct": 3,
        "fraction": 0.5, "by_length": {"300": {"cells": 3, "correct": 2, "fraction": 0.6667},
                                       "600": {"cells": 3, "correct": 1, "fraction": 0.3333}}}
    assert describe_record(records[2]).startswith("hybrid@160/original retention off, retrieval 3/6 (50%), ")

    too_long = SweepEvaluator(SimpleNamespace(config=tiny_config(), name="tiny"),
                              SweepOptions(quality=False, speed=False, retrieval=setup),
                              needle_prompts=[needle_prompt(4090, 50)])
    with pytest.raises(UserError, match=r"The longest retrieval prompt plus its answer \(4106 tokens\) exceeds tiny"):
        too_long.check(points[0])


def test_retrieval_in_turns_is_scored_per_question_and_per_turn():
    """With turns every question counts, and ``by_turn`` scores each turn (absent without turns)."""
    records = [{"length": 600, "depth": depth, "turn": turn, "correct": turn == 0 or (depth, turn) == (0.0, 2)}
               for depth in (0.0, 100.0) for turn in range(3)]
    summary = retrieval_summary("multikey", records)
    assert (summary["cells"], summary["correct"]) == (6, 3)
    assert summary["by_turn"] == {"1": {"cells": 2, "correct": 2, "fraction": 1.0},
                                  "2": {"cells": 2, "correct": 0, "fraction": 0.0},
                                  "3": {"cells": 2, "correct": 1, "fraction": 0.5}}
    assert "by_turn" not in retrieval_summary("multikey", [r for r in records if r["turn"] == 0])


def test_sweep_names_its_parameters_in_a_context_error_and_the_command_words_them_as_flags():
    from sparsespec.errors import ConfigError, user_message
    from sparsespec.eval.commands import SWEEP_PARAMETER_FLAGS

    evaluator = SweepEvaluator(SimpleNamespace(config=tiny_config(), name="tiny"),
                               SweepOptions(quality=True, speed=False), text_ids=list(range(5000)))
    with pytest.raises(ConfigError) as error:
        evaluator.check(build_grid(["full"], [160], ["original"])[0])
    assert str(error.value).startswith("The quality text (max_tokens) (5000 tokens) exceeds tiny's context")
    assert user_message(error.value, SWEEP_PARAMETER_FLAGS).startswith("The quality text (--max-tokens) (5000 tokens)")


def test_hybrid_gap_along_text_is_the_smoothed_percent_above_full():
    def record(policy, budget, positions, curve):
        return {"policy": policy, "budget": budget, "positions": positions, "draft": None,
                "quality": {"window": 4, "window_ppl": curve}}

    records = [record("full", None, "original", [10.0, 10.0, 20.0]),
               record("hybrid", 8, "in-cache", [11.0, 12.0, 22.0]),
               record("window", 8, "in-cache", [99.0, 99.0, 99.0])]
    window, series = _hybrid_gap_along_text(records, smooth=2)
    assert window == 4 and list(series) == ["hybrid 8 (in-cache)"]
    positions, gaps = zip(*series["hybrid 8 (in-cache)"])
    assert positions == (4, 8, 12) and gaps == pytest.approx([10.0, 15.0, 15.0])
    assert _hybrid_gap_along_text(records[1:]) is None  # no full-cache curve to compare with


def test_aggregate_stats_weights_by_tokens():
    from sparsespec.engine import RunStats
    from sparsespec.speculative import SpeculativeStats

    a = RunStats(prompt_tokens=10, new_tokens=11, decode_seconds=1.0, kv_cache_bytes=100, kv_peak_bytes=300,
                 speculative=SpeculativeStats(target_passes=5, draft_passes=8, drafted=8, accepted=6, new_tokens=11,
                                              draft_seconds=0.4, target_seconds=1.0))
    b = RunStats(prompt_tokens=20, new_tokens=31, decode_seconds=2.0, kv_cache_bytes=100, kv_peak_bytes=100,
                 speculative=SpeculativeStats(target_passes=10, draft_passes=32, drafted=32, accepted=14,
                                              new_tokens=31, draft_seconds=1.6, target_seconds=2.0))
    out = aggregate_stats([a, b])
    assert out["tokens_per_s"] == pytest.approx(42 / 3.0, abs=1e-3)  # every new token, over the decode time
    assert out["acceptance_rate"] == pytest.approx(20 / 40)
    assert out["tokens_per_target_pass"] == pytest.approx(42 / 15)
    assert out["draft_target_cost_ratio"] == pytest.approx((2.0 / 40) / (3.0 / 15))
    assert out["prompt_tokens"] == 30 and out["new_tokens"] == 42
    assert out["kv_cache_bytes"] == 100 and out["kv_peak_bytes"] == 300  # the most any run held


# ------------------------------------------------------------------------------------------- arguments
def parse(adder, argv):
    parser = argparse.ArgumentParser()
    adder(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--text", "/nonexistent/file.txt"], "does not exist"),
        (["--text", "corpus:"], "needs a text name"),
        (["--text", "corpus:no_such_play_xyz"], "corpus"),
        (["--text", "FILE", "--max-tokens", "1"], "at least 2"),
        (["--text", "FILE", "--chunk", "0"], "--chunk"),
        (["--text", "FILE", "--plot", "out.svg"], ".png"),
        (["--text", "FILE", "--policy", "hybrid"], "needs --budget"),
    ],
)
def test_ppl_argument_errors(tmp_path, argv, message):
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question.")
    argv = [str(text) if a == "FILE" else a for a in argv]
    with pytest.raises(UserError, match=message):
        run_ppl(parse(add_ppl_arguments, ["--model", "unused-model"] + argv))


def test_ppl_max_tokens_beyond_context_is_refused_before_loading(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 97, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    }))
    (folder / "model.safetensors").write_bytes(b"")  # never read: the check comes first
    text = tmp_path / "t.txt"
    text.write_text("word " * 50)
    base = ["--model", str(folder), "--text", str(text), "--max-tokens", "500"]
    with pytest.raises(UserError, match="context of 128"):
        run_ppl(parse(add_ppl_arguments, base))
    with pytest.raises(UserError, match="context of 128"):
        run_ppl(parse(add_ppl_arguments, base + ["--policy", "hybrid", "--budget", "32"]))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--out", "x.jsonl", "--quality"], "needs --text"),
        (["--out", "x.json", "--speed"], ".jsonl"),
        (["--out", "x.jsonl", "--speed", "--context-tokens", "10"], "give --text too"),
        (["--out", "x.jsonl", "--speed", "--new-tokens", "0"], "--new-tokens"),
        (["--out", "x.jsonl", "--speed", "--budgets", "32,abc"], "integers"),
        (["--out", "x.jsonl", "--speed", "--draft", "self", "--gammas", "0"], "--gamma must be from 1 to 64"),
        (["--out", "x.jsonl", "--speed", "--gammas", "2"], "--gammas does nothing without a draft"),
        (["--out", "x.jsonl", "--speed", "--draft-budget", "32"], "--draft-budget does nothing without a draft"),
        (["--out", "x.jsonl", "--speed", "--chunk", "4", "--ppl-window", "64"], "--chunk, --ppl-window do nothing"),
        (["--out", "x.jsonl", "--quality", "--new-tokens", "8"], "--new-tokens does nothing without the speed"),
        (["--out", "x.jsonl", "--speed", "--positions", "diagonal"], "position mode"),
        (["--out", "x.jsonl", "--speed", "--prompts", "poetry"], "prompt kind"),
        (["--out", "missing.jsonl", "--plot-only", "--plots", "DIR"], "no sweep records"),
        (["--out", "x.jsonl", "--plot-only"], "needs --plots"),
        (["--out", "x.jsonl", "--speed", "--draft", "self", "--draft-policy", "window", "--draft-heavy", "3"],
         "heavy hitters"),
        (["--out", "x.jsonl", "--speed", "--kv-dtypes", "int8,int2"], "KV dtype"),
        (["--out", "x.jsonl", "--speed", "--kv-bytes", "4MB"], "--kv-bytes takes a size"),
        (["--out", "x.jsonl", "--speed", "--kv-bytes", "4MiB", "--budgets", "32"], "not both"),
        (["--out", "x.jsonl", "--speed", "--retrieval-lengths", "512"],
         "--retrieval-lengths does nothing without --retrieval"),
        (["--out", "x.jsonl", "--retrieval", "--text", "t.txt", "--new-tokens", "8"],
         r"--new-tokens does nothing without the speed runs \(the sweep measures only retrieval\)"),
        (["--out", "x.jsonl", "--quality", "--text", "t.txt", "--retentions", "auto,off"],
         "--retentions does nothing without the speed runs or --retrieval"),
        (["--out", "x.jsonl", "--retrieval"], "--retrieval plants its needles in --text"),
        (["--out", "x.jsonl", "--retrieval", "--text", "t.txt", "--retrieval-task", "riddle"],
         "Unknown --retrieval-task 'riddle'"),
        (["--out", "x.jsonl", "--retrieval", "--text", "t.txt", "--retrieval-depths", "0,150"],
         "--retrieval-depths are percentages"),
        (["--out", "x.jsonl", "--retrieval", "--text", "t.txt", "--retrieval-lengths", "1k"],
         "--retrieval-lengths takes comma-separated whole numbers"),
        (["--out", "x.jsonl", "--speed", "--retentions", "auto,sometimes"], "Unknown retention 'sometimes'"),
    ],
)
def test_sweep_argument_errors(tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    argv = [str(tmp_path / "plots") if a == "DIR" else a for a in argv]
    with pytest.raises(UserError, match=message):
        run_sweep(parse(add_sweep_arguments, ["--model", "unused-model"] + argv))


def test_sweep_plot_only_draws_from_the_file(tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    run_grid(build_grid(["full", "hybrid"], [32, 64], ["original"]), out, fake_result, {"m": 1})
    args = parse(add_sweep_arguments, ["--out", str(out), "--plot-only", "--plots", str(tmp_path / "p")])
    assert run_sweep(args) == 0
    assert "ppl_vs_budget.png" in capsys.readouterr().out


# -------------------------------------------------------------------------------------------- real model
def test_smollm2_streaming_perplexity_smoke(smollm2_f32, tmp_path):
    from sparsespec.engine import CacheOptions
    from sparsespec.eval.perplexity import measure_perplexity
    from sparsespec.eval.texts import text_token_ids
    from sparsespec.loading.fetch import corpus_names

    # CI fetches only the model: read the prompt set's prose as one text instead
    spec = "corpus:hamlet" if "hamlet" in corpus_names() else str(prose_file(tmp_path))
    ids = text_token_ids(smollm2_f32.tokenizer, spec, 200)
    assert len(ids) == 200
    _, summary = measure_perplexity(smollm2_f32, CacheOptions(make_policy("hybrid", 64)), ids, 64, window=64)
    cfg = smollm2_f32.config
    assert 2.0 < summary["ppl"] < 100.0  # a trained model on English verse, not a random one (~49k)
    assert summary["predicted_tokens"] == 199 and len(summary["window_ppl"]) == 4
    assert summary["evicted_tokens"] > 0
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4  # K and V, float32
    assert summary["kv_cache_bytes"] == (64 + 64) * per_token  # budget + one chunk of staging


def prose_file(tmp_path) -> Path:
    """The prompt set's prose and chat as one text file of about 400 tokens, a text every checkout has."""
    path = tmp_path / "prose.txt"
    path.write_text("\n\n".join(p.text for p in load_prompts(["prose", "chat"])))
    return path


def sweep_on_smollm2(monkeypatch, model, tmp_path, *flags: str) -> Path:
    """Run ``sparsespec sweep FLAGS`` on the session's loaded SmolLM2 (no second load) with its prose as --text;
    return the --out file."""
    import sparsespec.loading.load as load

    monkeypatch.setattr(load, "load_model", lambda *args, **kwargs: model)
    out = tmp_path / "s.jsonl"
    argv = ["--out", str(out), "--text", str(prose_file(tmp_path)), "--quiet", "--dtype", "float32", *flags]
    assert run_sweep(parse(add_sweep_arguments, argv)) == 0
    return out


def test_sweep_retrieval_through_the_command(capsys, monkeypatch, smollm2_f32, tmp_path):
    """--retrieval and --retentions as a user gives them, SmolLM2's tokenizer building the prompts and a planted
    answerer standing in for its greedy answers: the summary lines, the setup recorded, the plot."""
    calls = []
    monkeypatch.setattr(needle, "engine_answerer", planted_answerer(calls))
    plots = tmp_path / "plots"
    out = sweep_on_smollm2(monkeypatch, smollm2_f32, tmp_path, "--retrieval", "--retrieval-lengths", "256",
                           "--retrieval-depths", "0,100", "--policies", "full,streaming,hybrid", "--budgets", "128",
                           "--retentions", "auto,off", "--plots", str(plots))
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines[0] == f"sweep: 4 points -> {out}"
    assert [line.split(", ")[:2] for line in lines[1:]] == [
        ["full", "retrieval 2/2 (100%)"], ["streaming@128/original", "retrieval 1/2 (50%)"],
        ["hybrid@128/original", "retrieval 2/2 (100%)"], ["hybrid@128/original retention off", "retrieval 1/2 (50%)"]]
    assert captured.out.split() == [str(plots / "retrieval_vs_budget.png")]
    records = read_records(out)
    assert all(r["setup"]["measure"] == ["retrieval"] for r in records)
    assert records[0]["setup"]["retrieval"] == {"task": "passkey", "lengths": [256], "depths": [0.0, 100.0],
                                                "keys": 1, "seed": 0, "chat": True, "answer_tokens": 16}
    assert [n for _, _, n in calls] == [16] * 4


def test_one_real_retrieval_cell_on_smollm2(monkeypatch, smollm2_f32, tmp_path):
    """The real answerer: SmolLM2 with a hybrid cache and retention reads one 256-token prompt and answers."""
    out = sweep_on_smollm2(monkeypatch, smollm2_f32, tmp_path, "--retrieval", "--retrieval-lengths", "256",
                           "--retrieval-depths", "50", "--policies", "hybrid", "--budgets", "128")
    (record,) = read_records(out)
    assert record["retention"] == "auto" and record["cache"] == "hybrid(sinks=4, heavy=62, window=62)"
    retrieval = record["retrieval"]
    assert retrieval["cells"] == 1 and retrieval["correct"] in (0, 1)
    assert retrieval["by_length"] == {"256": {"cells": 1, "correct": retrieval["correct"],
                                              "fraction": retrieval["fraction"]}}
