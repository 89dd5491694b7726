"""The OpenAI-compatible server, live on a loopback port, driven by the real ``openai`` client and raw HTTP.

SmolLM2-135M answers the questions whose text matters (equality with ``sparsespec generate``, prefix reuse); a
tiny random model with SmolLM2's tokenizer answers the ones about the server's behaviour (faults, queueing,
memory), where only speed matters.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import uvicorn
from openai import APIError, OpenAI

from sparsespec.cache import make_policy
from sparsespec.cli import main
from sparsespec.engine import CacheOptions, DraftOptions
from sparsespec.loading.load import release_freed_memory
from sparsespec.model import Transformer
from sparsespec.serve.server import ServerState, create_app
from sparsespec.sampling import SamplingParams
from sparsespec.serve.worker import TEXT_INTERVAL_SECONDS, EngineWorker, GenerationRequest, Job

from serving import chat, client, get, live_server, metric, post, settled_metric, start_long_stream

QUESTION = "What is 2+2? Answer with a number only."  # SmolLM2 answers "2 + 2 = 4" and stops


def generate_text(capsys, question: str, max_new_tokens: int, *flags: str) -> str:
    """What ``sparsespec generate --chat`` prints for ``question`` (greedy, float32, dense weights: the format of
    the ``smollm2_f32`` model the server runs; native weights round activations to 8 bits and can flip a near-tie)."""
    capsys.readouterr()
    assert main(["generate", "--dtype", "float32", "--weights", "dense", "--chat", "--json", "-p", question, "-n",
                 str(max_new_tokens), *flags]) == 0
    return json.loads(capsys.readouterr().out)["text"]


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def smol_server(smollm2_f32):
    with live_server(lambda: EngineWorker(smollm2_f32, CacheOptions())) as (url, _):
        yield url


@pytest.fixture(scope="module")
def tiny_server(tiny_loaded):
    with live_server(lambda: EngineWorker(tiny_loaded, CacheOptions(), queue_size=2)) as (url, state):
        yield url, state


# ----------------------------------------------------------------------------------- answers and equality
def test_chat_completions_whole_and_streamed_equal_generate(smol_server, capsys):
    c = client(smol_server)
    messages = [{"role": "user", "content": QUESTION}]
    whole = chat(c, messages, 16)
    choice = whole.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == generate_text(capsys, QUESTION, 16)
    assert whole.usage.completion_tokens < 16 and whole.usage.prompt_tokens > 20
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    extension = whole.model_extra["sparsespec"]
    assert extension["cache_policy"] == "full" and extension["evicted_tokens"] == 0 and extension["kv_cache_bytes"] > 0

    chunks = list(chat(c, messages, 16, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_length_finish_and_completions_endpoint(smol_server, capsys):
    c = client(smol_server)
    short = chat(c, [{"role": "user", "content": "Say OK."}], 4)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 4
    assert short.choices[0].message.content == generate_text(capsys, "Say OK.", 4)
    text = c.completions.create(model="any", prompt="The capital of France is", max_tokens=3, temperature=0)
    assert text.choices[0].finish_reason == "length" and text.usage.completion_tokens == 3
    assert text.choices[0].text.strip()
    stopped = c.completions.create(model="any", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=["7"])
    assert stopped.choices[0].finish_reason == "stop" and "7" not in stopped.choices[0].text
    assert "6" in stopped.choices[0].text


def test_ignore_eos_runs_past_the_end_to_max_tokens(smol_server):
    c = client(smol_server)
    messages = [{"role": "user", "content": QUESTION}]
    stopped = chat(c, messages, 24)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens < 24
    forced = chat(c, messages, 24, extra_body={"ignore_eos": True})
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 24
    assert forced.choices[0].message.content.startswith(stopped.choices[0].message.content)
    for body, message in (({"ignore_eos": "yes", "max_tokens": 4}, "'ignore_eos' must be true or false"),
                          ({"ignore_eos": True}, "'ignore_eos' needs 'max_tokens'")):
        status, answer = post(smol_server + "/v1/completions", {"prompt": "Hi", **body})
        assert status == 400 and message in answer["error"]["message"]


def test_stream_ends_with_done(smol_server):
    host, port = smol_server.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("POST", "/v1/completions", json.dumps({"prompt": "Hello", "max_tokens": 2, "stream": True}),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
    events = [line for line in response.read().decode().split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_self_speculation_through_the_api_equals_generate(smollm2_f32, capsys):
    draft = DraftOptions(smollm2_f32, CacheOptions(make_policy("hybrid", 64)), gamma=4, is_self=True)
    with live_server(lambda: EngineWorker(smollm2_f32, CacheOptions(), draft)) as (url, _):
        answer = chat(client(url), [{"role": "user", "content": QUESTION}], 16)
    assert answer.choices[0].message.content == generate_text(capsys, QUESTION, 16, "--draft", "self")
    extension = answer.model_extra["sparsespec"]
    assert extension["acceptance_rate"] > 0 and extension["tokens_per_target_pass"] > 1


def test_a_conversation_drafts_from_another_conversations_answer_of_its_salt(smollm2_default):
    """Greedy n-gram drafting matches finished requests' text across conversations, within one cache_salt."""
    from sparsespec.ngram import NgramOptions

    draft = DraftOptions(None, None, None, ngram=NgramOptions())
    with live_server(lambda: EngineWorker(smollm2_default, CacheOptions(), draft, parallel=2)) as (url, _):
        c = client(url)
        messages = [{"role": "user", "content": QUESTION}]
        first, second = chat(c, messages, 24), chat(c, messages, 24)
        salted = chat(c, messages, 24, extra_body={"cache_salt": "another client"})
        assert first.choices[0].message.content == second.choices[0].message.content
        assert salted.choices[0].message.content == first.choices[0].message.content
        assert first.model_extra["sparsespec"]["ngram_shared_drafted_tokens"] == 0
        assert second.model_extra["sparsespec"]["ngram_shared_accepted_tokens"] > 0
        assert salted.model_extra["sparsespec"]["ngram_shared_drafted_tokens"] == 0
        assert settled_metric(url, "ngram_shared_accepted_tokens_total") > 0


