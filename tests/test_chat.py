"""``sparsespec chat`` in a pseudo-terminal (pexpect): two turns, /stats, /reset, Ctrl-D; its input reader; and
what an answer holds while it computes."""

from __future__ import annotations

import io
import os
import re
import sys
from pathlib import Path

import pexpect
import pytest

from sparsespec.serve.chat import Chat, read_message


def reader(lines):
    feed = iter(lines)

    def read(prompt: str) -> str:
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    return read


def test_read_message_joins_a_block_between_triple_quotes():
    assert read_message(reader(["hello"])) == "hello"
    assert read_message(reader(['"""first', "second", 'third"""'])) == "first\nsecond\nthird"
    assert read_message(reader(['"""', "a", "", "b", '"""'])) == "a\n\nb"
    assert read_message(reader(['"""one line"""'])) == "one line"
    with pytest.raises(EOFError):
        read_message(reader(['"""unfinished']))


def test_chat_two_turns_stats_reset_and_ctrl_d(smollm2_path):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1] / "src"), TERM="dumb")
    child = pexpect.spawn(
        sys.executable, ["-m", "sparsespec.cli", "chat", "--dtype", "float32", "--threads", "1", "-n", "8"],
        env=env, encoding="utf-8", timeout=120, dimensions=(40, 200),
    )
    try:
        child.expect_exact(">>> ")
        child.sendline("What is 2+2? Answer with a number only.")
        child.expect_exact(">>> ")
        first = child.before
        assert "4" in first
        child.sendline("And 3+3?")
        child.expect_exact(">>> ")
        child.sendline("/stats")
        child.expect_exact(">>> ")
        stats = child.before
        assert "conversation: 2 turns" in stats
        prompt, resumed = map(int, re.search(r"prompt (\d+) tokens, (\d+) of them resumed", stats).groups())
        assert 0 < resumed < prompt  # the second turn read only the new message
        child.sendline("/reset")
        child.expect_exact("(conversation forgotten)")
        child.expect_exact(">>> ")
        child.sendline("/stats")
        child.expect_exact(">>> ")
        assert "conversation: 0 turns, 0 tokens in the cache" in child.before
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_an_answer_holds_slow_moves_while_it_computes(smollm2_f32, monkeypatch):
    """A slow move of the weights into huge pages waits while chat answers and goes on while it waits for input
    (``loading/huge_pages.py``)."""
    from sparsespec.engine import CacheOptions, Session
    from sparsespec.loading import huge_pages
    from sparsespec.sampling import SamplingParams
    from sparsespec.serve import chat as chat_module

    events = []
    monkeypatch.setattr(chat_module, "hold_slow_huge_page_moves",
                        lambda: events.append("hold") or huge_pages.hold_slow_huge_page_moves())
    monkeypatch.setattr(chat_module, "release_slow_huge_page_moves",
                        lambda: events.append("release") or huge_pages.release_slow_huge_page_moves())
    session = Session(smollm2_f32, CacheOptions(), None, capacity=512)
    out = io.StringIO()
    chat = Chat(session, sampling=SamplingParams(0.0, 0, 1.0), max_new_tokens=3, seed=0, out=out)
    chat.answer("Hi")
    assert events == ["hold", "release"] and huge_pages._slow_moves_may_run.is_set() and out.getvalue().strip()
