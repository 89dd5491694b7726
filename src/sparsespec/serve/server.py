"""The HTTP server: an ASGI app (FastAPI on Starlette, run by uvicorn) in front of one :class:`EngineWorker`.

Endpoints: ``GET /health`` (503 while the model loads, 200 after), ``GET /v1/models``,
``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed as server-sent events ending in
``data: [DONE]``, or whole), ``GET /metrics`` (Prometheus text). Errors are OpenAI error objects; 503s carry
``Retry-After``, 405s ``Allow``. ``guard.py`` decides who may call (Host, Origin, API key) and which bodies are
read at all (JSON, size).

A request's body is parsed and its prompt tokenized on a worker thread (the event loop keeps answering), then it is
queued and answered once the engine's first event arrives, so a request the engine refuses still gets a 400 rather
than a stream that breaks off. A request whose client goes away is cancelled, streamed or not: its slot is free
before the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ..errors import UserError, user_message
from .guard import UNEXPECTED, Access, BodyTooLarge, Guard, error_body
from .protocol import (BadRequest, ParsedRequest, PromptLimits, Responses, chat_prompt_ids, parse_body, parse_common,
                       text_prompt_ids)
from .worker import SERVER_NAMES, EngineWorker, Job, QueueFull, extension

log = logging.getLogger("sparsespec.serve")


class ServerState:
    """The worker once loaded, so that ``/health`` answers while the model loads.

    With ``background`` (tests, an app embedded elsewhere) the app's start runs ``load`` and then the engine in
    threads of their own. Without it the caller gives its own thread to :meth:`run_engine`: the ``serve`` command
    gives the engine the process's main thread and runs the HTTP server beside it. That placement is for speed:
    torch's OpenMP workers spin between parallel regions only while the process has no more OpenMP masters than
    cores, and an engine thread beside the main thread's own pool made every kernel call wait for its workers to
    wake (decoding through the API ran slower than ``generate``):
    benchmarks/history/decode.md#native-kernels-third-pass-q4_k--q6_k-in-column-tiles-and-the-servers-engine-thread
    """

    def __init__(self, load: Callable[[], EngineWorker], on_failure: Callable[[BaseException], None] | None = None,
                 background: bool = True):
        self._load = load
        self.on_failure = on_failure
        self.background = background
        self.worker: EngineWorker | None = None
        self.error: BaseException | None = None
        self._limits: PromptLimits | None = None

    @property
    def prompt_limits(self) -> PromptLimits:
        """The loaded worker's prompt limits (its tokenizer's longest token read once)."""
        if self._limits is None:
            self._limits = PromptLimits.for_tokenizer(self.worker.target.tokenizer, self.worker.max_prompt_tokens)
        return self._limits

    def start_loading(self) -> None:
        """Load and start the engine in background threads (a no-op without ``background``)."""
        if self.background:
            threading.Thread(target=self._loaded, name="sparsespec-load", daemon=True).start()

    def run_engine(self) -> None:
        """Load the model and serve requests on the calling thread until the worker is stopped."""
        worker = self._loaded()
        if worker is not None:
            worker.run()

    def _loaded(self) -> EngineWorker | None:
        try:
            worker = self._load()
            if self.background:
                worker.start()
            self.worker = worker
            return worker
        except Exception as exc:  # Ctrl-C while loading on the main thread goes on up to the command
            self.error = exc
            if not isinstance(exc, UserError):
                log.exception("loading the model failed")
            if self.on_failure is not None:
                self.on_failure(exc)
            return None


# Seconds a client is asked to wait before retrying a 503 (a full queue, a model still loading).
RETRY_AFTER_SECONDS = 1


def _error(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 503:
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS), **(headers or {})}
    return JSONResponse(error_body(message, kind, param), status_code=status, headers=headers)


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def create_app(state: ServerState, access: Access | None = None):
    """The ASGI app: the API behind :class:`~sparsespec.serve.guard.Guard` with ``access`` (default: listening on
    127.0.0.1, no API key, no CORS)."""

    def count_server_error() -> None:
        if state.worker is not None:
            state.worker.metrics.add(server_errors_total=1)

    return Guard(_api(state), access or Access(), count_server_error)


def _api(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start_loading()
        yield
        if state.worker is not None:
            await asyncio.to_thread(state.worker.stop)

    app = FastAPI(title="sparsespec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), headers=exc.headers)  # 405's Allow among them

    @app.exception_handler(BodyTooLarge)
    async def too_large(request: Request, exc: BodyTooLarge) -> JSONResponse:
        return _error(413, str(exc))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return _error(500, UNEXPECTED)  # then re-raised to the guard, which logs and counts it

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.worker is not None:
            return JSONResponse({"status": "ok"})
        if state.error is not None:
            message = user_message(state.error, SERVER_NAMES)
            return JSONResponse({"status": "error", "message": message}, status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.worker is None:
            return _error(503, "The model is still loading.")
        text = state.worker.metrics.render(state.worker.queue_length)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        if state.worker is None:
            return _error(503, "The model is still loading.")
        return JSONResponse({"object": "list", "data": [
            {"id": state.worker.target.name, "object": "model", "created": 0, "owned_by": "sparsespec"}]})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(state, request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(state, request, chat=False)

    return app


async def _generate(state: ServerState, request: Request, chat: bool) -> Response:
    worker = state.worker
    if worker is None:
        return _error(503, "The model is still loading.")
    try:
        raw = await request.body()  # its size bounded by the guard
    except ClientDisconnect:  # gone before its body arrived: nobody to answer, nothing to count
        return Response(status_code=499)
    tokenizer, limits = worker.target.tokenizer, state.prompt_limits
    prompt_ids = chat_prompt_ids if chat else text_prompt_ids

    def read() -> ParsedRequest:  # on a worker thread: parsing megabytes or tokenizing a long prompt takes seconds
        body = parse_body(raw)
        return parse_common(body, prompt_ids(body, tokenizer, limits))

    try:
        parsed = await asyncio.to_thread(read)
        generation = parsed.generation(parsed.max_tokens or worker.default_max_tokens(len(parsed.prompt_ids)))
        worker.check(generation)
    except BadRequest as exc:
        return _error(400, str(exc), exc.param)
    except UserError as exc:
        return _error(400, user_message(exc, SERVER_NAMES))
    try:
        job = worker.submit(generation, asyncio.get_running_loop())
    except QueueFull:
        return _error(503, "The server is busy (its queue is full); retry later.")
    # Until a stream takes over (it watches its client itself), a client that goes away cancels the job.
    watcher = asyncio.create_task(_cancel_when_gone(request, job))
    try:
        return await _answer(worker, job, parsed, Responses(chat, worker.target.name))
    except asyncio.CancelledError:
        job.cancel()
        raise
    finally:
        watcher.cancel()


async def _cancel_when_gone(request: Request, job: Job) -> None:
    """Cancel ``job`` once the request's client disconnects (the body is read, so the next message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel()