# ------------------------------------------------------------------------------------ several users at once
QUESTIONS = (QUESTION, "Name three colours.", "Write one sentence about the sea.")


@pytest.fixture(scope="module")
def parallel_server(smollm2_default):
    """Three slots, the default configuration (bfloat16, native weights): a row's result does not depend on the
    rows beside it there."""
    with live_server(lambda: EngineWorker(smollm2_default, CacheOptions(), parallel=3)) as (url, state):
        yield url, state


def ask_at_once(url: str, requests: list[list[dict]], max_tokens: int) -> list:
    """Send the chats at the same moment, each from its own thread; their answers, in order."""
    answers: list = [None] * len(requests)
    start = threading.Barrier(len(requests))

    def ask(i: int) -> None:
        start.wait()
        answers[i] = chat(client(url), requests[i], max_tokens)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


def test_answers_beside_others_equal_answers_alone_and_share_passes(parallel_server, monkeypatch):
    url, _ = parallel_server
    requests = [[{"role": "user", "content": q}] for q in QUESTIONS]
    alone = [chat(client(url), messages, 24).choices[0].message.content for messages in requests]
    blocks_per_pass: list[int] = []
    forward_blocks = Transformer.forward_blocks
    monkeypatch.setattr(Transformer, "forward_blocks",
                        lambda self, blocks: (blocks_per_pass.append(len(blocks)), forward_blocks(self, blocks))[1])
    steps, rows = settled_metric(url, "engine_steps_total"), metric(url, "batch_rows_total")
    blocks_per_pass.clear()  # passes counted before the engine settled are in steps
    together = ask_at_once(url, requests, 24)
    assert [answer.choices[0].message.content for answer in together] == alone
    assert max(blocks_per_pass) == 3  # passes over all three requests' rows ran
    assert settled_metric(url, "engine_steps_total") - steps == len(blocks_per_pass)
    assert metric(url, "batch_rows_total") - rows > len(blocks_per_pass)
    assert metric(url, "slots") == 3 and metric(url, "slots_busy") == 0


