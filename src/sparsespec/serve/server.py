"""The HTTP server: an ASGI app (FastAPI on Starlette, run by uvicorn) in front of one :class:`EngineWorker`.

Endpoints: ``GET /health`` (503 while the model loads, 200 after), ``GET /v1/models``,
``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed as server-sent events ending in
``data: [DONE]``, or whole), ``GET /metrics`` (Prometheus text). Errors are OpenAI error objects.

A request is checked and tokenized on the event loop, queued, and answered once the engine's first event arrives,
so a request the engine refuses still gets a 400 rather than a stream that breaks off.
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

from ..errors import UserError
from .protocol import BadRequest, ParsedRequest, Responses, chat_prompt_ids, error_body, parse_common, text_prompt_ids
from .worker import EngineWorker, Job, QueueFull, extension

log = logging.getLogger("sparsespec.serve")


class ServerState:
    """The worker once loaded, so that ``/health`` answers while the model loads.

    With ``background`` (tests, an app embedded elsewhere) the app's start runs ``load`` and then the engine in
    threads of their own. Without it the caller gives its own thread to :meth:`run_engine`: the ``serve`` command
    gives the engine the process's main thread and runs the HTTP server beside it. That placement is for speed:
    torch's OpenMP workers spin between parallel regions only while the process has no more OpenMP masters than
    cores, and an engine thread beside the main thread's own pool made every kernel call wait for its workers to
    wake (SmolLM2 decoded at 0.87x of ``generate`` through the API, one linear took 4x as long).
    """

    def __init__(self, load: Callable[[], EngineWorker], on_failure: Callable[[BaseException], None] | None = None,
                 background: bool = True):
        self._load = load
        self.on_failure = on_failure
        self.background = background
        self.worker: EngineWorker | None = None
        self.error: BaseException | None = None

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


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(error_body(message, kind, param), status_code=status)


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start_loading()
        yield
        if state.worker is not None:
            await asyncio.to_thread(state.worker.stop)

    app = FastAPI(title="sparsespec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.worker is not None:
            return JSONResponse({"status": "ok"})
        if state.error is not None:
            return JSONResponse({"status": "error", "message": str(state.error)}, status_code=503)
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
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError):
        return _error(400, "The request body is not valid JSON.")
    if not isinstance(body, dict):
        return _error(400, "The request body must be a JSON object.")
    tokenizer = worker.target.tokenizer
    try:
        prompt_ids = chat_prompt_ids(body, tokenizer) if chat else text_prompt_ids(body, tokenizer)
        parsed = parse_common(body, prompt_ids)
        generation = parsed.generation(parsed.max_tokens or worker.default_max_tokens(len(prompt_ids)))
        worker.check(generation)
    except BadRequest as exc:
        return _error(400, str(exc), exc.param)
    except UserError as exc:
        return _error(400, str(exc))
    try:
        job = worker.submit(generation, asyncio.get_running_loop())
    except QueueFull:
        return _error(503, "The server is busy (its queue is full); retry later.")
    responses = Responses(chat, worker.target.name)
    try:
        first = await job.events.get()
    except asyncio.CancelledError:
        job.cancel()
        raise
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