async def _answer(worker: EngineWorker, job: Job, parsed: ParsedRequest, responses: Responses) -> Response:
    """The response to a queued job: a stream once its first event has come, or the whole answer."""
    first = await job.events.get()
    if first[0] == "error":
        return _error(*first[1])
    if parsed.stream:
        return StreamingResponse(_stream(worker, job, first, parsed, responses), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    pieces = []
    kind, value = first
    while kind == "text":
        pieces.append(value)
        kind, value = await job.events.get()
    if kind == "error":
        return _error(*value)
    usage = Responses.usage(value.stats.prompt_tokens, value.stats.new_tokens)
    return JSONResponse(responses.complete("".join(pieces), value.finish_reason, usage, extension(worker, value)))


async def _stream(
    worker: EngineWorker, job: Job, first: tuple, parsed: ParsedRequest, responses: Responses
) -> AsyncIterator[str]:
    """Server-sent events of one job; leaving early (the client went away) cancels the job.

    A chunk carries the text of one event from the worker (which sends text at most every
    :data:`~sparsespec.serve.worker.TEXT_INTERVAL_SECONDS`), or of every event waiting when the last chunk was sent.
    """
    try:
        kind, value = first
        opened = False
        while kind == "text":
            pieces = [value]
            while not job.events.empty():
                kind, value = job.events.get_nowait()
                if kind != "text":
                    break
                pieces.append(value)
            else:
                kind = None
            yield _event(responses.chunk("".join(pieces), first=not opened))
            opened = True
            if kind is None:
                kind, value = await job.events.get()
        if kind == "error":
            status, message = value
            yield _event(error_body(message, "invalid_request_error" if status < 500 else "server_error"))
            yield "data: [DONE]\n\n"
            return
        if not opened and responses.chat:
            yield _event(responses.chunk("", first=True))
        final = responses.chunk(finish_reason=value.finish_reason)
        final["sparsespec"] = extension(worker, value)
        yield _event(final)
        if parsed.include_usage:
            yield _event(responses.usage_chunk(Responses.usage(value.stats.prompt_tokens, value.stats.new_tokens)))
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()  # a no-op once the job is done