def test_a_conversation_finds_its_slot_among_others(parallel_server):
    url, _ = parallel_server
    c = client(url)
    history = [{"role": "user", "content": QUESTION}]
    first = chat(c, history, 8)
    ask_at_once(url, [[{"role": "user", "content": q}] for q in QUESTIONS[1:]], 4)  # two other users meanwhile
    follow_up = chat(c, history + [{"role": "assistant", "content": first.choices[0].message.content},
                                   {"role": "user", "content": "And 3+3?"}], 8)
    reused = follow_up.model_extra["sparsespec"]["reused_prompt_tokens"]
    assert first.usage.prompt_tokens < reused < follow_up.usage.prompt_tokens


def test_a_client_leaving_frees_its_slot_while_others_run(parallel_server):
    url, _ = parallel_server
    cancelled = metric(url, "requests_cancelled_total")
    connection = start_long_stream(url)
    other = client(url).completions.create(model="any", prompt="Hello", max_tokens=4, temperature=0)
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    deadline = time.monotonic() + 30
    while metric(url, "requests_cancelled_total") == cancelled or metric(url, "slots_busy") > 0:
        assert time.monotonic() < deadline, "the slot was not freed"
        time.sleep(0.05)
    assert other.usage.completion_tokens == 4


# ------------------------------------------------------------------------------------------- prefix reuse
def conversation(c: OpenAI, questions: list[str], max_tokens: int) -> tuple[list[list[dict]], list]:
    """Ask the questions in turn, each with the history so far; returns each turn's messages and answer."""
    history, sent, answers = [], [], []
    for question in questions:
        history = history + [{"role": "user", "content": question}]
        sent.append(history)
        answers.append(chat(c, history, max_tokens))
        history = history + [{"role": "assistant", "content": answers[-1].choices[0].message.content}]
    return sent, answers


def test_three_turns_with_prefix_reuse_equal_a_fresh_server(smol_server, smollm2_f32):
    sent, answers = conversation(client(smol_server), [QUESTION, "And 3+3?", "And 4+4?"], 8)
    reused = [a.model_extra["sparsespec"]["reused_prompt_tokens"] for a in answers]
    assert reused[0] == 0
    # Each follow-up resumed from the previous turn: its whole prompt but the new message was not read again.
    for previous, answer, used in zip(answers, answers[1:], reused[1:]):
        assert previous.usage.prompt_tokens < used < answer.usage.prompt_tokens
    with live_server(lambda: EngineWorker(smollm2_f32, CacheOptions())) as (url, _):
        c = client(url)
        for turn in (2, 1):  # turn 2 does not extend turn 3's text: both are read from an empty cache
            again = chat(c, sent[turn], 8)
            assert again.choices[0].message.content == answers[turn].choices[0].message.content
            assert again.model_extra["sparsespec"]["reused_prompt_tokens"] == 0


def test_budget_conversation_reports_evictions(smollm2_f32):
    """With a budget, reuse equals re-reading until the budget fills; after, the run evicts, and says so."""
    cache = CacheOptions(make_policy("hybrid", 64), "in-cache")
    with live_server(lambda: EngineWorker(smollm2_f32, cache)) as (url, _):
        sent, answers = conversation(client(url), [QUESTION, "And 3+3?", "And 4+4?"], 8)
        first_again = chat(client(url), sent[0], 8)  # does not extend the conversation: read from empty
    ext = [a.model_extra["sparsespec"] for a in answers]
    assert ext[0]["evicted_tokens"] == 0 and ext[0]["cache_budget"] == 64
    assert first_again.choices[0].message.content == answers[0].choices[0].message.content
    assert ext[2]["reused_prompt_tokens"] > 0 and ext[2]["evicted_tokens"] > 0
    assert ext[2]["conversation_evicted_tokens"] == sum(e["evicted_tokens"] for e in ext)
    assert answers[2].usage.prompt_tokens > 64


