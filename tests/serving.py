"""Helpers of the server's tests: a live server on a free loopback port, raw HTTP, the ``openai`` client, metrics."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import uvicorn
from openai import OpenAI

from sparsespec.serve.server import ServerState, create_app


@contextmanager
def live_server(load, access=None):
    """An app on a free 127.0.0.1 port (``access``: its guard's rules), served by uvicorn in a thread; yields
    ``(base_url, state)``."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    state = ServerState(load)
    server = uvicorn.Server(uvicorn.Config(create_app(state, access), log_level="error"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        deadline = time.monotonic() + 120
        while get(url + "/health")[0] != 200:
            assert state.error is None, state.error
            assert time.monotonic() < deadline, "the server did not become healthy"
            time.sleep(0.05)
        yield url, state
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def post(url: str, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def client(url: str, api_key: str = "unused") -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=120)


def chat(c: OpenAI, messages: list[dict], max_tokens: int, **kw):
    return c.chat.completions.create(model="any", messages=messages, max_tokens=max_tokens, temperature=0, **kw)


def metric(url: str, name: str) -> float:
    status, text = get(url + "/metrics")
    assert status == 200
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(f"sparsespec_{name} ")))


def settled_metric(url: str, name: str, timeout: float = 30.0) -> float:
    """``metric`` once the engine is idle: a request's answer can reach the client before the engine thread has
    counted the pass that finished it, and it sets ``slots_busy`` only after counting."""
    deadline = time.monotonic() + timeout
    while metric(url, "slots_busy") != 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return metric(url, name)


def start_long_stream(url: str) -> http.client.HTTPConnection:
    """A streamed 2,000-token completion whose first event has arrived; its connection, for the test to drop."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("POST", "/v1/completions",
                       json.dumps({"prompt": "Once", "max_tokens": 2000, "stream": True, "temperature": 0}),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    response.fp.readline()  # the first event
    return connection
