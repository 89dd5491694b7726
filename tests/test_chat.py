"""``sparsespec chat`` in a pseudo-terminal (pexpect): two turns, /stats, /reset, Ctrl-D; and its input reader."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pexpect
import pytest

from sparsespec.serve.chat import read_message


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