def test_no_evict_overflow_refuses_what_outgrows_the_context(tiny_loaded):
    cache = CacheOptions(make_policy("hybrid", 32), "in-cache")
    overlong = {"prompt": list(range(100, 2100)), "max_tokens": 100}  # 2000 + 100 tokens; the context is 2048
    with live_server(lambda: EngineWorker(tiny_loaded, cache)) as (url, _):
        status, body = post(url + "/v1/completions", overlong)
        assert status == 200 and body["usage"]["prompt_tokens"] == 2000 and body["sparsespec"]["evicted_tokens"] > 0
    with live_server(lambda: EngineWorker(tiny_loaded, cache, no_evict_overflow=True)) as (url, _):
        status, body = post(url + "/v1/completions", overlong)
        assert status == 400 and "no-evict-overflow" in body["error"]["message"]
        status, body = post(url + "/v1/completions", {"prompt": list(range(100, 2000)), "max_tokens": 2})
        assert status == 200 and body["sparsespec"]["evicted_tokens"] > 0


# ------------------------------------------------------------------------------------------------- faults
def test_bad_requests_get_400_error_objects(tiny_server):
    url, _ = tiny_server
    cases = [
        (b"{not json", None),
        (b"[1, 2]", None),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 3}, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": 5}, "stop"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, None),  # past the 2048 context
    ]
    for body, param in cases:
        status, answer = post(url + "/v1/chat/completions", body)
        assert status == 400, body
        assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["message"]
        assert answer["error"]["param"] == param
    # The library's parameter, named as the request names it.
    message = answer["error"]["message"]  # the last case's: past the context
    assert message.startswith("The prompt plus max_tokens (") and "--" not in message.split(";")[0]
    status, answer = post(url + "/v1/completions",
                          {"prompt": "hi", "max_tokens": 1, "temperature": 0, "unknown_field": [1]})
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
    assert get(url + "/nowhere")[0] == 404
    assert get(url + "/health") == (200, '{"status":"ok"}')


def test_streamed_chunks_carry_every_token_in_fewer_events(tiny_server):
    """A model faster than the hand-over interval streams several tokens per chunk, and the chunks together are
    the whole answer."""
    url, _ = tiny_server
    c = client(url)
    body = dict(model="any", prompt="Once", max_tokens=200, temperature=0)
    whole = c.completions.create(**body).choices[0].text
    pieces = [chunk.choices[0].text for chunk in c.completions.create(stream=True, **body)
              if chunk.choices and chunk.choices[0].text]
    assert "".join(pieces) == whole
    assert 2 <= len(pieces) < 200


def test_the_engine_hands_text_over_at_most_once_per_interval(tiny_loaded, monkeypatch):
    """The engine thread wakes the event loop with text at once for the first piece, then at most once per
    interval (the last hand-over flushes the end), as timed where the engine hands it over."""
    handed: list[tuple[float, str, object]] = []
    real_emit = Job.emit
    monkeypatch.setattr(Job, "emit", lambda job, kind, value: (handed.append((time.perf_counter(), kind, value)),
                                                                real_emit(job, kind, value)))
    worker = EngineWorker(tiny_loaded, CacheOptions())
    worker.start()
    try:
        async def run() -> None:
            prompt = tiny_loaded.tokenizer.encode("Once")
            job = worker.submit(GenerationRequest(prompt, 200, SamplingParams()), asyncio.get_running_loop())
            while (await job.events.get())[0] == "text":
                pass

        asyncio.run(run())
    finally:
        worker.stop()
    texts = [(at, value) for at, kind, value in handed if kind == "text"]
    assert handed[-1][1] == "done" and handed[-1][2].stats.new_tokens == 200
    assert 2 <= len(texts) < 200
    gaps = [b[0] - a[0] for a, b in zip(texts, texts[1:-1])]
    assert all(gap >= TEXT_INTERVAL_SECONDS for gap in gaps)


