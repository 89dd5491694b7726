"""``sparsespec needle``: prompt construction (length, depth, reproducibility, multikey), answer scoring, the grid
runner with a planted answerer, the heatmap, the command's mistakes, and one real cell on SmolLM2."""

from __future__ import annotations

import json
import random

import pytest

from sparsespec.cli import main
from sparsespec.errors import ConfigError, UserError
from sparsespec.eval import needle
from sparsespec.loading.tokenizer import Tokenizer
from sparsespec.eval.needle import (
    TASKS,
    Answer,
    Haystack,
    NeedleSetup,
    answer_is_correct,
    boundary_near,
    build_prompt,
    build_prompts,
    plant_sentences,
    plot_heatmap,
    run_needle_grid,
    score_grid,
    summary_table,
)

VERSE_WORDS = ("the of and to in that with his from all their but not which by heaven night fire light dark sea "
               "wind stone gate king hand eyes voice deep high long cold bright slow stood fell rose spake heard "
               "saw beheld wandering golden ancient silent").split()
CHAT_TEMPLATE = ("{% for m in messages %}<|user|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def verse(lines: int = 3000, seed: int = 0) -> str:
    """Made-up verse, one short line after another, as a long haystack text (the corpus is not fetched on CI)."""
    rng = random.Random(seed)
    return "".join(" ".join(rng.choice(VERSE_WORDS) for _ in range(rng.randint(5, 9))).capitalize() + ",\n"
                   for _ in range(lines))


@pytest.fixture(scope="module")
def haystack_text() -> str:
    return verse()


@pytest.fixture(scope="module")
def bpe_tokenizer(haystack_text):
    """A small byte-level BPE trained on the haystack and the needles' words (lossless, with offsets, a BOS and a
    chat template)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<s>", "<|user|>", "<|assistant|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    needle_words = [needle.INTRO, *needle.LOCKS, *(f"{f.statement} {f.question}" for f in needle.FACTS)]
    backend.train_from_iterator([haystack_text, *needle_words * 20], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return Tokenizer.from_transformers(tokenizer)


@pytest.fixture(params=["bpe", "smollm2"])
def tokenizer(request, bpe_tokenizer):
    """The test BPE, and the real SmolLM2 tokenizer where that model is fetched."""
    if request.param == "bpe":
        return bpe_tokenizer
    return request.getfixturevalue("smollm2_f32").tokenizer


def prompt_text(tokenizer, prompt) -> str:
    return tokenizer.decode(list(prompt.ids))


def assistant_turn(tokenizer) -> str:
    """What the chat template puts after a user message to open the assistant's turn."""
    return tokenizer.apply_chat_template([{"role": "user", "content": "MESSAGE"}], add_generation_prompt=True,
                                         tokenize=False).split("MESSAGE")[-1]


# ---------------------------------------------------------------------------------------------- construction
@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("chat", [True, False])
def test_prompt_has_the_requested_length(tokenizer, haystack_text, task, chat):
    haystack = Haystack(haystack_text, tokenizer)
    setup = NeedleSetup(task=task, lengths=(300, 1000), depths=(0, 60, 100), chat=chat)
    for prompt in build_prompts(tokenizer, haystack, setup):
        assert prompt.length - 4 <= len(prompt.ids) <= prompt.length
        text = prompt_text(tokenizer, prompt)
        assert text.endswith(assistant_turn(tokenizer) if chat else "Answer:")
        assert prompt.question in text and prompt.expected in text


@pytest.mark.parametrize("depth", [0, 10, 25, 50, 75, 90, 100])
def test_needle_lands_at_the_requested_depth(tokenizer, haystack_text, depth):
    prompt = build_prompt(tokenizer, Haystack(haystack_text, tokenizer), NeedleSetup(), 2000, depth, 0)
    assert abs(prompt.measured_depth - depth) <= 2.0  # a line of verse is ~0.5% of this haystack
    start, stop = prompt.needle
    needle_text = tokenizer.decode(list(prompt.ids[start:stop]))
    assert f"The secret passkey is {prompt.expected}." in needle_text
    assert prompt.document[0] <= start < stop <= prompt.document[1]


def test_prompts_are_reproducible_and_differ_by_seed_and_trial(bpe_tokenizer, haystack_text):
    haystack = Haystack(haystack_text, bpe_tokenizer)
    setup = NeedleSetup(task="fact", lengths=(500,), depths=(50,), trials=2)
    first = build_prompts(bpe_tokenizer, haystack, setup)
    assert first == build_prompts(bpe_tokenizer, Haystack(haystack_text, bpe_tokenizer), setup)
    assert first[0].ids != first[1].ids  # trials differ
    other_seed = build_prompts(bpe_tokenizer, haystack, NeedleSetup(task="fact", lengths=(500,), depths=(50,),
                                                                    trials=2, seed=1))
    assert [p.ids for p in other_seed] != [p.ids for p in first]
    # A cell draws the same whatever else the grid holds.
    wider = build_prompts(bpe_tokenizer, haystack, NeedleSetup(task="fact", lengths=(500, 300), depths=(50, 0, 50)))
    assert [(p.length, p.depth) for p in wider] == [(300, 0), (300, 50), (500, 0), (500, 50)]  # each cell once
    assert wider[-1] == first[0]


def test_multikey_plants_every_key_and_asks_for_the_one_at_the_depth(bpe_tokenizer, haystack_text):
    haystack = Haystack(haystack_text, bpe_tokenizer)
    setup = NeedleSetup(task="multikey", keys=6, lengths=(1500,), depths=(30,))
    prompt = build_prompt(bpe_tokenizer, haystack, setup, 1500, 30, 0)
    text = prompt_text(bpe_tokenizer, prompt)
    keys = [line for line in text.splitlines() if line.startswith("The passkey for the ")]
    assert len(keys) == 6 and len({line.split(" is ")[1] for line in keys}) == 6  # six different numbers
    asked = [line for line in keys if line.endswith(f" is {prompt.expected}.")]
    assert len(asked) == 1
    lock = asked[0].removeprefix("The passkey for the ").split(" is ")[0]
    assert f"What is the passkey for the {lock} mentioned" in prompt.question
    assert bpe_tokenizer.decode(list(prompt.ids[slice(*prompt.needle)])).strip() == asked[0]
    # Its depth counts the other keys' lines as haystack: each is ~1% of it here.
    assert abs(prompt.measured_depth - 30) <= 6


def test_turns_ask_every_key_one_per_turn_after_the_same_prompt(bpe_tokenizer, haystack_text):
    """With turns, the prompt is the multikey prompt of the same seed and cell, and every planted key is asked: the
    prompt's own first, then the others, each by its own question; the first turn's message renders to the
    prompt."""
    haystack = Haystack(haystack_text, bpe_tokenizer)
    once = build_prompt(bpe_tokenizer, haystack, NeedleSetup(task="multikey", keys=4, lengths=(900,)), 900, 40, 0)
    setup = NeedleSetup(task="multikey", keys=4, lengths=(900,), turns=True)
    prompt = build_prompt(bpe_tokenizer, haystack, setup, 900, 40, 0)
    assert prompt.ids == once.ids and once.follow_ups == ()
    questions = prompt.questions()
    assert questions[0] == (once.question, once.expected) and len(questions) == 4
    text = prompt_text(bpe_tokenizer, prompt)
    for question, expected in questions:
        lock = question.removeprefix("What is the passkey for the ").split(" mentioned")[0]
        assert f"The passkey for the {lock} is {expected}." in text
    assert len({expected for _, expected in questions}) == 4
    rendered = bpe_tokenizer.apply_chat_template([{"role": "user", "content": prompt.message}],
                                                 add_generation_prompt=True, tokenize=True)
    assert list(rendered) == list(prompt.ids)


def test_boundaries_and_planting():
    text = "One line here,\nanother line. Then more\nlast"
    assert boundary_near(text, 3) == 0 and boundary_near(text, 12) == 15
    assert boundary_near(text, 27) == 29  # the sentence end "line. " is nearer than the next line
    assert boundary_near(text, len(text) - 1) == len(text)
    document, asked_at = plant_sentences(text, ["ASKED.", "OTHER."], [15, len(text)])
    assert document == "One line here,\nASKED.\nanother line. Then more\nlast\nOTHER."
    assert document[asked_at:].startswith("ASKED.")
    document, asked_at = plant_sentences(text, ["ASKED.", "OTHER."], [0, 0])
    assert document.startswith("ASKED.\nOTHER.\nOne line") and asked_at == 0
    assert boundary_near("x" * 1000 + " word " + "y" * 1000, 990) == 1001  # none near: a word start


# -------------------------------------------------------------------------------------------------- scoring
@pytest.mark.parametrize("answer, expected, correct", [
    ("48213", "48213", True),
    ("The passkey is 48213.", "48213", True),
    ("48213 is the passkey", "48213", True),
    ("148213", "48213", False),
    ("482139", "48213", False),
    ("4821", "48213", False),
    ("", "48213", False),
    ("oswin tarrow", "Oswin Tarrow", True),
    ("His name was OSWIN\nTarrow.", "Oswin Tarrow", True),
    ("Oswin Tarrowson", "Oswin Tarrow", False),
    ("Oswin", "Oswin Tarrow", False),
    ("silver heron's archive", "silver heron", True),
])
def test_answer_is_correct(answer, expected, correct):
    assert answer_is_correct(answer, expected) is correct


# ------------------------------------------------------------------------------------------------ the grid
def test_grid_with_a_planted_answerer(bpe_tokenizer, haystack_text, tmp_path):
    """An answerer that recalls the needle only within its last 400 tokens: the records, table and heatmap say
    exactly which cells it got, as a window cache of 400 would."""
    setup = NeedleSetup(task="passkey", lengths=(300, 800, 1600), depths=(0, 50, 100), trials=2)
    prompts = build_prompts(bpe_tokenizer, Haystack(haystack_text, bpe_tokenizer), setup)

    def recalls_last_400(prompt):
        return Answer(f"It is {prompt.expected}." if len(prompt.ids) - prompt.needle[0] <= 400 else "I do not know.")

    seen = []
    context = {"model": "planted", "policy": "window", "budget": 400}
    records = run_needle_grid(prompts, recalls_last_400, setup, context, on_record=seen.append, progress=False)
    assert seen == records and len(records) == 3 * 3 * 2
    json.dumps(records)  # every field is JSON
    for record, prompt in zip(records, prompts):
        assert record["correct"] is (record["prompt_tokens"] - record["needle_token"] <= 400)
        assert (record["length"], record["depth"], record["trial"]) == (prompt.length, prompt.depth, prompt.trial)
        assert record["prompt_tokens"] == len(prompt.ids) and record["expected"] == prompt.expected
        assert record["model"] == "planted" and record["budget"] == 400 and record["task"] == "passkey"
    grid = score_grid(records)
    assert grid.cells[(300, 0.0)] == (2, 2) and grid.cells[(1600, 0.0)] == (0, 2)
    assert grid.cells[(800, 0.0)] == (0, 2) and grid.cells[(800, 100.0)] == (2, 2)
    assert grid.cells[(1600, 50.0)] == (0, 2) and grid.cells[(1600, 100.0)] == (2, 2)
    table = summary_table(records)
    assert table.splitlines()[0].split()[-3:] == ["0%", "50%", "100%"]
    assert table.splitlines()[3].split() == ["1600", "0/2", "0/2", "2/2"]
    assert table.splitlines()[-1] == f"overall  {grid.correct}/18 correct ({grid.correct / 18:.0%})"

    from PIL import Image

    png = plot_heatmap(records, tmp_path / "plots" / "needle.png", "planted, window(400)")
    assert png.stat().st_size > 0
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100


def test_a_grid_of_turns_records_every_turn(bpe_tokenizer, haystack_text):
    """An answerer that answers the first turn only: one record per turn, the table counts every turn of a cell,
    and its last line scores each turn."""
    setup = NeedleSetup(task="multikey", keys=3, lengths=(600,), depths=(0, 100), turns=True)
    prompts = build_prompts(bpe_tokenizer, Haystack(haystack_text, bpe_tokenizer), setup)

    def first_turn_only(prompt):
        return [Answer(expected if turn == 0 else "no idea") for turn, (_, expected) in enumerate(prompt.questions())]

    records = run_needle_grid(prompts, first_turn_only, setup, {"model": "planted"}, progress=False)
    assert [(r["depth"], r["turn"], r["correct"]) for r in records] == [
        (0.0, 0, True), (0.0, 1, False), (0.0, 2, False), (100.0, 0, True), (100.0, 1, False), (100.0, 2, False)]
    assert [r["expected"] for r in records[:3]] == [expected for _, expected in prompts[0].questions()]
    assert all(r["turns"] is True and r["keys"] == 3 for r in records)
    table = summary_table(records).splitlines()
    assert table[1].split() == ["600", "1/3", "1/3"]
    assert table[-1] == "by turn  1: 2/2, 2: 0/2, 3: 0/2"


@pytest.mark.parametrize("fields, words", [
    (dict(depths=(50, 101)), ["depths", "0 to 100", "101"]),
    (dict(depths=(-5,)), ["depths", "-5"]),
    (dict(lengths=(0,)), ["lengths", "positive"]),
    (dict(trials=0), ["trials", "at least 1"]),
    (dict(task="multikey", keys=1), ["keys", "from 2"]),
    (dict(task="multikey", keys=99), ["keys", "99"]),
    (dict(keys=3), ["keys", "multikey", "task passkey"]),
    (dict(task="riddle"), ["task", "'riddle'", "passkey, multikey, fact"]),
    (dict(turns=True), ["turns", "multikey"]),
])
def test_setup_mistakes(fields, words):
    """In the setup's field names; the needle command names its flags (--depths), sweep its --retrieval-* ones."""
    with pytest.raises(ConfigError) as error:
        NeedleSetup(**fields)
    for word in words:
        assert word in str(error.value)
    assert set(fields) <= set(error.value.params) and "--" not in str(error.value)


def test_turns_need_chat_prompts():
    with pytest.raises(ConfigError) as error:
        NeedleSetup(task="multikey", turns=True, chat=False)
    assert error.value.params == ("turns", "chat") and "chat template" in str(error.value)


def test_a_length_too_short_or_a_text_too_short(bpe_tokenizer, haystack_text):
    haystack = Haystack(haystack_text, bpe_tokenizer, "verse.txt")
    with pytest.raises(UserError, match=r"lengths 60 is too short: .* takes \d+ tokens; give at least \d+"):
        build_prompt(bpe_tokenizer, haystack, NeedleSetup(), 60, 50, 0)
    with pytest.raises(UserError, match=r"verse.txt has \d+ tokens, too few for a prompt of 999999"):
        build_prompt(bpe_tokenizer, haystack, NeedleSetup(), 999999, 50, 0)


# ------------------------------------------------------------------------------------------------- command
def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["needle", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_user_error(result, *words: str) -> None:
    """Exit code 2, nothing on stdout, one ``sparsespec: error:`` line naming ``words``."""
    code, out, err = result
    assert code == 2 and out == "" and "Traceback" not in err, (code, out, err)
    assert len(err.splitlines()) == 1 and err.startswith("sparsespec: error: "), err
    for word in words:
        assert word.lower() in err.lower(), f"{word!r} not in {err!r}"


@pytest.fixture(scope="module")
def verse_file(tmp_path_factory, haystack_text):
    path = tmp_path_factory.mktemp("needle") / "verse.txt"
    path.write_text(haystack_text)
    return path


@pytest.mark.parametrize("flags, words", [
    (["--depths", "0,50,120"], ["--depths", "0 to 100", "120"]),
    (["--depths", "0,half"], ["--depths", "numbers", "'half'"]),
    (["--lengths", "1024,4k"], ["--lengths", "whole numbers", "'4k'"]),
    (["--lengths", "-1"], ["--lengths", "positive"]),
    (["--trials", "0"], ["--trials", "at least 1"]),
    (["--task", "multikey", "--keys", "1"], ["--keys", "from 2"]),
    (["--keys", "3"], ["--keys", "multikey"]),
    (["--task", "riddle"], ["--task", "'riddle'"]),
    (["-n", "0"], ["--max-new-tokens", "at least 1"]),
    (["--plot", "map.jpg"], ["--plot", ".png"]),
    (["--out", "cells.json"], ["--out", ".jsonl"]),
    (["--gamma", "2"], ["--gamma", "nothing without --draft"]),
    (["--draft", "self", "--draft-vocab", "100"], ["--draft self", "--draft-vocab"]),
    (["--policy", "window"], ["'window'", "needs --budget"]),
    (["--text", "no/such/file.txt"], ["no/such/file.txt", "does not exist"]),
])
def test_mistakes_before_loading_anything(capsys, flags, words):
    assert_user_error(run_cli(capsys, *flags), *words)


def test_task_help_names_every_task(capsys):
    with pytest.raises(SystemExit):
        main(["needle", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for task in TASKS:
        assert f"{task}:" in help_text


def test_longest_length_beyond_the_context(capsys, smollm2_path, verse_file):
    """Checked from the model's header before any cell runs (SmolLM2's context is 8192)."""
    assert_user_error(run_cli(capsys, "--text", str(verse_file), "--lengths", "1024,8190"),
                      "longest prompt", "8206 tokens", "context of 8192")
    # The target's ranks stay inside its window; the draft's full cache would see every true position.
    assert_user_error(run_cli(capsys, "--text", str(verse_file), "--lengths", "8190", "--policy", "window",
                              "--budget", "256", "--positions", "in-cache", "--draft", "self", "--draft-policy",
                              "full"),
                      "for the draft", "8206 tokens", "context of 8192")


@pytest.fixture
def loaded_smollm2(monkeypatch, smollm2_f32):
    """``--model smollm2-135m`` reuses the session's loaded model, whatever the weight format asked."""
    import sparsespec.loading.load as load

    real_load = load.load_model
    monkeypatch.setattr(load, "load_model", lambda ref, *a, **k: smollm2_f32 if ref == "smollm2-135m"
                        else real_load(ref, *a, **k))
    return smollm2_f32


def test_prompt_mistakes_after_loading(capsys, loaded_smollm2, verse_file, tmp_path):
    assert_user_error(run_cli(capsys, "--text", str(verse_file), "--lengths", "50,1024", "--dtype", "float32"),
                      "--lengths 50 is too short", "give at least")
    short = tmp_path / "short.txt"
    short.write_text(verse(40))
    assert_user_error(run_cli(capsys, "--text", str(short), "--lengths", "512", "--dtype", "float32"),
                      "short.txt has", "too few for a prompt of 512", "--text")


def test_summary_table_through_the_command(capsys, monkeypatch, loaded_smollm2, verse_file, tmp_path):
    """The text summary and --out, with a planted answerer in place of the model's greedy answers."""

    def planted(target, cache, draft, max_new_tokens):
        return lambda prompt: Answer(prompt.expected if prompt.depth >= 50 else "no idea")

    monkeypatch.setattr(needle, "engine_answerer", planted)
    out_file = tmp_path / "cells.jsonl"
    code, out, err = run_cli(capsys, "--text", str(verse_file), "--lengths", "256,400", "--depths", "0,50,100",
                             "--task", "fact", "--out", str(out_file), "--quiet", "--dtype", "float32",
                             "--policy", "streaming", "--budget", "64")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "model   smollm2-135m"
    assert lines[1].startswith("cache   streaming(sinks=4, heavy=0, window=60), original")
    assert lines[2].startswith("task    fact, 1 trial(s) per cell, seed 0, chat prompts, haystack ")
    assert lines[4].split() == ["256", "0/1", "1/1", "1/1"] and lines[5].split() == ["400", "0/1", "1/1", "1/1"]
    assert lines[6] == "overall  4/6 correct (67%)"
    records = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [r["correct"] for r in records] == [False, True, True] * 2
    assert all(r["policy"] == "streaming" and r["cache"]["policy"] == "streaming(sinks=4, heavy=0, window=60)"
               for r in records)


def test_one_real_cell_on_smollm2(capsys, smollm2_path, verse_file, tmp_path):
    """The whole command as a user runs it (model loaded from its file): one short cell, its record's fields."""
    out_file, png = tmp_path / "cells.jsonl", tmp_path / "map.png"
    code, out, err = run_cli(capsys, "--text", str(verse_file), "--lengths", "512", "--depths", "50", "-n", "4",
                             "--policy", "window", "--budget", "128", "--json", "--quiet", "--threads", "2",
                             "--out", str(out_file), "--plot", str(png))
    assert code == 0, err
    assert "Traceback" not in err
    lines = out.splitlines()
    assert len(lines) == 1 and out_file.read_text().splitlines() == lines
    record = json.loads(lines[0])
    types = {
        "task": str, "length": int, "prompt_tokens": int, "depth": float, "measured_depth": float,
        "needle_token": int, "trial": int, "seed": int, "keys": int, "chat": bool, "question": str,
        "expected": str, "answer": str, "correct": bool, "model": str, "policy": str, "budget": int,
        "positions": str, "kv_dtype": str, "cache": dict, "new_tokens": int, "prefill_seconds": float,
        "decode_seconds": float, "tokens_per_s": float, "kv_cache_bytes": int, "evicted_tokens": int,
    }
    for field, kind in types.items():
        assert isinstance(record[field], kind), (field, record[field])
    assert "retention" in record and "draft" in record and record["draft"] is None
    assert record["task"] == "passkey" and record["length"] == 512 and record["depth"] == 50.0
    assert 508 <= record["prompt_tokens"] <= 512 and record["chat"] is True and record["model"] == "smollm2-135m"
    assert record["policy"] == "window" and record["budget"] == 128 and record["evicted_tokens"] > 0
    assert record["cache"]["policy"] == "window(sinks=0, heavy=0, window=128)"
    assert 1 <= record["new_tokens"] <= 4 and record["kv_cache_bytes"] > 0
    assert record["correct"] == answer_is_correct(record["answer"], record["expected"])
    assert png.stat().st_size > 0


def test_turns_on_smollm2_run_through_one_session(capsys, smollm2_path, verse_file):
    """Two keys asked in two turns of one conversation with a budget: the second turn resumes the session (its
    prompt reuses what the arenas hold) and is scored against its own key."""
    code, out, err = run_cli(capsys, "--text", str(verse_file), "--lengths", "512", "--depths", "50", "-n", "8",
                             "--task", "multikey", "--keys", "2", "--turns", "--policy", "hybrid", "--budget", "128",
                             "--json", "--quiet", "--threads", "2")
    assert code == 0, err
    first, second = (json.loads(line) for line in out.splitlines())
    assert (first["turn"], second["turn"]) == (0, 1) and first["expected"] != second["expected"]
    assert first["reused_tokens"] == 0 and second["reused_tokens"] >= first["prompt_tokens"]
    assert second["turn_prompt_tokens"] > second["reused_tokens"] and second["evicted_tokens"] > 0
    assert second["correct"] == answer_is_correct(second["answer"], second["expected"])