def test_client_leaving_mid_stream_cancels_its_generation(tiny_server):
    url, _ = tiny_server
    generated = metric(url, "generated_tokens_total")
    cancelled = metric(url, "requests_cancelled_total")
    connection = start_long_stream(url)
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    deadline = time.monotonic() + 30
    while metric(url, "requests_cancelled_total") == cancelled:
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.05)
    assert metric(url, "generated_tokens_total") - generated < 2000
    status, answer = post(url + "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert status == 200 and answer["usage"]["completion_tokens"] == 2


def test_flood_past_the_queue_bound_gets_503_and_the_server_recovers(tiny_server):
    url, _ = tiny_server
    statuses = []

    def request():
        statuses.append(post(url + "/v1/completions", {"prompt": "Once", "max_tokens": 400, "temperature": 0})[0])

    threads = [threading.Thread(target=request) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(set(statuses)) == [200, 503]
    assert 1 <= statuses.count(200) <= 3  # one running, two waiting
    assert get(url + "/health")[0] == 200
    assert metric(url, "requests_rejected_total") >= statuses.count(503)
    assert post(url + "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "temperature": 0})[0] == 200


def test_an_exception_inside_generation_ends_the_stream_with_an_error(tiny_server, monkeypatch):
    url, state = tiny_server
    session = state.worker.slots[0].session
    steps = session.steps

    def failing(*args, **kwargs):  # the decoding program, failing after its second token
        tokens = 0
        program = steps(*args, **kwargs)
        reply = None
        while tokens < 2:
            item = program.send(reply)
            tokens += isinstance(item, int)
            reply = yield item
        raise RuntimeError("simulated fault")

    monkeypatch.setattr(session, "steps", failing)
    stream = client(url).completions.create(model="any", prompt="Once", max_tokens=50, stream=True)
    with pytest.raises(APIError, match="simulated fault"):
        for _ in stream:
            pass
    status, answer = post(url + "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "temperature": 0})
    assert status == 500 and "simulated fault" in answer["error"]["message"]
    monkeypatch.undo()
    assert post(url + "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 0})[0] == 200
    assert get(url + "/health")[0] == 200


def test_memory_stays_flat_over_200_requests(tiny_server):
    """Resident memory after 200 requests is within 4 MiB of that after 20: nothing is kept per request.

    Free heap pages are handed back before each reading, so glibc keeping pages that earlier tests freed (which
    varies with what ran before) does not count as growth.
    """
    url, _ = tiny_server
    process = psutil.Process()
    messages = [{"role": "user", "content": "Hi"}]
    c = client(url)
    for _ in range(20):
        chat(c, messages, 2)
    release_freed_memory()
    after_20 = process.memory_info().rss
    for i in range(180):
        list(chat(c, messages, 2, stream=True)) if i % 2 else chat(c, messages, 2)
    release_freed_memory()
    after_200 = process.memory_info().rss
    assert after_200 - after_20 < 4 * 2**20, (after_20, after_200)


def test_health_is_503_while_the_model_loads(tiny_loaded):
    loaded = threading.Event()

    def load():
        loaded.wait(30)
        return EngineWorker(tiny_loaded, CacheOptions())

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    state = ServerState(load)
    server = uvicorn.Server(uvicorn.Config(create_app(state), log_level="error"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        deadline = time.monotonic() + 30
        while (answer := get(url + "/health"))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert answer == (503, '{"status":"loading"}')
        assert post(url + "/v1/completions", {"prompt": "Hi"})[0] == 503
        loaded.set()
        while get(url + "/health")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert json.loads(get(url + "/v1/models")[1])["data"][0]["id"] == "tiny"
    finally:
        loaded.set()
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


# ------------------------------------------------------------------------------------------------- the CLI
def test_serve_command_starts_answers_and_stops(smollm2_path, tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1] / "src"))
    process = subprocess.Popen(
        [sys.executable, "-m", "sparsespec.cli", "serve", "--dtype", "float32", "--port", str(port), "--threads", "1"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while get(url + "/health")[0] != 200:
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.2)
        answer = client(url).completions.create(model="smollm2-135m", prompt="Hello", max_tokens=2)
        assert answer.usage.completion_tokens == 2
        # serve reads prompts in 128-row passes (SERVE_PREFILL_CHUNK): a long prompt's context, then one pass per
        # new token (the prompt's last token is fed like a generated one).
        steps = settled_metric(url, "engine_steps_total")
        long = client(url).completions.create(model="smollm2-135m", prompt="Hello there. " * 100, max_tokens=2)
        context = long.usage.prompt_tokens - 1
        assert context > 256 and settled_metric(url, "engine_steps_total") - steps == -(-context // 128) + 2
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("flags, message", [
    (["--no-evict-overflow"], "--no-evict-overflow only matters"),
    (["--gamma", "3"], "--gamma does nothing without --draft"),
    (["--draft-kv-dtype", "int4"], "--draft-kv-dtype does nothing without --draft"),
    (["--queue-size", "0"], "--queue-size must be from 1 to 65536 (got 0)"),
    (["--parallel", "0"], "--parallel must be from 1 to 256 (got 0)"),
    (["--parallel", "100000"], "--parallel must be from 1 to 256 (got 100000)"),
    (["--max-prompt-tokens", "0"], "--max-prompt-tokens must be at least 1"),
    (["--max-body-bytes", "12"], "--max-body-bytes must be at least 1 KiB"),
    (["--max-body-bytes", "lots"], "--max-body-bytes takes a size in bytes"),
    (["--api-key", " "], "--api-key is empty"),
    (["--threads", "100000"], "--threads must be from 1 to"),
    (["--gamma", "1000000", "--draft", "self"], "--gamma must be from 1 to 64"),
    (["--recall-pages", "100000", "--budget", "256"], "--recall-pages must be from 1 to 1024"),
    (["--ngram-shared-tokens", "4096"], "--ngram-shared-tokens does nothing without n-gram drafting"),
    (["--draft", "ngram", "--ngram-shared-tokens", "-1"], "--ngram-shared-tokens must be from 0 to 1048576"),
])
def test_serve_flags_that_do_nothing_or_are_wrong_fail_before_loading(flags, message, capsys):
    assert main(["serve", "--model", "smollm2-135m", *flags]) == 2
    assert message in capsys.readouterr().err


def test_serve_on_a_taken_port_fails_before_loading(capsys, monkeypatch):
    import sparsespec.serve.commands as commands

    monkeypatch.setattr(commands, "load_engine", lambda *a: pytest.fail("the model was loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", "smollm2-135m", "--port", str(port)]) == 2
    assert f"Could not listen on 127.0.0.1:{port}" in capsys.readouterr().err


@pytest.mark.parametrize("draft", ["ngram", "self"])
def test_serve_takes_drafts_without_a_model_name(draft, capsys, monkeypatch):
    """``--draft ngram`` and ``--draft self`` name no model: the checks before loading let them through."""
    import sparsespec.serve.server as server

    class Checked(Exception):
        pass

    def reached(*args, **kwargs):
        raise Checked

    monkeypatch.setattr(server, "ServerState", reached)
    with pytest.raises(Checked):
        main(["serve", "--model", "smollm2-135m", "--draft", draft, "--port", "0"])
